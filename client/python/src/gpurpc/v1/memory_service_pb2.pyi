from gpurpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArrayFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ARRAY_FORMAT_UNSPECIFIED: _ClassVar[ArrayFormat]
    ARRAY_FORMAT_UNSIGNED_INT8: _ClassVar[ArrayFormat]
    ARRAY_FORMAT_UNSIGNED_INT16: _ClassVar[ArrayFormat]
    ARRAY_FORMAT_UNSIGNED_INT32: _ClassVar[ArrayFormat]
    ARRAY_FORMAT_SIGNED_INT8: _ClassVar[ArrayFormat]
    ARRAY_FORMAT_SIGNED_INT16: _ClassVar[ArrayFormat]
    ARRAY_FORMAT_SIGNED_INT32: _ClassVar[ArrayFormat]
    ARRAY_FORMAT_HALF: _ClassVar[ArrayFormat]
    ARRAY_FORMAT_FLOAT: _ClassVar[ArrayFormat]
ARRAY_FORMAT_UNSPECIFIED: ArrayFormat
ARRAY_FORMAT_UNSIGNED_INT8: ArrayFormat
ARRAY_FORMAT_UNSIGNED_INT16: ArrayFormat
ARRAY_FORMAT_UNSIGNED_INT32: ArrayFormat
ARRAY_FORMAT_SIGNED_INT8: ArrayFormat
ARRAY_FORMAT_SIGNED_INT16: ArrayFormat
ARRAY_FORMAT_SIGNED_INT32: ArrayFormat
ARRAY_FORMAT_HALF: ArrayFormat
ARRAY_FORMAT_FLOAT: ArrayFormat

class AllocateRequest(_message.Message):
    __slots__ = ("size_bytes", "array")
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    array: ArrayDescriptor
    def __init__(self, size_bytes: _Optional[int] = ..., array: _Optional[_Union[ArrayDescriptor, _Mapping]] = ...) -> None: ...

class ArrayDescriptor(_message.Message):
    __slots__ = ("width", "height", "depth", "format", "num_channels", "flags")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    depth: int
    format: ArrayFormat
    num_channels: int
    flags: int
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ..., depth: _Optional[int] = ..., format: _Optional[_Union[ArrayFormat, str]] = ..., num_channels: _Optional[int] = ..., flags: _Optional[int] = ...) -> None: ...

class BufferInfo(_message.Message):
    __slots__ = ("buffer_id", "device_address", "size_bytes", "array")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    buffer_id: int
    device_address: int
    size_bytes: int
    array: ArrayDescriptor
    def __init__(self, buffer_id: _Optional[int] = ..., device_address: _Optional[int] = ..., size_bytes: _Optional[int] = ..., array: _Optional[_Union[ArrayDescriptor, _Mapping]] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("buffer",)
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    buffer: BufferInfo
    def __init__(self, buffer: _Optional[_Union[BufferInfo, _Mapping]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("buffer_id",)
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    buffer_id: int
    def __init__(self, buffer_id: _Optional[int] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetAllocationRequest(_message.Message):
    __slots__ = ("buffer_id", "device_address")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    buffer_id: int
    device_address: int
    def __init__(self, buffer_id: _Optional[int] = ..., device_address: _Optional[int] = ...) -> None: ...

class GetAllocationResponse(_message.Message):
    __slots__ = ("buffer",)
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    buffer: BufferInfo
    def __init__(self, buffer: _Optional[_Union[BufferInfo, _Mapping]] = ...) -> None: ...

class GetMemInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetMemInfoResponse(_message.Message):
    __slots__ = ("free_bytes", "total_bytes")
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    free_bytes: int
    total_bytes: int
    def __init__(self, free_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class UploadRequest(_message.Message):
    __slots__ = ("destination", "data", "stream_id")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    destination: _common_pb2.DevicePointer
    data: bytes
    stream_id: int
    def __init__(self, destination: _Optional[_Union[_common_pb2.DevicePointer, _Mapping]] = ..., data: _Optional[bytes] = ..., stream_id: _Optional[int] = ...) -> None: ...

class UploadResponse(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class UploadStreamRequest(_message.Message):
    __slots__ = ("destination", "total_size_bytes", "stream_id", "data")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    destination: _common_pb2.DevicePointer
    total_size_bytes: int
    stream_id: int
    data: bytes
    def __init__(self, destination: _Optional[_Union[_common_pb2.DevicePointer, _Mapping]] = ..., total_size_bytes: _Optional[int] = ..., stream_id: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("source", "size_bytes", "stream_id", "chunk_size_bytes")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    source: _common_pb2.DevicePointer
    size_bytes: int
    stream_id: int
    chunk_size_bytes: int
    def __init__(self, source: _Optional[_Union[_common_pb2.DevicePointer, _Mapping]] = ..., size_bytes: _Optional[int] = ..., stream_id: _Optional[int] = ..., chunk_size_bytes: _Optional[int] = ...) -> None: ...

class DownloadResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class MemsetRequest(_message.Message):
    __slots__ = ("destination", "value", "element_size_bytes", "count", "stream_id")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    destination: _common_pb2.DevicePointer
    value: int
    element_size_bytes: int
    count: int
    stream_id: int
    def __init__(self, destination: _Optional[_Union[_common_pb2.DevicePointer, _Mapping]] = ..., value: _Optional[int] = ..., element_size_bytes: _Optional[int] = ..., count: _Optional[int] = ..., stream_id: _Optional[int] = ...) -> None: ...

class MemsetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CopyDeviceToDeviceRequest(_message.Message):
    __slots__ = ("destination", "source", "size_bytes", "stream_id")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    destination: _common_pb2.DevicePointer
    source: _common_pb2.DevicePointer
    size_bytes: int
    stream_id: int
    def __init__(self, destination: _Optional[_Union[_common_pb2.DevicePointer, _Mapping]] = ..., source: _Optional[_Union[_common_pb2.DevicePointer, _Mapping]] = ..., size_bytes: _Optional[int] = ..., stream_id: _Optional[int] = ...) -> None: ...

class CopyDeviceToDeviceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
