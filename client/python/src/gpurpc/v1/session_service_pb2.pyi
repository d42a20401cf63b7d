from gpurpc.v1 import device_service_pb2 as _device_service_pb2
from gpurpc.v1 import memory_service_pb2 as _memory_service_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_STATE_ACTIVE: _ClassVar[SessionState]
    SESSION_STATE_FAULTED: _ClassVar[SessionState]
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_STATE_ACTIVE: SessionState
SESSION_STATE_FAULTED: SessionState

class ExportEventRequest(_message.Message):
    __slots__ = ("event_id",)
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    def __init__(self, event_id: _Optional[int] = ...) -> None: ...

class ExportEventResponse(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    def __init__(self, handle: _Optional[bytes] = ...) -> None: ...

class OpenEventHandleRequest(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    def __init__(self, handle: _Optional[bytes] = ...) -> None: ...

class OpenEventHandleResponse(_message.Message):
    __slots__ = ("event_id",)
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    def __init__(self, event_id: _Optional[int] = ...) -> None: ...

class ExportMemoryRequest(_message.Message):
    __slots__ = ("buffer_id",)
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    buffer_id: int
    def __init__(self, buffer_id: _Optional[int] = ...) -> None: ...

class ExportMemoryResponse(_message.Message):
    __slots__ = ("handle", "size_bytes")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    size_bytes: int
    def __init__(self, handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class OpenMemoryHandleRequest(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    def __init__(self, handle: _Optional[bytes] = ...) -> None: ...

class OpenMemoryHandleResponse(_message.Message):
    __slots__ = ("buffer",)
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    buffer: _memory_service_pb2.BufferInfo
    def __init__(self, buffer: _Optional[_Union[_memory_service_pb2.BufferInfo, _Mapping]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("device_ordinal", "client_label")
    DEVICE_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    CLIENT_LABEL_FIELD_NUMBER: _ClassVar[int]
    device_ordinal: int
    client_label: str
    def __init__(self, device_ordinal: _Optional[int] = ..., client_label: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "device", "idle_timeout_ms", "grace_ms", "daemon_instance")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    device: _device_service_pb2.DeviceInfo
    idle_timeout_ms: int
    grace_ms: int
    daemon_instance: str
    def __init__(self, session_id: _Optional[int] = ..., device: _Optional[_Union[_device_service_pb2.DeviceInfo, _Mapping]] = ..., idle_timeout_ms: _Optional[int] = ..., grace_ms: _Optional[int] = ..., daemon_instance: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("state", "fault_cause", "fault_code")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAULT_CAUSE_FIELD_NUMBER: _ClassVar[int]
    FAULT_CODE_FIELD_NUMBER: _ClassVar[int]
    state: SessionState
    fault_cause: str
    fault_code: int
    def __init__(self, state: _Optional[_Union[SessionState, str]] = ..., fault_cause: _Optional[str] = ..., fault_code: _Optional[int] = ...) -> None: ...

class WatchSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("state", "fault_cause", "fault_code")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAULT_CAUSE_FIELD_NUMBER: _ClassVar[int]
    FAULT_CODE_FIELD_NUMBER: _ClassVar[int]
    state: SessionState
    fault_cause: str
    fault_code: int
    def __init__(self, state: _Optional[_Union[SessionState, str]] = ..., fault_cause: _Optional[str] = ..., fault_code: _Optional[int] = ...) -> None: ...
