"""Device printf through the Python client: a kernel that #includes <stdio.h> (the daemon's
standard header shims) prints, and the text appears on ``sys.stdout`` when a synchronising
call of its own session returns -- never in another session's.

On the fake backend the built-in ``print_i32`` prints, on the host, the very lines the CUDA
source below prints on a GPU, so the same assertions run in CI and on the H200 (where the
lines of different threads may come in any order: they are compared sorted).
"""
from __future__ import annotations

from typing import List

import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc.compiler import SourceModule

PRINT_SOURCE = r"""
#include <stdio.h>
extern "C" __global__ void print_i32(const int* values, unsigned long long n) {
  const unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  if (i < n) printf("print_i32 %llu %d\n", i, values[i]);
}
"""


def lines(values: List[int]) -> List[str]:
    return sorted(f"print_i32 {i} {v}" for i, v in enumerate(values))


def printed(capsys: pytest.CaptureFixture) -> List[str]:
    return sorted(line for line in capsys.readouterr().out.splitlines() if line)


def launch(func: cuda.Function, values: List[int],
           stream: cuda.Stream = None) -> cuda.DeviceAllocation:
    """Launches print_i32 over ``values`` without synchronising (no In/Out: PyCUDA's
    argument handlers synchronise after the launch, which would print right away)."""
    data = cuda.to_device(np.array(values, np.int32))
    blocks = (len(values) + 255) // 256
    func(data, np.uint64(len(values)), block=(256, 1, 1), grid=(blocks, 1), stream=stream)
    return data


@pytest.fixture
def print_i32(ctx: cuda.Context) -> cuda.Function:
    return SourceModule(PRINT_SOURCE, no_extern_c=True).get_function("print_i32")


def test_printf_appears_at_the_synchronisation(print_i32: cuda.Function,
                                               ctx: cuda.Context,
                                               capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    data = launch(print_i32, [7, -3, 42])
    ctx.synchronize()
    assert printed(capsys) == lines([7, -3, 42])
    ctx.synchronize()
    assert printed(capsys) == []  # delivered once


def test_stream_and_event_synchronisations_print(print_i32: cuda.Function,
                                                 capsys: pytest.CaptureFixture) -> None:
    stream = cuda.Stream()
    capsys.readouterr()
    first = launch(print_i32, [1, 2], stream)
    stream.synchronize()
    assert printed(capsys) == lines([1, 2])
    event = cuda.Event()
    second = launch(print_i32, [5], stream)
    event.record(stream)
    event.synchronize()
    assert printed(capsys) == lines([5])


def test_sessions_never_print_each_others_output(print_i32: cuda.Function, ctx: cuda.Context,
                                                 capsys: pytest.CaptureFixture) -> None:
    other = cuda.Device(0).make_context()  # a second session, current now
    try:
        other_print = SourceModule(PRINT_SOURCE, no_extern_c=True).get_function("print_i32")
        other_data = launch(other_print, [-200, -201])
        cuda.Context.pop()  # back to ctx
        data = launch(print_i32, [100, 101, 102])
        capsys.readouterr()
        ctx.synchronize()
        assert printed(capsys) == lines([100, 101, 102])
        other.push()
        other.synchronize()
        assert printed(capsys) == lines([-200, -201])
        cuda.Context.pop()
        del data, other_data
    finally:
        other.detach()


def test_printf_with_standard_headers_compiles(ctx: cuda.Context) -> None:
    # What PyCUDA kernels include under nvcc: all found through the daemon's shims.
    SourceModule(r"""
#include <stdio.h>
#include <stdint.h>
#include <math.h>
#include <limits.h>
#include <cmath>
#include <limits>
#include <type_traits>
__global__ void k(float* out, uint32_t n) {
  if (threadIdx.x == 0) printf("%d %f\n", INT_MAX, M_PI);
  out[0] = std::sqrt(2.0f) + std::numeric_limits<float>::epsilon() + (std::is_same<uint32_t, unsigned>::value ? 1 : 0);
}
""")
