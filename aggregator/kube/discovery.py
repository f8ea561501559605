"""Discovery of Ray pods: the shared list+watch (:mod:`servehealth_common.kube.watch`), with
pods parsed into :class:`~aggregator.kube.pods.KubePod` and watch restarts counted in the
aggregator's metrics."""

from __future__ import annotations

import functools
from collections.abc import Callable

from aggregator.kube.api import KubeApi
from aggregator.kube.pods import KubePod, parse_pod
from aggregator.metrics import Metrics
from servehealth_common.kube.watch import PodWatch
from servehealth_common.pod_identity import PodKey


class Discovery(PodWatch[KubePod]):
    def __init__(
        self,
        api: KubeApi,
        *,
        namespaces: tuple[str, ...],
        selector: str,
        default_port: int,
        metrics: Metrics,
        upsert: Callable[[KubePod], None],
        delete: Callable[[PodKey], None],
        watch_timeout: int = 300,
        field_selector: str | None = None,
    ) -> None:
        super().__init__(
            api,
            namespaces=namespaces,
            label_selector=selector,
            field_selector=field_selector,
            parse=functools.partial(parse_pod, default_port=default_port),
            upsert=upsert,
            delete=lambda pod: delete(pod.key),
            on_restart=lambda reason: metrics.watch_restarts.labels(reason).inc(),
            watch_timeout=watch_timeout,
        )
