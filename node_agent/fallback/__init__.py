"""The agent's fallback: what it writes to its own pods while no aggregator answers.

The decider (``decider.py``) and its rules, phases, budget, the aggregator's messages and the
write bodies are pure; ``runner.py`` is the loop, ``writer.py`` and ``lease_watch.py`` the only
modules that talk to the Kubernetes API (loaded only when a fallback has something to write).
Nothing is imported here: a sidecar must not load the writer before it needs it.
"""
