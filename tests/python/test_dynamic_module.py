"""JIT linking and dynamic parallelism: ``gpurpc.compiler.DynamicModule`` /
``DynamicSourceModule`` and ``gpurpc.driver.Linker`` (``ModuleService.LinkModule``).

On the fake backend (CI) NVRTC compiles for real and the fake links: each input is checked,
symbols are resolved, and the linked module runs the fake's built-in kernels. The tests
marked ``gpu`` run a parent kernel that launches child kernels on a CUDA-backed daemon and
are skipped (with the reason) on the fake.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc.compiler import DynamicModule, DynamicSourceModule, SourceModule, compile
from gpurpc._errors import CompileError, LogicError

# Two of the fake's built-ins (tests/testing/fake_kernels.h), in separate sources.
AXPY = """
__global__ void axpy_f32(float a, const float* x, float* y, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}
"""
FILL = """
__global__ void fill_u32(unsigned* out, unsigned value, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = value;
}
"""
# Dynamic parallelism: each parent thread launches a child grid over its slice.
CHILD = """
__global__ void child_square(unsigned* out, unsigned base, unsigned n) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[base + i] = (base + i) * (base + i);
}
"""
PARENT_DECL = """
__global__ void child_square(unsigned* out, unsigned base, unsigned n);
"""
PARENT = """
__global__ void parent_launch(unsigned* out, unsigned per_parent) {
  const unsigned base = (blockIdx.x * blockDim.x + threadIdx.x) * per_parent;
  child_square<<<(per_parent + 63) / 64, 64>>>(out, base, per_parent);
}
"""

# Where the daemon's worker looks for libcudadevrt.a without $GPURPC_CUDADEVRT
# (server/worker/compiler/cuda_libraries.h); the fake test daemon runs on this machine.
_CUDADEVRT_PLACES = [
    f"{root}/{lib}/libcudadevrt.a"
    for root in ("/usr/local/cuda",)
    for lib in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")
] + ["/usr/lib/x86_64-linux-gnu/libcudadevrt.a", "/usr/lib/aarch64-linux-gnu/libcudadevrt.a"]


def _run_axpy_and_fill(module, n: int = 1000) -> np.ndarray:
    fill = module.get_function("fill_u32")
    axpy = module.get_function("axpy_f32")
    x = cuda.mem_alloc(n * 4)
    y = cuda.mem_alloc(n * 4)
    one = np.float32(1.0).view(np.uint32)
    fill(x, one, np.uint64(n), block=(256, 1, 1), grid=((n + 255) // 256, 1))
    fill(y, one, np.uint64(n), block=(256, 1, 1), grid=((n + 255) // 256, 1))
    axpy(np.float32(2.0), x, y, np.uint64(n), block=(256, 1, 1), grid=((n + 255) // 256, 1))
    out = np.empty(n, np.float32)
    cuda.memcpy_dtoh(out, y)
    return out


def test_dynamic_module_links_sources_and_ptx_data(ctx: cuda.Context) -> None:
    fill_ptx = compile(FILL, options=["-rdc=true"], arch="compute_75", target="ptx")
    mod = (DynamicModule()
           .add_source(AXPY, nvcc_options=["-rdc=true"], name="axpy.cu")
           .add_data(fill_ptx, cuda.jit_input_type.PTX, "fill.ptx")
           .link())
    assert np.array_equal(_run_axpy_and_fill(mod), np.full(1000, 3.0, np.float32))
    assert len(mod.effective_options) == 1
    assert "--relocatable-device-code=true" in mod.effective_options[0] or \
        "-rdc=true" in mod.effective_options[0]


def test_add_file_and_linker_message_handler(ctx: cuda.Context, tmp_path: Path) -> None:
    path = tmp_path / "fill.ptx"
    path.write_bytes(compile(FILL, options=["-rdc=true"], arch="compute_75", target="ptx"))
    calls = []
    linker = cuda.Linker(lambda ok, info, err: calls.append((ok, info, err)), log_verbose=True)
    linker.add_file(str(path), cuda.jit_input_type.PTX)
    linker.add_data(compile(AXPY, options=["-rdc=true"], arch="compute_75", target="ptx"),
                    cuda.jit_input_type.PTX, "axpy.ptx")
    module = linker.link_module()
    assert np.array_equal(_run_axpy_and_fill(module), np.full(1000, 3.0, np.float32))
    assert calls and calls[-1][0] is True and calls[-1][2] == ""


def test_dynamic_parallelism_without_cudadevrt_fails_to_link(ctx: cuda.Context) -> None:
    mod = DynamicModule().add_source(CHILD, name="child.cu") \
                         .add_source(PARENT_DECL + PARENT, name="parent.cu")
    with pytest.raises(LogicError, match="cuLinkComplete"):
        mod.link()


def test_dynamic_source_module_links_cudadevrt(ctx: cuda.Context, is_fake: bool) -> None:
    source = AXPY + FILL + CHILD + PARENT
    if is_fake and not any(os.path.isfile(p) for p in _CUDADEVRT_PLACES):
        with pytest.raises(cuda.LaunchError, match="not installed"):
            DynamicSourceModule(source)
        return
    mod = DynamicSourceModule(source)
    assert mod.module is not None
    if is_fake:
        assert np.array_equal(_run_axpy_and_fill(mod), np.full(1000, 3.0, np.float32))
        with pytest.raises(LogicError, match="built-in"):
            mod.get_function("parent_launch")


def test_failed_source_raises_compile_error_with_log(ctx: cuda.Context) -> None:
    mod = DynamicModule().add_source("__global__ void broken( { }", name="broken.cu")
    with pytest.raises(CompileError) as info:
        mod.link()
    assert "broken.cu" in str(info.value)


def test_misuse_and_hostile_inputs_are_refused(ctx: cuda.Context) -> None:
    with pytest.raises(LogicError, match="not a jit_input_type"):
        DynamicModule().add_data(b"x", 42)
    with pytest.raises(LogicError, match="unknown standard library 'm'"):
        DynamicModule().add_source(AXPY).add_stdlib("m").link()
    with pytest.raises(LogicError, match="no inputs"):
        DynamicModule().link()
    with pytest.raises(LogicError, match="link\\(\\)"):
        DynamicModule().get_function("axpy_f32")
    with pytest.raises(LogicError, match="the data is empty"):
        DynamicModule().add_data(b"", cuda.jit_input_type.PTX).link()
    with pytest.raises(LogicError, match="garbage.cubin|cuLinkComplete"):
        DynamicModule().add_data(b"not a cubin", cuda.jit_input_type.CUBIN, "garbage.cubin").link()
    with pytest.raises(LogicError, match="turns relocatable device code off"):
        DynamicModule().add_source(AXPY, nvcc_options=["-rdc=false"]).link()
    linked = DynamicModule().add_source(AXPY).link()
    with pytest.raises(LogicError, match="already called"):
        linked.add_source(FILL)
    # The session still works.
    assert _run_axpy_and_fill(SourceModule(AXPY + FILL)).shape == (1000,)


def test_jit_enums_mirror_cuda() -> None:
    assert cuda.jit_input_type.CUBIN == 0 and cuda.jit_input_type.LIBRARY == 4
    assert cuda.jit_option.LOG_VERBOSE == 12
    assert cuda.jit_fallback.PREFER_BINARY == 1


@pytest.mark.gpu
def test_parent_kernel_launches_children_on_gpu(ctx: cuda.Context) -> None:
    mod = DynamicSourceModule(CHILD + PARENT)
    parent = mod.get_function("parent_launch")
    per_parent, parents = 100, 8 * 4
    n = per_parent * parents
    out = np.zeros(n, np.uint32)
    parent(cuda.InOut(out), np.uint32(per_parent), block=(4, 1, 1), grid=(8, 1))
    expected = (np.arange(n, dtype=np.uint64) ** 2).astype(np.uint32)
    assert np.array_equal(out, expected)


@pytest.mark.gpu
def test_dynamic_module_two_sources_with_cudadevrt_on_gpu(ctx: cuda.Context) -> None:
    mod = (DynamicModule()
           .add_source(CHILD, name="child.cu")
           .add_source(PARENT_DECL + PARENT, name="parent.cu")
           .add_stdlib("cudadevrt")
           .link())
    parent = mod.get_function("parent_launch")
    out = np.zeros(128, np.uint32)
    parent(cuda.InOut(out), np.uint32(64), block=(2, 1, 1), grid=(1, 1))
    assert np.array_equal(out, (np.arange(128, dtype=np.uint64) ** 2).astype(np.uint32))
