from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Header(_message.Message):
    __slots__ = ("name", "content")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    content: str
    def __init__(self, name: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class CompileRequest(_message.Message):
    __slots__ = ("source", "program_name", "options", "headers", "name_expressions", "compile_only")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    NAME_EXPRESSIONS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_ONLY_FIELD_NUMBER: _ClassVar[int]
    source: str
    program_name: str
    options: _containers.RepeatedScalarFieldContainer[str]
    headers: _containers.RepeatedCompositeFieldContainer[Header]
    name_expressions: _containers.RepeatedScalarFieldContainer[str]
    compile_only: bool
    def __init__(self, source: _Optional[str] = ..., program_name: _Optional[str] = ..., options: _Optional[_Iterable[str]] = ..., headers: _Optional[_Iterable[_Union[Header, _Mapping]]] = ..., name_expressions: _Optional[_Iterable[str]] = ..., compile_only: bool = ...) -> None: ...

class LoweredName(_message.Message):
    __slots__ = ("name_expression", "lowered_name")
    NAME_EXPRESSION_FIELD_NUMBER: _ClassVar[int]
    LOWERED_NAME_FIELD_NUMBER: _ClassVar[int]
    name_expression: str
    lowered_name: str
    def __init__(self, name_expression: _Optional[str] = ..., lowered_name: _Optional[str] = ...) -> None: ...

class CompileResponse(_message.Message):
    __slots__ = ("success", "log", "module_id", "lowered_names", "cache_hit", "effective_options", "arch", "image", "cache_key", "device_memory_bytes")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    LOWERED_NAMES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    success: bool
    log: str
    module_id: int
    lowered_names: _containers.RepeatedCompositeFieldContainer[LoweredName]
    cache_hit: bool
    effective_options: _containers.RepeatedScalarFieldContainer[str]
    arch: str
    image: bytes
    cache_key: str
    device_memory_bytes: int
    def __init__(self, success: bool = ..., log: _Optional[str] = ..., module_id: _Optional[int] = ..., lowered_names: _Optional[_Iterable[_Union[LoweredName, _Mapping]]] = ..., cache_hit: bool = ..., effective_options: _Optional[_Iterable[str]] = ..., arch: _Optional[str] = ..., image: _Optional[bytes] = ..., cache_key: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ...) -> None: ...

class LoadModuleRequest(_message.Message):
    __slots__ = ("image",)
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    def __init__(self, image: _Optional[bytes] = ...) -> None: ...

class LoadModuleResponse(_message.Message):
    __slots__ = ("module_id", "device_memory_bytes")
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    module_id: int
    device_memory_bytes: int
    def __init__(self, module_id: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ...) -> None: ...

class UnloadModuleRequest(_message.Message):
    __slots__ = ("module_id",)
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    module_id: int
    def __init__(self, module_id: _Optional[int] = ...) -> None: ...

class UnloadModuleResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetFunctionRequest(_message.Message):
    __slots__ = ("module_id", "name")
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    module_id: int
    name: str
    def __init__(self, module_id: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class ParamInfo(_message.Message):
    __slots__ = ("offset_bytes", "size_bytes")
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    size_bytes: int
    def __init__(self, offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class FunctionAttributes(_message.Message):
    __slots__ = ("num_regs", "shared_size_bytes", "const_size_bytes", "local_size_bytes", "max_threads_per_block", "ptx_version", "binary_version", "max_dynamic_shared_size_bytes")
    NUM_REGS_FIELD_NUMBER: _ClassVar[int]
    SHARED_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONST_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_THREADS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PTX_VERSION_FIELD_NUMBER: _ClassVar[int]
    BINARY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_DYNAMIC_SHARED_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_regs: int
    shared_size_bytes: int
    const_size_bytes: int
    local_size_bytes: int
    max_threads_per_block: int
    ptx_version: int
    binary_version: int
    max_dynamic_shared_size_bytes: int
    def __init__(self, num_regs: _Optional[int] = ..., shared_size_bytes: _Optional[int] = ..., const_size_bytes: _Optional[int] = ..., local_size_bytes: _Optional[int] = ..., max_threads_per_block: _Optional[int] = ..., ptx_version: _Optional[int] = ..., binary_version: _Optional[int] = ..., max_dynamic_shared_size_bytes: _Optional[int] = ...) -> None: ...

class GetFunctionResponse(_message.Message):
    __slots__ = ("function_id", "params", "attributes")
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    function_id: int
    params: _containers.RepeatedCompositeFieldContainer[ParamInfo]
    attributes: FunctionAttributes
    def __init__(self, function_id: _Optional[int] = ..., params: _Optional[_Iterable[_Union[ParamInfo, _Mapping]]] = ..., attributes: _Optional[_Union[FunctionAttributes, _Mapping]] = ...) -> None: ...

class GetGlobalRequest(_message.Message):
    __slots__ = ("module_id", "name")
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    module_id: int
    name: str
    def __init__(self, module_id: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class GetGlobalResponse(_message.Message):
    __slots__ = ("device_address", "size_bytes")
    DEVICE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    device_address: int
    size_bytes: int
    def __init__(self, device_address: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...
