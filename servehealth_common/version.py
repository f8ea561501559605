"""The version of ray-serve-health: the one place it is written.

pyproject.toml reads it (``[tool.setuptools.dynamic]``, without importing the package); both
programs' ``__version__`` and every command's ``--version`` show it; the agent sends it in its
hello and the aggregator logs it at start and exports it in ``serve_health_build_info``.

Files that cannot import it name the same version and are checked against it by
tests/unit/test_version.py: the Dockerfile's label, the image tags of deploy/, the image in the
docs, the newest release of CHANGELOG.md and the release SECURITY.md supports.
"""

__version__ = "0.2.0"
