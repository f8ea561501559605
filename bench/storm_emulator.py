"""The fallback storm's Kubernetes API emulator, in a process of its own or in the bench's.

``bench/fallback_storm.py`` keeps about 11,000 watches open against the emulator at full scale
(each agent in fallback watches the aggregator's Lease). Every open connection is a file
descriptor on the client's side and one on the server's: 22,000 in one process, over the hard
limit of 20,000 of the machine the bench runs on (``ulimit -Hn``; it cannot be raised). So by
default the emulator runs in a child process (:class:`ChildEmulator`, which starts
``python -m bench.storm_emulator --control-fd N``): the server's sockets are there, the agents'
shared client's in the bench, about 11,000 each. :class:`LocalEmulator` runs it in the bench's
own process and event loop, as before (``--in-process``; a few thousand agents at most).

Both answer the same calls (:class:`EmulatorControl`): store the pods and the Lease, renew the
Lease, count the requests and the open watches, hand over the requests (as :class:`Arrival`
records) and the pods at the end. Setup and renewals change the store directly, not through the
API: they are not counted. The child's control channel is one end of a socket pair, framed and
pickled by :class:`multiprocessing.connection.Connection`: a request ``(op, args)``, a reply
``("ok", value)`` or ``("error", text)``; a thread of the child receives each request and runs it
on the emulator's event loop (the emulator is not thread-safe), the bench sends them from one
thread of its own so that its event loop never waits for the child.

One clock: an arrival's time (``ApiCall.at``) is the emulator's event-loop time, which is
``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the machine), the clock
the bench's timeline is read on, in either mode.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import socket
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import TracebackType
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kmock
import kubernetes

from bench import procstat
from testsupport import harness
from testsupport.kube.emulator import ApiCall, KubeEmulator

START_WITHIN = 60.0  # seconds for the child to answer that it serves
STOP_WITHIN = 30.0


class StormEmulator(KubeEmulator):
    """The tests' emulator, handing each change only to the open watches of its resource (the
    API server's watch cache is per resource; kmock's store wakes every watch, which then
    ignores a change of another resource). What every watch receives is the same."""

    only_own_resource: bool = True

    def _commit(self, resource: Any, kind: str, obj: Any, prev: Any) -> Any:
        if not self.only_own_resource:
            return super()._commit(resource, kind, obj, prev)
        everyone = self._watches
        self._watches = [watch for watch in everyone if watch.resource == resource]
        try:
            return super()._commit(resource, kind, obj, prev)
        finally:  # (synchronous: no watch can come or go meanwhile)
            self._watches = everyone


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request that reached the emulator: an :class:`ApiCall` without its kmock request
    (which stays in the emulator's process) and what the bench does not read."""

    method: str  # GET, POST, PUT, PATCH, DELETE
    verb: str  # get, list, watch, create, update, patch, delete
    resource: str | None  # plural
    subresource: str | None
    namespace: str | None
    name: str | None
    body: Any  # parsed JSON, or None
    at: float  # time.monotonic() of its arrival (the emulator's loop time)

    @classmethod
    def of(cls, call: ApiCall) -> Arrival:
        return cls(
            call.method,
            call.verb,
            call.resource,
            call.subresource,
            call.namespace,
            call.name,
            call.body,
            call.at,
        )


class Operations:
    """What the bench asks of the emulator, run on the emulator's event loop."""

    NAMES = frozenset(
        {"add_pods", "put_object", "patch_object", "counters", "requests", "list_objects", "gc"}
    )

    def __init__(self, emulator: StormEmulator) -> None:
        self.emulator = emulator

    def add_pods(
        self, namespace: str, labels: dict[str, str], pods: Sequence[tuple[str, str]]
    ) -> list[dict[str, Any]]:
        """Pods ``(name, node name)`` in the store, as stored (uid, resourceVersion)."""
        return [
            self.emulator.add_pod(namespace, name, labels=labels, node_name=node)
            for name, node in pods
        ]

    def put_object(self, resource: kmock.resource, obj: dict[str, Any]) -> None:
        self.emulator.put_object(resource, obj)

    def patch_object(
        self, resource: kmock.resource, namespace: str, name: str, patch: dict[str, Any]
    ) -> None:
        self.emulator.patch_object(resource, namespace, name, patch)

    def counters(self) -> tuple[int, int]:
        """The requests so far (a checkpoint: an index into :meth:`requests`), the open watches."""
        return self.emulator.checkpoint(), self.emulator.watch_count

    def requests(self) -> list[Arrival]:
        return [Arrival.of(call) for call in self.emulator.requests()]

    def list_objects(self, resource: kmock.resource, namespace: str) -> list[dict[str, Any]]:
        return self.emulator.list_objects(resource, namespace)

    def gc(self, disable: bool) -> None:
        """The emulator process's store out of the collector's way, as the bench does its own
        (``gc.freeze()``; with ``disable``, no collections from now on)."""
        gc.collect()
        gc.freeze()
        if disable:
            gc.disable()

    async def run(self, op: str, args: Sequence[Any]) -> Any:
        if op not in self.NAMES:
            raise ValueError(f"no operation {op!r}")
        return getattr(self, op)(*args)


class EmulatorControl:
    """The bench's handle on the emulator, wherever it runs (an async context manager)."""

    url: str = ""
    pid: int | None = None  # the emulator's own process; None: the bench's

    async def _call(self, op: str, *args: Any) -> Any:
        raise NotImplementedError

    def client_configuration(self) -> kubernetes.client.Configuration:
        """For the official client (no auth), as ``KubeEmulator.client_configuration``."""
        return kubernetes.client.Configuration(host=self.url)

    async def add_pods(
        self, namespace: str, labels: dict[str, str], pods: Sequence[tuple[str, str]]
    ) -> list[dict[str, Any]]:
        return list(await self._call("add_pods", namespace, labels, list(pods)))

    async def put_object(self, resource: kmock.resource, obj: dict[str, Any]) -> None:
        await self._call("put_object", resource, obj)

    async def patch_object(
        self, resource: kmock.resource, namespace: str, name: str, patch: dict[str, Any]
    ) -> None:
        await self._call("patch_object", resource, namespace, name, patch)

    async def counters(self) -> tuple[int, int]:
        """The requests so far (an index into :meth:`requests`) and the open watches."""
        requests, watches = await self._call("counters")
        return int(requests), int(watches)

    async def requests(self) -> list[Arrival]:
        """Every request so far, oldest first."""
        return list(await self._call("requests"))

    async def list_objects(self, resource: kmock.resource, namespace: str) -> list[dict[str, Any]]:
        return list(await self._call("list_objects", resource, namespace))

    async def settle_gc(self, disable: bool) -> None:
        """The emulator's process: its objects frozen, its collector off with ``disable``."""
        await self._call("gc", disable)


class LocalEmulator(EmulatorControl):
    """The emulator in the bench's own process and event loop (``--in-process``)."""

    def __init__(self, *, only_own_resource: bool = True) -> None:
        self.only_own_resource = only_own_resource
        self._stack = contextlib.AsyncExitStack()
        self._emulator: StormEmulator | None = None
        self._ops: Operations | None = None

    async def __aenter__(self) -> LocalEmulator:
        emulator = await self._stack.enter_async_context(StormEmulator())
        await self._stack.enter_async_context(kmock.Server(emulator))
        emulator.only_own_resource = self.only_own_resource
        self._emulator, self._ops = emulator, Operations(emulator)
        self.url = str(emulator.url).rstrip("/")
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._emulator is not None:
                await self._emulator.close()
        finally:
            await self._stack.aclose()

    async def _call(self, op: str, *args: Any) -> Any:
        assert self._ops is not None, "not started"
        return await self._ops.run(op, args)

    async def settle_gc(self, disable: bool) -> None:
        """Nothing: the bench's own collector settings are the emulator's."""


class ChildEmulator(EmulatorControl):
    """The emulator in a child process (``python -m bench.storm_emulator``), driven over a
    socket pair; the calls go out from one thread, one at a time, in the order made."""

    def __init__(self, *, only_own_resource: bool = True) -> None:
        self.only_own_resource = only_own_resource
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emulator-control")
        self._conn: Connection | None = None
        self._process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> ChildEmulator:
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "bench.storm_emulator", "--control-fd"]
        command.append(str(theirs.fileno()))
        if not self.only_own_resource:
            command.append("--plain-emulator")
        with theirs:
            self._process = await asyncio.create_subprocess_exec(
                *command, cwd=harness.REPO_ROOT, pass_fds=(theirs.fileno(),)
            )
        self._conn = Connection(ours.detach())
        try:
            ready = await asyncio.wait_for(self._in_thread(self._conn.recv), START_WITHIN)
        except BaseException:  # (its recv, in our one thread, ends when the child does)
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            await self._stop()
            raise
        _, self.url, self.pid = ready
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stop()

    async def _stop(self) -> None:
        """Ask the child to close its watches and stop; kill it if it does not."""
        process, conn = self._process, self._conn
        with contextlib.suppress(OSError, EOFError, TimeoutError):  # (behind a call stuck)
            if conn is not None:
                await asyncio.wait_for(self._in_thread(conn.send, ("close", ())), STOP_WITHIN)
        if process is not None:
            try:
                await asyncio.wait_for(process.wait(), STOP_WITHIN)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if conn is not None:
            conn.close()
        self._executor.shutdown(wait=False)

    async def _in_thread(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    def _exchange(self, op: str, args: tuple[Any, ...]) -> Any:
        assert self._conn is not None, "not started"
        self._conn.send((op, args))
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"the emulator's process: {value}")
        return value

    async def _call(self, op: str, *args: Any) -> Any:
        # Sent and answered in one job of the one thread: a caller cancelled meanwhile leaves
        # the exchange whole, and the next call's reply is its own.
        return await self._in_thread(self._exchange, op, args)


# -- the child process ----------------------------------------------------------------------


def settle(finished: asyncio.Future[None]) -> None:
    if not finished.done():
        finished.set_result(None)


def answer(
    conn: Connection,
    ops: Operations,
    loop: asyncio.AbstractEventLoop,
    finished: asyncio.Future[None],
) -> None:
    """The control thread: each request run on the emulator's loop, until ``close`` or until
    the bench is gone (its end of the socket pair closed)."""
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            op, args = "close", ()
        if op == "close":
            loop.call_soon_threadsafe(settle, finished)
            return
        try:
            reply = ("ok", asyncio.run_coroutine_threadsafe(ops.run(op, args), loop).result())
        except Exception as exc:
            reply = ("error", f"{op}: {exc!r}")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            continue  # the next recv ends it


async def serve(conn: Connection, *, only_own_resource: bool) -> None:
    """Serve the emulator on 127.0.0.1 (a free port) until the bench says ``close``."""
    async with StormEmulator() as emulator, kmock.Server(emulator):
        emulator.only_own_resource = only_own_resource
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        conn.send(("ready", str(emulator.url).rstrip("/"), os.getpid()))
        thread = threading.Thread(
            target=answer,
            args=(conn, Operations(emulator), loop, finished),
            name="emulator-control",
            daemon=True,
        )
        thread.start()
        await finished
        await emulator.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the fallback storm's emulator (a child)")
    parser.add_argument("--control-fd", type=int, required=True, help="a socket pair's end")
    parser.add_argument("--plain-emulator", action="store_true")
    args = parser.parse_args(argv)
    procstat.raise_fd_limit()
    conn = Connection(args.control_fd)
    try:
        asyncio.run(serve(conn, only_own_resource=not args.plain_emulator))
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
