from gpurpc.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenDirectChannelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenDirectChannelResponse(_message.Message):
    __slots__ = ("attach_ticket", "region_socket")
    ATTACH_TICKET_FIELD_NUMBER: _ClassVar[int]
    REGION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    attach_ticket: bytes
    region_socket: str
    def __init__(self, attach_ticket: _Optional[bytes] = ..., region_socket: _Optional[str] = ...) -> None: ...

class RegisterHostRegionRequest(_message.Message):
    __slots__ = ("size_bytes",)
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    def __init__(self, size_bytes: _Optional[int] = ...) -> None: ...

class RegisterHostRegionResponse(_message.Message):
    __slots__ = ("region_id", "attach_ticket", "region_socket")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    ATTACH_TICKET_FIELD_NUMBER: _ClassVar[int]
    REGION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    attach_ticket: bytes
    region_socket: str
    def __init__(self, region_id: _Optional[int] = ..., attach_ticket: _Optional[bytes] = ..., region_socket: _Optional[str] = ...) -> None: ...

class UnregisterHostRegionRequest(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    def __init__(self, region_id: _Optional[int] = ...) -> None: ...

class UnregisterHostRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CopyHostRegionRequest(_message.Message):
    __slots__ = ("region_id", "region_offset_bytes", "device", "size_bytes", "to_device", "stream_id")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TO_DEVICE_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    region_offset_bytes: int
    device: _common_pb2.DevicePointer
    size_bytes: int
    to_device: bool
    stream_id: int
    def __init__(self, region_id: _Optional[int] = ..., region_offset_bytes: _Optional[int] = ..., device: _Optional[_Union[_common_pb2.DevicePointer, _Mapping]] = ..., size_bytes: _Optional[int] = ..., to_device: bool = ..., stream_id: _Optional[int] = ...) -> None: ...

class CopyHostRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachHostRegionRequest(_message.Message):
    __slots__ = ("session_id", "region_id", "ticket", "direct_channel", "framed_commands")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DIRECT_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    FRAMED_COMMANDS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    region_id: int
    ticket: bytes
    direct_channel: bool
    framed_commands: bool
    def __init__(self, session_id: _Optional[int] = ..., region_id: _Optional[int] = ..., ticket: _Optional[bytes] = ..., direct_channel: bool = ..., framed_commands: bool = ...) -> None: ...

class AttachHostRegionReply(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
