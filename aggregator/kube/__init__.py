"""The Kubernetes backend: discovery of Ray pods, and the writer that keeps their label true.

Built on the reads shared with the DaemonSet agent (:mod:`servehealth_common.kube`); only these
two packages import the ``kubernetes`` client, whose errors are wrapped in
:mod:`servehealth_common.kube.errors` at the boundary.
"""
