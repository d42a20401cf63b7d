"""Client-side logic that needs no daemon: wire encoding, argument packing, error mapping."""
from __future__ import annotations

import importlib
import os
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest

import gpurpc
import gpurpc.driver as cuda
from gpurpc import _core, _errors, _functions, _memory, compiler, tools
from gpurpc.v1 import common_pb2, execution_service_pb2 as ex, module_service_pb2 as mod


# -- stubs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["common", "device_service", "session_service", "memory_service",
                                  "module_service", "execution_service", "host_region_service"])
def test_generated_stubs_import_as_gpurpc_v1(name: str) -> None:
    pb2 = importlib.import_module(f"gpurpc.v1.{name}_pb2")
    importlib.import_module(f"gpurpc.v1.{name}_pb2_grpc")
    assert pb2.DESCRIPTOR.package == "gpurpc.v1"


def test_package_is_typed() -> None:
    root = Path(gpurpc.__file__).parent
    assert (root / "py.typed").is_file()
    assert (root / "v1" / "execution_service_pb2.pyi").is_file()


# -- wire encoding of the launch fast path ---------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16383, 16384, 2097151, 2097152,
                               2**32 + 5, 2**63 - 1])
def test_varint_matches_protobuf(n: int) -> None:
    encoded = common_pb2.BufferRef(buffer_id=n).SerializeToString()
    assert encoded == (b"\x08" + _core.varint(n) if n else b"")


def test_launch_command_bytes_parse_as_the_same_message() -> None:
    prefix = _core.launch_prefix(0xDEADBEEF, (4, 2), (128,), 256, 77)
    args = b"\x01" * 20
    body = prefix + _core.TAG_PACKED_ARGS + _core.varint(len(args)) + args
    # The real path: CommandStream.add_launch frames them (queued, not sent: auto=False).
    stream = _core.CommandStream(None, (), 1, {}, None)  # type: ignore[arg-type]
    stream.add_launch(body, "first", auto=False)
    stream.add_launch(prefix, "second", auto=False)
    batch = ex.CommandBatch.FromString(b"".join(stream._cmds))
    assert [c.sequence for c in batch.commands] == [1, 2]
    launch = batch.commands[0].launch
    assert launch.function_id == 0xDEADBEEF
    assert (launch.grid.x, launch.grid.y, launch.grid.z) == (4, 2, 1)
    assert (launch.block.x, launch.block.y, launch.block.z) == (128, 1, 1)
    assert launch.shared_memory_bytes == 256
    assert launch.stream_id == 77
    assert launch.packed_args == args
    assert batch.commands[1].launch.packed_args == b""


def test_zero_dimension_is_a_logic_error() -> None:
    with pytest.raises(cuda.LogicError, match="block extents must be >= 1"):
        _core.dim3((0, 1, 1), "block")


# -- addresses -----------------------------------------------------------------------------

def test_address_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import socket as socket_module
    monkeypatch.delenv("GPURPC_ADDRESS", raising=False)
    # Nothing given and no daemon socket: a clear error naming every place looked at.
    missing = [str(tmp_path / "a.sock"), str(tmp_path / "b.sock")]
    monkeypatch.setattr(_core, "default_socket_paths", lambda: missing)
    with pytest.raises(cuda.RuntimeError) as info:
        _core.resolve_address()
    assert "GPURPC_ADDRESS" in str(info.value)
    assert all(path in str(info.value) for path in missing)
    monkeypatch.undo()
    # The daemon's default socket under $XDG_RUNTIME_DIR is found without configuration.
    monkeypatch.delenv("GPURPC_ADDRESS", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "gpurpc").mkdir()
    path = tmp_path / "gpurpc" / "gpurpcd.sock"
    with socket_module.socket(socket_module.AF_UNIX) as listener:
        listener.bind(str(path))
        assert _core.resolve_address() == f"unix:{path}"
    monkeypatch.setenv("GPURPC_ADDRESS", "gpu-box:7000")
    assert _core.resolve_address() == "gpu-box:7000"
    assert _core.resolve_address("/run/gpurpc.sock") == "unix:/run/gpurpc.sock"
    assert _core.resolve_address("unix:///tmp/x.sock") == "unix:///tmp/x.sock"


def test_unreachable_daemon_raises_runtime_error() -> None:
    client = _core.Client(f"unix:/nonexistent/gpurpc-{os.getpid()}.sock")
    with pytest.raises(cuda.RuntimeError) as info:
        client.call("DeviceService.ListDevices", __import__(
            "gpurpc.v1.device_service_pb2", fromlist=["x"]).ListDevicesRequest(), timeout=5)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "GPURPC_ADDRESS" in str(info.value)


# -- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("code,cls", [
    (grpc.StatusCode.INVALID_ARGUMENT, cuda.LogicError),
    (grpc.StatusCode.NOT_FOUND, cuda.LogicError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, cuda.MemoryError),
    (grpc.StatusCode.ABORTED, cuda.LaunchError),
    (grpc.StatusCode.FAILED_PRECONDITION, cuda.LaunchError),
    (grpc.StatusCode.UNAVAILABLE, cuda.RuntimeError),
    (grpc.StatusCode.INTERNAL, cuda.Error),
])
def test_status_codes_map_to_pycuda_exceptions(code: grpc.StatusCode, cls: type) -> None:
    err = _errors.error_from_status(code, "the server said so", "MemoryService.Upload")
    assert type(err) is cls
    assert isinstance(err, cuda.Error)
    assert err.code == code
    assert err.details == "the server said so"
    assert "MemoryService.Upload failed: the server said so" in str(err)


def test_fault_errors_tell_what_to_do() -> None:
    err = _errors.error_from_status(grpc.StatusCode.FAILED_PRECONDITION,
                                    "session FAULTED: CUDA_ERROR_ILLEGAL_ADDRESS", "memcpy_dtoh")
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in str(err)
    assert "make_context" in str(err)


def test_status_code_from_int_round_trips() -> None:
    for code in grpc.StatusCode:
        assert _errors.status_code_from_int(code.value[0]) is code
    assert _errors.status_code_from_int(999) is grpc.StatusCode.UNKNOWN


def test_compile_error_str_has_pycuda_layout() -> None:
    err = cuda.CompileError("NVRTC compilation of kernel.cu failed", ["-arch=sm_90", "-DX=1"],
                            stderr="kernel.cu(3): error: expected a \";\"")
    text = str(err)
    assert text.startswith("NVRTC compilation of kernel.cu failed")
    assert "[command: -arch=sm_90 -DX=1]" in text
    assert "[stderr:\nkernel.cu(3): error: expected a \";\"]" in text
    assert err.stdout == "" and err.command_line == ["-arch=sm_90", "-DX=1"]
    assert isinstance(err, cuda.Error)


# -- argument packing ----------------------------------------------------------------------

def test_plain_python_numbers_are_rejected_like_pycuda() -> None:
    with pytest.raises(TypeError, match=r"invalid type on parameter #2 \(0-based\)"):
        _functions._pack_arg(2, 5)
    with pytest.raises(TypeError, match="invalid type on parameter #0"):
        _functions._pack_arg(0, 1.5)


def test_numpy_scalars_structs_and_arrays_pack_by_value() -> None:
    assert _functions._pack_arg(0, np.float32(1.5)) == struct.pack("<f", 1.5)
    assert _functions._pack_arg(0, np.uint64(7)) == struct.pack("<Q", 7)
    assert _functions._pack_arg(0, np.intp(0x1234)) == struct.pack("<q", 0x1234)
    float4 = np.dtype([("x", np.float32), ("y", np.float32), ("z", np.float32), ("w", np.float32)])
    v = np.array((1, 2, 3, 4), dtype=float4)[()]
    assert _functions._pack_arg(0, v) == np.array([1, 2, 3, 4], np.float32).tobytes()
    ints = np.arange(3, dtype=np.int32)
    assert _functions._pack_arg(0, ints) == ints.tobytes()
    assert _functions._pack_arg(0, cuda.In(np.zeros(3))) is None


class _Holder(cuda.PointerHolderBase):
    def get_pointer(self) -> int:
        return 0xABC000


def test_pointer_like_objects_pack_as_addresses() -> None:
    assert _functions._pack_arg(0, _Holder()) == struct.pack("<Q", 0xABC000)

    class FakeArray:
        gpudata = 0x1000

    assert _functions._pack_arg(0, FakeArray()) == struct.pack("<Q", 0x1000)

    class Indexable:
        def __index__(self) -> int:
            return 0x2000

    assert _functions._pack_arg(0, Indexable()) == struct.pack("<Q", 0x2000)
    assert _memory._address(np.uint64(0x10)) == 0x10
    with pytest.raises(TypeError, match="expected a device pointer"):
        _memory._address("not a pointer")


def _function(params: list[tuple[int, int]], name: str = "k") -> cuda.Function:
    reply = mod.GetFunctionResponse(function_id=42, params=[
        mod.ParamInfo(offset_bytes=o, size_bytes=s) for o, s in params])
    module = cuda.Module.__new__(cuda.Module)
    module._core = None  # type: ignore[assignment]
    return cuda.Function(module, name, reply)


def test_layout_places_arguments_at_the_kernel_offsets() -> None:
    # void k(float* out, float4 v): v lives at offset 16, not 8 as numpy packing would put it.
    fn = _function([(0, 8), (16, 16)])
    vec = np.array([1, 2, 3, 4], np.float32)
    blob = fn._layout([struct.pack("<Q", 0x1000), vec.tobytes()], [None, vec])
    assert len(blob) == 32
    assert blob[:8] == struct.pack("<Q", 0x1000)
    assert blob[8:16] == b"\0" * 8
    assert np.frombuffer(blob[16:], np.float32).tolist() == [1, 2, 3, 4]


def test_layout_rejects_wrong_argument_count() -> None:
    fn = _function([(0, 8), (8, 4)], "axpy")
    with pytest.raises(cuda.LogicError, match="axpy: the kernel takes 2 parameters, 3 given"):
        fn._layout([b"\0" * 8, b"\0" * 4, b"\0" * 4], [None, None, None])


def test_layout_rejects_size_mismatch_naming_the_parameter() -> None:
    fn = _function([(0, 8), (8, 4)], "axpy")
    with pytest.raises(cuda.LogicError) as info:
        fn._layout([b"\0" * 8, np.float64(1).tobytes()], [None, np.float64(1)])
    assert "parameter #1 (0-based) takes 4 bytes" in str(info.value)
    assert "numpy.float64 of 8 bytes" in str(info.value)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_prepare_builds_padded_struct_format() -> None:
    fn = _function([(0, 4), (8, 8), (16, 16)])
    fn.prepare("iP16s")
    blob = fn._pack_prepared([np.int32(3), 0x2000, b"x" * 16])
    assert blob == struct.pack("<i4xQ", 3, 0x2000) + b"x" * 16
    # numpy types and pointer-like objects work too
    fn.prepare([np.int32, np.intp, np.dtype((np.void, 16))])
    assert fn._pack_prepared([5, _Holder(), np.zeros(4, np.float32)])[8:16] == \
        struct.pack("<Q", 0xABC000)


def test_prepare_rejects_mismatched_types() -> None:
    fn = _function([(0, 8), (8, 4)], "axpy")
    with pytest.raises(cuda.LogicError, match="prepared with 1 argument types"):
        fn.prepare("P")
    with pytest.raises(cuda.LogicError, match=r"parameter #1 \(0-based\) takes 4 bytes"):
        fn.prepare("Pd")


def test_prepared_call_names_a_bad_value() -> None:
    fn = _function([(0, 4)], "k")
    fn.prepare("i")
    with pytest.raises(TypeError, match=r"parameter #0"):
        fn._pack_prepared(["nope"])


def test_struct_format_parsing() -> None:
    assert [i[1] for i in _functions._parse_format("PPfi")] == [8, 8, 4, 4]
    assert [i[1] for i in _functions._parse_format("3f12sQ")] == [4, 4, 4, 12, 8]
    assert _functions._type_char(np.float32) == "f"
    assert _functions._type_char(np.dtype([("a", np.int32), ("b", np.int32)])) == "8s"
    assert _functions._type_char(cuda.DeviceAllocation) == "P"


def test_texrefs_and_missing_block_are_rejected() -> None:
    fn = _function([])
    with pytest.raises(ValueError, match="must specify block size"):
        fn()
    with pytest.raises(ValueError, match="extra keyword arguments: blocks"):
        fn(blocks=(1, 1, 1))


# -- host buffers --------------------------------------------------------------------------

def test_host_views_follow_memory_order() -> None:
    a = np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3))
    assert bytes(_memory._readable(a)) == a.tobytes(order="F")
    strided = np.arange(10, dtype=np.int32)[::2]
    assert bytes(_memory._readable(strided)) == strided.tobytes()
    with pytest.raises(ValueError, match="contiguous"):
        _memory._writable(strided, "memcpy_dtoh")
    with pytest.raises(ValueError, match="read-only"):
        _memory._writable(b"abc", "memcpy_dtoh")


# -- compiler helpers ----------------------------------------------------------------------

def test_collect_headers_reads_text_files_recursively(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.h").write_text("#define A 1\n")
    (tmp_path / "sub" / "b.cuh").write_text("#define B 2\n")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref")
    assert compiler.collect_headers([str(tmp_path)]) == [
        ("a.h", "#define A 1\n"), ("sub/b.cuh", "#define B 2\n")]
    with pytest.raises(cuda.LogicError, match="does not exist"):
        compiler.collect_headers([str(tmp_path / "missing")])


def test_compile_request_wraps_source_and_translates_include_options(tmp_path: Path) -> None:
    (tmp_path / "v.h").write_text("// header")
    req = compiler._compile_request("__global__ void k() {}", ["-I" + str(tmp_path), "-DX=1"],
                                    False, "sm_90", None, [], False)
    assert req.source.startswith('extern "C" {\n')
    assert list(req.options) == ["-DX=1", "-arch=sm_90"]
    assert [(h.name, h.content) for h in req.headers] == [("v.h", "// header")]
    plain = compiler._compile_request("x", None, True, None, "sm_80", [], True)
    assert plain.source == "x" and "-arch=sm_80" in plain.options and plain.compile_only


# -- tools ---------------------------------------------------------------------------------

def test_parse_c_arg() -> None:
    v = tools.parse_c_arg("const float *__restrict__ x")
    assert isinstance(v, tools.VectorArg) and v.dtype == np.float32 and v.name == "x"
    s = tools.parse_c_arg(" unsigned long long n ")
    assert isinstance(s, tools.ScalarArg) and s.dtype == np.uint64
    assert struct.calcsize(s.struct_char) == 8
    assert tools.parse_c_arg("int a[]").__class__ is tools.VectorArg
    with pytest.raises(TypeError, match="unknown C type"):
        tools.parse_c_arg("mystery_t q")


def test_dtype_to_ctype() -> None:
    assert tools.dtype_to_ctype(np.float32) == "float"
    assert tools.dtype_to_ctype(np.int64) == "long long"
    assert tools.dtype_to_ctype(np.uint8) == "unsigned char"
    assert tools.dtype_to_ctype(np.complex64) == "pycuda::complex<float>"
    with pytest.raises(ValueError):
        tools.dtype_to_ctype(np.dtype([("a", np.int32), ("b", np.float16)]))


def test_pool_size_classes_waste_little() -> None:
    for n in [1, 255, 256, 1000, 4096, 10**6, 3 * 2**20 + 1]:
        # PyCUDA's bins: two mantissa bits, so a block wastes at most a quarter.
        size = tools.DeviceMemoryPool.alloc_size(tools.DeviceMemoryPool.bin_number(n))
        assert n <= size <= n + n // 4 + 1


@pytest.mark.parametrize("module, name, why", [
    ("gpurpc.driver", "MipmappedArray", "mipmapped"),
    ("gpurpc.driver", "memcpy_peer", "peer copies"),
    ("gpurpc.driver", "register_host_memory", "pagelocked_empty"),
    ("gpurpc.driver", "managed_empty", "managed memory"),
    ("gpurpc.driver", "TextureReference", "CUDA 12"),
])
def test_pycuda_names_not_served_say_why(module: str, name: str, why: str) -> None:
    import importlib
    mod = importlib.import_module(module)
    assert not hasattr(mod, name)
    with pytest.raises(AttributeError, match=why):
        getattr(mod, name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        getattr(mod, "no_such_name")
