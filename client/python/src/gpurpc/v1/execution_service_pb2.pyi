from gpurpc.v1 import common_pb2 as _common_pb2
from gpurpc.v1 import module_service_pb2 as _module_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CaptureMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPTURE_MODE_GLOBAL: _ClassVar[CaptureMode]
    CAPTURE_MODE_THREAD_LOCAL: _ClassVar[CaptureMode]
    CAPTURE_MODE_RELAXED: _ClassVar[CaptureMode]

class CaptureStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPTURE_STATUS_NONE: _ClassVar[CaptureStatus]
    CAPTURE_STATUS_ACTIVE: _ClassVar[CaptureStatus]
    CAPTURE_STATUS_INVALIDATED: _ClassVar[CaptureStatus]

class GraphNodeType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAPH_NODE_TYPE_UNSPECIFIED: _ClassVar[GraphNodeType]
    GRAPH_NODE_TYPE_KERNEL: _ClassVar[GraphNodeType]
    GRAPH_NODE_TYPE_MEMSET: _ClassVar[GraphNodeType]
    GRAPH_NODE_TYPE_MEMCPY: _ClassVar[GraphNodeType]
CAPTURE_MODE_GLOBAL: CaptureMode
CAPTURE_MODE_THREAD_LOCAL: CaptureMode
CAPTURE_MODE_RELAXED: CaptureMode
CAPTURE_STATUS_NONE: CaptureStatus
CAPTURE_STATUS_ACTIVE: CaptureStatus
CAPTURE_STATUS_INVALIDATED: CaptureStatus
GRAPH_NODE_TYPE_UNSPECIFIED: GraphNodeType
GRAPH_NODE_TYPE_KERNEL: GraphNodeType
GRAPH_NODE_TYPE_MEMSET: GraphNodeType
GRAPH_NODE_TYPE_MEMCPY: GraphNodeType

class CreateStreamRequest(_message.Message):
    __slots__ = ("non_blocking",)
    NON_BLOCKING_FIELD_NUMBER: _ClassVar[int]
    non_blocking: bool
    def __init__(self, non_blocking: bool = ...) -> None: ...

class CreateStreamResponse(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    def __init__(self, stream_id: _Optional[int] = ...) -> None: ...

class DestroyStreamRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    def __init__(self, stream_id: _Optional[int] = ...) -> None: ...

class DestroyStreamResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SynchronizeStreamRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    def __init__(self, stream_id: _Optional[int] = ...) -> None: ...

class SynchronizeStreamResponse(_message.Message):
    __slots__ = ("device_output",)
    DEVICE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    device_output: bytes
    def __init__(self, device_output: _Optional[bytes] = ...) -> None: ...

class QueryStreamRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    def __init__(self, stream_id: _Optional[int] = ...) -> None: ...

class QueryStreamResponse(_message.Message):
    __slots__ = ("done",)
    DONE_FIELD_NUMBER: _ClassVar[int]
    done: bool
    def __init__(self, done: bool = ...) -> None: ...

class SynchronizeSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SynchronizeSessionResponse(_message.Message):
    __slots__ = ("device_output",)
    DEVICE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    device_output: bytes
    def __init__(self, device_output: _Optional[bytes] = ...) -> None: ...

class CreateEventRequest(_message.Message):
    __slots__ = ("disable_timing", "blocking_sync", "interprocess")
    DISABLE_TIMING_FIELD_NUMBER: _ClassVar[int]
    BLOCKING_SYNC_FIELD_NUMBER: _ClassVar[int]
    INTERPROCESS_FIELD_NUMBER: _ClassVar[int]
    disable_timing: bool
    blocking_sync: bool
    interprocess: bool
    def __init__(self, disable_timing: bool = ..., blocking_sync: bool = ..., interprocess: bool = ...) -> None: ...

class CreateEventResponse(_message.Message):
    __slots__ = ("event_id",)
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    def __init__(self, event_id: _Optional[int] = ...) -> None: ...

class DestroyEventRequest(_message.Message):
    __slots__ = ("event_id",)
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    def __init__(self, event_id: _Optional[int] = ...) -> None: ...

class DestroyEventResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RecordEventRequest(_message.Message):
    __slots__ = ("event_id", "stream_id")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    stream_id: int
    def __init__(self, event_id: _Optional[int] = ..., stream_id: _Optional[int] = ...) -> None: ...

class RecordEventResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QueryEventRequest(_message.Message):
    __slots__ = ("event_id",)
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    def __init__(self, event_id: _Optional[int] = ...) -> None: ...

class QueryEventResponse(_message.Message):
    __slots__ = ("done",)
    DONE_FIELD_NUMBER: _ClassVar[int]
    done: bool
    def __init__(self, done: bool = ...) -> None: ...

class SynchronizeEventRequest(_message.Message):
    __slots__ = ("event_id",)
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    def __init__(self, event_id: _Optional[int] = ...) -> None: ...

class SynchronizeEventResponse(_message.Message):
    __slots__ = ("device_output",)
    DEVICE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    device_output: bytes
    def __init__(self, device_output: _Optional[bytes] = ...) -> None: ...

class EventElapsedTimeRequest(_message.Message):
    __slots__ = ("start_event_id", "end_event_id")
    START_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    END_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    start_event_id: int
    end_event_id: int
    def __init__(self, start_event_id: _Optional[int] = ..., end_event_id: _Optional[int] = ...) -> None: ...

class EventElapsedTimeResponse(_message.Message):
    __slots__ = ("elapsed_ms",)
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    elapsed_ms: float
    def __init__(self, elapsed_ms: _Optional[float] = ...) -> None: ...

class StreamWaitEventRequest(_message.Message):
    __slots__ = ("stream_id", "event_id")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    event_id: int
    def __init__(self, stream_id: _Optional[int] = ..., event_id: _Optional[int] = ...) -> None: ...

class StreamWaitEventResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KernelArg(_message.Message):
    __slots__ = ("u8", "u16", "u32", "u64", "f32", "f64", "buffer", "raw", "device_address")
    U8_FIELD_NUMBER: _ClassVar[int]
    U16_FIELD_NUMBER: _ClassVar[int]
    U32_FIELD_NUMBER: _ClassVar[int]
    U64_FIELD_NUMBER: _ClassVar[int]
    F32_FIELD_NUMBER: _ClassVar[int]
    F64_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    u8: int
    u16: int
    u32: int
    u64: int
    f32: float
    f64: float
    buffer: _common_pb2.BufferRef
    raw: bytes
    device_address: int
    def __init__(self, u8: _Optional[int] = ..., u16: _Optional[int] = ..., u32: _Optional[int] = ..., u64: _Optional[int] = ..., f32: _Optional[float] = ..., f64: _Optional[float] = ..., buffer: _Optional[_Union[_common_pb2.BufferRef, _Mapping]] = ..., raw: _Optional[bytes] = ..., device_address: _Optional[int] = ...) -> None: ...

class LaunchCommand(_message.Message):
    __slots__ = ("function_id", "grid", "block", "shared_memory_bytes", "stream_id", "packed_args", "args")
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_ARGS_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    function_id: int
    grid: _common_pb2.Dim3
    block: _common_pb2.Dim3
    shared_memory_bytes: int
    stream_id: int
    packed_args: bytes
    args: _containers.RepeatedCompositeFieldContainer[KernelArg]
    def __init__(self, function_id: _Optional[int] = ..., grid: _Optional[_Union[_common_pb2.Dim3, _Mapping]] = ..., block: _Optional[_Union[_common_pb2.Dim3, _Mapping]] = ..., shared_memory_bytes: _Optional[int] = ..., stream_id: _Optional[int] = ..., packed_args: _Optional[bytes] = ..., args: _Optional[_Iterable[_Union[KernelArg, _Mapping]]] = ...) -> None: ...

class LaunchRequest(_message.Message):
    __slots__ = ("launch", "synchronize")
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    SYNCHRONIZE_FIELD_NUMBER: _ClassVar[int]
    launch: LaunchCommand
    synchronize: bool
    def __init__(self, launch: _Optional[_Union[LaunchCommand, _Mapping]] = ..., synchronize: bool = ...) -> None: ...

class LaunchResponse(_message.Message):
    __slots__ = ("device_output", "synchronized")
    DEVICE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SYNCHRONIZED_FIELD_NUMBER: _ClassVar[int]
    device_output: bytes
    synchronized: bool
    def __init__(self, device_output: _Optional[bytes] = ..., synchronized: bool = ...) -> None: ...

class MemsetCommand(_message.Message):
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

class CopyCommand(_message.Message):
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

class Copy3DEndpoint(_message.Message):
    __slots__ = ("array_id", "device", "pitch_bytes", "height", "x_bytes", "y", "z")
    ARRAY_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PITCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    X_BYTES_FIELD_NUMBER: _ClassVar[int]
    Y_FIELD_NUMBER: _ClassVar[int]
    Z_FIELD_NUMBER: _ClassVar[int]
    array_id: int
    device: _common_pb2.DevicePointer
    pitch_bytes: int
    height: int
    x_bytes: int
    y: int
    z: int
    def __init__(self, array_id: _Optional[int] = ..., device: _Optional[_Union[_common_pb2.DevicePointer, _Mapping]] = ..., pitch_bytes: _Optional[int] = ..., height: _Optional[int] = ..., x_bytes: _Optional[int] = ..., y: _Optional[int] = ..., z: _Optional[int] = ...) -> None: ...

class Copy3DCommand(_message.Message):
    __slots__ = ("destination", "source", "width_bytes", "height", "depth", "stream_id")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    destination: Copy3DEndpoint
    source: Copy3DEndpoint
    width_bytes: int
    height: int
    depth: int
    stream_id: int
    def __init__(self, destination: _Optional[_Union[Copy3DEndpoint, _Mapping]] = ..., source: _Optional[_Union[Copy3DEndpoint, _Mapping]] = ..., width_bytes: _Optional[int] = ..., height: _Optional[int] = ..., depth: _Optional[int] = ..., stream_id: _Optional[int] = ...) -> None: ...

class UploadCommand(_message.Message):
    __slots__ = ("destination", "data", "stream_id")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    destination: _common_pb2.DevicePointer
    data: bytes
    stream_id: int
    def __init__(self, destination: _Optional[_Union[_common_pb2.DevicePointer, _Mapping]] = ..., data: _Optional[bytes] = ..., stream_id: _Optional[int] = ...) -> None: ...

class DownloadCommand(_message.Message):
    __slots__ = ("source", "size_bytes", "stream_id")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    source: _common_pb2.DevicePointer
    size_bytes: int
    stream_id: int
    def __init__(self, source: _Optional[_Union[_common_pb2.DevicePointer, _Mapping]] = ..., size_bytes: _Optional[int] = ..., stream_id: _Optional[int] = ...) -> None: ...

class RecordEventCommand(_message.Message):
    __slots__ = ("event_id", "stream_id")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    stream_id: int
    def __init__(self, event_id: _Optional[int] = ..., stream_id: _Optional[int] = ...) -> None: ...

class WaitEventCommand(_message.Message):
    __slots__ = ("event_id", "stream_id")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    stream_id: int
    def __init__(self, event_id: _Optional[int] = ..., stream_id: _Optional[int] = ...) -> None: ...

class SyncCommand(_message.Message):
    __slots__ = ("stream_id", "whole_session", "event_id")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    WHOLE_SESSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    whole_session: bool
    event_id: int
    def __init__(self, stream_id: _Optional[int] = ..., whole_session: bool = ..., event_id: _Optional[int] = ...) -> None: ...

class RegionCopyCommand(_message.Message):
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

class Command(_message.Message):
    __slots__ = ("sequence", "launch", "memset", "copy", "upload", "download", "record_event", "wait_event", "sync", "region_copy", "launch_graph", "copy_3d")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    MEMSET_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_FIELD_NUMBER: _ClassVar[int]
    RECORD_EVENT_FIELD_NUMBER: _ClassVar[int]
    WAIT_EVENT_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    REGION_COPY_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_GRAPH_FIELD_NUMBER: _ClassVar[int]
    COPY_3D_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    launch: LaunchCommand
    memset: MemsetCommand
    copy: CopyCommand
    upload: UploadCommand
    download: DownloadCommand
    record_event: RecordEventCommand
    wait_event: WaitEventCommand
    sync: SyncCommand
    region_copy: RegionCopyCommand
    launch_graph: LaunchGraphCommand
    copy_3d: Copy3DCommand
    def __init__(self, sequence: _Optional[int] = ..., launch: _Optional[_Union[LaunchCommand, _Mapping]] = ..., memset: _Optional[_Union[MemsetCommand, _Mapping]] = ..., copy: _Optional[_Union[CopyCommand, _Mapping]] = ..., upload: _Optional[_Union[UploadCommand, _Mapping]] = ..., download: _Optional[_Union[DownloadCommand, _Mapping]] = ..., record_event: _Optional[_Union[RecordEventCommand, _Mapping]] = ..., wait_event: _Optional[_Union[WaitEventCommand, _Mapping]] = ..., sync: _Optional[_Union[SyncCommand, _Mapping]] = ..., region_copy: _Optional[_Union[RegionCopyCommand, _Mapping]] = ..., launch_graph: _Optional[_Union[LaunchGraphCommand, _Mapping]] = ..., copy_3d: _Optional[_Union[Copy3DCommand, _Mapping]] = ...) -> None: ...

class CommandBatch(_message.Message):
    __slots__ = ("commands",)
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[Command]
    def __init__(self, commands: _Optional[_Iterable[_Union[Command, _Mapping]]] = ...) -> None: ...

class CommandError(_message.Message):
    __slots__ = ("sequence", "code", "message")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    code: int
    message: str
    def __init__(self, sequence: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class DownloadResult(_message.Message):
    __slots__ = ("sequence", "data")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    data: bytes
    def __init__(self, sequence: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class CommandReply(_message.Message):
    __slots__ = ("processed_through_sequence", "error", "skipped_from_sequence", "downloads", "device_output")
    PROCESSED_THROUGH_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DOWNLOADS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    processed_through_sequence: int
    error: CommandError
    skipped_from_sequence: int
    downloads: _containers.RepeatedCompositeFieldContainer[DownloadResult]
    device_output: bytes
    def __init__(self, processed_through_sequence: _Optional[int] = ..., error: _Optional[_Union[CommandError, _Mapping]] = ..., skipped_from_sequence: _Optional[int] = ..., downloads: _Optional[_Iterable[_Union[DownloadResult, _Mapping]]] = ..., device_output: _Optional[bytes] = ...) -> None: ...

class BeginCaptureRequest(_message.Message):
    __slots__ = ("stream_id", "mode")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    mode: CaptureMode
    def __init__(self, stream_id: _Optional[int] = ..., mode: _Optional[_Union[CaptureMode, str]] = ...) -> None: ...

class BeginCaptureResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndCaptureRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    def __init__(self, stream_id: _Optional[int] = ...) -> None: ...

class EndCaptureResponse(_message.Message):
    __slots__ = ("graph_id", "node_count")
    GRAPH_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    graph_id: int
    node_count: int
    def __init__(self, graph_id: _Optional[int] = ..., node_count: _Optional[int] = ...) -> None: ...

class GetCaptureInfoRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    def __init__(self, stream_id: _Optional[int] = ...) -> None: ...

class GetCaptureInfoResponse(_message.Message):
    __slots__ = ("status", "node_count")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    status: CaptureStatus
    node_count: int
    def __init__(self, status: _Optional[_Union[CaptureStatus, str]] = ..., node_count: _Optional[int] = ...) -> None: ...

class InstantiateGraphRequest(_message.Message):
    __slots__ = ("graph_id",)
    GRAPH_ID_FIELD_NUMBER: _ClassVar[int]
    graph_id: int
    def __init__(self, graph_id: _Optional[int] = ...) -> None: ...

class InstantiateGraphResponse(_message.Message):
    __slots__ = ("graph_exec_id",)
    GRAPH_EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    graph_exec_id: int
    def __init__(self, graph_exec_id: _Optional[int] = ...) -> None: ...

class LaunchGraphCommand(_message.Message):
    __slots__ = ("graph_exec_id", "stream_id")
    GRAPH_EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    graph_exec_id: int
    stream_id: int
    def __init__(self, graph_exec_id: _Optional[int] = ..., stream_id: _Optional[int] = ...) -> None: ...

class LaunchGraphRequest(_message.Message):
    __slots__ = ("launch",)
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    launch: LaunchGraphCommand
    def __init__(self, launch: _Optional[_Union[LaunchGraphCommand, _Mapping]] = ...) -> None: ...

class LaunchGraphResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DestroyGraphRequest(_message.Message):
    __slots__ = ("graph_id",)
    GRAPH_ID_FIELD_NUMBER: _ClassVar[int]
    graph_id: int
    def __init__(self, graph_id: _Optional[int] = ...) -> None: ...

class DestroyGraphResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DestroyGraphExecRequest(_message.Message):
    __slots__ = ("graph_exec_id",)
    GRAPH_EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    graph_exec_id: int
    def __init__(self, graph_exec_id: _Optional[int] = ...) -> None: ...

class DestroyGraphExecResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetGraphNodesRequest(_message.Message):
    __slots__ = ("graph_id",)
    GRAPH_ID_FIELD_NUMBER: _ClassVar[int]
    graph_id: int
    def __init__(self, graph_id: _Optional[int] = ...) -> None: ...

class GraphNode(_message.Message):
    __slots__ = ("index", "type", "function_id", "kernel_name", "params", "grid", "block", "shared_memory_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    type: GraphNodeType
    function_id: int
    kernel_name: str
    params: _containers.RepeatedCompositeFieldContainer[_module_service_pb2.ParamInfo]
    grid: _common_pb2.Dim3
    block: _common_pb2.Dim3
    shared_memory_bytes: int
    def __init__(self, index: _Optional[int] = ..., type: _Optional[_Union[GraphNodeType, str]] = ..., function_id: _Optional[int] = ..., kernel_name: _Optional[str] = ..., params: _Optional[_Iterable[_Union[_module_service_pb2.ParamInfo, _Mapping]]] = ..., grid: _Optional[_Union[_common_pb2.Dim3, _Mapping]] = ..., block: _Optional[_Union[_common_pb2.Dim3, _Mapping]] = ..., shared_memory_bytes: _Optional[int] = ...) -> None: ...

class GetGraphNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[GraphNode]
    def __init__(self, nodes: _Optional[_Iterable[_Union[GraphNode, _Mapping]]] = ...) -> None: ...

class UpdateGraphExecRequest(_message.Message):
    __slots__ = ("graph_exec_id", "graph_id")
    GRAPH_EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    GRAPH_ID_FIELD_NUMBER: _ClassVar[int]
    graph_exec_id: int
    graph_id: int
    def __init__(self, graph_exec_id: _Optional[int] = ..., graph_id: _Optional[int] = ...) -> None: ...

class UpdateGraphExecResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetGraphExecKernelNodeArgsRequest(_message.Message):
    __slots__ = ("graph_exec_id", "node_index", "function_id", "grid", "block", "shared_memory_bytes", "packed_args", "args")
    GRAPH_EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PACKED_ARGS_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    graph_exec_id: int
    node_index: int
    function_id: int
    grid: _common_pb2.Dim3
    block: _common_pb2.Dim3
    shared_memory_bytes: int
    packed_args: bytes
    args: _containers.RepeatedCompositeFieldContainer[KernelArg]
    def __init__(self, graph_exec_id: _Optional[int] = ..., node_index: _Optional[int] = ..., function_id: _Optional[int] = ..., grid: _Optional[_Union[_common_pb2.Dim3, _Mapping]] = ..., block: _Optional[_Union[_common_pb2.Dim3, _Mapping]] = ..., shared_memory_bytes: _Optional[int] = ..., packed_args: _Optional[bytes] = ..., args: _Optional[_Iterable[_Union[KernelArg, _Mapping]]] = ...) -> None: ...

class SetGraphExecKernelNodeArgsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
