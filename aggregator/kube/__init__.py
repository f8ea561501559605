"""The Kubernetes backend: discovery of Ray pods, and the writer that keeps their label true.

Only this package imports the ``kubernetes`` client; its errors are wrapped in
:mod:`aggregator.kube.errors` at the boundary.
"""
