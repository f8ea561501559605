"""Starting ``python -m aggregator`` with hostile or mistaken flags, as a real process on
127.0.0.1 (issue 13): every mistake is one clear line and a non-zero exit, never a traceback.

- Usage errors (exit 2, one ``error:`` line naming the flag and its value): a port outside
  0-65535 (it used to be wrapped: 99999 bound 34463), a negative duration (argparse took
  ``-1s`` for a flag), an invalid IPv4 address, a certificate or key that is not PEM.
- Start errors (exit 1, one ERROR line naming the address and its flag): a gRPC port another
  aggregator holds (gRPC's SO_REUSEPORT let two share it), a metrics port in use (the failed
  start left its gRPC server to be collected on a closed loop: "Exception ignored ... Event loop
  is closed"), a host that does not resolve. A start that fails stops what it had started.
- The startup line names the addresses really bound, for the gRPC and the /metrics port.
- A few hundred half-sent requests to /metrics, against a process limited to 256 file
  descriptors, starve neither the gRPC port nor /metrics (the metrics server caps its
  connections and cuts a request head after its deadline); nothing is logged above INFO.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator.flags import AggregatorFlags
from aggregator.lifecycle import Phase
from aggregator.wiring import build_aggregator
from servehealth_common.config import split_host_port
from tests.conftest import eventually

#: The start line: "aggregator 0.2.0 listening on HOST:PORT (plaintext, metrics HOST:PORT), ...".
STARTED = re.compile(r"listening on (?P<grpc>\S+) \([^,]+, metrics (?P<metrics>\S+)\)")
#: Every line the aggregator writes in text format (anything else is noise: a traceback,
#: gRPC's own log, "Exception ignored in ...").
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) \S+: ")
#: The file-descriptor limit of the process under the connection flood.
FD_LIMIT = 256
#: Half-sent requests of the flood: well past both the limit and the metrics server's cap.
FLOOD = 300
HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"


#: Run as ``python -c LIMITED FD_LIMIT -m aggregator ...``: lower the limit of open files, soft
#: and hard (the aggregator raises its soft limit to the hard one at start), then exec the
#: aggregator (no preexec_fn: that runs Python between fork and exec).
LIMITED = (
    "import os, resource, sys; "
    "limit = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def command(*flags: str, fd_limit: int | None = None) -> list[str]:
    """``python -m aggregator`` in memory mode without auth, with ``flags`` after the base ones."""
    limited = ["-c", LIMITED, str(fd_limit)] if fd_limit else []
    return [
        sys.executable,
        *limited,
        "-m",
        "aggregator",
        "--kube-backend=memory",
        "--auth=none",
        "--listen=127.0.0.1:0",
        "--metrics-listen=",
        *flags,
    ]


def environment() -> dict[str, str]:
    """This environment without SERVE_HEALTH_* (they would change the flags' defaults)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_HEALTH_")}
    return {**environ, "PYTHONUNBUFFERED": "1"}


# The processes are started with the standard library's subprocess, not the event loop's:
# uvloop runs Python's after-fork hooks in the child between fork and exec, where a thread
# join inherited from gRPC's aio machinery in this process can spin for ever.


async def run_to_exit(*flags: str) -> tuple[int, list[str]]:
    """Run an aggregator that must exit by itself (30 s at most): exit code, stderr lines."""
    done = await asyncio.to_thread(
        subprocess.run,
        command(*flags),
        env=environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=30,
        check=False,
    )
    return done.returncode, done.stderr.decode().splitlines()


def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` with its stderr piped (fork and exec: it does not block)."""
    return subprocess.Popen(
        argv,
        env=environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


class Running:
    """A started aggregator process: its addresses from the start line, its stderr so far."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.lines: list[str] = []
        self.grpc = ("", 0)
        self.metrics = ("", 0)
        self.start_line = ""
        self._stderr = asyncio.StreamReader()
        self._pipe: asyncio.BaseTransport | None = None

    async def started(self) -> None:
        """Read stderr up to the start line (30 s at most)."""
        loop = asyncio.get_running_loop()
        self._pipe, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(self._stderr), self.process.stderr
        )
        async with asyncio.timeout(30):
            while True:
                raw = await self._stderr.readline()
                assert raw, "aggregator exited:\n" + "\n".join(self.lines)
                self.lines.append(raw.decode().rstrip("\n"))
                if match := STARTED.search(self.lines[-1]):
                    break
        self.start_line = self.lines[-1]
        self.grpc = split_host_port(match["grpc"])
        if match["metrics"] != "off":
            self.metrics = split_host_port(match["metrics"])

    async def stop(self) -> int:
        """SIGTERM, then the exit code (30 s at most); the rest of stderr joins :attr:`lines`."""
        self.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            rest = await self._stderr.read()
        self.lines += rest.decode().splitlines()
        return await asyncio.to_thread(self.process.wait, 30)

    async def close(self) -> None:
        """Kill the process if it still runs; close the pipe."""
        if self.process.poll() is None:
            self.process.kill()
            await asyncio.to_thread(self.process.wait, 30)
        if self._pipe is not None:
            self._pipe.close()
        if self.process.stderr is not None:
            self.process.stderr.close()


StartProcess = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start() -> AsyncIterator[StartProcess]:
    """``await start(*flags, fd_limit=None)``: a :class:`Running` aggregator; killed after."""
    started: list[Running] = []

    async def starter(*flags: str, fd_limit: int | None = None) -> Running:
        running = Running(spawn(command(*flags, fd_limit=fd_limit)))
        started.append(running)
        await running.started()
        return running

    yield starter
    for running in started:
        await running.close()


def noise(lines: list[str]) -> list[str]:
    """Lines that are not the aggregator's own log lines (tracebacks, gRPC's log, ...)."""
    return [line for line in lines if line.strip() and not LOG_LINE.match(line)]


def errors(lines: list[str]) -> list[str]:
    return [line for line in lines if " ERROR " in line]


def assert_one_usage_error(code: int, lines: list[str], *expected: str) -> None:
    """Exit 2, the usage, and one ``error:`` line holding every text in ``expected``."""
    text = "\n".join(lines)
    assert code == 2, text
    assert "Traceback" not in text
    (line,) = [line for line in lines if "error:" in line]
    assert line.startswith("serve-health-aggregator: error: "), text
    for part in expected:
        assert part in line, line


def assert_one_start_error(code: int, lines: list[str], *expected: str) -> None:
    """Exit 1, only log lines, and one ERROR line "cannot start: ..." holding ``expected``."""
    text = "\n".join(lines)
    assert code == 1, text
    assert not noise(lines), text
    (line,) = errors(lines)
    assert "cannot start: " in line, text
    for part in expected:
        assert part in line, line


async def health(host: str, port: int) -> int:
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    return response.status


async def scrape(host: str, port: int) -> tuple[int, bytes] | None:
    """GET /metrics: (status, body), or None when the connection is closed without an answer."""
    try:
        async with asyncio.timeout(5):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answer = await reader.read()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return None
    head, _, body = answer.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 "):
        return None
    return int(head.split()[1]), body


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port of 127.0.0.1 with a listening socket on it (held for the test)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


# -- usage errors: exit 2 -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        pytest.param(("--listen=127.0.0.1:99999",), ("--listen", "99999", "0-65535"), id="99999"),
        pytest.param(("--listen=127.0.0.1:65536",), ("--listen", "65536", "0-65535"), id="65536"),
        pytest.param(
            ("--metrics-listen=127.0.0.1:99999",),
            ("--metrics-listen", "99999", "0-65535"),
            id="metrics-99999",
        ),
        pytest.param(
            ("--metrics-listen", "127.0.0.1:65536"),
            ("--metrics-listen", "65536", "0-65535"),
            id="metrics-65536",
        ),
        pytest.param(
            ("--heartbeat-ttl", "-1s"), ("--heartbeat-ttl must be positive", "-1s"), id="ttl"
        ),
        pytest.param(
            ("--hello-timeout", "0"), ("--hello-timeout must be at least 1ms", "0s"), id="hello"
        ),
        pytest.param(("--listen", "256.1.1.1:0"), ("--listen", "256.1.1.1"), id="bad-ipv4"),
    ],
)
async def test_a_bad_flag_is_one_usage_line(flags: tuple[str, ...], expected: tuple[str]) -> None:
    code, lines = await run_to_exit(*flags)
    assert_one_usage_error(code, lines, *expected)
    assert not any("listening on" in line for line in lines)


async def test_a_certificate_that_is_not_pem_is_one_usage_line(tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    code, lines = await run_to_exit(f"--tls-cert={cert}", f"--tls-key={key}")
    assert_one_usage_error(code, lines, "--tls-cert", str(cert), "PEM")


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def pem(tmp_path: Path, ca: trustme.CA) -> dict[str, str]:
    """Paths of a server certificate, its key, another certificate's key, the CA, and junk."""
    leaf, other = ca.issue_cert("127.0.0.1"), ca.issue_cert("127.0.0.1")
    files = {
        "cert": b"".join(blob.bytes() for blob in leaf.cert_chain_pems),
        "key": leaf.private_key_pem.bytes(),
        "other-key": other.private_key_pem.bytes(),
        "ca": ca.cert_pem.bytes(),
        "junk": b"-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n",
        "key-as-cert": leaf.private_key_pem.bytes(),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return {name: str(tmp_path / name) for name in files}


@pytest.mark.parametrize(
    ("files", "flag"),
    [
        pytest.param(("junk", "key", ""), "--tls-cert", id="cert-junk"),
        pytest.param(("key-as-cert", "key", ""), "--tls-cert", id="cert-is-a-key"),
        pytest.param(("cert", "junk", ""), "--tls-key", id="key-junk"),
        pytest.param(("cert", "cert", ""), "--tls-key", id="key-is-a-cert"),
        pytest.param(("cert", "other-key", ""), "--tls-key", id="key-of-another-cert"),
        pytest.param(("cert", "key", "junk"), "--tls-client-ca", id="client-ca-junk"),
        pytest.param(("cert", "key", "key"), "--tls-client-ca", id="client-ca-is-a-key"),
    ],
)
def test_tls_files_must_be_pem_and_match(
    pem: dict[str, str], files: tuple[str, str, str], flag: str
) -> None:
    cert, key, client_ca = (pem[name] if name else "" for name in files)
    path = {"--tls-cert": cert, "--tls-key": key, "--tls-client-ca": client_ca}[flag]
    with pytest.raises(ValueError, match=re.escape(f"{flag} {path}: ")):
        AggregatorFlags(tls_cert=cert, tls_key=key, tls_client_ca=client_ca)


def test_good_tls_files_pass(pem: dict[str, str]) -> None:
    AggregatorFlags(tls_cert=pem["cert"], tls_key=pem["key"], tls_client_ca=pem["ca"])


# -- start errors: exit 1 -------------------------------------------------------------------


async def test_a_second_aggregator_cannot_share_the_grpc_port(start: StartProcess) -> None:
    first = await start()
    host, port = first.grpc
    code, lines = await run_to_exit(f"--listen={host}:{port}")
    assert_one_start_error(code, lines, f"127.0.0.1:{port}", "--listen", "address already in use")
    assert await health(host, port) == health_pb2.HealthCheckResponse.SERVING  # the first one
    assert await first.stop() == 0


async def test_a_taken_metrics_port_is_one_line_and_a_clean_exit(taken_port: int) -> None:
    code, lines = await run_to_exit(f"--metrics-listen=127.0.0.1:{taken_port}")
    assert_one_start_error(
        code, lines, f"127.0.0.1:{taken_port}", "--metrics-listen", "address already in use"
    )
    assert not any("Exception ignored" in line or "Event loop is closed" in line for line in lines)


async def test_a_host_that_does_not_resolve_is_one_line() -> None:
    code, lines = await run_to_exit("--listen=nosuchhost.invalid:0")
    assert_one_start_error(code, lines, "nosuchhost.invalid:0", "--listen", "cannot resolve")


async def test_a_failed_start_stops_what_it_started(taken_port: int) -> None:
    settings = AggregatorFlags(
        listen="127.0.0.1:0",
        metrics_listen=f"127.0.0.1:{taken_port}",
        kube_backend="memory",
        auth="none",
        shutdown_grace=0.1,
    )
    aggregator = build_aggregator(settings)
    try:
        with pytest.raises(OSError, match=f"127.0.0.1:{taken_port} \\(--metrics-listen\\)"):
            await aggregator.start()
        assert aggregator.lifecycle.phase is Phase.STOPPED  # stopped by start() itself
    finally:
        await aggregator.stop()  # does nothing when start() stopped it (the bug: it did not)
    # No task is left running (the autouse leak check).


# -- the start line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("listen", "shown", "connect"),
    [
        pytest.param("127.0.0.1", "127.0.0.1", "127.0.0.1", id="loopback"),
        pytest.param("0.0.0.0", "0.0.0.0", "127.0.0.1", id="any"),
        pytest.param(
            "[::1]",
            "[::1]",
            "::1",
            id="ipv6-loopback",
            marks=pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback"),
        ),
    ],
)
async def test_the_start_line_names_the_bound_ports(
    start: StartProcess, listen: str, shown: str, connect: str
) -> None:
    running = await start(f"--listen={listen}:0", f"--metrics-listen={listen}:0")
    grpc_port, metrics_port = running.grpc[1], running.metrics[1]
    assert grpc_port, running.start_line
    assert metrics_port, running.start_line
    assert f"listening on {shown}:{grpc_port} (" in running.start_line
    assert f"metrics {shown}:{metrics_port})" in running.start_line
    # The ports shown are the ones that answer.
    assert await health(connect, grpc_port) == health_pb2.HealthCheckResponse.SERVING
    scraped = await scrape(connect, metrics_port)
    assert scraped is not None
    assert scraped[0] == 200
    assert await running.stop() == 0
    assert not errors(running.lines)
    assert not noise(running.lines)


# -- the /metrics port under a connection flood -------------------------------------------------


async def open_half_sent(host: str, port: int, count: int) -> list[asyncio.StreamWriter]:
    """``count`` connections, each with a request head that never ends (10 s at most)."""
    writers: list[asyncio.StreamWriter] = []

    async def one() -> None:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection(host, port)
            writers.append(writer)
            writer.write(HALF_SENT)

    async with asyncio.timeout(10):
        for batch in range(0, count, 50):
            await asyncio.gather(*(one() for _ in range(batch, min(count, batch + 50))))
    return writers


def open_fds(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return None


def open_files_limit(pid: int) -> int | None:
    """The soft RLIMIT_NOFILE of process ``pid`` (None without /proc)."""
    with contextlib.suppress(OSError):
        limits = Path(f"/proc/{pid}/limits").read_text()
        found = re.search(r"^Max open files\s+(\d+)", limits, re.MULTILINE)
        return int(found[1]) if found else None
    return None


async def test_half_sent_metrics_requests_starve_neither_port(start: StartProcess) -> None:
    running = await start("--metrics-listen=127.0.0.1:0", fd_limit=FD_LIMIT)
    (host, grpc_port), (_, metrics_port) = running.grpc, running.metrics
    assert open_files_limit(running.process.pid) in (FD_LIMIT, None)
    writers = await open_half_sent(host, metrics_port, FLOOD)
    try:
        assert len(writers) > FD_LIMIT  # the kernel accepted them all; the cap closed most
        assert await health(host, grpc_port) == health_pb2.HealthCheckResponse.SERVING
        fds = open_fds(running.process.pid)
        assert fds is None or fds < FD_LIMIT - 64, fds
        # A scrape is answered at the latest once the held heads passed their 5 s deadline,
        # while this client still holds every one of its sockets.
        scraped = await eventually(lambda: scrape(host, metrics_port), timeout=15, interval=0.2)
        assert scraped[0] == 200
        refused = re.search(
            rb"^serve_health_metrics_connections_refused_total (\S+)$", scraped[1], re.M
        )
        assert refused is not None
        assert float(refused[1]) > 0
        assert await health(host, grpc_port) == health_pb2.HealthCheckResponse.SERVING
    finally:
        for writer in writers:
            writer.transport.abort()
    assert await running.stop() == 0
    assert not errors(running.lines), running.lines
    assert not noise(running.lines), running.lines
