"""``serve-health-cleanup``, the third program: gives the pods back to KubeRay after an
uninstall. Nothing else in the aggregator imports it (import contract in pyproject.toml)."""
