"""What a pod should carry, from what is known of it: the one desired state (pure; both
programs ask it: the aggregator's Kubernetes backend on a transition, on the watch's drift
repair and for the shadow figures, its memory backend, and an agent's fallback).

The rules, in order:

1. **The override beats the pod's health**: an honoured ``ray-serve-health/override``
   (:class:`~servehealth_common.override.Override`) wants its label (``out-of-service``:
   ``"false"``, ``in-service``: ``"true"``) whatever the health wants, even while PANIC holds
   a removal; an ignored value changes nothing. Without an override, the label the health
   calls for; ``None`` (not tracked, a removal held by PANIC or awaiting a look): leave
   everything the pod carries.
2. **The label** is wanted in label mode (``label``, ``both``).
3. **The condition** is wanted in condition mode (``condition``, ``both``), and only on a pod
   that declares its type in ``spec.readinessGates``: the value that goes with the label
   (:func:`~servehealth_common.pod_writes.rule.condition_status`), ``NoProxyByDesign`` for a
   pod with no proxy by design, unless an override decides. On a drift repair (``repair``: a
   watch event, not a transition) a condition nobody wrote yet is not drift: it is left to the
   pod's first transition, unless an override decides.
4. **The condition's message**: the override's while one decides, else the transition's (if
   any; None keeps the one a pending write already has), at most 512 characters.

Whether a write is needed is then :func:`~servehealth_common.pod_writes.rule.write_needed`'s
(a missing label counts as ``"false"``): :attr:`Desired.writes`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from servehealth_common.override import ANNOTATION, NONE, Override
from servehealth_common.pod_writes.rule import WriteKind, condition_status, write_needed

#: The longest condition message written (the API takes more; people read less).
MESSAGE_LIMIT = 512


@dataclass(frozen=True, slots=True)
class Known:
    """What is known of a pod, for :func:`desired`."""

    #: The label the pod's health calls for (``"true"``, ``"false"``); None: leave it.
    health: str | None
    #: The mode: whether the label, and the readiness-gate condition, are written at all.
    writes_label: bool
    writes_condition: bool
    #: Whether the pod declares the condition's type in ``spec.readinessGates``.
    gated: bool = False
    override: Override = NONE
    #: Whether the pod has no Serve proxy by design (its condition is then True).
    by_design: bool = False
    #: What the pod carries now (None: absent).
    label: str | None = None
    condition: str | None = None
    #: The transition's message for the condition (None: no transition).
    message: str | None = None
    #: A drift repair (a watch event), not a transition: an unwritten condition is left.
    repair: bool = False


@dataclass(frozen=True, slots=True)
class Desired:
    """What a pod should carry: each value None where nothing is to be written."""

    #: The label value every target follows (the override's, else the health's; None: leave).
    value: str | None = None
    label: str | None = None
    condition: str | None = None
    #: The condition's message (None: keep the one already wanted).
    message: str | None = None
    #: The targets that differ from what the pod carries (what write_needed calls for).
    writes: frozenset[WriteKind] = frozenset()

    def targets(self) -> Iterator[tuple[WriteKind, str]]:
        """Each thing to carry and its value: the label, then the condition."""
        if self.label is not None:
            yield WriteKind.LABEL, self.label
        if self.condition is not None:
            yield WriteKind.CONDITION, self.condition


def desired(known: Known) -> Desired:
    """The complete desired state of a pod (the module's rules)."""
    override = known.override
    value = override.label if override.label is not None else known.health
    if value is None:
        return Desired()
    overridden = override.value is not None
    label = value if known.writes_label else None
    condition = None
    message = None
    if (
        known.writes_condition
        and known.gated
        and (not known.repair or known.condition is not None or overridden)
    ):
        condition = condition_status(value, by_design=known.by_design and not overridden)
        message = override_message(override) if overridden else known.message
    writes = frozenset(
        kind
        for kind, wanted, carried in (
            (WriteKind.LABEL, label, known.label),
            (WriteKind.CONDITION, condition, known.condition),
        )
        if wanted is not None and write_needed(kind, carried, wanted)
    )
    return Desired(value, label, condition, message and message[:MESSAGE_LIMIT], writes)


def override_message(override: Override) -> str | None:
    """The condition's message while an override decides (None: none does)."""
    if override.value is None:
        return None
    return f"override {override.value} ({ANNOTATION}): the pod's health does not decide"
