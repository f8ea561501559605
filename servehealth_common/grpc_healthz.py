"""Ask a Ray Serve gRPC proxy ``Healthz`` (an adapter of grpc.aio around :mod:`classify`).

Ray's gRPC proxy serves ``/ray.serve.RayServeAPIService/Healthz`` beside the applications'
services when an application sets ``grpc_options``; Ray's HAProxy mode answers it in front of
the proxies. The call is generic (bytes in, bytes out): the agent does not import Ray. The
request is an empty ``HealthzRequest`` (no bytes); the answer, ``HealthzResponse``, has one
field, ``string message = 1``, the wire format of protobuf's own ``StringValue``, which decodes
it.

One channel per address, kept while the proxy answers (a probe is then one HTTP/2 stream on an
open connection); a call that got no answer from the server (refused, reset, timeout) closes
its channel, so that the next probe connects afresh rather than wait out gRPC's reconnection
backoff (up to 2 minutes) while the proxy is already back.

A status the gRPC library made up itself (no connection) is told from one the server sent by
its details: the C core's ``failed to connect to all addresses`` (then ``Connection refused``
means nothing listens: NO_PROXY). A server that sends those words itself only makes its own pod
look worse.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
from google.protobuf import wrappers_pb2
from google.protobuf.message import DecodeError

from servehealth_common import classify
from servehealth_common.states import ServeState

HEALTHZ_METHOD = "/ray.serve.RayServeAPIService/Healthz"
#: The proxy's answer is a few bytes; refuse more than this.
MAX_ANSWER_BYTES = 4096
#: The words of the C core when no connection could be made.
_NOT_CONNECTED = "failed to connect to all addresses"
_REFUSED = "Connection refused"

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_ANSWER_BYTES),
    ("grpc.enable_retries", 0),
    # A probe is the only caller: no keepalive pings of our own, no BDP probes.
    ("grpc.http2.bdp_probe", 0),
    # Each probe stands alone: never share a connection with the agent's own stream.
    ("grpc.use_local_subchannel_pool", 1),
)


@dataclass(frozen=True, slots=True)
class GrpcAnswer:
    """What one call came back with: the verdict, whether the server itself answered, and
    whether the call ran out of time."""

    verdict: classify.Verdict
    answered: bool
    timed_out: bool = False


class _Channel:
    """A channel and the calls in flight on it: one that is dropped while another call uses
    it (a hedged probe of the same proxy) is closed when that call ends, not under it."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.calls = 0
        self.dropped = False

    async def close_if_unused(self) -> None:
        if self.dropped and self.calls == 0:
            # Shielded: a cancelled probe still lets its channel go.
            await asyncio.shield(self.channel.close())


class GrpcHealthz:
    """``await healthz.check(address)`` → :class:`GrpcAnswer`; ``await close()``. Each call
    has a deadline of ``deadline`` seconds.

    Build it inside the event loop that calls it (grpc.aio channels belong to one loop).
    """

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline
        self._channels: dict[str, _Channel] = {}

    async def check(self, address: str) -> GrpcAnswer:
        """Call ``Healthz`` on ``address`` (``host:port``).

        Cancellation (the prober's own timeout) drops the channel and propagates.
        """
        entry = self._channels.get(address)
        if entry is None:
            entry = self._channels[address] = _Channel(address)
        entry.calls += 1
        answered = False
        try:
            call = entry.channel.unary_unary(HEALTHZ_METHOD)
            try:
                answer = await call(b"", timeout=self._deadline)
            except grpc.aio.AioRpcError as error:
                result = _from_error(error, self._deadline)
            else:
                result = _from_answer(answer)
            answered = result.answered
            return result
        finally:
            entry.calls -= 1
            if not answered:
                self._drop(address, entry)
            await entry.close_if_unused()

    async def close(self) -> None:
        for address, entry in list(self._channels.items()):
            self._drop(address, entry)
            await entry.close_if_unused()

    def _drop(self, address: str, entry: _Channel) -> None:
        entry.dropped = True
        if self._channels.get(address) is entry:
            del self._channels[address]


def _from_answer(answer: bytes | None) -> GrpcAnswer:
    try:  # None: OK and no message at all, HAProxy's trailers-only answer (as an empty one)
        message = wrappers_pb2.StringValue.FromString(answer or b"").value
    except DecodeError:
        verdict = classify.Verdict(
            ServeState.UNHEALTHY, "OK with an answer that is not a HealthzResponse."
        )
    else:
        verdict = classify.classify_grpc_healthz("OK", message)
    return GrpcAnswer(verdict, answered=True)


def _from_error(error: grpc.aio.AioRpcError, timeout: float) -> GrpcAnswer:
    code = error.code()
    details = error.details() or ""
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return GrpcAnswer(classify.timed_out(timeout), answered=False, timed_out=True)
    if code is grpc.StatusCode.UNAVAILABLE and details.startswith(_NOT_CONNECTED):
        if _REFUSED in details:
            return GrpcAnswer(classify.connection_refused(), answered=False)
        return GrpcAnswer(classify.transport_error(RuntimeError(details)), answered=False)
    verdict = classify.classify_grpc_healthz(code.name, details)
    # An UNAVAILABLE in words the proxy does not use is the library's own (a broken connection).
    answered = code is not grpc.StatusCode.UNAVAILABLE or verdict.state is not ServeState.UNHEALTHY
    return GrpcAnswer(verdict, answered=answered)
