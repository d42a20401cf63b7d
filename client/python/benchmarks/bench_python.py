#!/usr/bin/env python3
"""gpurpc (remote, through gpurpcd) beside CuPy (local) on the same machine, in one run.

Measures, for both where they apply:

* asynchronous launches per second of a trivial kernel (prepared_async_call in a loop, then
  one synchronize; CuPy: RawKernel calls in a loop, then one synchronize);
* the same through ``Function.__call__`` (PyCUDA's everyday launch syntax);
* launch + synchronize round trips per second;
* one ``In``/``Out`` call on 4 MiB arrays (upload two, launch, download one; CuPy: asarray,
  launch, asnumpy);
* ``gpuarray.to_gpu`` and ``.get()`` of 256 MiB (CuPy: ``cp.asarray``/``cp.asnumpy``).

and prints a table with the ratio gpurpc/CuPy (higher is better for gpurpc). The target is
>= 50,000 asynchronous launches per second from Python.

Usage (daemon at $GPURPC_ADDRESS or --address; CuPy optional)::

    PYTHONPATH=client/python/src python3 client/python/benchmarks/bench_python.py

The kernels are named like the fake backend's, so the program also runs against
``gpurpcd --backend=fake`` (then only the client-side numbers mean anything).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

try:
    import gpurpc  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import gpurpc.driver as cuda  # noqa: E402
from gpurpc import gpuarray  # noqa: E402
from gpurpc.compiler import SourceModule  # noqa: E402

KERNELS = r"""
__global__ void add_one_f32(float *data, unsigned long long n)
{
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] += 1.0f;
}

__global__ void multiply_them(float *dest, const float *a, const float *b)
{
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  dest[i] = a[i] * b[i];
}
"""

LAUNCH_TARGET_PER_S = 50_000
MiB = 1 << 20


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Result:
    def __init__(self, name: str, unit: str, note: str = "") -> None:
        self.name = name
        self.unit = unit
        self.note = note
        self.gpurpc: Optional[float] = None
        self.cupy: Optional[float] = None


# -- gpurpc -----------------------------------------------------------------------------------

def bench_gpurpc(results: Dict[str, Result], args: argparse.Namespace) -> None:
    mod = SourceModule(KERNELS)
    add_one = mod.get_function("add_one_f32")
    prepared = mod.get_function("add_one_f32").prepare("PQ")
    multiply = mod.get_function("multiply_them")
    buf = cuda.mem_alloc(4096)
    stream = cuda.Stream()

    # asynchronous launches, prepared
    for _ in range(2000):
        prepared.prepared_async_call((1, 1), (32, 1, 1), stream, buf, 0)
    stream.synchronize()
    n = args.launches
    t0 = time.perf_counter()
    for _ in range(n):
        prepared.prepared_async_call((1, 1), (32, 1, 1), stream, buf, 0)
    stream.synchronize()
    results["async"].gpurpc = n / (time.perf_counter() - t0)

    # asynchronous launches, __call__
    zero = np.uint64(0)
    n_call = max(n // 2, 1000)
    t0 = time.perf_counter()
    for _ in range(n_call):
        add_one(buf, zero, block=(32, 1, 1), stream=stream)
    stream.synchronize()
    results["async_call"].gpurpc = n_call / (time.perf_counter() - t0)

    # launch + synchronize round trips
    rounds = args.sync_launches
    for _ in range(50):
        prepared.prepared_async_call((1, 1), (32, 1, 1), stream, buf, 0)
        stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        prepared.prepared_async_call((1, 1), (32, 1, 1), stream, buf, 0)
        stream.synchronize()
    results["sync"].gpurpc = rounds / (time.perf_counter() - t0)

    # In/Out on 4 MiB arrays
    count = 4 * MiB // 4
    a = np.random.rand(count).astype(np.float32)
    b = np.random.rand(count).astype(np.float32)
    dest = np.empty_like(a)

    def in_out() -> None:
        multiply(cuda.Out(dest), cuda.In(a), cuda.In(b), block=(256, 1, 1),
                 grid=(count // 256, 1))

    in_out()
    if not np.array_equal(dest, a * b):
        raise SystemExit("gpurpc In/Out result is wrong")
    results["inout"].gpurpc = 1.0 / _median_time(in_out, args.repeats)

    # to_gpu / get of 256 MiB
    size = args.transfer_mib * MiB
    host = np.random.randint(0, 255, size, dtype=np.uint8)
    holder: List[gpuarray.GPUArray] = []

    def upload() -> None:
        holder[:] = [gpuarray.to_gpu(host)]

    def download() -> None:
        holder[0].get()

    upload()
    if not np.array_equal(holder[0].get(), host):
        raise SystemExit("gpurpc to_gpu/get round trip is wrong")
    results["to_gpu"].gpurpc = size / _median_time(upload, args.transfer_repeats) / 1e9
    results["get"].gpurpc = size / _median_time(download, args.transfer_repeats) / 1e9
    holder.clear()


# -- CuPy -------------------------------------------------------------------------------------

def bench_cupy(results: Dict[str, Result], args: argparse.Namespace) -> Optional[str]:
    try:
        import cupy as cp  # type: ignore[import-not-found]
    except ImportError as e:
        return f"CuPy is not installed ({e}); its columns are skipped"
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver / no GPU here
        return f"CuPy cannot use a GPU here ({e}); its columns are skipped"
    # SourceModule wraps sources in extern "C" (PyCUDA's default); RawKernel does not.
    cupy_source = 'extern "C" {\n' + KERNELS + '\n}\n'
    add_one = cp.RawKernel(cupy_source, "add_one_f32")
    multiply = cp.RawKernel(cupy_source, "multiply_them")
    buf = cp.zeros(1024, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    zero = np.uint64(0)
    with stream:
        for _ in range(2000):
            add_one((1,), (32,), (buf, zero))
        stream.synchronize()
        n = args.launches
        t0 = time.perf_counter()
        for _ in range(n):
            add_one((1,), (32,), (buf, zero))
        stream.synchronize()
        rate = n / (time.perf_counter() - t0)
        results["async"].cupy = rate
        results["async_call"].cupy = rate
        rounds = args.sync_launches
        t0 = time.perf_counter()
        for _ in range(rounds):
            add_one((1,), (32,), (buf, zero))
            stream.synchronize()
        results["sync"].cupy = rounds / (time.perf_counter() - t0)

    count = 4 * MiB // 4
    a = np.random.rand(count).astype(np.float32)
    b = np.random.rand(count).astype(np.float32)

    def in_out() -> None:
        da, db = cp.asarray(a), cp.asarray(b)
        dd = cp.empty_like(da)
        multiply((count // 256,), (256,), (dd, da, db))
        cp.asnumpy(dd)

    in_out()
    results["inout"].cupy = 1.0 / _median_time(in_out, args.repeats)

    size = args.transfer_mib * MiB
    host = np.random.randint(0, 255, size, dtype=np.uint8)
    holder: list = []

    def upload() -> None:
        holder[:] = [cp.asarray(host)]
        cp.cuda.Device().synchronize()

    def download() -> None:
        cp.asnumpy(holder[0])

    upload()
    results["to_gpu"].cupy = size / _median_time(upload, args.transfer_repeats) / 1e9
    results["get"].cupy = size / _median_time(download, args.transfer_repeats) / 1e9
    holder.clear()
    return None


# -- report -----------------------------------------------------------------------------------

def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def print_table(results: Dict[str, Result], cupy_note: Optional[str]) -> None:
    rows = [("metric", "unit", "gpurpc", "CuPy local", "gpurpc/CuPy")]
    for r in results.values():
        ratio = "-"
        if r.gpurpc is not None and r.cupy:
            ratio = f"{r.gpurpc / r.cupy:.3f}"
        rows.append((r.name, r.unit, _fmt(r.gpurpc), _fmt(r.cupy), ratio))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    line = "-+-".join("-" * w for w in widths)
    for k, row in enumerate(rows):
        print(" | ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(row, widths))))
        if k == 0:
            print(line)
    for r in results.values():
        if r.note:
            print(f"  {r.name}: {r.note}")
    if cupy_note:
        print(f"note: {cupy_note}")
    rate = results["async"].gpurpc
    if rate is not None:
        verdict = "meets" if rate >= LAUNCH_TARGET_PER_S else "MISSES"
        print(f"target: >= {LAUNCH_TARGET_PER_S:,} async launches/s from Python: {verdict} "
              f"({rate:,.0f}/s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="daemon address (default $GPURPC_ADDRESS)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--launches", type=int, default=200_000)
    parser.add_argument("--sync-launches", type=int, default=2_000)
    parser.add_argument("--repeats", type=int, default=20, help="In/Out calls timed")
    parser.add_argument("--transfer-mib", type=int, default=256)
    parser.add_argument("--transfer-repeats", type=int, default=3)
    parser.add_argument("--no-cupy", action="store_true", help="skip the CuPy baseline")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.launches, args.sync_launches, args.repeats = 20_000, 200, 5
        args.transfer_mib, args.transfer_repeats = 16, 2

    results = {
        "async": Result("async launches (prepared_async_call)", "launch/s"),
        "async_call": Result("async launches (func(..., stream=))", "launch/s",
                             "CuPy column: its RawKernel call, the same as the row above"),
        "sync": Result("launch + synchronize", "round trip/s"),
        "inout": Result("In/Out call, 2 x 4 MiB in, 4 MiB out", "call/s"),
        "to_gpu": Result(f"to_gpu {args.transfer_mib} MiB", "GB/s",
                         "CuPy column: cp.asarray from pageable memory"),
        "get": Result(f"get {args.transfer_mib} MiB", "GB/s",
                      "CuPy column: cp.asnumpy into pageable memory"),
    }

    cuda.init(address=args.address)
    dev = cuda.Device(args.device)
    ctx = dev.make_context()
    import google.protobuf
    import grpc
    print(f"gpurpc daemon {resolve(args.address)}: backend {dev.backend}, device "
          f"{dev.name()!r}")
    print(f"client: Python {platform.python_version()}, grpcio {grpc.__version__}, protobuf "
          f"{google.protobuf.__version__}, numpy {np.__version__}, host {platform.node()}")
    try:
        bench_gpurpc(results, args)
    finally:
        cuda.Context.pop()
        ctx.detach()
    cupy_note = "skipped (--no-cupy)" if args.no_cupy else bench_cupy(results, args)
    print()
    print_table(results, cupy_note)
    return 0


def resolve(address: Optional[str]) -> str:
    from gpurpc._core import resolve_address
    return resolve_address(address)


if __name__ == "__main__":
    sys.exit(main())
