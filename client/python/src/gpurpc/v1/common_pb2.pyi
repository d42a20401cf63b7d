from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DevicePointer(_message.Message):
    __slots__ = ("buffer", "device_address")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    buffer: BufferRef
    device_address: int
    def __init__(self, buffer: _Optional[_Union[BufferRef, _Mapping]] = ..., device_address: _Optional[int] = ...) -> None: ...

class BufferRef(_message.Message):
    __slots__ = ("buffer_id", "offset_bytes")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    buffer_id: int
    offset_bytes: int
    def __init__(self, buffer_id: _Optional[int] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class Dim3(_message.Message):
    __slots__ = ("x", "y", "z")
    X_FIELD_NUMBER: _ClassVar[int]
    Y_FIELD_NUMBER: _ClassVar[int]
    Z_FIELD_NUMBER: _ClassVar[int]
    x: int
    y: int
    z: int
    def __init__(self, x: _Optional[int] = ..., y: _Optional[int] = ..., z: _Optional[int] = ...) -> None: ...
