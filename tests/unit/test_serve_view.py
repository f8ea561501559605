"""The Serve controller's view (aggregator/decision/serve_view.py), pure: parsing a body captured
from Ray 2.60, whether a proxy is meant at a pod, and what a NO_PROXY observation becomes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence

import pytest

from aggregator.decision.core import Core
from aggregator.decision.fleet_look import OnLooked
from aggregator.decision.serve_view import (
    UNKNOWN,
    BadView,
    ProxyIntent,
    ServeView,
    judge_no_proxy,
    parse_view,
    proxy_meant,
    rejudged,
)
from aggregator.decision.tracker import Observation, PodRecord, Tracker
from aggregator.flags import AggregatorFlags
from aggregator.metrics import Metrics
from aggregator.wiring import core_settings, tracker_settings
from servehealth_common.pod_identity import PodInfo, PodKey
from servehealth_common.pod_writes.rule import (
    NO_PROXY_BY_DESIGN,
    WriteKind,
    condition_fields,
    condition_status,
    condition_value,
    write_needed,
)
from servehealth_common.states import OBSERVABLE_STATES, ServeState, Source
from tests.conftest import FakeClock
from testsupport.captures import SERVE_APPLICATIONS_HEADONLY
from testsupport.simulation import RecordingRegistry

CAPTURED = json.loads(SERVE_APPLICATIONS_HEADONLY.read_text())
HEAD_IP = "192.0.2.2"  # the node IP Ray reported in the capture


def test_parses_the_answer_ray_gives() -> None:
    view = parse_view(CAPTURED)
    assert view == ServeView("HeadOnly", ((HEAD_IP, "HEALTHY"),))


def test_no_serve_instance_says_nothing() -> None:
    # What the dashboard answers when no Serve controller runs (ServeInstanceDetails'
    # empty schema).
    view = parse_view({"controller_info": {}, "proxies": {}, "applications": {}})
    assert view.proxy_location is None
    assert proxy_meant(view, "10.0.0.7", head=False) is UNKNOWN


@pytest.mark.parametrize(
    ("document", "error"),
    [
        ([], "not a JSON object"),
        ({"proxy_location": "Somewhere"}, "unknown proxy_location"),
        ({"proxy_location": "HeadOnly", "proxies": []}, "proxies is not an object"),
        ({"proxy_location": "HeadOnly", "proxies": {"n": {"status": "HEALTHY"}}}, "node_ip"),
    ],
)
def test_a_broken_answer_is_refused(document: object, error: str) -> None:
    with pytest.raises(BadView, match=error):
        parse_view(document)


@pytest.mark.parametrize(
    ("view", "ip", "head", "meant", "reason"),
    [
        (None, "10.0.0.7", False, None, ""),
        (ServeView("HeadOnly"), "", False, None, ""),
        (ServeView("HeadOnly"), "10.0.0.7", False, False, "proxy_location HeadOnly: Serve runs no"),
        (ServeView("HeadOnly"), "10.0.0.1", True, True, "proxy_location HeadOnly: Serve runs the"),
        (ServeView("Disabled"), "10.0.0.1", True, False, "proxy_location Disabled"),
        (
            ServeView("EveryNode", (("10.0.0.7", "HEALTHY"),)),
            "10.0.0.7",
            False,
            True,
            "Serve keeps a proxy on node 10.0.0.7 (HEALTHY)",
        ),
        (
            ServeView("EveryNode", (("10.0.0.7", "STARTING"),)),
            "10.0.0.7",
            False,
            True,
            "(STARTING)",
        ),
        (
            ServeView("EveryNode", (("10.0.0.1", "HEALTHY"),)),
            "10.0.0.7",
            False,
            False,
            "Serve runs no proxy on node 10.0.0.7 (no replica there)",
        ),
        (
            ServeView("EveryNode", (("10.0.0.7", "DRAINING"),)),
            "10.0.0.7",
            False,
            False,
            "Serve is removing the proxy on node 10.0.0.7 (DRAINING)",
        ),
        (ServeView("EveryNode"), "10.0.0.1", True, True, "runs a proxy on the head"),
    ],
)
def test_whether_a_proxy_is_meant(
    view: ServeView | None, ip: str, head: bool, meant: bool | None, reason: str
) -> None:
    intent = proxy_meant(view, ip, head=head)
    assert intent.meant is meant
    assert intent.reason.startswith(reason) or reason in intent.reason


NOT_MEANT = ProxyIntent(False, "proxy_location HeadOnly: Serve runs no proxy on worker nodes")
MEANT = ProxyIntent(True, "Serve keeps a proxy on node 10.0.0.7 (HEALTHY)")


def test_no_proxy_where_none_is_meant_is_by_design() -> None:
    state, reason = judge_no_proxy(
        ServeState.NO_PROXY, "Connection refused", ServeState.SERVING, "", NOT_MEANT
    )
    assert state is ServeState.NO_PROXY_BY_DESIGN
    assert reason == f"{NOT_MEANT.reason} (probe: Connection refused)"


def test_no_proxy_where_one_is_meant_or_unknown_stays_no_proxy() -> None:
    for intent in (MEANT, UNKNOWN):
        assert judge_no_proxy(ServeState.NO_PROXY, "refused", ServeState.SERVING, "", intent) == (
            ServeState.NO_PROXY,
            "refused",
        )


def test_an_unknown_view_keeps_a_pod_by_design() -> None:
    # The dashboard failed since: no flap to NO_PROXY and back.
    assert judge_no_proxy(
        ServeState.NO_PROXY, "refused", ServeState.NO_PROXY_BY_DESIGN, "as before", UNKNOWN
    ) == (ServeState.NO_PROXY_BY_DESIGN, "as before")
    # ... but a view that says a proxy is meant makes it NO_PROXY.
    assert judge_no_proxy(
        ServeState.NO_PROXY, "refused", ServeState.NO_PROXY_BY_DESIGN, "as before", MEANT
    ) == (ServeState.NO_PROXY, "refused")


@pytest.mark.parametrize("observed", sorted(OBSERVABLE_STATES - {ServeState.NO_PROXY}))
def test_every_other_observation_is_what_it_is(observed: ServeState) -> None:
    assert judge_no_proxy(observed, "why", ServeState.NO_PROXY_BY_DESIGN, "", NOT_MEANT) == (
        observed,
        "why",
    )


def record(state: ServeState, reason: str, *, observed: bool = True, streak: int = 0) -> PodRecord:
    return PodRecord(
        PodKey("ray", "w"),
        "uid",
        "node",
        state,
        state_since=0.0,
        touched_at=0.0,
        observed_at=1.0 if observed else None,
        reason=reason,
        streak=streak,
    )


def test_a_view_change_judges_again_only_a_refused_pod() -> None:
    assert rejudged(record(ServeState.NO_PROXY, "refused"), NOT_MEANT) == (
        ServeState.NO_PROXY_BY_DESIGN,
        f"{NOT_MEANT.reason} (probe: refused)",
    )
    back = rejudged(record(ServeState.NO_PROXY_BY_DESIGN, "x"), MEANT)
    assert back is not None
    assert back[0] is ServeState.NO_PROXY
    assert back[1] == f"{MEANT.reason}, and the pod's last probe was refused"
    assert rejudged(record(ServeState.NO_PROXY_BY_DESIGN, "x"), UNKNOWN) is None
    assert rejudged(record(ServeState.NO_PROXY, "refused"), MEANT) is None  # no change
    assert rejudged(record(ServeState.SERVING, ""), NOT_MEANT) is None
    # Only seeded (never observed), or its last observation disagreed: wait for the next one.
    assert rejudged(record(ServeState.NO_PROXY_BY_DESIGN, "", observed=False), MEANT) is None
    assert rejudged(record(ServeState.NO_PROXY_BY_DESIGN, "", streak=1), MEANT) is None


def test_the_condition_of_a_pod_with_no_proxy_by_design() -> None:
    assert condition_status("false", by_design=True) == NO_PROXY_BY_DESIGN
    assert condition_status("false") == "False"
    assert condition_status("true", by_design=True) == "True"
    assert condition_fields(NO_PROXY_BY_DESIGN) == ("True", "NoProxyByDesign")
    assert condition_fields("True") == ("True", "ServeProxyServing")
    assert condition_fields("False") == ("False", "ServeProxyNotServing")
    assert condition_value("True", "NoProxyByDesign") == NO_PROXY_BY_DESIGN
    assert condition_value("True", "ServeProxyServing") == "True"
    # A pod that is True for serving must be written to say why it is True now.
    assert write_needed(WriteKind.CONDITION, "True", NO_PROXY_BY_DESIGN)
    assert not write_needed(WriteKind.CONDITION, NO_PROXY_BY_DESIGN, NO_PROXY_BY_DESIGN)


# -- the core's decisions ------------------------------------------------------------------


class NoPulls:
    def can_pull(self, key: PodKey) -> bool:
        return False

    def pull_now(self, keys: Iterable[PodKey]) -> None:
        pass

    def look(self, keys: Sequence[PodKey], on_looked: OnLooked) -> Callable[[], None]:
        return lambda: None


class ViewRegistry(RecordingRegistry):
    """Labels in a dict, and whatever proxy intent the test sets for each pod."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__(clock)
        self.intents: dict[PodKey, ProxyIntent] = {}

    def proxy_meant(self, key: PodKey) -> ProxyIntent:
        return self.intents.get(key, UNKNOWN)


KEYS = [PodKey("ray", f"pod-{i}") for i in range(10)]


@pytest.fixture
def fleet() -> tuple[Core, ViewRegistry, FakeClock]:
    clock = FakeClock()
    registry = ViewRegistry(clock)
    flags = AggregatorFlags()
    core = Core(
        Tracker(tracker_settings(flags), clock),
        registry,
        Metrics("test"),
        NoPulls(),
        core_settings(flags),
    )
    stream = core.hello([PodInfo(key) for key in KEYS], reports_on_change=True)
    for key in KEYS:
        core.pod_seen(PodInfo(key), "true")  # seeded SERVING
        registry.labels[key] = "true"
    core.hello([], reports_on_change=True)
    assert stream == 1
    return core, registry, clock


def refused(core: Core, key: PodKey) -> bool:
    return core.report(1, key, Observation(ServeState.NO_PROXY, "Connection refused"))


def test_most_of_a_fleet_by_design_is_no_failure(
    fleet: tuple[Core, ViewRegistry, FakeClock],
) -> None:
    core, registry, _ = fleet
    workers = KEYS[1:8]  # 7 of 10: far past the PANIC threshold, were they failures
    for key in workers:
        registry.intents[key] = NOT_MEANT
        assert refused(core, key)
    assert core.counts()[ServeState.NO_PROXY_BY_DESIGN] == 7
    assert all(registry.labels[key] == "false" for key in workers)
    assert not core.panic
    assert core.summary().panic_held_writes == 0
    assert all(core.no_proxy_by_design(key) for key in workers)
    assert not core.no_proxy_by_design(KEYS[0])
    # More refusals change nothing.
    assert not refused(core, workers[0])
    record = core.pod(workers[0])
    assert record is not None
    assert record.reason == f"{NOT_MEANT.reason} (probe: Connection refused)"


def test_a_refusal_with_no_view_is_no_proxy(fleet: tuple[Core, ViewRegistry, FakeClock]) -> None:
    core, _, _ = fleet
    assert refused(core, KEYS[0])
    assert core.counts()[ServeState.NO_PROXY] == 1


def test_a_view_change_moves_refused_pods_at_once(
    fleet: tuple[Core, ViewRegistry, FakeClock],
) -> None:
    core, registry, clock = fleet
    key = KEYS[3]
    refused(core, key)  # no view yet
    observed = core.pod(key)
    assert observed is not None
    observed_at = observed.observed_at
    registry.intents[key] = NOT_MEANT
    clock.advance(10)
    core.proxy_views_changed(KEYS)
    record = core.pod(key)
    assert record is not None
    assert record.state is ServeState.NO_PROXY_BY_DESIGN
    assert record.observed_at == observed_at  # a judgment, not an observation
    registry.intents[key] = MEANT
    core.proxy_views_changed([key])
    assert core.pod(key).state is ServeState.NO_PROXY  # type: ignore[union-attr]
    assert core.counts()[ServeState.NO_PROXY_BY_DESIGN] == 0


def test_a_pull_that_is_refused_is_judged_too(
    fleet: tuple[Core, ViewRegistry, FakeClock],
) -> None:
    core, registry, clock = fleet
    registry.intents[KEYS[0]] = NOT_MEANT
    clock.advance(1)
    core.pulled(KEYS[0], Observation(ServeState.NO_PROXY, "refused", source=Source.PULL), 1.0)
    assert core.pod(KEYS[0]).state is ServeState.NO_PROXY_BY_DESIGN  # type: ignore[union-attr]


def test_a_pod_carrying_the_condition_starts_by_design() -> None:
    clock = FakeClock()
    flags = AggregatorFlags()
    core = Core(
        Tracker(tracker_settings(flags), clock),
        ViewRegistry(clock),
        Metrics("test"),
        NoPulls(),
        core_settings(flags),
    )
    core.pod_seen(PodInfo(KEYS[0]), None, by_design=True)
    core.pod_seen(PodInfo(KEYS[1]), "true", by_design=True)  # the label wins
    assert core.pod(KEYS[0]).state is ServeState.NO_PROXY_BY_DESIGN  # type: ignore[union-attr]
    assert core.pod(KEYS[1]).state is ServeState.SERVING  # type: ignore[union-attr]
    # Its agent's refusal with no view yet keeps it there: nothing moves after a restart.
    stream = core.hello([PodInfo(KEYS[0])], reports_on_change=True)
    assert not core.report(stream, KEYS[0], Observation(ServeState.NO_PROXY, "refused"))
