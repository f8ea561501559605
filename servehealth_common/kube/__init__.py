"""Kubernetes API access shared by both programs: configuration, errors, list and watch of
pods, and the writes both make on a pod (its label, its condition, an Event).

The aggregator adds token reviews and its Lease on top (``aggregator.kube``). The agents read
(a DaemonSet agent lists and watches its node's pods) and write only in fallback, for their own
pods, when no aggregator answers (``node_agent.fallback.writer``). Only this package,
``aggregator.kube`` and the agent's DaemonSet and fallback modules import the ``kubernetes``
client, and its errors are wrapped in :mod:`servehealth_common.kube.errors`.
"""
