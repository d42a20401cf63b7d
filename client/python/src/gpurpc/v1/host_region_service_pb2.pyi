from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterHostRegionRequest(_message.Message):
    __slots__ = ("shm_name", "size_bytes")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    size_bytes: int
    def __init__(self, shm_name: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class RegisterHostRegionResponse(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    def __init__(self, region_id: _Optional[int] = ...) -> None: ...

class UnregisterHostRegionRequest(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    def __init__(self, region_id: _Optional[int] = ...) -> None: ...

class UnregisterHostRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CopyHostRegionRequest(_message.Message):
    __slots__ = ("region_id", "region_offset_bytes", "device_address", "size_bytes", "to_device", "stream_id")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TO_DEVICE_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    region_offset_bytes: int
    device_address: int
    size_bytes: int
    to_device: bool
    stream_id: int
    def __init__(self, region_id: _Optional[int] = ..., region_offset_bytes: _Optional[int] = ..., device_address: _Optional[int] = ..., size_bytes: _Optional[int] = ..., to_device: bool = ..., stream_id: _Optional[int] = ...) -> None: ...

class CopyHostRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
