"""How the suite runs on parallel workers (pytest-xdist; ``scripts/test`` passes ``-n``).

Two things, both keyed by a test's module:

- **Units.** A module's tests run on one worker, so that what a module computes once (its
  module-scoped fixtures, the renders of deploy/ its worker caches) is computed once: with a
  test per unit instead, tests/deploy took 74 s of CPU on four workers instead of 65. The
  modules of one group run on one worker, one after the other in file order, so that they share
  what is expensive to start: the session's Ray (``tests/e2e/conftest.py``, package-scoped: it
  stops when its worker leaves tests/e2e) or the Rays in HAProxy mode, of which no two then
  start at once.
- **Order.** The longest units are collected first (the groups, the demo, the process-heavy
  modules), so that no worker picks up a minute of work when the others are nearly done.
  Modules of process tests that take long are listed here, longest first.

xdist's own ``--dist loadgroup`` cannot be used for the groups: it renames a marked item's
nodeid through ``item._nodeid``, which pytest 9.2 no longer reads (``Node.nodeid`` comes from
``_id``), so the marks were silently ignored. This scheduler groups by the module path in the
nodeid instead, which both versions give the controller.
"""

from __future__ import annotations

from typing import Any

import pytest

#: Modules that must share a worker, by group.
GROUPS: dict[str, str] = {
    "tests/e2e/test_grpc_ingress.py": "ray-session",
    "tests/e2e/test_no_proxy_by_design.py": "ray-session",
    "tests/e2e/test_ray_serve.py": "ray-session",
    "tests/e2e/test_haproxy.py": "ray-haproxy",
    "tests/e2e/test_haproxy_ray_grpc.py": "ray-haproxy",
}

#: Collected first, in this order: the longest units (minutes of one worker on a loaded machine,
#: measured with ``--durations``), so that the others fill in around them.
LONGEST_FIRST: tuple[str, ...] = (
    *GROUPS,
    "tests/kube/test_uninstall_processes.py",
    "tests/kube/test_cleanup.py",
    "tests/kube/test_agent_fallback_processes.py",
    "tests/deploy/test_schemas.py",
    "tests/bench/test_smoke.py",
    "tests/kube/test_mass_hang_processes.py",
    "tests/aggregator/test_startup_errors.py",
    "tests/deploy/test_agent_admission_policy.py",
    "tests/kube/test_fallback_outage.py",
    "tests/kube/test_fallback_lease_processes.py",
    "tests/kube/test_fallback_refused_processes.py",
    "tests/deploy/test_kustomize.py",
    "tests/e2e/test_demo.py",  # after the groups' Rays have started, not beside them
    "tests/kube/test_agent_liveness.py",
    "tests/kube/test_fallback_lease_daemonset_processes.py",
    "tests/kube/test_lease_release_processes.py",
    "tests/unit/test_panic_trials.py",
    "tests/kube/test_pull_fallback.py",
    "tests/aggregator/test_pull_sweep.py",
    "tests/aggregator/test_connection_flood.py",
    "tests/kube/test_shadow_mode_processes.py",
    "tests/kube/test_failover.py",
)


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its group, or its module."""
    module = module_of(nodeid)
    return GROUPS.get(module, module)


def _rank(item: pytest.Item) -> int:
    module = module_of(item.nodeid)
    return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest first; a stable sort, so the order within a module (and a group) is kept.
    Every worker sorts the same collection the same way, as xdist requires."""
    items.sort(key=_rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Units of work as :func:`unit_of` says (only with ``--dist loadgroup``, which
    ``scripts/test`` passes; any other ``--dist`` is xdist's own)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # Keep the collection's order (longest first): xdist would sort the units by their number
    # of tests, which puts a module of 400 one-millisecond tests before a minute of Ray.
    config.option.loadscopereorder = False

    class ModuleGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ModuleGroupScheduling(config, log)
