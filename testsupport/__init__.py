"""What the tests and the benchmarks share, and only they: the Kubernetes API emulator and its
in-process kubelet, EndpointSlice controller and Service router (``kube/``), fake Serve proxies
(``fakes.py``), the programs started as processes (``harness.py``, ``kube/agent_processes.py``,
``processes.py``), raw gRPC messages (``messages.py``), the discrete-event simulation of the core
(``simulation.py``), the polling wait (``waiting.py``) and bodies captured from real systems
(``captures.py``, ``data/``).

It imports neither ``tests`` nor ``bench`` (both import it), and no product package imports it
(``[tool.importlinter]`` in pyproject.toml). It is not in the wheel."""
