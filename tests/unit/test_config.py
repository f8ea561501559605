"""Settings from flags and ``SERVE_HEALTH_*`` environment variables (``servehealth_common.config``).

Covers both real settings classes (the node agent's and the aggregator's): defaults, flags,
environment, precedence (flag, then environment, then default), duration syntax, usage errors
(exit code 2 with a message naming the culprit), validation in ``__post_init__``, and that
``describe()`` and ``--help`` document every field.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from aggregator.flags import AggregatorFlags
from node_agent.flags import AgentFlags
from servehealth_common.config import (
    describe,
    load,
    parse_bool,
    parse_duration,
    split_host_port,
)

AGGREGATOR_FLAG = ["--aggregator", "agg.example:50051"]


def load_agent(argv: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> AgentFlags:
    return load(AgentFlags, list(argv), environ or {}, "serve-health-agent", "test")


def load_aggregator(
    argv: Sequence[str] = (), environ: Mapping[str, str] | None = None
) -> AggregatorFlags:
    return load(AggregatorFlags, list(argv), environ or {}, "serve-health-aggregator", "test")


def usage_error(
    capsys: pytest.CaptureFixture[str], cls: type, argv: Sequence[str], environ: Mapping[str, str]
) -> str:
    """Load and expect a usage error; returns what was printed on stderr."""
    with pytest.raises(SystemExit) as exc_info:
        load(cls, list(argv), environ, "prog", "test")
    assert exc_info.value.code == 2
    captured = capsys.readouterr()
    assert "usage: prog" in captured.err
    return captured.err


# -- defaults -----------------------------------------------------------------------------


def test_agent_defaults() -> None:
    settings = load_agent(AGGREGATOR_FLAG)
    assert settings == AgentFlags(aggregator="agg.example:50051")
    assert settings.proxy_url == "http://127.0.0.1:8000/-/healthz"
    assert settings.interval == 0.75
    assert settings.probe_timeout == 0.5
    assert settings.confirm_delay == 0.1
    assert settings.mode == "sidecar"
    assert settings.connect_timeout == 5.0
    assert settings.reconnect_max == 2.0
    assert settings.log_level == "info"


def test_aggregator_defaults() -> None:
    settings = load_aggregator()
    assert settings == AggregatorFlags()
    assert settings.listen == "0.0.0.0:50051"
    assert settings.metrics_listen == "0.0.0.0:9090"
    assert settings.heartbeat_ttl == 3.0
    assert settings.heartbeat_interval == 1.0
    assert settings.label_key == "ray.io/serve"
    assert settings.failure_threshold == 1
    assert settings.success_threshold == 2


# -- flags and environment ----------------------------------------------------------------


def test_agent_flags() -> None:
    settings = load_agent(
        [
            "--aggregator=127.0.0.1:50051",
            "--proxy-url",
            "http://127.0.0.2:8000/-/healthz",
            "--interval",
            "2s",
            "--probe-timeout",
            "300ms",
            "--confirm-delay",
            "50ms",
            "--connect-timeout",
            "1m",
            "--reconnect-max",
            "30",
            "--log-level",
            "debug",
        ]
    )
    assert settings == AgentFlags(
        aggregator="127.0.0.1:50051",
        proxy_url="http://127.0.0.2:8000/-/healthz",
        interval=2.0,
        probe_timeout=0.3,
        confirm_delay=0.05,
        connect_timeout=60.0,
        reconnect_max=30.0,
        log_level="debug",
    )


def test_aggregator_flags() -> None:
    settings = load_aggregator(
        [
            "--listen",
            "[::]:6000",
            "--metrics-listen",
            "",
            "--heartbeat-ttl",
            "10s",
            "--heartbeat-interval",
            "2s",
            "--label-key",
            "example.com/serve",
            "--failure-threshold",
            "3",
            "--success-threshold",
            "4",
            "--max-message-bytes",
            "2048",
            "--expiry-interval",
            "100ms",
            "--shutdown-grace",
            "0",
        ]
    )
    assert settings == AggregatorFlags(
        listen="[::]:6000",
        metrics_listen="",
        heartbeat_ttl=10.0,
        heartbeat_interval=2.0,
        label_key="example.com/serve",
        failure_threshold=3,
        success_threshold=4,
        max_message_bytes=2048,
        expiry_interval=0.1,
        shutdown_grace=0.0,
    )


def test_agent_environment() -> None:
    settings = load_agent(
        environ={
            "SERVE_HEALTH_AGGREGATOR": "agg:1",
            "SERVE_HEALTH_PROXY_URL": "https://proxy:8443/-/healthz",
            "SERVE_HEALTH_INTERVAL": "3s",
            "SERVE_HEALTH_PROBE_TIMEOUT": "1s",
            "SERVE_HEALTH_CONFIRM_DELAY": "0.2",
            "SERVE_HEALTH_LOG_LEVEL": "warning",
            "UNRELATED": "ignored",
            "INTERVAL": "ignored too (no prefix)",
        }
    )
    assert settings == AgentFlags(
        aggregator="agg:1",
        proxy_url="https://proxy:8443/-/healthz",
        interval=3.0,
        probe_timeout=1.0,
        confirm_delay=0.2,
        log_level="warning",
    )


def test_aggregator_environment() -> None:
    settings = load_aggregator(
        environ={
            "SERVE_HEALTH_LISTEN": "127.0.0.1:7000",
            "SERVE_HEALTH_HEARTBEAT_TTL": "5s",
            "SERVE_HEALTH_FAILURE_THRESHOLD": "2",
            "SERVE_HEALTH_METRICS_LISTEN": "",
        }
    )
    assert settings == AggregatorFlags(
        listen="127.0.0.1:7000", heartbeat_ttl=5.0, failure_threshold=2, metrics_listen=""
    )


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        pytest.param([], {}, 5.0, id="default"),
        pytest.param([], {"SERVE_HEALTH_CONNECT_TIMEOUT": "2s"}, 2.0, id="env-beats-default"),
        pytest.param(["--connect-timeout", "3s"], {}, 3.0, id="flag-beats-default"),
        pytest.param(
            ["--connect-timeout", "3s"],
            {"SERVE_HEALTH_CONNECT_TIMEOUT": "2s"},
            3.0,
            id="flag-beats-env",
        ),
    ],
)
def test_precedence_duration(argv: list[str], environ: dict[str, str], expected: float) -> None:
    settings = load_agent([*AGGREGATOR_FLAG, *argv], environ)
    assert settings.connect_timeout == expected


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        pytest.param([], {}, "ray.io/serve", id="default"),
        pytest.param([], {"SERVE_HEALTH_LABEL_KEY": "env/key"}, "env/key", id="env-beats-default"),
        pytest.param(["--label-key", "flag/key"], {}, "flag/key", id="flag-beats-default"),
        pytest.param(
            ["--label-key", "flag/key"],
            {"SERVE_HEALTH_LABEL_KEY": "env/key"},
            "flag/key",
            id="flag-beats-env",
        ),
    ],
)
def test_precedence_string(argv: list[str], environ: dict[str, str], expected: str) -> None:
    assert load_aggregator(argv, environ).label_key == expected


def test_precedence_int() -> None:
    environ = {"SERVE_HEALTH_SUCCESS_THRESHOLD": "5"}
    assert load_aggregator([], environ).success_threshold == 5
    assert load_aggregator(["--success-threshold", "7"], environ).success_threshold == 7


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        pytest.param([], {}, True, id="default"),
        pytest.param([], {"SERVE_HEALTH_EVENTS": "false"}, False, id="env-false"),
        pytest.param([], {"SERVE_HEALTH_EVENTS": "0"}, False, id="env-zero"),
        pytest.param(["--events", "no"], {}, False, id="flag-no"),
        pytest.param(
            ["--events", "true"], {"SERVE_HEALTH_EVENTS": "off"}, True, id="flag-beats-env"
        ),
    ],
)
def test_booleans(argv: list[str], environ: dict[str, str], expected: bool) -> None:
    assert load_aggregator(argv, environ).events is expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["--dry-run"], True, id="alone"),
        pytest.param(["--dry-run", "--events=false"], True, id="alone-then-a-flag"),
        pytest.param(["--dry-run=false"], False, id="equals-false"),
        pytest.param(["--dry-run", "false"], False, id="value-after"),
    ],
)
def test_a_boolean_is_a_switch(argv: list[str], expected: bool) -> None:
    """``--dry-run`` alone means true (it used to answer "expected one argument")."""
    assert load_aggregator(argv).dry_run is expected


def test_old_agents_flag_is_accepted_but_not_on_help_and_panic_settle_is_gone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert load_aggregator(["--heartbeat-interval", "2s"]).heartbeat_interval == 2.0
    with pytest.raises(SystemExit):
        load_aggregator(["--help"])
    shown = capsys.readouterr().out
    assert "--panic-settle" not in shown
    assert "--heartbeat-interval" not in shown
    assert "--dry-run [true|false]" in shown
    assert "--no-dry-run: false" in shown
    with pytest.raises(SystemExit) as exit_info:
        load_aggregator(["--panic-settle", "1s"])  # removed: CHANGELOG.md
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        (["--no-dry-run"], {}, False),
        (["--no-dry-run"], {"SERVE_HEALTH_DRY_RUN": "true"}, False),
        (["--dry-run", "--no-dry-run"], {}, False),
        (["--no-dry-run", "--dry-run"], {}, True),
        ([], {"SERVE_HEALTH_DRY_RUN": "true"}, True),
    ],
)
def test_a_boolean_has_its_negative_switch(
    argv: list[str], environ: dict[str, str], expected: bool
) -> None:
    assert load_aggregator(argv, environ).dry_run is expected


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        pytest.param([], {}, (), id="default"),
        pytest.param(["--namespace", "a"], {}, ("a",), id="one-flag"),
        pytest.param(["--namespace", "a", "--namespace", "b"], {}, ("a", "b"), id="repeated-flag"),
        pytest.param([], {"SERVE_HEALTH_NAMESPACE": "a"}, ("a",), id="env-one"),
        pytest.param([], {"SERVE_HEALTH_NAMESPACE": "a, b,,"}, ("a", "b"), id="env-comma-list"),
        pytest.param([], {"SERVE_HEALTH_NAMESPACE": ""}, (), id="env-empty"),
        pytest.param(
            ["--namespace", "c"], {"SERVE_HEALTH_NAMESPACE": "a,b"}, ("c",), id="flag-beats-env"
        ),
    ],
)
def test_repeatable_setting(
    argv: list[str], environ: dict[str, str], expected: tuple[str, ...]
) -> None:
    assert load_aggregator(argv, environ).namespace == expected


def test_aggregator_address_from_env_or_flag() -> None:
    environ = {"SERVE_HEALTH_AGGREGATOR": "env:1"}
    assert load_agent([], environ).aggregator == "env:1"
    assert load_agent(["--aggregator", "flag:2"], environ).aggregator == "flag:2"


# -- durations ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        pytest.param("500ms", 0.5, id="500ms"),
        pytest.param("3s", 3.0, id="3s"),
        pytest.param("1m", 60.0, id="1m"),
        pytest.param("0.5", 0.5, id="0.5-plain-seconds"),
        pytest.param("2", 2.0, id="2-plain-seconds"),
        pytest.param(".25", 0.25, id="leading-dot"),
        pytest.param("1.5m", 90.0, id="fractional-minutes"),
        pytest.param("1h", 3600.0, id="1h"),
        pytest.param("0", 0.0, id="zero"),
        pytest.param(" 3s ", 3.0, id="padded"),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)
    # The same syntax through a flag and through the environment.
    assert load_agent([*AGGREGATOR_FLAG, "--confirm-delay", text]).confirm_delay == (
        pytest.approx(seconds)
    )
    environ = {"SERVE_HEALTH_CONFIRM_DELAY": text}
    assert load_agent(AGGREGATOR_FLAG, environ).confirm_delay == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text", ["", "abc", "1d", "1sec", "1e3", "s", "1.", "5 ms ms", "--1s", "-", "-s", "+1s"]
)
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("-1s", -1.0), ("-.5", -0.5), ("-500ms", -0.5), (" -2 ", -2.0), ("-0", 0.0)],
)
def test_negative_durations_parse_so_that_validation_refuses_them(
    text: str, seconds: float
) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        *[("true", True), ("1", True), ("Yes", True), ("ON", True)],
        *[("false", False), ("0", False), ("no", False), (" off ", False)],
    ],
)
def test_parse_bool(text: str, value: bool) -> None:
    assert parse_bool(text) is value


def test_parse_bool_refuses_other_words() -> None:
    with pytest.raises(ValueError, match="not a boolean"):
        parse_bool("maybe")


# -- usage errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "variable", "value"),
    [
        pytest.param(AgentFlags, "SERVE_HEALTH_INTERVAL", "soon", id="agent-duration"),
        pytest.param(AgentFlags, "SERVE_HEALTH_PROBE_TIMEOUT", "", id="agent-empty-duration"),
        pytest.param(AgentFlags, "SERVE_HEALTH_MODE", "daemon", id="agent-choice"),
        pytest.param(AgentFlags, "SERVE_HEALTH_LOG_LEVEL", "INFO", id="agent-choice-case"),
        pytest.param(
            AggregatorFlags, "SERVE_HEALTH_HEARTBEAT_TTL", "3 days", id="aggregator-duration"
        ),
        pytest.param(AggregatorFlags, "SERVE_HEALTH_FAILURE_THRESHOLD", "two", id="aggregator-int"),
        pytest.param(AggregatorFlags, "SERVE_HEALTH_KUBE_BACKEND", "etcd", id="aggregator-choice"),
        pytest.param(AggregatorFlags, "SERVE_HEALTH_EVENTS", "maybe", id="aggregator-bool"),
    ],
)
def test_bad_environment_value_exits_naming_the_variable(
    capsys: pytest.CaptureFixture[str], cls: type, variable: str, value: str
) -> None:
    environ = {"SERVE_HEALTH_AGGREGATOR": "agg:1", variable: value}
    err = usage_error(capsys, cls, [], environ)
    assert f"environment variable {variable}" in err
    assert repr(value) in err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        pytest.param(["--interval", "soon"], "--interval", id="duration"),
        pytest.param(["--mode", "daemon"], "--mode", id="choice"),
        pytest.param(["--no-such-flag"], "--no-such-flag", id="unknown-flag"),
    ],
)
def test_bad_flag_exits_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    err = usage_error(capsys, AgentFlags, [*AGGREGATOR_FLAG, *argv], {})
    assert flag in err


def test_missing_aggregator_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, AgentFlags, [], {})
    assert "--aggregator (or SERVE_HEALTH_AGGREGATOR) is required: HOST:PORT" in err


def test_empty_aggregator_from_env_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, AgentFlags, [], {"SERVE_HEALTH_AGGREGATOR": ""})
    assert "--aggregator (or SERVE_HEALTH_AGGREGATOR) is required" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["--proxy-url", "127.0.0.1:8000"], "--proxy-url must be an http(s) URL", id="proxy-url"
        ),
        pytest.param(["--interval", "0"], "must be positive", id="zero-interval"),
        pytest.param(["--probe-timeout", "0s"], "must be positive", id="zero-timeout"),
        pytest.param(
            ["--interval", "1s", "--probe-timeout", "1s"],
            "--probe-timeout (1s) must be shorter than --interval (1s)",
            id="timeout-equal-interval",
        ),
        pytest.param(
            ["--interval", "500ms"],
            "--probe-timeout (0.5s) must be shorter than --interval (0.5s)",
            id="default-timeout-vs-short-interval",
        ),
    ],
)
def test_agent_validation(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    err = usage_error(capsys, AgentFlags, [*AGGREGATOR_FLAG, *argv], {})
    assert message in err


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        pytest.param(["--heartbeat-ttl", "1s"], {}, id="ttl-equal-interval"),
        pytest.param(["--heartbeat-ttl", "500ms"], {}, id="ttl-below-interval"),
        pytest.param(["--heartbeat-interval", "5s"], {}, id="interval-above-default-ttl"),
        pytest.param(
            [],
            {"SERVE_HEALTH_HEARTBEAT_TTL": "2s", "SERVE_HEALTH_HEARTBEAT_INTERVAL": "2s"},
            id="from-env",
        ),
    ],
)
def test_aggregator_refuses_ttl_not_above_interval(
    capsys: pytest.CaptureFixture[str], argv: list[str], environ: dict[str, str]
) -> None:
    err = usage_error(capsys, AggregatorFlags, argv, environ)
    assert "--heartbeat-ttl" in err
    assert "must be longer than --heartbeat-interval" in err


def test_aggregator_ttl_just_above_interval_is_accepted() -> None:
    settings = load_aggregator(["--heartbeat-ttl", "1001ms"])
    assert settings.heartbeat_ttl == pytest.approx(1.001)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--listen", "nowhere"], "not a HOST:PORT address: 'nowhere'", id="listen"),
        pytest.param(["--metrics-listen", ":9090"], "not a HOST:PORT", id="metrics-no-host"),
        pytest.param(["--failure-threshold", "0"], "at least 1", id="failure-threshold"),
        pytest.param(["--success-threshold", "0"], "at least 1", id="success-threshold"),
        pytest.param(["--max-message-bytes", "100"], "at least 1024", id="max-message-bytes"),
        pytest.param(["--expiry-interval", "0"], "must be positive", id="expiry-interval"),
    ],
)
def test_aggregator_validation(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    err = usage_error(capsys, AggregatorFlags, argv, {})
    assert message in err


def error_line(err: str) -> str:
    (line,) = [line for line in err.splitlines() if line.startswith("prog: error: ")]
    return line.removeprefix("prog: error: ")


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--listen", "127.0.0.1:99999"),
        ("--listen", "127.0.0.1:65536"),
        ("--listen", "[::]:70000"),
        ("--metrics-listen", "127.0.0.1:65536"),
        ("--metrics-listen", "0.0.0.0:99999"),
    ],
)
def test_ports_outside_the_tcp_range_are_refused(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    line = error_line(usage_error(capsys, AggregatorFlags, [flag, value], {}))
    assert line.startswith(f"{flag}: ")
    assert repr(value) in line
    assert "0-65535" in line


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--listen", "256.1.1.1:0", "'256.1.1.1' is not an IPv4 address"),
        ("--listen", "10.0.0:0", "'10.0.0' is not an IPv4 address"),
        ("--metrics-listen", "[::g]:9090", "'::g' is not an IPv6 address"),
        ("--listen", "[]:1", "not a HOST:PORT address"),
        ("--listen", "host:\uff11\uff12", "not a HOST:PORT address"),  # full-width digits
        ("--listen", "host:-1", "not a HOST:PORT address"),
    ],
)
def test_listen_hosts_that_cannot_be_addresses_are_refused(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    line = error_line(usage_error(capsys, AggregatorFlags, [f"{flag}={value}"], {}))
    assert line.startswith(f"{flag}: ")
    assert message in line


@pytest.mark.parametrize(
    ("address", "host", "port"),
    [
        ("0.0.0.0:0", "0.0.0.0", 0),
        ("127.0.0.1:65535", "127.0.0.1", 65535),
        ("[::]:50051", "::", 50051),
        ("[::1]:9090", "::1", 9090),
        ("localhost:8080", "localhost", 8080),
        ("aggregator.example:0", "aggregator.example", 0),
    ],
)
def test_listen_addresses_that_are_fine(address: str, host: str, port: int) -> None:
    assert split_host_port(address) == (host, port)
    assert load_aggregator(["--listen", address, "--metrics-listen", address]).listen == address


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--heartbeat-ttl", "-1s"], "--heartbeat-ttl must be positive", id="ttl"),
        pytest.param(["--heartbeat-ttl=-1s"], "--heartbeat-ttl must be positive", id="ttl-eq"),
        pytest.param(["--heartbeat-t", "-1s"], "--heartbeat-ttl must be positive", id="prefix"),
        pytest.param(
            ["--heartbeat-interval", "-.5"], "--heartbeat-interval must be positive", id="dot"
        ),
        pytest.param(
            ["--shutdown-grace", "-1s"], "--shutdown-grace must not be negative", id="grace"
        ),
        pytest.param(
            ["--max-connections", "-1"], "--max-connections must not be negative", id="int"
        ),
        pytest.param(["--kube-qps", "-2.5"], "--kube-qps must be positive", id="float"),
    ],
)
def test_a_negative_value_reaches_validation(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    line = error_line(usage_error(capsys, AggregatorFlags, argv, {}))
    assert line.startswith(message)
    assert "expected one argument" not in line


def test_a_negative_duration_from_the_environment_reaches_validation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = usage_error(capsys, AggregatorFlags, [], {"SERVE_HEALTH_HEARTBEAT_TTL": "-1s"})
    assert error_line(err).startswith("--heartbeat-ttl must be positive")


def test_a_negative_agent_duration_reaches_validation(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, AgentFlags, [*AGGREGATOR_FLAG, "--interval", "-1s"], {})
    assert "must be positive" in error_line(err)


def test_a_value_that_starts_with_a_dash_and_a_digit_is_a_value() -> None:
    settings = load_aggregator(["--pod-selector", "-1x", "--label-key", "-.x"])
    assert settings.pod_selector == "-1x"
    assert settings.label_key == "-.x"


def test_a_flag_after_a_flag_is_still_a_missing_value(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, AggregatorFlags, ["--heartbeat-ttl", "--listen", "h:1"], {})
    assert "--heartbeat-ttl: expected one argument" in error_line(err)


#: One bad value per validated flag: the error starts with that flag and shows the value.
ONE_BAD_VALUE = [
    ("--heartbeat-ttl", "0", "0s"),
    ("--heartbeat-interval", "0", "0s"),
    ("--failure-threshold", "0", "0"),
    ("--success-threshold", "0", "0"),
    ("--ack-every", "0", "0"),
    ("--max-message-bytes", "100", "100"),
    ("--max-streams-per-peer", "0", "0"),
    ("--max-pods-per-stream", "0", "0"),
    ("--max-reports-per-second", "0", "0"),
    ("--hello-timeout", "0", "0s"),
    ("--handshake-timeout", "0", "0s"),
    ("--keepalive-time", "0", "0s"),
    ("--keepalive-timeout", "0", "0s"),
    ("--max-connection-idle", "0", "0s"),
    ("--max-connections", "-1", "-1"),
    ("--expiry-interval", "0", "0s"),
    ("--shutdown-grace", "-1", "-1s"),
    ("--kube-qps", "0", "0"),
    ("--kube-burst", "0", "0"),
    ("--kube-concurrency", "0", "0"),
    ("--pull-interval", "0", "0s"),
    ("--pull-timeout", "0", "0s"),
    ("--pull-concurrency", "0", "0"),
    ("--panic-threshold", "0", "0"),
    ("--panic-threshold", "1.5", "1.5"),
    ("--panic-min-pods", "0", "0"),
    ("--startup-grace", "-1", "-1s"),
]


@pytest.mark.parametrize(("flag", "value", "shown"), ONE_BAD_VALUE)
def test_each_error_names_its_own_flag_and_value(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, shown: str
) -> None:
    line = error_line(usage_error(capsys, AggregatorFlags, [flag, value], {}))
    assert line.startswith(f"{flag} "), line
    assert f"(got {shown})" in line, line
    others = {row["flag"] for row in describe(AggregatorFlags)} - {flag}
    assert not [other for other in others if re.search(re.escape(other) + r"\b(?!-)", line)]


# -- documentation ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [AgentFlags, AggregatorFlags], ids=["agent", "aggregator"])
def test_describe_lists_every_field(cls: type) -> None:
    rows = describe(cls)
    fields = dataclasses.fields(cls)
    assert [row["flag"] for row in rows] == ["--" + f.name.replace("_", "-") for f in fields]
    assert [row["env"] for row in rows] == ["SERVE_HEALTH_" + f.name.upper() for f in fields]
    for row in rows:
        assert set(row) == {"flag", "env", "default", "help"}
        assert row["help"].strip(), f"{row['flag']} has no help"


@pytest.mark.parametrize(
    ("cls", "flag", "default"),
    [
        pytest.param(AgentFlags, "--aggregator", "(required)", id="agent-shown"),
        pytest.param(AgentFlags, "--connect-timeout", "5s", id="agent-seconds"),
        pytest.param(AgentFlags, "--interval", "750ms", id="agent-interval"),
        pytest.param(AgentFlags, "--probe-timeout", "500ms", id="agent-milliseconds"),
        pytest.param(AgentFlags, "--confirm-delay", "100ms", id="agent-confirm"),
        pytest.param(AgentFlags, "--log-level", "info", id="agent-choice"),
        pytest.param(AggregatorFlags, "--heartbeat-ttl", "3s", id="aggregator-ttl"),
        pytest.param(AggregatorFlags, "--expiry-interval", "250ms", id="aggregator-expiry"),
        pytest.param(AggregatorFlags, "--max-message-bytes", "65536", id="aggregator-int"),
        pytest.param(AggregatorFlags, "--events", "true", id="aggregator-bool"),
    ],
)
def test_describe_renders_defaults(cls: type, flag: str, default: str) -> None:
    rows = {row["flag"]: row for row in describe(cls)}
    assert rows[flag]["default"] == default


@pytest.mark.parametrize("cls", [AgentFlags, AggregatorFlags], ids=["agent", "aggregator"])
def test_help_documents_every_flag_and_variable(
    capsys: pytest.CaptureFixture[str], cls: type
) -> None:
    with pytest.raises(SystemExit) as exc_info:
        load(cls, ["--help"], {}, "prog", "a description")
    assert exc_info.value.code == 0
    out = capsys.readouterr().out
    assert "a description" in out
    # argparse wraps lines; compare without whitespace.
    squashed = "".join(out.split())
    hidden = {
        f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(cls) if f.metadata["hidden"]
    }
    for row in describe(cls):
        if row["flag"] in hidden:  # deprecated: accepted, in the docs, not on --help
            continue
        assert row["flag"] in out
        assert row["env"] in squashed


def test_settings_are_frozen() -> None:
    settings: Any = load_agent(AGGREGATOR_FLAG)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.interval = 2.0


@pytest.mark.parametrize("cls", [AgentFlags, AggregatorFlags], ids=["agent", "aggregator"])
def test_help_comes_in_sections_that_cover_every_flag(
    capsys: pytest.CaptureFixture[str], cls: Any
) -> None:
    names = [field.name for field in dataclasses.fields(cls)]
    firsts = [first for _, first in cls.HELP_GROUPS]
    assert firsts[0] == names[0]  # no flag before the first section
    assert firsts == sorted(firsts, key=names.index)  # in field order
    with pytest.raises(SystemExit):
        load(cls, ["--help"], {}, "prog", "test")
    out = capsys.readouterr().out
    for title, _ in cls.HELP_GROUPS:
        assert f"\n{title}:\n" in out
