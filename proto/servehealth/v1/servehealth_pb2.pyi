import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVE_STATE_UNSPECIFIED: _ClassVar[ServeState]
    SERVE_STATE_SERVING: _ClassVar[ServeState]
    SERVE_STATE_NOT_READY: _ClassVar[ServeState]
    SERVE_STATE_DRAINING: _ClassVar[ServeState]
    SERVE_STATE_NO_PROXY: _ClassVar[ServeState]
    SERVE_STATE_UNHEALTHY: _ClassVar[ServeState]
    SERVE_STATE_SILENT: _ClassVar[ServeState]
    SERVE_STATE_UNKNOWN: _ClassVar[ServeState]
    SERVE_STATE_NO_PROXY_BY_DESIGN: _ClassVar[ServeState]

class AgentMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGENT_MODE_UNSPECIFIED: _ClassVar[AgentMode]
    AGENT_MODE_SIDECAR: _ClassVar[AgentMode]
    AGENT_MODE_DAEMONSET: _ClassVar[AgentMode]

class Source(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SOURCE_UNSPECIFIED: _ClassVar[Source]
    SOURCE_PUSH: _ClassVar[Source]
    SOURCE_PULL: _ClassVar[Source]
    SOURCE_SEED: _ClassVar[Source]
SERVE_STATE_UNSPECIFIED: ServeState
SERVE_STATE_SERVING: ServeState
SERVE_STATE_NOT_READY: ServeState
SERVE_STATE_DRAINING: ServeState
SERVE_STATE_NO_PROXY: ServeState
SERVE_STATE_UNHEALTHY: ServeState
SERVE_STATE_SILENT: ServeState
SERVE_STATE_UNKNOWN: ServeState
SERVE_STATE_NO_PROXY_BY_DESIGN: ServeState
AGENT_MODE_UNSPECIFIED: AgentMode
AGENT_MODE_SIDECAR: AgentMode
AGENT_MODE_DAEMONSET: AgentMode
SOURCE_UNSPECIFIED: Source
SOURCE_PUSH: Source
SOURCE_PULL: Source
SOURCE_SEED: Source

class PodRef(_message.Message):
    __slots__ = ("namespace", "name", "uid")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    uid: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., uid: _Optional[str] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("hello", "reports")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    reports: ReportBatch
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., reports: _Optional[_Union[ReportBatch, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("mode", "pod", "node_name", "agent_version", "reports_on_change")
    MODE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPORTS_ON_CHANGE_FIELD_NUMBER: _ClassVar[int]
    mode: AgentMode
    pod: PodRef
    node_name: str
    agent_version: str
    reports_on_change: bool
    def __init__(self, mode: _Optional[_Union[AgentMode, str]] = ..., pod: _Optional[_Union[PodRef, _Mapping]] = ..., node_name: _Optional[str] = ..., agent_version: _Optional[str] = ..., reports_on_change: _Optional[bool] = ...) -> None: ...

class ReportBatch(_message.Message):
    __slots__ = ("reports",)
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    reports: _containers.RepeatedCompositeFieldContainer[PodReport]
    def __init__(self, reports: _Optional[_Iterable[_Union[PodReport, _Mapping]]] = ...) -> None: ...

class PodReport(_message.Message):
    __slots__ = ("pod", "state", "reason", "http_status", "probe_latency", "sequence")
    POD_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    PROBE_LATENCY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    pod: PodRef
    state: ServeState
    reason: str
    http_status: int
    probe_latency: _duration_pb2.Duration
    sequence: int
    def __init__(self, pod: _Optional[_Union[PodRef, _Mapping]] = ..., state: _Optional[_Union[ServeState, str]] = ..., reason: _Optional[str] = ..., http_status: _Optional[int] = ..., probe_latency: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., sequence: _Optional[int] = ...) -> None: ...

class AggregatorMessage(_message.Message):
    __slots__ = ("settings", "ack", "pod")
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    settings: AgentSettings
    ack: Ack
    pod: PodView
    def __init__(self, settings: _Optional[_Union[AgentSettings, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., pod: _Optional[_Union[PodView, _Mapping]] = ...) -> None: ...

class AgentSettings(_message.Message):
    __slots__ = ("heartbeat_interval", "resync_interval", "reports_per_change", "reports_per_failure", "writes", "fleet_size")
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    RESYNC_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    REPORTS_PER_CHANGE_FIELD_NUMBER: _ClassVar[int]
    REPORTS_PER_FAILURE_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    FLEET_SIZE_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval: _duration_pb2.Duration
    resync_interval: _duration_pb2.Duration
    reports_per_change: int
    reports_per_failure: int
    writes: WriteSettings
    fleet_size: int
    def __init__(self, heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., resync_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., reports_per_change: _Optional[int] = ..., reports_per_failure: _Optional[int] = ..., writes: _Optional[_Union[WriteSettings, _Mapping]] = ..., fleet_size: _Optional[int] = ...) -> None: ...

class PodView(_message.Message):
    __slots__ = ("pod", "resource_version", "node_name", "label", "condition", "gated", "overridden", "override")
    POD_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    GATED_FIELD_NUMBER: _ClassVar[int]
    OVERRIDDEN_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    pod: PodRef
    resource_version: str
    node_name: str
    label: str
    condition: str
    gated: bool
    overridden: bool
    override: str
    def __init__(self, pod: _Optional[_Union[PodRef, _Mapping]] = ..., resource_version: _Optional[str] = ..., node_name: _Optional[str] = ..., label: _Optional[str] = ..., condition: _Optional[str] = ..., gated: _Optional[bool] = ..., overridden: _Optional[bool] = ..., override: _Optional[str] = ...) -> None: ...

class WriteSettings(_message.Message):
    __slots__ = ("label", "label_key", "condition", "condition_type", "failure_threshold", "success_threshold", "fallback", "lease")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    LABEL_KEY_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    CONDITION_TYPE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    label: bool
    label_key: str
    condition: bool
    condition_type: str
    failure_threshold: int
    success_threshold: int
    fallback: bool
    lease: str
    def __init__(self, label: _Optional[bool] = ..., label_key: _Optional[str] = ..., condition: _Optional[bool] = ..., condition_type: _Optional[str] = ..., failure_threshold: _Optional[int] = ..., success_threshold: _Optional[int] = ..., fallback: _Optional[bool] = ..., lease: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("sequence",)
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    def __init__(self, sequence: _Optional[int] = ...) -> None: ...

class ListPodsRequest(_message.Message):
    __slots__ = ("namespace", "states")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    states: _containers.RepeatedScalarFieldContainer[ServeState]
    def __init__(self, namespace: _Optional[str] = ..., states: _Optional[_Iterable[_Union[ServeState, str]]] = ...) -> None: ...

class ListPodsResponse(_message.Message):
    __slots__ = ("pods",)
    PODS_FIELD_NUMBER: _ClassVar[int]
    pods: _containers.RepeatedCompositeFieldContainer[Pod]
    def __init__(self, pods: _Optional[_Iterable[_Union[Pod, _Mapping]]] = ...) -> None: ...

class GetPodRequest(_message.Message):
    __slots__ = ("namespace", "name")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class GetSummaryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchTransitionsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class Pod(_message.Message):
    __slots__ = ("namespace", "name", "uid", "node_name", "state", "reason", "http_status", "source", "last_report_age", "desired_label", "agent_connected", "probe_latency", "state_since", "carried", "override", "kubelet_checks_serve", "kubelet_ready")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_AGE_FIELD_NUMBER: _ClassVar[int]
    DESIRED_LABEL_FIELD_NUMBER: _ClassVar[int]
    AGENT_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    PROBE_LATENCY_FIELD_NUMBER: _ClassVar[int]
    STATE_SINCE_FIELD_NUMBER: _ClassVar[int]
    CARRIED_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    KUBELET_CHECKS_SERVE_FIELD_NUMBER: _ClassVar[int]
    KUBELET_READY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    uid: str
    node_name: str
    state: ServeState
    reason: str
    http_status: int
    source: Source
    last_report_age: _duration_pb2.Duration
    desired_label: str
    agent_connected: bool
    probe_latency: _duration_pb2.Duration
    state_since: _timestamp_pb2.Timestamp
    carried: str
    override: str
    kubelet_checks_serve: bool
    kubelet_ready: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., uid: _Optional[str] = ..., node_name: _Optional[str] = ..., state: _Optional[_Union[ServeState, str]] = ..., reason: _Optional[str] = ..., http_status: _Optional[int] = ..., source: _Optional[_Union[Source, str]] = ..., last_report_age: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., desired_label: _Optional[str] = ..., agent_connected: _Optional[bool] = ..., probe_latency: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., state_since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., carried: _Optional[str] = ..., override: _Optional[str] = ..., kubelet_checks_serve: _Optional[bool] = ..., kubelet_ready: _Optional[str] = ...) -> None: ...

class Summary(_message.Message):
    __slots__ = ("pods", "pods_by_state", "agents_connected", "label_key", "panic", "pods_in_pull_mode", "panic_held_writes", "dry_run", "would_enter", "would_leave", "overridden_out_of_service", "overridden_in_service", "pods_kubelet_checks_serve")
    class PodsByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PODS_FIELD_NUMBER: _ClassVar[int]
    PODS_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    AGENTS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LABEL_KEY_FIELD_NUMBER: _ClassVar[int]
    PANIC_FIELD_NUMBER: _ClassVar[int]
    PODS_IN_PULL_MODE_FIELD_NUMBER: _ClassVar[int]
    PANIC_HELD_WRITES_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    WOULD_ENTER_FIELD_NUMBER: _ClassVar[int]
    WOULD_LEAVE_FIELD_NUMBER: _ClassVar[int]
    OVERRIDDEN_OUT_OF_SERVICE_FIELD_NUMBER: _ClassVar[int]
    OVERRIDDEN_IN_SERVICE_FIELD_NUMBER: _ClassVar[int]
    PODS_KUBELET_CHECKS_SERVE_FIELD_NUMBER: _ClassVar[int]
    pods: int
    pods_by_state: _containers.ScalarMap[str, int]
    agents_connected: int
    label_key: str
    panic: bool
    pods_in_pull_mode: int
    panic_held_writes: int
    dry_run: bool
    would_enter: int
    would_leave: int
    overridden_out_of_service: int
    overridden_in_service: int
    pods_kubelet_checks_serve: int
    def __init__(self, pods: _Optional[int] = ..., pods_by_state: _Optional[_Mapping[str, int]] = ..., agents_connected: _Optional[int] = ..., label_key: _Optional[str] = ..., panic: _Optional[bool] = ..., pods_in_pull_mode: _Optional[int] = ..., panic_held_writes: _Optional[int] = ..., dry_run: _Optional[bool] = ..., would_enter: _Optional[int] = ..., would_leave: _Optional[int] = ..., overridden_out_of_service: _Optional[int] = ..., overridden_in_service: _Optional[int] = ..., pods_kubelet_checks_serve: _Optional[int] = ...) -> None: ...

class Transition(_message.Message):
    __slots__ = ("namespace", "name", "from_state", "to_state", "source", "reason", "desired_label", "time")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DESIRED_LABEL_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    from_state: ServeState
    to_state: ServeState
    source: Source
    reason: str
    desired_label: str
    time: _timestamp_pb2.Timestamp
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., from_state: _Optional[_Union[ServeState, str]] = ..., to_state: _Optional[_Union[ServeState, str]] = ..., source: _Optional[_Union[Source, str]] = ..., reason: _Optional[str] = ..., desired_label: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
