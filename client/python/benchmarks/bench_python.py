#!/usr/bin/env python3
"""gpurpc (remote, through gpurpcd) beside CuPy (local) on the same machine, in one run.

Measures, for both where they apply:

* asynchronous launches per second of a trivial kernel (prepared_async_call in a loop, then
  one synchronize; CuPy: RawKernel calls in a loop, then one synchronize);
* the same through ``Function.__call__`` (PyCUDA's everyday launch syntax);
* launch + synchronize round trips per second;
* one ``In``/``Out`` call on 4 MiB arrays (upload two, launch, download one; CuPy: asarray,
  launch, asnumpy), from ordinary numpy arrays and from ``pagelocked_empty`` arrays;
* ``memcpy_htod``/``memcpy_dtoh`` of 1 GiB from and to a ``pagelocked_empty`` array (CuPy:
  ``cudaMemcpy`` with ``cupyx.empty_pinned`` memory) and from and to an ordinary numpy array
  (CuPy: ``cudaMemcpy`` with the same pageable array);
* ``float(gpuarray.sum(a))`` (a synchronising call) and ``a * 2 + 1`` (asynchronous: many,
  then one synchronize) on 1M floats (CuPy: the same expressions; with CuPy, the three
  columns of ``a * 2 + 1`` come from rounds that alternate them, at the end);
* in the gRPC-only column, the numpy-array ``memcpy_htod``/``memcpy_dtoh`` again on one
  connection (``transfer_connections = 1``) beside the default's parts on 4 (its note prints
  the ratio);
* ``gpuarray.to_gpu``, ``GPUArray.set`` and ``.get()`` of 256 MiB (CuPy: ``cp.asarray``,
  ``ndarray.set``, ``cp.asnumpy``).

The transfer and round-trip rows run twice: in a context as it comes (on a Unix-socket
daemon: same-host regions, pagelocked arrays backed by them and other arrays staged through
one, and commands on the framed channel straight to the worker) and in a context with
``host_regions="off"`` (every byte and every batch through gRPC and the front end). The table
prints both, their ratio, and the ratio gpurpc/CuPy (higher is better for gpurpc). The target
is >= 50,000 asynchronous launches per second from Python.

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
GRAPH_KERNELS = 100  # kernels of the graph rows
GPUARRAY_ELEMENTS = 1 << 20  # floats of the gpuarray rows
MiB = 1 << 20


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _expressions_per_s(expr: Callable[[], object], sync: Callable[[], None], n: int,
                       samples: int = 3) -> float:
    """Throughput of an asynchronous expression: n of them, then one synchronize; the median
    of ``samples`` such runs (one run of a few milliseconds varies by half between runs)."""
    for _ in range(10):
        expr()
    sync()
    rates = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(n):
            expr()
        sync()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


class Result:
    def __init__(self, name: str, unit: str, note: str = "") -> None:
        self.name = name
        self.unit = unit
        self.note = note
        self.gpurpc: Optional[float] = None
        self.grpc: Optional[float] = None  # the same with host_regions="off"
        self.cupy: Optional[float] = None


# -- gpurpc -----------------------------------------------------------------------------------

def bench_gpurpc(results: Dict[str, Result], args: argparse.Namespace) -> None:
    mod = SourceModule(KERNELS)
    add_one = mod.get_function("add_one_f32")
    prepared = mod.get_function("add_one_f32").prepare("PQ")
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

    bench_round_trips(results, args, "gpurpc")
    rounds = args.sync_launches

    # 100 kernels + synchronize: one CUDA graph launch against 100 launches
    graph_rounds = max(rounds // 10, 20)
    stream.begin_capture()
    for _ in range(GRAPH_KERNELS):
        prepared.prepared_async_call((1, 1), (32, 1, 1), stream, buf, 0)
    graph = stream.end_capture().instantiate()
    graph.launch(stream)
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(graph_rounds):
        graph.launch(stream)
        stream.synchronize()
    results["graph"].gpurpc = graph_rounds / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(graph_rounds):
        for _ in range(GRAPH_KERNELS):
            prepared.prepared_async_call((1, 1), (32, 1, 1), stream, buf, 0)
        stream.synchronize()
    results["graph_separate"].gpurpc = graph_rounds / (time.perf_counter() - t0)


def bench_round_trips(results: Dict[str, Result], args: argparse.Namespace, column: str) -> None:
    """The rows a round trip bounds, into ``column``: launch + synchronize, and gpuarray's
    synchronising reduction and elementwise expression of 1M floats (generated kernels: on the
    fake backend, which runs only its built-in kernels, they are refused and the rows say
    so)."""
    prepared = SourceModule(KERNELS).get_function("add_one_f32").prepare("PQ")
    buf = cuda.mem_alloc(4096)
    stream = cuda.Stream()
    rounds = args.sync_launches
    for _ in range(50):
        prepared.prepared_async_call((1, 1), (32, 1, 1), stream, buf, 0)
        stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        prepared.prepared_async_call((1, 1), (32, 1, 1), stream, buf, 0)
        stream.synchronize()
    setattr(results["sync"], column, rounds / (time.perf_counter() - t0))

    a = gpuarray.to_gpu(np.ones(GPUARRAY_ELEMENTS, np.float32))
    try:
        float(gpuarray.sum(a))
        setattr(results["gpuarray_sum"], column, 1.0 / _median_time(
            lambda: float(gpuarray.sum(a)), args.repeats * 10))
        setattr(results["gpuarray_expr"], column, _expressions_per_s(
            lambda: a * 2 + 1, cuda.Context.synchronize, args.repeats * 400))
    except cuda.LogicError as e:
        for key in ("gpuarray_sum", "gpuarray_expr"):
            results[key].note = f"not run: {str(e)[:80]}..."


def bench_transfers(results: Dict[str, Result], args: argparse.Namespace, column: str) -> None:
    """The transfer rows in the current context, into ``column`` ("gpurpc" or "grpc")."""
    multiply = SourceModule(KERNELS).get_function("multiply_them")

    def put(key: str, value: float) -> None:
        setattr(results[key], column, value)

    # In/Out on 4 MiB arrays, ordinary and page-locked
    count = 4 * MiB // 4
    for key, alloc in (("inout", np.empty), ("inout_pl", cuda.pagelocked_empty)):
        a = alloc(count, np.float32)
        b = alloc(count, np.float32)
        dest = alloc(count, np.float32)
        a[:] = np.random.rand(count)
        b[:] = np.random.rand(count)

        def in_out(a: np.ndarray = a, b: np.ndarray = b, dest: np.ndarray = dest) -> None:
            multiply(cuda.Out(dest), cuda.In(a), cuda.In(b), block=(256, 1, 1),
                     grid=(count // 256, 1))

        in_out()
        if not np.array_equal(dest, a * b):
            raise SystemExit(f"gpurpc In/Out result is wrong ({column}, {key})")
        put(key, 1.0 / _median_time(in_out, args.repeats))
        del a, b, dest

    # memcpy_htod / memcpy_dtoh of --big-mib, page-locked and ordinary
    size = args.big_mib * MiB
    device = cuda.mem_alloc(size)
    for suffix, alloc in (("_pl", cuda.pagelocked_empty), ("", np.empty)):
        src = alloc(size, np.uint8)
        src[:] = np.random.randint(0, 255, size, dtype=np.uint8)
        dest = alloc(size, np.uint8)
        cuda.memcpy_htod(device, src)
        cuda.memcpy_dtoh(dest, device)
        if not np.array_equal(dest, src):
            raise SystemExit(f"gpurpc memcpy round trip is wrong ({column}, {suffix})")
        put("htod" + suffix, size / _median_time(lambda s=src: cuda.memcpy_htod(device, s),
                                                 args.transfer_repeats) / 1e9)
        put("dtoh" + suffix, size / _median_time(lambda d=dest: cuda.memcpy_dtoh(d, device),
                                                 args.transfer_repeats) / 1e9)
        if column == "grpc" and not suffix:
            # The same on one connection: a transfer's parts on several connections add up
            # (GPURPC_TRANSFER_CONNECTIONS, default 4) where one carries a message at a time.
            client = cuda.Context.get_current()._core.client
            connections = client.transfer_connections
            client.transfer_connections = 1
            try:
                put("htod_one", size / _median_time(lambda s=src: cuda.memcpy_htod(device, s),
                                                    args.transfer_repeats) / 1e9)
                put("dtoh_one", size / _median_time(lambda d=dest: cuda.memcpy_dtoh(d, device),
                                                    args.transfer_repeats) / 1e9)
            finally:
                client.transfer_connections = connections
            up = _ratio(results["htod"].grpc, results["htod_one"].grpc)
            down = _ratio(results["dtoh"].grpc, results["dtoh_one"].grpc)
            results["dtoh_one"].note = (f"gRPC only, {connections} connections against one: "
                                        f"{up}x (htod), {down}x (dtoh)")
        del src, dest
    device.free()

    # to_gpu / set / get of --transfer-mib
    size = args.transfer_mib * MiB
    host = np.random.randint(0, 255, size, dtype=np.uint8)
    holder: List[gpuarray.GPUArray] = []

    def upload() -> None:
        holder[:] = [gpuarray.to_gpu(host)]

    def download() -> None:
        holder[0].get()

    upload()
    if not np.array_equal(holder[0].get(), host):
        raise SystemExit(f"gpurpc to_gpu/get round trip is wrong ({column})")
    put("to_gpu", size / _median_time(upload, args.transfer_repeats) / 1e9)
    put("set", size / _median_time(lambda: holder[0].set(host), args.transfer_repeats) / 1e9)
    put("get", size / _median_time(download, args.transfer_repeats) / 1e9)
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
        try:  # CUDA graphs (CuPy 11 and newer)
            graph_rounds = max(rounds // 10, 20)
            stream.begin_capture()
            for _ in range(GRAPH_KERNELS):
                add_one((1,), (32,), (buf, zero))
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(graph_rounds):
                graph.launch(stream)
                stream.synchronize()
            results["graph"].cupy = graph_rounds / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(graph_rounds):
                for _ in range(GRAPH_KERNELS):
                    add_one((1,), (32,), (buf, zero))
                stream.synchronize()
            results["graph_separate"].cupy = graph_rounds / (time.perf_counter() - t0)
        except (AttributeError, cp.cuda.runtime.CUDARuntimeError):
            pass  # no stream capture in this CuPy

    ga = cp.ones(GPUARRAY_ELEMENTS, cp.float32)
    float(cp.sum(ga))
    results["gpuarray_sum"].cupy = 1.0 / _median_time(lambda: float(cp.sum(ga)),
                                                       args.repeats * 10)
    # a * 2 + 1: bench_expr_alternating, beside gpurpc's

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
    results["inout_pl"].cupy = results["inout"].cupy

    # cudaMemcpy of --big-mib, pinned (cupyx.empty_pinned) and pageable
    import cupyx  # type: ignore[import-not-found]

    runtime = cp.cuda.runtime
    size = args.big_mib * MiB
    device = cp.empty(size, cp.uint8)
    for suffix, host in (("_pl", cupyx.empty_pinned(size, np.uint8)),
                         ("", np.empty(size, np.uint8))):
        host[:] = 7
        ptr = host.ctypes.data
        results["htod" + suffix].cupy = size / _median_time(
            lambda d=device, p=ptr: runtime.memcpy(d.data.ptr, p, size, runtime.memcpyHostToDevice),
            args.transfer_repeats) / 1e9
        results["dtoh" + suffix].cupy = size / _median_time(
            lambda d=device, p=ptr: runtime.memcpy(p, d.data.ptr, size, runtime.memcpyDeviceToHost),
            args.transfer_repeats) / 1e9
        del host
    del device

    size = args.transfer_mib * MiB
    host = np.random.randint(0, 255, size, dtype=np.uint8)
    holder: list = []

    def upload() -> None:
        holder[:] = [cp.asarray(host)]
        cp.cuda.Device().synchronize()

    def set_() -> None:
        holder[0].set(host)
        cp.cuda.Device().synchronize()

    def download() -> None:
        cp.asnumpy(holder[0])

    upload()
    results["to_gpu"].cupy = size / _median_time(upload, args.transfer_repeats) / 1e9
    results["set"].cupy = size / _median_time(set_, args.transfer_repeats) / 1e9
    results["get"].cupy = size / _median_time(download, args.transfer_repeats) / 1e9
    holder.clear()
    return None


# -- gpurpc and CuPy in turn ------------------------------------------------------------------

EXPR_ROUNDS = 9  # rounds of bench_expr_alternating, each side


def bench_expr_alternating(results: Dict[str, Result], args: argparse.Namespace,
                           dev: "cuda.Device") -> None:
    """``a * 2 + 1`` again, in rounds that alternate gpurpc in a context as it comes, gpurpc in
    a context with ``host_regions="off"`` (the gRPC-only column) and CuPy; the medians replace
    the three columns of the row. The sides measured minutes apart differed by up to 2x
    between runs (CuPy's own rate fell by a quarter from its first rounds to its later ones
    in one process), so the ratios are taken from rounds run side by side, the order rotated
    so that each side goes first in every third round."""
    import cupy as cp  # type: ignore[import-not-found]
    n = args.repeats * 400
    contexts, arrays = [], []
    try:
        sides = []
        for regions in (None, "off"):
            ctx = dev.make_context()
            contexts.append(ctx)
            if regions is not None:
                ctx.host_regions = regions
            a = gpuarray.to_gpu(np.ones(GPUARRAY_ELEMENTS, np.float32))
            arrays.append(a)
            cuda.Context.pop()
            sides.append((ctx, lambda a=a: a * 2 + 1, cuda.Context.synchronize, []))
        ga = cp.ones(GPUARRAY_ELEMENTS, cp.float32)
        sides.append((None, lambda: ga * 2 + 1, cp.cuda.Device().synchronize, []))

        def run(ctx, expr, sync, count: int) -> float:
            if ctx is not None:
                ctx.push()
            try:
                t0 = time.perf_counter()
                for _ in range(count):
                    expr()
                sync()
                return count / (time.perf_counter() - t0)
            finally:
                if ctx is not None:
                    cuda.Context.pop()

        for ctx, expr, sync, _ in sides:
            run(ctx, expr, sync, n)
        for round_ in range(EXPR_ROUNDS):
            k = round_ % len(sides)
            for ctx, expr, sync, rates in sides[k:] + sides[:k]:
                rates.append(run(ctx, expr, sync, n))
        row = results["gpuarray_expr"]
        row.gpurpc, row.grpc, row.cupy = (statistics.median(rates) for *_, rates in sides)
        ratios = sorted(g / c for g, c in zip(sides[0][3], sides[2][3]))
        row.note = (f"target: >= 0.8x CuPy; all three columns the medians of {EXPR_ROUNDS} "
                    f"rounds of {n} alternating the three, per-round ratios to CuPy "
                    f"{ratios[0]:.2f}-{ratios[-1]:.2f}")
    finally:
        for ctx, a in zip(contexts, arrays):
            ctx.push()
            a.gpudata.free()
            cuda.Context.pop()
        for ctx in contexts:
            ctx.detach()


# -- report -----------------------------------------------------------------------------------

def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.3f}" if a is not None and b else "-"


def print_table(results: Dict[str, Result], cupy_note: Optional[str]) -> None:
    rows = [("metric", "unit", "gpurpc", "gRPC only", "CuPy local", "gpurpc/gRPC",
             "gpurpc/CuPy")]
    for r in results.values():
        rows.append((r.name, r.unit, _fmt(r.gpurpc), _fmt(r.grpc), _fmt(r.cupy),
                     _ratio(r.gpurpc, r.grpc), _ratio(r.gpurpc, r.cupy)))
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
    parser.add_argument("--big-mib", type=int, default=1024,
                        help="size of the memcpy_htod/dtoh rows")
    parser.add_argument("--transfer-repeats", type=int, default=3)
    parser.add_argument("--no-cupy", action="store_true", help="skip the CuPy baseline")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--cpp-bench", metavar="PATH",
                        help="gpurpc_bench_compute: run it against the same daemon and compare "
                             "launch + synchronize with the C++ client's")
    args = parser.parse_args()
    if args.quick:
        args.launches, args.sync_launches, args.repeats = 20_000, 200, 5
        args.transfer_mib, args.transfer_repeats, args.big_mib = 16, 2, 64

    results = {
        "async": Result("async launches (prepared_async_call)", "launch/s"),
        "async_call": Result("async launches (func(..., stream=))", "launch/s",
                             "CuPy column: its RawKernel call, the same as the row above"),
        "sync": Result("launch + synchronize", "round trip/s"),
        "graph": Result(f"{GRAPH_KERNELS} kernels + synchronize, one graph launch",
                        "round trip/s", "CuPy column: cupy.cuda.Graph.launch of the same"),
        "graph_separate": Result(f"{GRAPH_KERNELS} kernels + synchronize, {GRAPH_KERNELS} "
                                 "launches", "round trip/s"),
        "gpuarray_sum": Result("gpuarray float(sum(a)), 1M floats", "call/s",
                               "target: one round trip, >= 5,000/s"),
        "gpuarray_expr": Result("gpuarray a * 2 + 1, 1M floats (n of them, one sync)", "expr/s",
                                "target: >= 0.8x CuPy"),
        "inout": Result("In/Out call, 2 x 4 MiB in, 4 MiB out", "call/s"),
        "inout_pl": Result("In/Out call, the same, pagelocked arrays", "call/s",
                           "CuPy column: the same as the row above"),
        "htod_pl": Result(f"memcpy_htod {args.big_mib} MiB, pagelocked", "GB/s",
                          "CuPy column: cudaMemcpy from cupyx.empty_pinned memory"),
        "dtoh_pl": Result(f"memcpy_dtoh {args.big_mib} MiB, pagelocked", "GB/s"),
        "htod": Result(f"memcpy_htod {args.big_mib} MiB, numpy array", "GB/s",
                       "CuPy column: cudaMemcpy from the same pageable numpy array"),
        "dtoh": Result(f"memcpy_dtoh {args.big_mib} MiB, numpy array", "GB/s"),
        "htod_one": Result(f"memcpy_htod {args.big_mib} MiB, numpy array, 1 connection",
                           "GB/s"),
        "dtoh_one": Result(f"memcpy_dtoh {args.big_mib} MiB, numpy array, 1 connection",
                           "GB/s"),
        "to_gpu": Result(f"to_gpu {args.transfer_mib} MiB", "GB/s",
                         "CuPy column: cp.asarray from pageable memory"),
        "set": Result(f"GPUArray.set {args.transfer_mib} MiB", "GB/s",
                      "CuPy column: cupy.ndarray.set from pageable memory"),
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
        bench_transfers(results, args, "gpurpc")
        regions = _regions_note(ctx)
        channel = _channel_note(ctx)
    finally:
        cuda.Context.pop()
        ctx.detach()
    ctx = dev.make_context()
    try:
        ctx.host_regions = "off"
        bench_round_trips(results, args, "grpc")
        bench_transfers(results, args, "grpc")
        grpc_channel = _channel_note(ctx)
    finally:
        cuda.Context.pop()
        ctx.detach()
    print(f"gpurpc column: {regions}; commands {channel}")
    print(f"gRPC-only column: host_regions='off'; commands {grpc_channel}")
    cpp = run_cpp_bench(args.cpp_bench, resolve(args.address)) if args.cpp_bench else None
    cupy_note = "skipped (--no-cupy)" if args.no_cupy else bench_cupy(results, args)
    if cupy_note is None and results["gpuarray_expr"].gpurpc is not None:
        bench_expr_alternating(results, args, dev)
    print()
    print_table(results, cupy_note)
    if cpp is not None and results["sync"].gpurpc:
        print_against_cpp(results["sync"].gpurpc, results["sync"].grpc, cpp)
    return 0


def run_cpp_bench(path: str, address: str) -> Optional[Dict[str, float]]:
    """Runs the C++ compute benchmark against ``address``; its round trips in microseconds
    (from its ``machine:`` line), or None with a note when it did not run."""
    import subprocess
    try:
        out = subprocess.run([path, f"--address={address}"], capture_output=True, text=True,
                             timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"note: {path} did not run ({e}); the comparison with C++ is skipped")
        return None
    for line in out.stdout.splitlines():
        if line.startswith("machine:"):
            return {k: float(v) for k, v in (item.split("=") for item in line.split()[1:])}
    print(f"note: {path} printed no results (exit {out.returncode}): "
          f"{(out.stderr or out.stdout).strip()[-500:]}")
    return None


def print_against_cpp(python_round_trips_per_s: float, grpc_round_trips_per_s: Optional[float],
                      cpp: Dict[str, float]) -> None:
    python_us = 1e6 / python_round_trips_per_s
    cpp_us = cpp["stream_round_trip_us"]
    print()
    print("launch + synchronize, Python against the C++ client on the same daemon")
    print(f"  Python {python_us:.1f} us, C++ command stream through the relay {cpp_us:.1f} us "
          f"(bare ping {cpp['ping_us']:.1f} us): {python_us / cpp_us:.2f}x the C++ round trip "
          "(target <= 1.5x)")
    if grpc_round_trips_per_s:
        grpc_us = 1e6 / grpc_round_trips_per_s
        print(f"  Python on the gRPC command stream (host_regions='off') {grpc_us:.1f} us: "
              f"{grpc_us / cpp_us:.2f}x the C++ round trip")
    direct_us = cpp.get("direct_channel_round_trip_us", 0.0)
    if direct_us > 0:
        print(f"  C++ on its direct channel {direct_us:.1f} us: Python is "
              f"{python_us / direct_us:.2f}x that")


def _channel_note(ctx: "cuda.Context") -> str:
    from gpurpc import _framed
    if isinstance(ctx._core.commands._call, _framed.FramedCall):
        return "on the framed channel straight to the worker"
    return "on the gRPC command stream through the front end"


def _regions_note(ctx: "cuda.Context") -> str:
    from gpurpc import _regions
    probe = cuda.pagelocked_empty(1, np.uint8)
    if _regions.region_of(ctx._core, probe) is not None:
        return (f"same-host regions (host_regions={ctx.host_regions!r}; staging from "
                f"{_regions.STAGING_MIN_BYTES >> 10} KiB)")
    why = _regions.off_reason(ctx._core) or f"host_regions={ctx.host_regions!r}"
    return f"no same-host regions ({why})"


def resolve(address: Optional[str]) -> str:
    from gpurpc._core import resolve_address
    return resolve_address(address)


if __name__ == "__main__":
    sys.exit(main())
