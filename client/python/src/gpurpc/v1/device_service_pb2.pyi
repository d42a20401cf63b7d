from gpurpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices", "backend", "driver_version", "nvrtc_version", "compile_sandbox", "daemon_instance", "accepting_sessions")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    NVRTC_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SANDBOX_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    backend: str
    driver_version: int
    nvrtc_version: int
    compile_sandbox: str
    daemon_instance: str
    accepting_sessions: bool
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., backend: _Optional[str] = ..., driver_version: _Optional[int] = ..., nvrtc_version: _Optional[int] = ..., compile_sandbox: _Optional[str] = ..., daemon_instance: _Optional[str] = ..., accepting_sessions: bool = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TenantQuota(_message.Message):
    __slots__ = ("max_sessions", "max_device_memory_bytes", "max_streams_per_session", "max_events_per_session", "max_modules_per_session", "max_concurrent_compiles", "kernel_timeout_ms", "max_host_region_bytes")
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAMS_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MODULES_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_COMPILES_FIELD_NUMBER: _ClassVar[int]
    KERNEL_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_HOST_REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_sessions: int
    max_device_memory_bytes: int
    max_streams_per_session: int
    max_events_per_session: int
    max_modules_per_session: int
    max_concurrent_compiles: int
    kernel_timeout_ms: int
    max_host_region_bytes: int
    def __init__(self, max_sessions: _Optional[int] = ..., max_device_memory_bytes: _Optional[int] = ..., max_streams_per_session: _Optional[int] = ..., max_events_per_session: _Optional[int] = ..., max_modules_per_session: _Optional[int] = ..., max_concurrent_compiles: _Optional[int] = ..., kernel_timeout_ms: _Optional[int] = ..., max_host_region_bytes: _Optional[int] = ...) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("version", "tenant", "auth_method", "admin", "quota", "sessions_open", "device_memory_bytes", "compile_sandbox", "daemon_instance", "started_unix_ms")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    AUTH_METHOD_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_OPEN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SANDBOX_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    version: str
    tenant: str
    auth_method: str
    admin: bool
    quota: TenantQuota
    sessions_open: int
    device_memory_bytes: int
    compile_sandbox: str
    daemon_instance: str
    started_unix_ms: int
    def __init__(self, version: _Optional[str] = ..., tenant: _Optional[str] = ..., auth_method: _Optional[str] = ..., admin: bool = ..., quota: _Optional[_Union[TenantQuota, _Mapping]] = ..., sessions_open: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., compile_sandbox: _Optional[str] = ..., daemon_instance: _Optional[str] = ..., started_unix_ms: _Optional[int] = ...) -> None: ...

class GetDeviceRequest(_message.Message):
    __slots__ = ("ordinal",)
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    ordinal: int
    def __init__(self, ordinal: _Optional[int] = ...) -> None: ...

class GetDeviceResponse(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: DeviceInfo
    def __init__(self, device: _Optional[_Union[DeviceInfo, _Mapping]] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("ordinal", "name", "compute_capability_major", "compute_capability_minor", "total_memory_bytes", "multiprocessor_count", "max_threads_per_block", "max_block_dim", "max_grid_dim", "max_shared_memory_per_block_bytes", "max_shared_memory_per_block_optin_bytes", "warp_size", "pci_bus_id", "attributes", "is_fake", "load")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_MAJOR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_MINOR_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MULTIPROCESSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_THREADS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_GRID_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_SHARED_MEMORY_PER_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    WARP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    IS_FAKE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ordinal: int
    name: str
    compute_capability_major: int
    compute_capability_minor: int
    total_memory_bytes: int
    multiprocessor_count: int
    max_threads_per_block: int
    max_block_dim: _common_pb2.Dim3
    max_grid_dim: _common_pb2.Dim3
    max_shared_memory_per_block_bytes: int
    max_shared_memory_per_block_optin_bytes: int
    warp_size: int
    pci_bus_id: str
    attributes: _containers.ScalarMap[int, int]
    is_fake: bool
    load: DeviceLoad
    def __init__(self, ordinal: _Optional[int] = ..., name: _Optional[str] = ..., compute_capability_major: _Optional[int] = ..., compute_capability_minor: _Optional[int] = ..., total_memory_bytes: _Optional[int] = ..., multiprocessor_count: _Optional[int] = ..., max_threads_per_block: _Optional[int] = ..., max_block_dim: _Optional[_Union[_common_pb2.Dim3, _Mapping]] = ..., max_grid_dim: _Optional[_Union[_common_pb2.Dim3, _Mapping]] = ..., max_shared_memory_per_block_bytes: _Optional[int] = ..., max_shared_memory_per_block_optin_bytes: _Optional[int] = ..., warp_size: _Optional[int] = ..., pci_bus_id: _Optional[str] = ..., attributes: _Optional[_Mapping[int, int]] = ..., is_fake: bool = ..., load: _Optional[_Union[DeviceLoad, _Mapping]] = ...) -> None: ...

class DeviceLoad(_message.Message):
    __slots__ = ("sessions", "allocated_bytes", "free_memory_bytes")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    allocated_bytes: int
    free_memory_bytes: int
    def __init__(self, sessions: _Optional[int] = ..., allocated_bytes: _Optional[int] = ..., free_memory_bytes: _Optional[int] = ...) -> None: ...
