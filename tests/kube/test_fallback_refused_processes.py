"""Issue 26, bug 5, with the real programs and to the end: a sidecar agent that a live
aggregator refuses writes nothing for its failing pod for as long as the aggregator renews its
Lease, and writes it once the aggregator is gone (killed: the Lease is no longer renewed, and
never released).

A real ``serve-health-aggregator --leader-elect`` (kube backend on the emulator, lease
``LEASE_SECONDS``) and a real ``serve-health-agent`` sidecar (``--fallback-after 2s``,
``--fallback-write label``, ``--fallback-lease`` naming the aggregator's Lease) whose loopback
Serve proxy answers 503, so that the agent always has a write it wants to make (label
``ray.io/serve: "false"`` on a pod that carries ``"true"``). Two refusals the aggregator really
makes:

- ``unauthenticated``: ``--auth tokenreview``, and the sidecar sends a real token of its pod
  for the wrong audience (the API server's: as if it had mounted the default token instead of
  the projected one); the emulator's TokenReview rejects it: UNAUTHENTICATED;
- ``unknown-pod``: the hello names a pod the aggregator does not select (its
  ``--pod-selector``, as after a skew between the agent's and the aggregator's selection):
  FAILED_PRECONDITION.

Both aggregators select no pod of this test (``--pod-selector app=elsewhere``): they never
probe nor write the agent's pod themselves, so the pod's label is the agent's alone to change,
and a write on it shows the agent's fallback (and nothing else).

What is observed: the PATCHes that reach the emulator (by User-Agent), the label the pod
carries, the Lease's writes; the agent's log only to tell how it was refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.conftest import eventually
from testsupport import harness
from testsupport.kube.agent_processes import (
    FAILING,
    FALLBACK_AFTER,
    LABEL,
    LEASE,
    ProxyPool,
    add_pod,
    agent_read_the_lease,
    kill,
    leading_aggregator,
    lease_holder,
    lease_writes,
    more_probes,
    pod_writes_by_agents,
    spawn_sidecar,
    stop_all,
    writes_by,
)
from testsupport.kube.emulator import API_AUDIENCE, KubeEmulator

#: The aggregator's Lease: short, so that the story is; with room to renew on a loaded
#: machine (a leader that misses its renew deadline gives its Lease up, and then the agent is
#: right to fall back: not what is tested here).
LEASE_SECONDS = 6
RENEW_DEADLINE = 5.0
#: How long the refused agent must write nothing once it has read the Lease: longer than its
#: --fallback-after plus the Lease's duration, which is when it would write if the gate
#: failed (a Lease first seen counts as renewed for its duration).
QUIET = FALLBACK_AFTER + LEASE_SECONDS + 2.0
#: How long a wait for what real processes do may take: only a hang takes that long.
WAIT = 90.0
#: How the aggregator refuses: its flags, and the status code the agent is told.
REFUSALS = {
    "unauthenticated": (("--auth=tokenreview",), "UNAUTHENTICATED"),
    "unknown-pod": (("--auth=none",), "FAILED_PRECONDITION"),
}


@pytest.fixture
async def proxies() -> AsyncIterator[ProxyPool]:
    pool = ProxyPool()
    yield pool
    await pool.stop()


@pytest.fixture
def processes() -> Iterator[list[harness.Process]]:
    running: list[harness.Process] = []
    yield running
    stop_all(running)


@pytest.mark.parametrize("how", sorted(REFUSALS))
async def test_a_refused_agent_writes_nothing_while_the_aggregator_lives_then_falls_back(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    tmp_path: Path,
    how: str,
) -> None:
    kube = kube_emulator
    loop = asyncio.get_running_loop()
    aggregator_flags, refusal = REFUSALS[how]
    [proxy] = await proxies.start(1)
    proxy.set(FAILING)  # from the agent's first probe on, it has a write it wants to make
    pod = add_pod(kube, "worker", proxy, labels={LABEL: "true"})
    aggregator = await asyncio.to_thread(
        leading_aggregator,
        tmp_path / "aggregator",
        kubeconfig_path,
        *aggregator_flags,
        "--mode=label",
        "--agent-fallback=on",
        "--pod-selector=app=elsewhere",
        lease_seconds=LEASE_SECONDS,
        renew_deadline=RENEW_DEADLINE,
    )
    processes.append(aggregator)
    await eventually(lambda: lease_holder(kube), WAIT)
    holder = lease_holder(kube)
    agent_flags = ["--fallback-write=label", f"--fallback-lease={LEASE}"]
    if how == "unauthenticated":
        token = kube.issue_token("default", "default", pod="worker", audiences=[API_AUDIENCE])
        token_file = tmp_path / "token"
        token_file.write_text(token)
        agent_flags.append(f"--token-file={token_file}")
    agent = spawn_sidecar(tmp_path, aggregator.address, proxy, pod, kubeconfig_path, *agent_flags)
    processes.append(agent)

    # Refused, and then (past --fallback-after, with a write it wants to make) it reads the
    # Lease: from here on only the gate keeps it from writing.
    await eventually(lambda: refusal in agent.log_text(), WAIT)
    await eventually(lambda: agent_read_the_lease(kube), WAIT)
    await more_probes(proxy, QUIET)
    assert aggregator.alive, f"the aggregator stopped\n{aggregator.tail()}"
    assert lease_holder(kube) == holder, "the aggregator lost its Lease: see its log"
    assert pod_writes_by_agents(kube) == [], agent.tail()
    assert writes_by(kube, agent=True) == [], agent.tail()  # no Event either
    assert kube.pod_labels("default", "worker")[LABEL] == "true"

    # The aggregator dies without a word: its Lease is neither renewed nor released.
    await asyncio.to_thread(kill, aggregator)
    killed = loop.time()
    last_renewal = max(call.at for call in lease_writes(kube))
    await eventually(lambda: kube.pod_labels("default", "worker")[LABEL] == "false", WAIT)
    written = pod_writes_by_agents(kube)
    assert written, "the label changed, but no agent wrote it"
    assert {call.name for call in written} == {"worker"}
    assert all(call.at > killed for call in written)
    # Not before the Lease had gone unrenewed for its duration (the agent's clock starts when
    # it sees a renewal, which is after the emulator received it).
    assert min(call.at for call in written) >= last_renewal + LEASE_SECONDS - 0.5, (
        min(call.at for call in written) - last_renewal
    )
    assert [call for call in writes_by(kube, agent=False) if call.resource == "pods"] == []
    print(f"the agent wrote {min(c.at for c in written) - killed:.2f}s after the kill")
