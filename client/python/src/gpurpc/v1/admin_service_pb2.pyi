from gpurpc.v1 import session_service_pb2 as _session_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListSessionsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class SessionSummary(_message.Message):
    __slots__ = ("session_id", "tenant", "device_ordinal", "device_memory_bytes", "age_ms", "idle_ms", "state", "fault_cause", "peer", "client_label", "worker_pid")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAULT_CAUSE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    CLIENT_LABEL_FIELD_NUMBER: _ClassVar[int]
    WORKER_PID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    tenant: str
    device_ordinal: int
    device_memory_bytes: int
    age_ms: int
    idle_ms: int
    state: _session_service_pb2.SessionState
    fault_cause: str
    peer: str
    client_label: str
    worker_pid: int
    def __init__(self, session_id: _Optional[int] = ..., tenant: _Optional[str] = ..., device_ordinal: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., age_ms: _Optional[int] = ..., idle_ms: _Optional[int] = ..., state: _Optional[_Union[_session_service_pb2.SessionState, str]] = ..., fault_cause: _Optional[str] = ..., peer: _Optional[str] = ..., client_label: _Optional[str] = ..., worker_pid: _Optional[int] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionSummary]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionSummary, _Mapping]]] = ...) -> None: ...

class AdminCloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class AdminCloseSessionResponse(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...
