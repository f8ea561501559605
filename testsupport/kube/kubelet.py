"""A kubelet for the API emulator: readiness probes, ``ContainersReady`` and ``Ready``.

What a cluster adds between our write (a label, a readiness-gate condition) and the traffic:
the kubelet runs each container's ``readinessProbe`` and writes the pod's ``ContainersReady``
and ``Ready`` conditions; a Service routes only to Ready pods (testsupport/kube/endpoints.py).

:class:`Kubelet` manages a set of pods (``pods=[(namespace, name), ...]``) and/or every pod on
a node (``node="node-1"``), as they are now and as they come and go (it follows the emulator's
store through ``KubeEmulator.subscribe``). For each container with a ``readinessProbe`` it runs
a worker, as the kubelet's prober does (pkg/kubelet/prober/worker.go): the first probe at once,
then one every ``periodSeconds``; no probe before ``initialDelaySeconds`` since the container
started (when the kubelet first saw the pod Running); each probe bounded by
``timeoutSeconds`` (a probe that takes longer fails); the container's readiness starts False
and flips only after ``failureThreshold`` consecutive failures or ``successThreshold``
consecutive successes. Defaults as the API documents them: period 10, timeout 1, failure 3,
success 1, initial delay 0. Probe kinds:

- ``httpGet``: ``GET scheme://host:port/path`` (``host`` defaults to the pod's IP; ``port`` a
  number or the name of a container port; ``httpHeaders``); success is 200 <= status < 400;
  redirects to the same host are followed (at most 10), a redirect elsewhere counts as a
  success (the prober's "Probe terminated redirects" warning is a success).
- ``tcpSocket``: the connection is accepted.
- ``grpc``: ``grpc.health.v1.Health/Check`` with ``service``; ``SERVING`` is success.
- ``exec``: only the commands KubeRay injects, never a shell: ``["bash"|"sh", "-c", S]`` where
  ``S`` is ``wget [--tries N] -T T -q -O- http://localhost:PORT/PATH | grep WORD`` joined by
  ``&&`` (see :func:`kuberay_readiness_probe`). Each ``wget`` is a GET to the pod's own port
  (``localhost`` is the pod's IP), ``-T`` bounding each try and a timed-out try retried up to
  ``--tries`` (GNU wget: 20 by default); the step passes when the answer is 2xx and its body
  contains ``WORD`` (wget prints nothing for an error status, and ``grep`` decides the step's
  exit status). Any other command fails the probe, with a WARNING log line.

Addresses: pods in tests live at 127.0.0.1 and their container ports are the fake servers'
real loopback ports: :meth:`Kubelet.map_ports` says "port 52365 of pod X is 127.0.0.1:p"
(every probe kind, by container port number after resolving a named port).

Status writes go straight into the emulator's store (watches see MODIFIED, resourceVersions
move; no HTTP request is recorded), only when a condition changed (``status.containerStatuses``,
``ready`` and ``started``, go along with it). The conditions, as
``pkg/kubelet/status/generate.go`` computes them: ``ContainersReady`` is True when every
container is ready (one without a readiness probe is ready once running), else False with
reason ``ContainersNotReady``; ``Ready`` is False with the same reason and message while
containers are not ready, else False with reason ``ReadinessGatesNotReady`` while a
``spec.readinessGates`` condition is absent or not True, else True. ``lastTransitionTime``
moves only when the status does. Any change to a managed pod (e.g. the aggregator's write of a
readiness-gate condition) makes the kubelet re-evaluate ``Ready`` at once, as the kubelet's
``HandlePodReconcile`` does on a status change (``NeedToReconcilePodReadiness``), not at the
next probe.

Time: ``clock`` (default: the event loop's) schedules probes; a :class:`FakeClock` with
:meth:`Kubelet.advance` moves it by hand, and ``advance`` returns once every probe due in that
span has run and its result is written. Probes themselves do real I/O; their timeouts are in
real seconds: ``timeoutSeconds * timeout_scale``. ``time_scale`` multiplies the schedule
(``periodSeconds``, ``initialDelaySeconds``) and, unless ``timeout_scale`` is given, the
timeouts: ``time_scale=0.02`` runs KubeRay's 5 s period every 100 ms of real time.

Not emulated: liveness and startup probes (ignored: a readiness probe runs even if a startup
probe would still hold it), container restarts and ``restartCount``, init containers (pods are
taken as initialized), the prober's start-up jitter and its 3 retries of an *errored* probe, a
terminating pod's phase change, ``Initialized``/``PodScheduled`` and phase (left as the test
wrote them), node status and heartbeats, pod IP assignment, HTTPS certificates (not checked,
as the kubelet does not check them), ``exec`` commands other than KubeRay's wget chains,
``grpc`` probes over TLS. An *errored* probe (a named port the container does not declare) is
thrown away, as the kubelet does: the readiness stays as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import heapq
import itertools
import logging
import posixpath
import shlex
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import yarl

from testsupport.kube.emulator import PODS, KubeEmulator, StoreChange, make_pod

log = logging.getLogger(__name__)

#: The kubelet's User-Agent on probes (``kube-probe/<major>.<minor>``).
USER_AGENT = "kube-probe/1.33"

#: Defaults of ``core/v1.Probe`` fields, as the API reference documents them.
PROBE_DEFAULTS: Mapping[str, float] = {
    "initialDelaySeconds": 0,
    "periodSeconds": 10,
    "timeoutSeconds": 1,
    "successThreshold": 1,
    "failureThreshold": 3,
}

#: GNU wget's defaults: ``--tries`` 20, ``--timeout`` (the read timeout) 900 s.
WGET_DEFAULT_TRIES = 20
WGET_DEFAULT_TIMEOUT = 900.0
#: How many redirects each client follows: the kubelet's prober 10, GNU wget 20.
PROBE_MAX_REDIRECTS = 10
WGET_MAX_REDIRECTS = 20

LOCALHOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


# --------------------------------------------------------------------------------------------
# KubeRay's injected readiness probes (ray-operator/controllers/ray/common/pod.go,
# initLivenessAndReadinessProbe; constants in ray-operator/controllers/ray/utils/constant.go).

KUBERAY_AGENT_PORT = 52365  # DefaultDashboardAgentListenPort
KUBERAY_SERVE_PORT = 8000  # DefaultServingPort
KUBERAY_RELEASES = ("1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7")


def kuberay_wget(release: str, timeout: int, port: int, path: str) -> str:
    """``BaseWgetHealthCommand`` of a KubeRay release: ``-T 2`` fixed in 1.1, a parameter from
    1.2, ``--tries 1`` from 1.4; ``path`` without its leading slash."""
    if release == "1.1":
        return f"wget -T 2 -q -O- http://localhost:{port}/{path} | grep success"
    tries = "--tries 1 " if _release_at_least(release, "1.4") else ""
    return f"wget {tries}-T {timeout} -q -O- http://localhost:{port}/{path} | grep success"


def kuberay_readiness_probe(
    release: str = "1.4",
    *,
    rayservice_worker: bool = True,
    serve_port: int = KUBERAY_SERVE_PORT,
    agent_port: int = KUBERAY_AGENT_PORT,
    unified_http: bool = False,
) -> dict[str, Any]:
    """The ``readinessProbe`` KubeRay ``release`` (1.1 .. 1.7) injects into a worker's Ray
    container that declares none (``ENABLE_PROBES_INJECTION`` not ``false``).

    A RayService worker (``rayservice_worker``) gets the raylet check and the Serve proxy
    check, ``failureThreshold: 1`` (``ServeReadinessProbeFailureThreshold``); the proxy's wget
    has ``-T 10`` from 1.2 on (``DefaultReadinessProbeInitialDelaySeconds`` passed as its
    timeout), ``-T 2`` in 1.1. Another worker (a RayCluster's) gets the raylet check alone,
    ``failureThreshold: 10``, or, from 1.6 with Ray 2.53+ (``unified_http``), an ``httpGet`` of
    ``/api/healthz`` on the agent port. Every release: ``initialDelaySeconds: 10``,
    ``periodSeconds: 5``, ``successThreshold: 1``; ``timeoutSeconds`` 1 in 1.1, 2 from 1.2.
    """
    if release not in KUBERAY_RELEASES:
        raise ValueError(f"KubeRay release {release!r}: one of {KUBERAY_RELEASES}")
    probe: dict[str, Any] = {
        "initialDelaySeconds": 10,
        "timeoutSeconds": 1 if release == "1.1" else 2,
        "periodSeconds": 5,
        "successThreshold": 1,
        "failureThreshold": 10,
    }
    raylet = kuberay_wget(release, 2, agent_port, "api/local_raylet_healthz")
    if rayservice_worker:
        proxy = kuberay_wget(release, 10, serve_port, "-/healthz")
        probe["failureThreshold"] = 1
        probe["exec"] = {"command": ["bash", "-c", f"{raylet} && {proxy}"]}
    elif unified_http and _release_at_least(release, "1.6"):
        probe["httpGet"] = {"path": "/api/healthz", "port": agent_port}
    else:
        probe["exec"] = {"command": ["bash", "-c", raylet]}
    return probe


def _release_at_least(release: str, minimum: str) -> bool:
    return tuple(map(int, release.split("."))) >= tuple(map(int, minimum.split(".")))


def probed_pod(
    namespace: str = "default",
    name: str = "ray-worker-0",
    *,
    readiness_probe: Mapping[str, Any] | None,
    pod_ip: str = "127.0.0.1",
    ports: Sequence[Mapping[str, Any]] = (),
    sidecars: Sequence[Mapping[str, Any]] = (),
    **settings: Any,
) -> dict[str, Any]:
    """``make_pod`` (``settings`` as it takes them) with ``readiness_probe`` on its Ray
    container, more container ``ports`` (``{"name": ..., "containerPort": ...}``) and more
    containers (``sidecars``); at 127.0.0.1 unless told."""
    pod = make_pod(namespace, name, pod_ip=pod_ip, **settings)
    container = pod["spec"]["containers"][0]
    if readiness_probe is not None:
        container["readinessProbe"] = copy.deepcopy(dict(readiness_probe))
    if ports:
        container.setdefault("ports", []).extend(dict(port) for port in ports)
    pod["spec"]["containers"].extend(copy.deepcopy(dict(sidecar)) for sidecar in sidecars)
    return pod


# --------------------------------------------------------------------------------------------
# Clocks.


class Clock(Protocol):
    def time(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    """The event loop's clock: probes on real time."""

    def time(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that moves only when told (through :meth:`Kubelet.advance`)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._listeners: list[Callable[[], None]] = []

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (self.now + max(0.0, seconds), next(self._order), future)
        heapq.heappush(self._sleepers, entry)
        self._notify()
        try:
            await future
        finally:
            if entry in self._sleepers:  # cancelled before it was due
                self._sleepers.remove(entry)
                heapq.heapify(self._sleepers)
                self._notify()

    @property
    def sleeping(self) -> int:
        """How many sleeps wait for the clock to move."""
        return len(self._sleepers)

    def next_deadline(self) -> float | None:
        return self._sleepers[0][0] if self._sleepers else None

    def fire_due(self) -> int:
        """Wake every sleep due by ``now``; how many."""
        fired = 0
        while self._sleepers and self._sleepers[0][0] <= self.now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)
            fired += 1
        return fired

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def _notify(self) -> None:
        for listener in self._listeners:
            listener()


# --------------------------------------------------------------------------------------------
# Probes.


class ProbeUnsupported(Exception):
    """A probe this emulation cannot run: the probe fails (and a WARNING says why)."""


class ProbeErrored(Exception):
    """A probe the kubelet cannot even start (a named port the container does not declare):
    its result is thrown away, the readiness stays as it was."""


@dataclass(frozen=True)
class ProbeSpec:
    """A ``readinessProbe``, its defaults applied."""

    kind: str  # httpGet, tcpSocket, grpc, exec
    action: Mapping[str, Any]
    initial_delay: float
    period: float
    timeout: float
    success_threshold: int
    failure_threshold: int

    @classmethod
    def parse(cls, probe: Mapping[str, Any]) -> ProbeSpec:
        kinds = [kind for kind in ("httpGet", "tcpSocket", "grpc", "exec") if probe.get(kind)]
        if len(kinds) != 1:
            raise ProbeUnsupported(f"a probe needs exactly one handler, found {kinds or 'none'}")

        def number(key: str) -> float:
            value = probe.get(key)
            return PROBE_DEFAULTS[key] if value in (None, 0) else value

        return cls(
            kind=kinds[0],
            action=copy.deepcopy(dict(probe[kinds[0]])),
            initial_delay=float(probe.get("initialDelaySeconds") or 0),
            period=float(number("periodSeconds")),
            timeout=float(number("timeoutSeconds")),
            success_threshold=int(number("successThreshold")),
            failure_threshold=int(number("failureThreshold")),
        )


@dataclass(frozen=True)
class WgetStep:
    """``wget [--tries N] -T T -q -O- URL | grep WORD``, one step of an exec chain."""

    url: str
    timeout: float = WGET_DEFAULT_TIMEOUT
    tries: int = WGET_DEFAULT_TRIES
    word: str = "success"


def parse_exec(command: Sequence[str]) -> list[WgetStep]:
    """The steps of a KubeRay exec probe (``["bash", "-c", "wget ... | grep ... && ..."]``);
    :class:`ProbeUnsupported` for anything else."""
    command = [str(part) for part in command]
    if (
        len(command) != 3
        or posixpath.basename(command[0]) not in ("bash", "sh")
        or command[1] != "-c"
    ):
        raise ProbeUnsupported(f"exec {command!r}: only `bash -c` / `sh -c` wget chains run")
    script = command[2]
    for forbidden in ("||", ";", "`", "$(", ">", "<", "\n"):
        if forbidden in script:
            raise ProbeUnsupported(f"exec script {script!r}: {forbidden!r} is not emulated")
    steps = []
    for segment in script.split("&&"):
        parts = segment.split("|")
        if len(parts) != 2:
            raise ProbeUnsupported(f"exec step {segment.strip()!r}: not `wget ... | grep WORD`")
        steps.append(_parse_wget(shlex.split(parts[0]), shlex.split(parts[1]), segment))
    return steps


def _parse_wget(wget: list[str], grep: list[str], segment: str) -> WgetStep:
    def unsupported(why: str) -> ProbeUnsupported:
        return ProbeUnsupported(f"exec step {segment.strip()!r}: {why}")

    if not wget or wget[0] != "wget":
        raise unsupported("the first command is not wget")
    if len(grep) != 2 or grep[0] != "grep" or grep[1].startswith("-"):
        raise unsupported("the second command is not `grep WORD`")
    url = None
    timeout, tries, to_stdout = WGET_DEFAULT_TIMEOUT, WGET_DEFAULT_TRIES, False
    args = iter(wget[1:])
    for arg in args:
        option, _, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        try:
            if arg in ("-q", "--quiet"):
                continue
            if arg in ("-O", "--output-document") and not inline:
                to_stdout = next(args) == "-"
            elif arg in ("-O-", "--output-document=-"):
                to_stdout = True
            elif option == "--timeout" or arg == "-T":
                timeout = float(inline or next(args))
            elif arg.startswith("-T"):
                timeout = float(arg[2:])
            elif option == "--tries" or arg == "-t":
                tries = int(inline or next(args))
            elif arg.startswith("-t") and arg[2:].isdigit():
                tries = int(arg[2:])
            elif not arg.startswith("-") and url is None:
                url = arg
            else:
                raise unsupported(f"wget argument {arg!r} is not emulated")
        except (StopIteration, ValueError):
            raise unsupported(f"wget argument {arg!r} lacks a valid value") from None
    if url is None:
        raise unsupported("wget has no URL")
    if not to_stdout:
        raise unsupported("wget does not write to stdout (-O-): grep would see nothing")
    return WgetStep(
        url=url, timeout=timeout, tries=max(1, tries or WGET_DEFAULT_TRIES), word=grep[1]
    )


@dataclass(frozen=True)
class ProbeRecord:
    """One probe that ran (``success`` None: errored, its result thrown away)."""

    at: float  # the kubelet's clock
    namespace: str
    pod: str
    container: str
    success: bool | None
    detail: str


# --------------------------------------------------------------------------------------------
# The kubelet.


@dataclass
class _Container:
    name: str
    spec: ProbeSpec | None  # None: no readiness probe
    invalid: str | None = None  # why the probe cannot run at all
    ready: bool = False
    last: bool | None = None
    run: int = 0
    task: asyncio.Task[None] | None = None


@dataclass
class _PodState:
    namespace: str
    name: str
    uid: str
    containers: dict[str, _Container]
    running: bool = False
    started_at: float = 0.0  # clock time the containers started
    started_iso: str = ""


def _pod_key(pod: Mapping[str, Any]) -> tuple[str, str]:
    metadata = pod.get("metadata") or {}
    return metadata.get("namespace") or "", metadata.get("name") or ""


def _iso_now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kubelet:
    """The kubelet of some pods of a :class:`KubeEmulator` (module docstring).

    ``async with Kubelet(kube, node="node-1") as kubelet:`` (or ``pods=[("default", "a")]``);
    ``kubelet.map_ports("default", "a", {52365: agent.port, 8000: proxy.port})``.
    ``adopt=True`` takes the pods as running for long already, each probed container's
    readiness as its ``containerStatuses[].ready`` (or the pod's ``ContainersReady``) shows it,
    and nothing written until a probe result changes it: a cluster that was running before the
    test started.
    """

    def __init__(
        self,
        kube: KubeEmulator,
        *,
        node: str | None = None,
        pods: Iterable[tuple[str, str]] = (),
        clock: Clock | None = None,
        time_scale: float = 1.0,
        timeout_scale: float | None = None,
        adopt: bool = False,
    ) -> None:
        self.kube = kube
        self.node = node
        self.clock: Clock = clock if clock is not None else LoopClock()
        self.time_scale = time_scale
        self.timeout_scale = time_scale if timeout_scale is None else timeout_scale
        self.adopt = adopt
        self._wanted: set[tuple[str, str]] = set(pods)
        self._ports: dict[tuple[str, str, int], tuple[str, int]] = {}
        self._pods: dict[tuple[str, str], _PodState] = {}
        self._records: list[ProbeRecord] = []
        self._queue: asyncio.Queue[StoreChange] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._busy = False
        self._changed = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self.writes = 0  # status writes made
        if isinstance(self.clock, FakeClock):
            self.clock.add_listener(self._changed.set)

    # ---- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Kubelet:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def start(self) -> None:
        # A probe's connection is never reused, as the kubelet's prober disables keep-alive.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), auto_decompress=False
        )
        # Subscribe, then take the pods as they are: in one synchronous step, so that no
        # change falls between them.
        self._queue = self.kube.subscribe()
        for pod in self.kube.list_objects(PODS):
            if self._manages(pod):
                self._sync(pod)
        self._follower = asyncio.create_task(self._follow(), name="kubelet-follower")

    async def stop(self) -> None:
        if self._queue is not None:
            self.kube.unsubscribe(self._queue)
        tasks = [state_task for state in self._pods.values() for state_task in self._tasks(state)]
        if self._follower is not None:
            tasks.append(self._follower)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pods.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- what a test says and reads -----------------------------------------------------------

    def manage(self, namespace: str, name: str) -> None:
        """Manage this pod too (now, or once it exists)."""
        self._wanted.add((namespace, name))
        pod = self.kube.pod(namespace, name)
        if pod is not None:
            self._sync(pod)

    def map_ports(
        self, namespace: str, name: str, ports: Mapping[int, int | tuple[str, int]]
    ) -> None:
        """``{container_port: loopback_port}`` (or ``(host, port)``): where a probe of that
        port of the pod connects, for every probe kind (``localhost`` in an exec too)."""
        for container_port, target in ports.items():
            address = ("127.0.0.1", target) if isinstance(target, int) else tuple(target)
            self._ports[(namespace, name, int(container_port))] = (str(address[0]), int(address[1]))

    def probes(
        self, namespace: str | None = None, name: str | None = None, container: str | None = None
    ) -> list[ProbeRecord]:
        """The probes that ran, oldest first."""
        return [
            record
            for record in self._records
            if (namespace is None or record.namespace == namespace)
            and (name is None or record.pod == name)
            and (container is None or record.container == container)
        ]

    def container_ready(self, namespace: str, name: str) -> dict[str, bool]:
        """Each container's readiness as the kubelet holds it ({} if it does not manage it)."""
        state = self._pods.get((namespace, name))
        if state is None:
            return {}
        return self._readiness(state)

    @staticmethod
    def _readiness(state: _PodState) -> dict[str, bool]:
        """Each container's readiness; one without a readiness probe is ready once running."""
        return {
            c.name: state.running and (c.ready or c.spec is None) for c in state.containers.values()
        }

    async def settle(self, within: float = 10.0) -> None:
        """Wait until every store change so far is handled and, on a :class:`FakeClock`, every
        probe worker waits for the clock (no probe in flight)."""
        await self._wait(self._settled, within, "the kubelet did not settle")

    async def advance(self, seconds: float, within: float = 10.0) -> None:
        """Move the :class:`FakeClock` by ``seconds``, running every probe due on the way (each
        to its end, its result written) in order of their times."""
        clock = self.clock
        if not isinstance(clock, FakeClock):
            raise TypeError("advance() needs a Kubelet built with clock=FakeClock()")
        target = clock.now + seconds
        await self.settle(within)
        while (deadline := clock.next_deadline()) is not None and deadline <= target:
            clock.now = max(clock.now, deadline)
            clock.fire_due()
            await self.settle(within)
        clock.now = target

    # ---- following the store -----------------------------------------------------------------

    def _manages(self, pod: Mapping[str, Any]) -> bool:
        if _pod_key(pod) in self._wanted:
            return True
        return self.node is not None and (pod.get("spec") or {}).get("nodeName") == self.node

    async def _follow(self) -> None:
        assert self._queue is not None
        while True:
            change = await self._queue.get()
            self._busy = True
            try:
                if change.resource == PODS:
                    self._on_pod_change(change)
            except Exception:
                log.exception("kubelet: handling a change of %s failed", _pod_key(change.obj))
            finally:
                self._busy = self._queue.qsize() > 0
                self._changed.set()

    def _on_pod_change(self, change: StoreChange) -> None:
        key = _pod_key(change.obj)
        if key not in self._pods and not self._manages(change.obj):
            return  # not ours then (a pod that becomes ours shows in a later change)
        current = self.kube.pod(*key)
        if current is None or not self._manages(current):
            self._forget(key)
            return
        self._sync(current)

    def _forget(self, key: tuple[str, str]) -> None:
        state = self._pods.pop(key, None)
        if state is not None:
            for task in self._tasks(state):
                task.cancel()

    @staticmethod
    def _tasks(state: _PodState) -> list[asyncio.Task[None]]:
        return [c.task for c in state.containers.values() if c.task is not None]

    def _sync(self, pod: Mapping[str, Any]) -> None:
        """Take a managed pod's current state: (re)start its workers, write its status."""
        key = _pod_key(pod)
        uid = pod["metadata"].get("uid", "")
        state = self._pods.get(key)
        if state is not None and state.uid != uid:  # deleted and created again
            self._forget(key)
            state = None
        if state is None:
            state = self._pods[key] = self._new_state(pod)
        phase = (pod.get("status") or {}).get("phase")
        if phase == "Running" and not state.running:
            state.running = True
            state.started_at = self.clock.time() - (1e9 if self.adopt else 0.0)
            state.started_iso = _iso_now()
            for container in state.containers.values():
                if container.spec is not None and container.task is None:
                    container.task = asyncio.create_task(
                        self._worker(state, container),
                        name=f"kubelet-probe-{key[0]}/{key[1]}/{container.name}",
                    )
                    container.task.add_done_callback(lambda _: self._changed.set())
        elif phase != "Running" and state.running:
            state.running = False
            for container in state.containers.values():
                if container.task is not None:
                    container.task.cancel()
                    container.task = None
                container.ready, container.last, container.run = False, None, 0
        self._write(state)

    def _new_state(self, pod: Mapping[str, Any]) -> _PodState:
        namespace, name = _pod_key(pod)
        containers = {}
        statuses = {
            s.get("name"): s for s in (pod.get("status") or {}).get("containerStatuses") or []
        }
        adopted_ready = _condition(pod, "ContainersReady") == "True"
        for spec in (pod.get("spec") or {}).get("containers") or []:
            container = _Container(name=spec["name"], spec=None)
            probe = spec.get("readinessProbe")
            if probe:
                try:
                    container.spec = ProbeSpec.parse(probe)
                except ProbeUnsupported as error:
                    container.invalid = str(error)
                    container.spec = ProbeSpec("invalid", {}, 0, 10, 1, 1, 3)
            if self.adopt and container.spec is not None:
                status = statuses.get(container.name)
                ready = bool(status.get("ready")) if status else adopted_ready
                container.ready, container.last = ready, ready
                spec_ = container.spec
                container.run = spec_.success_threshold if ready else spec_.failure_threshold
            containers[container.name] = container
        return _PodState(namespace, name, pod["metadata"].get("uid", ""), containers)

    # ---- probing -------------------------------------------------------------------------------

    async def _worker(self, state: _PodState, container: _Container) -> None:
        assert container.spec is not None
        period = container.spec.period * self.time_scale
        tick = self.clock.time()
        while True:
            try:
                await self._probe_once(state, container)
            except Exception:
                log.exception("kubelet: probe of %s/%s failed", state.name, container.name)
            tick += period
            now = self.clock.time()
            while tick <= now:  # a ticker drops the ticks a slow receiver missed
                tick += period
            await self.clock.sleep(tick - now)

    async def _probe_once(self, state: _PodState, container: _Container) -> None:
        spec = container.spec
        assert spec is not None
        if not state.running:
            return
        elapsed = (self.clock.time() - state.started_at) / self.time_scale
        if elapsed < spec.initial_delay:
            return  # "Probe disabled for InitialDelaySeconds"
        pod = self.kube.pod(state.namespace, state.name)
        if pod is None or pod["metadata"].get("uid") != state.uid:
            return
        at = self.clock.time()
        try:
            if container.invalid is not None:
                raise ProbeUnsupported(container.invalid)
            async with asyncio.timeout(spec.timeout * self.timeout_scale):
                success, detail = await self._run(pod, container.name, spec)
        except TimeoutError:
            success, detail = False, f"timeout: no answer within {spec.timeout:g}s"
        except ProbeUnsupported as error:
            log.warning(
                "kubelet: readiness probe of %s/%s container %s cannot run here, so it fails: %s",
                state.namespace,
                state.name,
                container.name,
                error,
            )
            success, detail = False, f"unsupported: {error}"
        except ProbeErrored as error:
            log.warning(
                "kubelet: readiness probe of %s/%s container %s errored (result thrown away): %s",
                state.namespace,
                state.name,
                container.name,
                error,
            )
            self._records.append(
                ProbeRecord(at, state.namespace, state.name, container.name, None, str(error))
            )
            return
        self._records.append(
            ProbeRecord(at, state.namespace, state.name, container.name, success, detail)
        )
        if self._pods.get((state.namespace, state.name)) is not state or not state.running:
            return  # the pod went away or stopped while the probe ran
        if container.last == success:
            container.run += 1
        else:
            container.last, container.run = success, 1
        threshold = spec.success_threshold if success else spec.failure_threshold
        if container.run < threshold or container.ready == success:
            return
        container.ready = success
        log.info(
            "kubelet: %s/%s container %s is %s (%s)",
            state.namespace,
            state.name,
            container.name,
            "ready" if success else "not ready",
            detail,
        )
        self._write(state)

    async def _run(
        self, pod: Mapping[str, Any], container_name: str, spec: ProbeSpec
    ) -> tuple[bool, str]:
        container = next(c for c in pod["spec"]["containers"] if c.get("name") == container_name)
        action = spec.action
        if spec.kind == "httpGet":
            port = self._container_port(container, action.get("port"))
            host, real_port = self._address(pod, port, action.get("host"))
            scheme = str(action.get("scheme") or "HTTP").lower()
            path = str(action.get("path") or "/")
            if not path.startswith("/"):
                path = "/" + path
            headers = {"User-Agent": USER_AGENT, "Accept": "*/*"}
            for header in action.get("httpHeaders") or []:
                headers[header["name"]] = header.get("value", "")
            url = yarl.URL.build(scheme=scheme, host=host, port=real_port).join(yarl.URL(path))
            return await self._http_probe(url, headers)
        if spec.kind == "tcpSocket":
            port = self._container_port(container, action.get("port"))
            host, real_port = self._address(pod, port, action.get("host"))
            try:
                _, writer = await asyncio.open_connection(host, real_port)
            except OSError as error:
                return False, f"dial tcp {host}:{real_port}: {error}"
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return True, "connected"
        if spec.kind == "grpc":
            port = action.get("port")
            if not isinstance(port, int):
                raise ProbeUnsupported(f"a grpc probe's port is a number, not {port!r}")
            host, real_port = self._address(pod, port, None)
            return await self._grpc_probe(f"{host}:{real_port}", str(action.get("service") or ""))
        if spec.kind == "exec":
            steps = parse_exec(action.get("command") or [])
            for step in steps:
                ok, detail = await self._wget(pod, step)
                if not ok:
                    return False, detail
            return True, f"{len(steps)} wget step(s) passed"
        raise ProbeUnsupported(f"probe kind {spec.kind!r}")

    def _container_port(self, container: Mapping[str, Any], port: Any) -> int:
        if isinstance(port, int):
            return port
        if isinstance(port, str) and port.isdigit():
            return int(port)
        for declared in container.get("ports") or []:
            if declared.get("name") == port:
                return int(declared["containerPort"])
        raise ProbeErrored(f"couldn't find port {port!r} in container {container.get('name')}")

    def _address(self, pod: Mapping[str, Any], port: int, host: str | None) -> tuple[str, int]:
        namespace, name = _pod_key(pod)
        pod_ip = (pod.get("status") or {}).get("podIP")
        if host in (None, "", pod_ip) or host in LOCALHOSTS:
            mapped = self._ports.get((namespace, name, port))
            if mapped is not None:
                return mapped
        address = host or pod_ip
        if not address:
            raise ProbeUnsupported(f"pod {namespace}/{name} has no IP to probe")
        return str(address), port

    async def _http_probe(self, url: yarl.URL, headers: Mapping[str, str]) -> tuple[bool, str]:
        assert self._session is not None
        first_host = url.host
        for _ in range(PROBE_MAX_REDIRECTS + 1):
            try:
                async with self._session.get(
                    url, headers=headers, allow_redirects=False, ssl=False
                ) as response:
                    status = response.status
                    location = response.headers.get("Location")
            except aiohttp.ClientError as error:
                return False, f"Get {str(url)!r}: {error}"
            if 300 <= status < 400 and location:
                target = url.join(yarl.URL(location))
                if target.host != first_host:
                    return True, f"HTTP {status}: probe terminated redirects"
                url = target
                continue
            return 200 <= status < 400, f"HTTP {status}"
        return False, f"stopped after {PROBE_MAX_REDIRECTS} redirects"

    async def _grpc_probe(self, target: str, service: str) -> tuple[bool, str]:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async with grpc.aio.insecure_channel(
            target, options=[("grpc.primary_user_agent", USER_AGENT)]
        ) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            except grpc.aio.AioRpcError as error:
                return False, f"rpc error: {error.code().name}: {error.details()}"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        if status != "SERVING":
            return False, f"service unhealthy (responded with {status!r})"
        return True, "SERVING"

    async def _wget(self, pod: Mapping[str, Any], step: WgetStep) -> tuple[bool, str]:
        assert self._session is not None
        url = yarl.URL(step.url)
        if url.scheme != "http" or url.host not in LOCALHOSTS:
            raise ProbeUnsupported(f"wget {step.url}: only http://localhost URLs are emulated")
        host, port = self._address(pod, url.port or 80, "localhost")
        url = url.with_host(host).with_port(port)
        for attempt in range(1, step.tries + 1):
            try:
                async with asyncio.timeout(step.timeout * self.timeout_scale):
                    async with self._session.get(
                        url, max_redirects=WGET_MAX_REDIRECTS, headers={"User-Agent": "Wget"}
                    ) as response:
                        body = await response.text(errors="replace")
                        status = response.status
            except TimeoutError:
                if attempt < step.tries:
                    continue  # wget retries a timed-out read
                return False, f"wget {step.url}: timed out ({step.tries} tries)"
            except aiohttp.ClientError as error:
                return False, f"wget {step.url}: {error}"
            if not 200 <= status < 300:
                return False, f"wget {step.url}: HTTP {status} (nothing for grep)"
            if step.word not in body:
                return False, f"wget {step.url}: HTTP {status}, no {step.word!r} in the body"
            return True, f"wget {step.url}: HTTP {status}, {step.word!r}"
        raise AssertionError("unreachable")  # pragma: no cover

    # ---- status --------------------------------------------------------------------------------

    def _write(self, state: _PodState) -> None:
        """Write the pod's container readiness and Ready/ContainersReady if they changed."""
        pod = self.kube.pod(state.namespace, state.name)
        if pod is None or pod["metadata"].get("uid") != state.uid:
            return
        status = pod.get("status") or {}
        phase = status.get("phase")
        # A container without a readiness probe is ready once running.
        ready = self._readiness(state)
        old_statuses = {s.get("name"): s for s in status.get("containerStatuses") or []}
        statuses = []
        for container in pod["spec"].get("containers") or []:
            name = container["name"]
            entry = copy.deepcopy(old_statuses.get(name)) or {
                "name": name,
                "image": container.get("image", ""),
                "imageID": "",
                "containerID": f"containerd://{uuid.uuid5(uuid.NAMESPACE_URL, state.uid + name)}",
                "restartCount": 0,
            }
            entry["ready"] = ready.get(name, False)
            entry["started"] = state.running
            if state.running and "running" not in (entry.get("state") or {}):
                entry["state"] = {"running": {"startedAt": state.started_iso or _iso_now()}}
            statuses.append(entry)
        containers_ready = _containers_ready_condition(pod, ready, phase)
        pod_ready = _ready_condition(pod, containers_ready)
        conditions = [copy.deepcopy(c) for c in status.get("conditions") or []]
        for new in (containers_ready, pod_ready):
            conditions = _set_condition(conditions, new)
        if conditions == status.get("conditions"):
            return  # (container statuses change with the conditions: no write of theirs alone)
        self.kube.patch_object(
            PODS,
            state.namespace,
            state.name,
            {"status": {"conditions": conditions, "containerStatuses": statuses}},
        )
        self.writes += 1

    # ---- waiting -------------------------------------------------------------------------------

    def _settled(self) -> bool:
        if self._queue is None or not self._queue.empty() or self._busy:
            return False
        if isinstance(self.clock, FakeClock):
            workers = sum(
                1 for state in self._pods.values() for task in self._tasks(state) if not task.done()
            )
            return self.clock.sleeping >= workers
        return True

    async def _wait(self, predicate: Callable[[], bool], within: float, what: str) -> None:
        try:
            async with asyncio.timeout(within):
                while not predicate():
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"{what} within {within}s") from None


def _condition(pod: Mapping[str, Any], kind: str) -> str | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return condition.get("status")
    return None


def _containers_ready_condition(
    pod: Mapping[str, Any], ready: Mapping[str, bool], phase: str | None
) -> dict[str, Any]:
    """``GenerateContainersReadyCondition``."""
    if phase in ("Succeeded", "Failed"):
        reason = "PodCompleted" if phase == "Succeeded" else "PodFailed"
        return {"type": "ContainersReady", "status": "False", "reason": reason}
    unready = [c["name"] for c in pod["spec"].get("containers") or [] if not ready.get(c["name"])]
    if unready:
        return {
            "type": "ContainersReady",
            "status": "False",
            "reason": "ContainersNotReady",
            "message": f"containers with unready status: [{' '.join(unready)}]",
        }
    return {"type": "ContainersReady", "status": "True"}


def _ready_condition(pod: Mapping[str, Any], containers_ready: Mapping[str, Any]) -> dict[str, Any]:
    """``GeneratePodReadyCondition``: ContainersReady, then every readiness gate True."""
    if containers_ready["status"] != "True":
        return {**containers_ready, "type": "Ready"}
    messages = []
    for gate in pod["spec"].get("readinessGates") or []:
        kind = gate.get("conditionType")
        status = _condition(pod, kind)
        if status is None:
            messages.append(
                f'corresponding condition of pod readiness gate "{kind}" does not exist.'
            )
        elif status != "True":
            messages.append(
                f'the status of pod readiness gate "{kind}" is not "True", but {status}'
            )
    if messages:
        return {
            "type": "Ready",
            "status": "False",
            "reason": "ReadinessGatesNotReady",
            "message": ", ".join(messages),
        }
    return {"type": "Ready", "status": "True"}


def _set_condition(
    conditions: list[dict[str, Any]], new: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Put ``new`` in place of its type's condition; unchanged if status, reason and message
    are the same; ``lastTransitionTime`` moves only with the status."""
    for index, old in enumerate(conditions):
        if old.get("type") != new["type"]:
            continue
        same = all(old.get(key) == new.get(key) for key in ("status", "reason", "message"))
        if same:
            return conditions
        entry = dict(new)
        entry["lastTransitionTime"] = (
            old.get("lastTransitionTime")
            if old.get("status") == new["status"] and old.get("lastTransitionTime")
            else _iso_now()
        )
        return [*conditions[:index], entry, *conditions[index + 1 :]]
    return [*conditions, {**new, "lastTransitionTime": _iso_now()}]


__all__ = [
    "FakeClock",
    "Kubelet",
    "LoopClock",
    "ProbeErrored",
    "ProbeRecord",
    "ProbeSpec",
    "ProbeUnsupported",
    "WgetStep",
    "kuberay_readiness_probe",
    "kuberay_wget",
    "parse_exec",
    "probed_pod",
]
