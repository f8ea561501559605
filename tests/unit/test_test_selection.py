"""The lists that schedule and select tests (tests/parallel.py, tests/markers.py) name tests
that exist: a renamed module or test would otherwise drop out of its group or of the
``processes`` mark without a word."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import markers, parallel

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("prefix", markers.PROCESS_TESTS)
def test_every_process_test_prefix_names_a_folder_a_module_or_a_test(prefix: str) -> None:
    path, _, test = prefix.partition("::")
    assert (ROOT / path).exists(), f"{path} does not exist"
    if test:
        source = (ROOT / path).read_text()
        assert re.search(rf"^(async )?def {test}\(", source, re.MULTILINE), prefix


@pytest.mark.parametrize("module", [*parallel.GROUPS, *parallel.LONGEST_FIRST])
def test_every_scheduled_module_exists(module: str) -> None:
    assert (ROOT / module).is_file(), module


def test_a_group_is_one_unit_and_any_other_module_its_own() -> None:
    ray = "tests/e2e/test_ray_serve.py::test_pod_follows_the_real_serve_proxy"
    ingress = "tests/e2e/test_grpc_ingress.py::test_the_pod_serves_only_when_both_proxies_do"
    assert parallel.unit_of(ray) == parallel.unit_of(ingress) == "ray-session"
    lone = "tests/unit/test_wire.py::test_good_hellos"
    assert parallel.unit_of(lone) == "tests/unit/test_wire.py"
