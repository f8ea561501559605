"""What both programs write to a pod, in one place: the aggregator's writer and an agent's
fallback decide and build their writes with these, so that an agent writes what the aggregator
would (pure: no I/O).

- :mod:`.pod`: a pod as both programs read it (what it carries, its readiness gates, its
  resourceVersion, override and fallback marks), and what a view of it shows;
- :mod:`.streak`: the thresholds step (observations in a row before a side is accepted; the
  programs differ only where UNHEALTHY and a first observation count, said by its parameters);
- :mod:`.desired`: what a pod should carry (the label, the condition and its message), from
  what is known of it: its health, the override, the mode, the gate, what it carries;
- :mod:`.rule`: whether a write is needed (a missing label counts as ``"false"``), the
  condition a value is written as (``NoProxyByDesign`` included), what a pod carries as read,
  and which of two readings of a pod is the earlier;
- :mod:`.bodies`: the label and condition patches and the Event;
- :mod:`.times`: the API's two time formats (whole seconds, and ``MicroTime``).

Retries and ``Retry-After`` are :mod:`servehealth_common.backoff`'s.
"""
