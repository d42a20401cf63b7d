"""Modules, launches, In/Out batching, streams, events and faults against a real daemon.

The kernels used here are the ones the fake backend implements (kernels.FAKE_KERNELS), so
these tests run in CI on the fake backend and unchanged on a GPU.
"""
from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import debug
from gpurpc.compiler import SourceModule, compile as compile_source
from gpurpc.v1 import common_pb2, execution_service_pb2 as ex

from kernels import FAKE_KERNELS

rng = np.random.default_rng(99)
float4 = np.dtype([("x", np.float32), ("y", np.float32), ("z", np.float32), ("w", np.float32)])
float3 = np.dtype([("x", np.float32), ("y", np.float32), ("z", np.float32)])


@pytest.fixture
def mod(ctx: cuda.Context) -> SourceModule:
    return SourceModule(FAKE_KERNELS)


# -- compiling -----------------------------------------------------------------------------

def test_source_module_compiles_and_finds_kernels(mod: SourceModule) -> None:
    f = mod.get_function("multiply_them")
    assert f.name == "multiply_them"
    assert [size for _, size in f.param_layout] == [8, 8, 8]
    assert isinstance(f.num_regs, int) and f.num_regs >= 0
    assert isinstance(f.shared_size_bytes, int)
    assert isinstance(f.local_size_bytes, int)
    assert f.get_attribute(cuda.function_attribute.NUM_REGS) == f.num_regs
    assert isinstance(mod.cubin, bytes) and mod.cubin
    assert mod.arch


def test_unknown_kernel_name_is_a_logic_error(mod: SourceModule) -> None:
    with pytest.raises(cuda.LogicError, match="no_such_kernel"):
        mod.get_function("no_such_kernel")


def test_second_compile_hits_the_daemon_cache(ctx: cuda.Context) -> None:
    source = FAKE_KERNELS + "\n// cache probe %d\n" % time.time_ns()
    first = SourceModule(source)
    second = SourceModule(source)
    assert not first.cache_hit
    assert second.cache_hit


def test_compile_error_carries_the_log(ctx: cuda.Context) -> None:
    bad = "__global__ void broken(float *x) { x[0] = undefined_identifier_42; }"
    with pytest.raises(cuda.CompileError) as info:
        SourceModule(bad)
    err = info.value
    assert "undefined_identifier_42" in err.stderr
    text = str(err)
    assert text.startswith("NVRTC compilation of kernel.cu failed")
    assert "[stderr:" in text and "undefined_identifier_42" in text
    assert "[command:" in text
    assert isinstance(err, cuda.Error)


def test_include_dirs_are_sent_as_headers(ctx: cuda.Context, tmp_path) -> None:
    (tmp_path / "mylib").mkdir()
    (tmp_path / "mylib" / "scale.h").write_text("#define SCALE 3.0f\n")
    mod = SourceModule('#include "mylib/scale.h"\n'
                       "__global__ void add_one_f32(float *d, unsigned long long n)\n"
                       "{ if (threadIdx.x < n) d[threadIdx.x] += SCALE - 2.0f; }\n",
                       include_dirs=[str(tmp_path)])
    mod.get_function("add_one_f32")
    # -I in options is translated the same way (the daemon itself rejects -I)
    SourceModule('#include "mylib/scale.h"\n'
                 "__global__ void fill_u32(unsigned *out, unsigned value, unsigned long long n)\n"
                 "{ out[0] = value * (unsigned)SCALE; }\n",
                 options=["-I" + str(tmp_path)]).get_function("fill_u32")


def test_compile_returns_a_cubin(ctx: cuda.Context) -> None:
    image = compile_source(FAKE_KERNELS)
    assert isinstance(image, bytes) and len(image) > 100
    module = cuda.module_from_buffer(image)
    assert module.get_function("fill_u32").name == "fill_u32"


def test_get_global_on_module_variables(mod: SourceModule) -> None:
    address, size = mod.get_global("device_table")
    assert size == 16 * 4
    cuda.memcpy_htod(address, np.arange(16, dtype=np.float32))
    out = np.empty(16, np.float32)
    cuda.memcpy_dtoh(out, address)
    assert (out == np.arange(16)).all()
    c_address, c_size = mod.get_global("constant_coeffs")
    assert c_size == 16
    cuda.memcpy_htod(c_address, np.array([1, 2, 3, 4], np.int32))
    with pytest.raises(cuda.LogicError):
        mod.get_global("no_such_global")


# -- In / Out / InOut ----------------------------------------------------------------------

def test_multiply_them_with_in_out(mod: SourceModule) -> None:
    multiply_them = mod.get_function("multiply_them")
    a = rng.standard_normal(400).astype(np.float32)
    b = rng.standard_normal(400).astype(np.float32)
    dest = np.zeros_like(a)
    multiply_them(cuda.Out(dest), cuda.In(a), cuda.In(b), block=(400, 1, 1), grid=(1, 1))
    assert np.array_equal(dest, a * b)


def test_in_out_is_one_round_trip(mod: SourceModule) -> None:
    multiply_them = mod.get_function("multiply_them")
    a = rng.standard_normal(400).astype(np.float32)
    b = rng.standard_normal(400).astype(np.float32)
    dest = np.zeros_like(a)
    multiply_them(cuda.Out(dest), cuda.In(a), cuda.In(b), block=(400, 1, 1))  # warm up
    dest[:] = 0
    debug.reset_rpc_counts()
    multiply_them(cuda.Out(dest), cuda.In(a), cuda.In(b), block=(400, 1, 1))
    assert debug.rpc_counts() == {debug.BATCH: 1}
    assert np.array_equal(dest, a * b)


def test_inout_updates_the_host_array(mod: SourceModule) -> None:
    multiply_them = mod.get_function("multiply_them")
    a = rng.standard_normal(256).astype(np.float32)
    b = rng.standard_normal(256).astype(np.float32)
    expected = a * b
    multiply_them(cuda.InOut(a), cuda.In(a.copy()), cuda.In(b), block=(128, 1, 1), grid=(2, 1))
    assert np.array_equal(a, expected)


def test_in_out_with_arrays_larger_than_one_chunk(mod: SourceModule) -> None:
    multiply_them = mod.get_function("multiply_them")
    n = 500 * 800  # 1.6 MB per array
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    dest = np.zeros_like(a)
    multiply_them(cuda.Out(dest), cuda.In(a), cuda.In(b), block=(500, 1, 1), grid=(800, 1))
    assert np.array_equal(dest, a * b)


def test_in_out_mixes_with_device_pointers(mod: SourceModule) -> None:
    multiply_them = mod.get_function("multiply_them")
    a = rng.standard_normal(64).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    a_gpu = cuda.to_device(a)
    dest = np.zeros_like(a)
    multiply_them(cuda.Out(dest), a_gpu, cuda.In(b), block=(64, 1, 1))
    assert np.array_equal(dest, a * b)


# -- plain and prepared launches -------------------------------------------------------------

def test_launch_with_device_pointers_and_scalars(mod: SourceModule) -> None:
    axpy = mod.get_function("axpy_f32")
    n = 10_000
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    x_gpu, y_gpu = cuda.to_device(x), cuda.to_device(y)
    # One thread per element: the fake backend processes element i only when i < threads.
    axpy(np.float32(2.5), x_gpu, y_gpu, np.uint64(n), block=(128, 1, 1), grid=((n + 127) // 128, 1))
    out = cuda.from_device_like(y_gpu, y)
    # The GPU fuses a*x+y into one FMA; numpy rounds twice.
    np.testing.assert_allclose(out, y + np.float32(2.5) * x, rtol=1e-5)


def test_prepared_call(mod: SourceModule) -> None:
    fill = mod.get_function("fill_u32").prepare("PIQ")
    buf = cuda.mem_alloc(4 * 1000)
    fill.prepared_call((4, 1), (256, 1, 1), buf, 0xC0FFEE, 1000)
    out = np.empty(1000, np.uint32)
    cuda.memcpy_dtoh(out, buf)
    assert (out == 0xC0FFEE).all()


def test_prepared_call_with_numpy_types_and_pointer_arithmetic(mod: SourceModule) -> None:
    add_one = mod.get_function("add_one_f32").prepare([np.intp, np.uint64])
    data = np.zeros(100, np.float32)
    buf = cuda.to_device(data)
    add_one.prepared_call((1, 1), (128, 1, 1), int(buf) + 40 * 4, 10)
    out = cuda.from_device_like(buf, data)
    expected = data.copy()
    expected[40:50] = 1
    assert np.array_equal(out, expected)


def test_prepared_async_call_on_a_stream(mod: SourceModule) -> None:
    axpy = mod.get_function("axpy_f32").prepare([np.float32, np.intp, np.intp, np.uint64])
    stream = cuda.Stream()
    n = 4096
    x = rng.standard_normal(n).astype(np.float32)
    y = np.zeros(n, np.float32)
    x_gpu, y_gpu = cuda.mem_alloc(x.nbytes), cuda.mem_alloc(y.nbytes)
    cuda.memcpy_htod_async(x_gpu, x, stream)
    cuda.memcpy_htod_async(y_gpu, y, stream)
    for _ in range(10):
        axpy.prepared_async_call((16, 1), (256, 1, 1), stream, 1.0, x_gpu, y_gpu, n)
    out = np.empty_like(y)
    cuda.memcpy_dtoh_async(out, y_gpu, stream)
    stream.synchronize()
    np.testing.assert_allclose(out, 10 * x, rtol=1e-5)


def test_many_async_launches_are_batched(mod: SourceModule) -> None:
    add_one = mod.get_function("add_one_f32").prepare("PQ")
    buf = cuda.to_device(np.zeros(32, np.float32))
    cuda.Context.synchronize()
    debug.reset_rpc_counts()
    for _ in range(3000):
        add_one.prepared_call((1, 1), (32, 1, 1), buf, 32)
    out = np.empty(32, np.float32)
    cuda.memcpy_dtoh(out, buf)
    assert (out == 3000).all()
    assert debug.rpc_counts()[debug.BATCH] < 3000 // 10


# -- argument errors -----------------------------------------------------------------------

def test_wrong_argument_count_is_a_logic_error(mod: SourceModule) -> None:
    axpy = mod.get_function("axpy_f32")
    buf = cuda.mem_alloc(64)
    with pytest.raises(cuda.LogicError, match="takes 4 parameters, 2 given"):
        axpy(buf, buf, block=(1, 1, 1))


def test_plain_python_scalar_is_a_type_error(mod: SourceModule) -> None:
    axpy = mod.get_function("axpy_f32")
    buf = cuda.mem_alloc(64)
    with pytest.raises(TypeError, match=r"invalid type on parameter #3 \(0-based\)"):
        axpy(np.float32(1), buf, buf, 16, block=(1, 1, 1))


def test_wrong_scalar_size_names_the_parameter(mod: SourceModule) -> None:
    axpy = mod.get_function("axpy_f32")
    buf = cuda.mem_alloc(64)
    with pytest.raises(cuda.LogicError) as info:
        axpy(np.float64(1), buf, buf, np.uint64(16), block=(1, 1, 1))
    assert "parameter #0 (0-based) takes 4 bytes" in str(info.value)
    assert "float64" in str(info.value)


def test_struct_size_mismatch_names_the_parameter(mod: SourceModule) -> None:
    axpy = mod.get_function("axpy_f32")
    buf = cuda.mem_alloc(64)
    v4 = np.array((1, 2, 3, 4), dtype=float4)[()]  # a float4 where the kernel takes a float
    with pytest.raises(cuda.LogicError) as info:
        axpy(v4, buf, buf, np.uint64(16), block=(1, 1, 1))
    assert "parameter #0 (0-based) takes 4 bytes" in str(info.value)
    assert "struct of 16 bytes" in str(info.value)


def test_the_daemon_checks_packed_arguments_too(mod: SourceModule, ctx: cuda.Context) -> None:
    f = mod.get_function("axpy_f32")
    request = ex.LaunchRequest(launch=ex.LaunchCommand(
        function_id=f.handle, grid=common_pb2.Dim3(x=1, y=1, z=1),
        block=common_pb2.Dim3(x=1, y=1, z=1), packed_args=b"\0" * 3))
    with pytest.raises(cuda.LogicError) as info:
        ctx._core.call("ExecutionService.Launch", request)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_block_too_large_is_a_logic_error(mod: SourceModule, ctx: cuda.Context) -> None:
    add_one = mod.get_function("add_one_f32")
    buf = cuda.mem_alloc(64)
    with pytest.raises(cuda.LogicError):
        add_one(buf, np.uint64(16), block=(1 << 20, 1, 1))
        ctx.synchronize()
    ctx.synchronize()


# -- streams, events, timing -------------------------------------------------------------------

def test_events_time_work_on_the_server(mod: SourceModule) -> None:
    spin = mod.get_function("spin_us")
    start, end = cuda.Event(), cuda.Event()
    start.record()
    spin(np.uint64(20_000), block=(1, 1, 1))
    assert end.record() is end
    assert end.synchronize() is end
    assert end.query() and start.query()
    elapsed = end.time_since(start)
    assert 15 <= elapsed < 5000
    assert start.time_till(end) == pytest.approx(elapsed)


def test_time_since_an_unrecorded_event_is_a_logic_error(ctx: cuda.Context) -> None:
    recorded, never = cuda.Event(), cuda.Event()
    recorded.record().synchronize()
    with pytest.raises(cuda.LogicError):
        recorded.time_since(never)


def test_event_without_timing(ctx: cuda.Context) -> None:
    a = cuda.Event(cuda.event_flags.DISABLE_TIMING)
    b = cuda.Event(cuda.event_flags.DISABLE_TIMING)
    a.record()
    b.record().synchronize()
    with pytest.raises(cuda.LogicError):
        b.time_since(a)


def test_stream_waits_for_event_of_another_stream(mod: SourceModule) -> None:
    spin = mod.get_function("spin_us")
    fill = mod.get_function("fill_u32")
    copy = mod.get_function("copy_bytes")
    s1, s2 = cuda.Stream(), cuda.Stream()
    src = cuda.to_device(np.zeros(256, np.uint32))
    dst = cuda.to_device(np.zeros(256, np.uint32))
    done = cuda.Event()
    spin(np.uint64(10_000), block=(1, 1, 1), stream=s1)
    fill(src, np.uint32(5), np.uint64(256), block=(256, 1, 1), stream=s1)
    done.record(s1)
    s2.wait_for_event(done)
    copy(dst, src, np.uint64(1024), block=(1024, 1, 1), stream=s2)
    s2.synchronize()
    out = np.empty(256, np.uint32)
    cuda.memcpy_dtoh(out, dst)
    assert (out == 5).all()


def test_time_kernel_uses_server_events(mod: SourceModule) -> None:
    spin = mod.get_function("spin_us")
    seconds = spin(np.uint64(10_000), block=(1, 1, 1), time_kernel=True)
    assert 0.008 <= seconds < 5.0


def test_time_kernel_with_in_out(mod: SourceModule) -> None:
    multiply_them = mod.get_function("multiply_them")
    a = rng.standard_normal(128).astype(np.float32)
    dest = np.zeros_like(a)
    seconds = multiply_them(cuda.Out(dest), cuda.In(a), cuda.In(a), block=(128, 1, 1),
                            time_kernel=True)
    assert 0 <= seconds < 5.0
    assert np.array_equal(dest, a * a)


def test_prepared_timed_call(mod: SourceModule) -> None:
    spin = mod.get_function("spin_us").prepare("Q")
    get_time = spin.prepared_timed_call((1, 1), (1, 1, 1), 10_000)
    assert 0.008 <= get_time() < 5.0


# -- faults ----------------------------------------------------------------------------------

def test_fault_raises_launch_error_then_every_call_names_the_cause(mod: SourceModule,
                                                                  ctx: cuda.Context) -> None:
    buf = cuda.mem_alloc(64)
    mod.get_function("fault_illegal_address")(block=(1, 1, 1))
    with pytest.raises(cuda.LaunchError) as first:
        ctx.synchronize()
    assert first.value.code == grpc.StatusCode.ABORTED
    for attempt in (lambda: cuda.mem_alloc(16),
                    lambda: cuda.memcpy_dtoh(np.empty(4, np.float32), buf),
                    lambda: cuda.memcpy_htod(buf, np.zeros(4, np.float32)),
                    lambda: ctx.synchronize(),
                    lambda: cuda.Stream()):
        with pytest.raises(cuda.LaunchError) as later:
            attempt()
        # FAILED_PRECONDITION once the daemon has marked the session FAULTED; a call racing
        # with that may still see the worker's own ABORTED. Either way it names the cause.
        assert later.value.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED)
        message = str(later.value)
        assert "ILLEGAL_ADDRESS" in message.upper().replace(" ", "_")
        assert "make_context" in message  # says what to do
    with pytest.raises(cuda.LaunchError) as last:
        cuda.mem_alloc(16)
    assert last.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "FAULTED" in str(last.value)


def test_out_of_bounds_kernel_access_is_a_launch_error(mod: SourceModule,
                                                       ctx: cuda.Context) -> None:
    multiply_them = mod.get_function("multiply_them")
    a = rng.standard_normal(64).astype(np.float32)
    dest = np.zeros_like(a)
    with pytest.raises(cuda.LaunchError):
        # 64 elements, far more threads: reads and writes past the temporary buffers.
        multiply_them(cuda.Out(dest), cuda.In(a), cuda.In(a), block=(1024, 1, 1),
                      grid=(1 << 16, 1))
    with pytest.raises(cuda.LaunchError, match="make_context"):
        cuda.mem_alloc(16)


def test_a_fault_does_not_disturb_other_sessions(mod: SourceModule, ctx: cuda.Context) -> None:
    other = cuda.Device(0).retain_primary_context()
    try:
        other.push()
        healthy = cuda.to_device(np.arange(8, dtype=np.int32))
        cuda.Context.pop()
        mod.get_function("fault_illegal_address")(block=(1, 1, 1))
        with pytest.raises(cuda.LaunchError):
            ctx.synchronize()
        other.push()
        out = np.empty(8, np.int32)
        cuda.memcpy_dtoh(out, healthy)
        assert (out == np.arange(8)).all()
        cuda.Context.pop()
    finally:
        other.detach()
