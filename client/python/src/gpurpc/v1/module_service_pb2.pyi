from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LinkInputType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LINK_INPUT_TYPE_UNSPECIFIED: _ClassVar[LinkInputType]
    LINK_INPUT_TYPE_CUBIN: _ClassVar[LinkInputType]
    LINK_INPUT_TYPE_PTX: _ClassVar[LinkInputType]
    LINK_INPUT_TYPE_FATBINARY: _ClassVar[LinkInputType]
    LINK_INPUT_TYPE_OBJECT: _ClassVar[LinkInputType]
    LINK_INPUT_TYPE_LIBRARY: _ClassVar[LinkInputType]

class ContextLimit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIMIT_STACK_SIZE: _ClassVar[ContextLimit]
    LIMIT_PRINTF_FIFO_SIZE: _ClassVar[ContextLimit]
    LIMIT_MALLOC_HEAP_SIZE: _ClassVar[ContextLimit]
    LIMIT_DEV_RUNTIME_SYNC_DEPTH: _ClassVar[ContextLimit]
    LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT: _ClassVar[ContextLimit]
    LIMIT_MAX_L2_FETCH_GRANULARITY: _ClassVar[ContextLimit]
    LIMIT_PERSISTING_L2_CACHE_SIZE: _ClassVar[ContextLimit]

class CacheConfig(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_CONFIG_PREFER_NONE: _ClassVar[CacheConfig]
    CACHE_CONFIG_PREFER_SHARED: _ClassVar[CacheConfig]
    CACHE_CONFIG_PREFER_L1: _ClassVar[CacheConfig]
    CACHE_CONFIG_PREFER_EQUAL: _ClassVar[CacheConfig]

class SharedConfig(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARED_CONFIG_DEFAULT_BANK_SIZE: _ClassVar[SharedConfig]
    SHARED_CONFIG_FOUR_BYTE_BANK_SIZE: _ClassVar[SharedConfig]
    SHARED_CONFIG_EIGHT_BYTE_BANK_SIZE: _ClassVar[SharedConfig]

class FunctionAttribute(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FUNCTION_ATTRIBUTE_MAX_THREADS_PER_BLOCK: _ClassVar[FunctionAttribute]
    FUNCTION_ATTRIBUTE_SHARED_SIZE_BYTES: _ClassVar[FunctionAttribute]
    FUNCTION_ATTRIBUTE_CONST_SIZE_BYTES: _ClassVar[FunctionAttribute]
    FUNCTION_ATTRIBUTE_LOCAL_SIZE_BYTES: _ClassVar[FunctionAttribute]
    FUNCTION_ATTRIBUTE_NUM_REGS: _ClassVar[FunctionAttribute]
    FUNCTION_ATTRIBUTE_PTX_VERSION: _ClassVar[FunctionAttribute]
    FUNCTION_ATTRIBUTE_BINARY_VERSION: _ClassVar[FunctionAttribute]
    FUNCTION_ATTRIBUTE_CACHE_MODE_CA: _ClassVar[FunctionAttribute]
    FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: _ClassVar[FunctionAttribute]
    FUNCTION_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: _ClassVar[FunctionAttribute]
LINK_INPUT_TYPE_UNSPECIFIED: LinkInputType
LINK_INPUT_TYPE_CUBIN: LinkInputType
LINK_INPUT_TYPE_PTX: LinkInputType
LINK_INPUT_TYPE_FATBINARY: LinkInputType
LINK_INPUT_TYPE_OBJECT: LinkInputType
LINK_INPUT_TYPE_LIBRARY: LinkInputType
LIMIT_STACK_SIZE: ContextLimit
LIMIT_PRINTF_FIFO_SIZE: ContextLimit
LIMIT_MALLOC_HEAP_SIZE: ContextLimit
LIMIT_DEV_RUNTIME_SYNC_DEPTH: ContextLimit
LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT: ContextLimit
LIMIT_MAX_L2_FETCH_GRANULARITY: ContextLimit
LIMIT_PERSISTING_L2_CACHE_SIZE: ContextLimit
CACHE_CONFIG_PREFER_NONE: CacheConfig
CACHE_CONFIG_PREFER_SHARED: CacheConfig
CACHE_CONFIG_PREFER_L1: CacheConfig
CACHE_CONFIG_PREFER_EQUAL: CacheConfig
SHARED_CONFIG_DEFAULT_BANK_SIZE: SharedConfig
SHARED_CONFIG_FOUR_BYTE_BANK_SIZE: SharedConfig
SHARED_CONFIG_EIGHT_BYTE_BANK_SIZE: SharedConfig
FUNCTION_ATTRIBUTE_MAX_THREADS_PER_BLOCK: FunctionAttribute
FUNCTION_ATTRIBUTE_SHARED_SIZE_BYTES: FunctionAttribute
FUNCTION_ATTRIBUTE_CONST_SIZE_BYTES: FunctionAttribute
FUNCTION_ATTRIBUTE_LOCAL_SIZE_BYTES: FunctionAttribute
FUNCTION_ATTRIBUTE_NUM_REGS: FunctionAttribute
FUNCTION_ATTRIBUTE_PTX_VERSION: FunctionAttribute
FUNCTION_ATTRIBUTE_BINARY_VERSION: FunctionAttribute
FUNCTION_ATTRIBUTE_CACHE_MODE_CA: FunctionAttribute
FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: FunctionAttribute
FUNCTION_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: FunctionAttribute

class SetProfilingRequest(_message.Message):
    __slots__ = ("enabled",)
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    def __init__(self, enabled: bool = ...) -> None: ...

class SetProfilingResponse(_message.Message):
    __slots__ = ("was_enabled",)
    WAS_ENABLED_FIELD_NUMBER: _ClassVar[int]
    was_enabled: bool
    def __init__(self, was_enabled: bool = ...) -> None: ...

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

class LinkSource(_message.Message):
    __slots__ = ("source", "program_name", "options", "headers", "name_expressions")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    NAME_EXPRESSIONS_FIELD_NUMBER: _ClassVar[int]
    source: str
    program_name: str
    options: _containers.RepeatedScalarFieldContainer[str]
    headers: _containers.RepeatedCompositeFieldContainer[Header]
    name_expressions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, source: _Optional[str] = ..., program_name: _Optional[str] = ..., options: _Optional[_Iterable[str]] = ..., headers: _Optional[_Iterable[_Union[Header, _Mapping]]] = ..., name_expressions: _Optional[_Iterable[str]] = ...) -> None: ...

class LinkData(_message.Message):
    __slots__ = ("type", "data", "name")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    type: LinkInputType
    data: bytes
    name: str
    def __init__(self, type: _Optional[_Union[LinkInputType, str]] = ..., data: _Optional[bytes] = ..., name: _Optional[str] = ...) -> None: ...

class LinkInput(_message.Message):
    __slots__ = ("source", "data", "standard_library")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STANDARD_LIBRARY_FIELD_NUMBER: _ClassVar[int]
    source: LinkSource
    data: LinkData
    standard_library: str
    def __init__(self, source: _Optional[_Union[LinkSource, _Mapping]] = ..., data: _Optional[_Union[LinkData, _Mapping]] = ..., standard_library: _Optional[str] = ...) -> None: ...

class LinkModuleRequest(_message.Message):
    __slots__ = ("inputs", "log_verbose")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    LOG_VERBOSE_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[LinkInput]
    log_verbose: bool
    def __init__(self, inputs: _Optional[_Iterable[_Union[LinkInput, _Mapping]]] = ..., log_verbose: bool = ...) -> None: ...

class LinkSourceResult(_message.Message):
    __slots__ = ("input_index", "success", "log", "cache_hit", "effective_options", "arch", "lowered_names")
    INPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    LOWERED_NAMES_FIELD_NUMBER: _ClassVar[int]
    input_index: int
    success: bool
    log: str
    cache_hit: bool
    effective_options: _containers.RepeatedScalarFieldContainer[str]
    arch: str
    lowered_names: _containers.RepeatedCompositeFieldContainer[LoweredName]
    def __init__(self, input_index: _Optional[int] = ..., success: bool = ..., log: _Optional[str] = ..., cache_hit: bool = ..., effective_options: _Optional[_Iterable[str]] = ..., arch: _Optional[str] = ..., lowered_names: _Optional[_Iterable[_Union[LoweredName, _Mapping]]] = ...) -> None: ...

class LinkModuleResponse(_message.Message):
    __slots__ = ("success", "log", "module_id", "device_memory_bytes", "sources")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    success: bool
    log: str
    module_id: int
    device_memory_bytes: int
    sources: _containers.RepeatedCompositeFieldContainer[LinkSourceResult]
    def __init__(self, success: bool = ..., log: _Optional[str] = ..., module_id: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[LinkSourceResult, _Mapping]]] = ...) -> None: ...

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
    __slots__ = ("num_regs", "shared_size_bytes", "const_size_bytes", "local_size_bytes", "max_threads_per_block", "ptx_version", "binary_version", "max_dynamic_shared_size_bytes", "preferred_shared_memory_carveout")
    NUM_REGS_FIELD_NUMBER: _ClassVar[int]
    SHARED_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONST_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_THREADS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PTX_VERSION_FIELD_NUMBER: _ClassVar[int]
    BINARY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_DYNAMIC_SHARED_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_SHARED_MEMORY_CARVEOUT_FIELD_NUMBER: _ClassVar[int]
    num_regs: int
    shared_size_bytes: int
    const_size_bytes: int
    local_size_bytes: int
    max_threads_per_block: int
    ptx_version: int
    binary_version: int
    max_dynamic_shared_size_bytes: int
    preferred_shared_memory_carveout: int
    def __init__(self, num_regs: _Optional[int] = ..., shared_size_bytes: _Optional[int] = ..., const_size_bytes: _Optional[int] = ..., local_size_bytes: _Optional[int] = ..., max_threads_per_block: _Optional[int] = ..., ptx_version: _Optional[int] = ..., binary_version: _Optional[int] = ..., max_dynamic_shared_size_bytes: _Optional[int] = ..., preferred_shared_memory_carveout: _Optional[int] = ...) -> None: ...

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

class SetContextLimitRequest(_message.Message):
    __slots__ = ("limit", "value")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    limit: ContextLimit
    value: int
    def __init__(self, limit: _Optional[_Union[ContextLimit, str]] = ..., value: _Optional[int] = ...) -> None: ...

class SetContextLimitResponse(_message.Message):
    __slots__ = ("value", "reserved_device_bytes")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    RESERVED_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    value: int
    reserved_device_bytes: int
    def __init__(self, value: _Optional[int] = ..., reserved_device_bytes: _Optional[int] = ...) -> None: ...

class GetContextLimitRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: ContextLimit
    def __init__(self, limit: _Optional[_Union[ContextLimit, str]] = ...) -> None: ...

class GetContextLimitResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class SetCacheConfigRequest(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: CacheConfig
    def __init__(self, config: _Optional[_Union[CacheConfig, str]] = ...) -> None: ...

class SetCacheConfigResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCacheConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCacheConfigResponse(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: CacheConfig
    def __init__(self, config: _Optional[_Union[CacheConfig, str]] = ...) -> None: ...

class SetSharedConfigRequest(_message.Message):
    __slots__ = ("config", "function_id")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    config: SharedConfig
    function_id: int
    def __init__(self, config: _Optional[_Union[SharedConfig, str]] = ..., function_id: _Optional[int] = ...) -> None: ...

class SetSharedConfigResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSharedConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSharedConfigResponse(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: SharedConfig
    def __init__(self, config: _Optional[_Union[SharedConfig, str]] = ...) -> None: ...

class SetFunctionAttributeRequest(_message.Message):
    __slots__ = ("function_id", "attribute", "value")
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    function_id: int
    attribute: FunctionAttribute
    value: int
    def __init__(self, function_id: _Optional[int] = ..., attribute: _Optional[_Union[FunctionAttribute, str]] = ..., value: _Optional[int] = ...) -> None: ...

class SetFunctionAttributeResponse(_message.Message):
    __slots__ = ("attributes",)
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    attributes: FunctionAttributes
    def __init__(self, attributes: _Optional[_Union[FunctionAttributes, _Mapping]] = ...) -> None: ...

class SetFunctionCacheConfigRequest(_message.Message):
    __slots__ = ("function_id", "config")
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    function_id: int
    config: CacheConfig
    def __init__(self, function_id: _Optional[int] = ..., config: _Optional[_Union[CacheConfig, str]] = ...) -> None: ...

class SetFunctionCacheConfigResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
