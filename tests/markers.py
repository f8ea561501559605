"""Which tests start real processes: the programs (``serve-health-*``), Ray, or a benchmark.

They carry the mark ``processes``; ``-m "not processes"`` leaves them out, which makes the
inner loop of unit and emulator tests (README, "The two commands")::

    scripts/test -m "not processes" tests/unit tests/kube

Listed here by nodeid prefix (a folder, a module, or one test of a module that is otherwise in
process), so that one place says what the inner loop skips. A test of the whole program belongs
here; everything else should run in process, on the emulator and fake clocks.
"""

from __future__ import annotations

import pytest

PROCESS_TESTS: tuple[str, ...] = (
    "tests/e2e/",
    "tests/bench/",
    "tests/kube/test_agent_fallback_processes.py",
    "tests/kube/test_agent_liveness.py",
    "tests/kube/test_aggregator_writes_no_files.py",
    "tests/kube/test_cleanup.py",
    "tests/kube/test_failover.py",
    "tests/kube/test_fallback_lease_processes.py",
    "tests/kube/test_fallback_lease_daemonset_processes.py",
    "tests/kube/test_fallback_refused_processes.py",
    "tests/kube/test_fallback_outage.py",
    "tests/kube/test_kubeconfig_errors.py",
    "tests/kube/test_lease_release_processes.py",
    "tests/kube/test_mass_hang_processes.py",
    "tests/kube/test_shadow_mode_processes.py",
    "tests/kube/test_uninstall_processes.py",
    "tests/kube/test_auth.py::test_tokenreview_without_a_kubernetes_configuration_does_not_start",
    "tests/kube/test_backend.py::test_kubernetes_backend_without_a_config_exits_with_a_clear_error",
    "tests/kube/test_pull_fallback.py::test_killed_agent_keeps_label_then_dead_proxy_loses_it",
    "tests/kube/test_startup_sync.py::test_sigterm_while_waiting_for_the_api_exits_0_at_once",
)


def starts_processes(nodeid: str) -> bool:
    return nodeid.startswith(PROCESS_TESTS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if starts_processes(item.nodeid):
            item.add_marker(pytest.mark.processes)
