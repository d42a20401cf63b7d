"""Same-host regions (HostRegionService, RegionCopyCommand) through gpurpc.driver and
gpurpc.gpuarray, and hostile use of the contract through the raw stubs and the region socket.

The session daemon of conftest.py is reached over a Unix socket, so its contexts use regions
("auto"). Against a daemon given by $GPURPC_ADDRESS over TCP these tests skip. Tests that need
their own daemon configuration (no region socket, quotas) start one, like test_quotas.py.
"""
from __future__ import annotations

import fcntl
import gc
import mmap
import os
import pwd
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

import grpc
import numpy as np
import pytest

import gpurpc.driver as cuda
import gpurpc.gpuarray as gpuarray
from gpurpc import _core, _devices, _regions, debug
from gpurpc.compiler import SourceModule
from gpurpc.v1 import common_pb2, execution_service_pb2 as ex, host_region_service_pb2 as hr

from conftest import REPO_ROOT, _wait_ready
from kernels import FAKE_KERNELS

KiB = 1 << 10
MiB = 1 << 20
USER = pwd.getpwuid(os.getuid()).pw_name
rng = np.random.default_rng(2024)
STAGING = 2 * _regions.STAGING_HALF_BYTES
REGION_RPCS = ("HostRegionService.RegisterHostRegion", _regions.ATTACH_COUNTER)
GRPC_TRANSFERS = ("MemoryService.UploadStream", "MemoryService.DownloadStream")


def random_bytes(n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


@pytest.fixture(autouse=True)
def _no_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests choose the mode themselves (GPURPC_HOST_REGIONS=off must not skew them)."""
    monkeypatch.delenv("GPURPC_HOST_REGIONS", raising=False)


@pytest.fixture
def rctx(ctx: cuda.Context) -> cuda.Context:
    """The test's context, in auto mode, which must use regions (skips over TCP)."""
    if not _core._is_unix(ctx._core.client.target):
        pytest.skip(f"regions need a Unix-socket daemon; {ctx._core.client.target} is not one")
    ctx.host_regions = "auto"
    return ctx


@pytest.fixture
def mod(rctx: cuda.Context) -> SourceModule:
    return SourceModule(FAKE_KERNELS)


@pytest.fixture
def kinds(rctx: cuda.Context, monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """The kinds of the commands the context queues from now on ("upload", "region_copy"
    ...; launches are not listed)."""
    seen: List[str] = []
    original = rctx._core.commands.add

    def add(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.extend(k for k in kwargs if k in ex.Command.DESCRIPTOR.fields_by_name)
        return original(*args, **kwargs)

    monkeypatch.setattr(rctx._core.commands, "add", add)
    return seen


def region_of(ctx: cuda.Context, array: np.ndarray) -> Optional[Tuple[int, int]]:
    return _regions.region_of(ctx._core, array)


def grpc_transfer_counts() -> dict:
    counts = debug.rpc_counts()
    return {k: counts[k] for k in GRPC_TRANSFERS if k in counts}


# -- region-backed pagelocked arrays ----------------------------------------------------------

@pytest.mark.parametrize("nbytes", [1, 7, 4095, 4096, 4097, MiB + 3, STAGING + 5])
def test_pagelocked_arrays_are_region_backed_and_round_trip(rctx: cuda.Context,
                                                           kinds: List[str],
                                                           nbytes: int) -> None:
    src = cuda.pagelocked_empty(nbytes, np.uint8)
    dest = cuda.pagelocked_zeros(nbytes, np.uint8)
    assert region_of(rctx, src) is not None and region_of(rctx, dest) is not None
    assert region_of(rctx, src)[0] != region_of(rctx, dest)[0]
    assert not dest.any()  # zeroed
    src[:] = random_bytes(nbytes)
    buf = cuda.mem_alloc(nbytes)
    cuda.memcpy_htod(buf, src)  # warm
    debug.reset_rpc_counts()
    cuda.memcpy_htod(buf, src)
    cuda.memcpy_dtoh(dest, buf)
    # Each synchronous copy is its copy plus a sync in one batch: one round trip.
    assert debug.rpc_counts() == {debug.BATCH: 2}
    assert np.array_equal(dest, src)
    assert set(kinds) == {"region_copy", "sync"}, kinds


def test_pagelocked_shapes_dtypes_orders_and_likes(rctx: cuda.Context) -> None:
    f = cuda.pagelocked_empty((3, 5), np.float64, order="F")
    assert f.shape == (3, 5) and f.dtype == np.float64 and f.flags.f_contiguous
    assert f.ctypes.data % mmap.PAGESIZE == 0
    z = cuda.pagelocked_zeros((2, 3, 4), np.int16)
    assert z.flags.c_contiguous and not z.any()
    like = cuda.pagelocked_empty_like(f)
    assert like.shape == f.shape and like.dtype == f.dtype and like.flags.f_contiguous
    zl = cuda.pagelocked_zeros_like(z)
    assert zl.shape == z.shape and not zl.any()
    aligned = cuda.aligned_zeros(100, np.complex64)
    for array in (f, z, like, zl, aligned):
        assert region_of(rctx, array) is not None
    f[:] = rng.standard_normal((3, 5))
    buf = cuda.mem_alloc(f.nbytes)
    cuda.memcpy_htod(buf, f)
    cuda.memcpy_dtoh(like, buf)
    assert np.array_equal(like, f)
    # Empty and object arrays are ordinary ones.
    assert region_of(rctx, cuda.pagelocked_empty(0, np.float32)) is None
    assert cuda.pagelocked_empty((2, 0), np.float32).shape == (2, 0)
    assert cuda.pagelocked_empty(3, object).dtype == object
    with pytest.raises(ValueError):
        cuda.pagelocked_empty(-1, np.float32)


def test_views_of_a_region_use_it_and_strided_views_use_grpc(rctx: cuda.Context) -> None:
    host = cuda.pagelocked_empty(4096, np.float32)
    host[:] = np.arange(4096, dtype=np.float32)
    region_id, offset = region_of(rctx, host[100:200])
    assert (region_id, offset) == (region_of(rctx, host)[0], 400)
    buf = cuda.mem_alloc(4096 * 4)
    cuda.memset_d32(buf, 0, 4096)
    cuda.memcpy_htod(int(buf) + 12, host[100:200])  # an odd device offset, a view
    back = np.empty(103, np.float32)
    cuda.memcpy_dtoh(back, buf)
    assert back[:3].tolist() == [0, 0, 0] and np.array_equal(back[3:], host[100:200])
    strided = host[::2]
    assert region_of(rctx, strided) is None
    cuda.memcpy_htod(buf, strided)
    back = np.empty(2048, np.float32)
    cuda.memcpy_dtoh(back, buf)
    assert np.array_equal(back, host[::2])
    # A destination view inside the region.
    dest = cuda.pagelocked_zeros(4096, np.float32)
    cuda.memcpy_dtoh(dest[1000:3048], buf)
    assert np.array_equal(dest[1000:3048], host[::2]) and not dest[:1000].any()


def _unregistered(ctx: cuda.Context, region_id: int) -> bool:
    try:
        ctx._core.call("HostRegionService.UnregisterHostRegion",
                       hr.UnregisterHostRegionRequest(region_id=region_id))
    except cuda.Error as e:
        assert e.code == grpc.StatusCode.NOT_FOUND, e
        return True
    return False


def test_the_last_view_keeps_the_region_and_garbage_collection_unregisters_it(
        rctx: cuda.Context) -> None:
    host = cuda.pagelocked_zeros(8192, np.uint8)
    region_id = region_of(rctx, host)[0]
    view = host[4096:]
    del host
    gc.collect()
    buf = cuda.mem_alloc(4096)
    cuda.memset_d8(buf, 7, 4096)
    cuda.memcpy_dtoh(view, buf)  # the region is still there, through the view
    assert region_of(rctx, view) == (region_id, 4096) and (view == 7).all()
    debug.reset_rpc_counts()
    del view
    gc.collect()
    rctx.synchronize()  # deferred releases happen at synchronising calls
    assert debug.rpc_counts().get("HostRegionService.UnregisterHostRegion") == 1
    assert _unregistered(rctx, region_id)


def test_detach_leaves_the_arrays_as_ordinary_memory(daemon: str) -> None:
    ctx = cuda.Device(0).make_context()
    try:
        ctx.host_regions = "auto"
        host = cuda.pagelocked_empty(10000, np.int32)
        host[:] = np.arange(10000)
        if not _core._is_unix(ctx._core.client.target):
            pytest.skip("regions need a Unix-socket daemon")
        assert region_of(ctx, host) is not None
    finally:
        cuda.Context.pop()
        ctx.detach()
    assert region_of(ctx, host) is None
    host += 1
    assert host[-1] == 10000
    # Another context copies it as ordinary memory.
    other = cuda.Device(0).make_context()
    try:
        buf = cuda.to_device(host)
        assert np.array_equal(cuda.from_device_like(buf, host), host)
    finally:
        cuda.Context.pop()
        other.detach()
    del host
    gc.collect()  # the finalizer finds the context closed: nothing to do, nothing raised


# -- asynchronous copies and streams ----------------------------------------------------------

def test_async_copies_with_streams_and_events(rctx: cuda.Context) -> None:
    n = 3 * MiB + 11
    src = cuda.pagelocked_empty(n, np.uint8)
    src[:] = random_bytes(n)
    dest = cuda.pagelocked_zeros(n, np.uint8)
    s1, s2 = cuda.Stream(), cuda.Stream()
    buf = cuda.mem_alloc(n)
    copy = cuda.mem_alloc(n)
    done = cuda.Event()
    cuda.memcpy_htod_async(buf, src, s1)
    cuda.memcpy_dtod_async(copy, buf, n, s1)
    done.record(s1)
    s2.wait_for_event(done)
    cuda.memcpy_dtoh_async(dest, copy, s2)
    s2.synchronize()
    assert np.array_equal(dest, src)
    # Plain arrays of staging size: bytes taken at once (src reusable), dest filled at sync.
    plain = random_bytes(n)
    expected = plain.copy()
    out = np.zeros(n, np.uint8)
    cuda.memcpy_htod_async(buf, plain, s1)
    plain[:] = 0  # allowed: an upload from ordinary memory takes the bytes at once
    cuda.memcpy_dtoh_async(out, buf, s1)
    s1.synchronize()
    assert np.array_equal(out, expected)
    assert _regions.staging_region_id(rctx._core) is not None


def test_async_download_fills_at_context_synchronize(rctx: cuda.Context) -> None:
    n = 5 * MiB
    data = random_bytes(n)
    buf = cuda.to_device(data)
    region_dest = cuda.pagelocked_zeros(n, np.uint8)
    plain_dest = np.zeros(n, np.uint8)
    stream = cuda.Stream()
    cuda.memcpy_dtoh_async(region_dest, buf, stream)
    cuda.memcpy_dtoh_async(plain_dest, buf, stream)
    cuda.Context.synchronize()
    assert np.array_equal(region_dest, data) and np.array_equal(plain_dest, data)


def test_many_async_staged_uploads_reuse_the_halves_in_order(rctx: cuda.Context) -> None:
    """More staged chunks than halves, on two streams: every chunk must land intact."""
    chunk = _regions.STAGING_HALF_BYTES // 4 + 5
    streams = [cuda.Stream(), cuda.Stream()]
    sources = [random_bytes(chunk) for _ in range(10)]
    bufs = [cuda.mem_alloc(chunk) for _ in sources]
    for i, (src, buf) in enumerate(zip(sources, bufs)):
        cuda.memcpy_htod_async(buf, src, streams[i % 2])
    cuda.Context.synchronize()
    for src, buf in zip(sources, bufs):
        back = np.empty_like(src)
        cuda.memcpy_dtoh(back, buf)
        assert np.array_equal(back, src)


# -- kernel arguments -------------------------------------------------------------------------

def test_in_out_inout_with_region_backed_and_staged_arrays(mod: SourceModule,
                                                           rctx: cuda.Context,
                                                           kinds: List[str]) -> None:
    multiply_them = mod.get_function("multiply_them")
    add_one = mod.get_function("add_one_f32")
    n = MiB  # 4 MiB per array
    a = cuda.pagelocked_empty(n, np.float32)
    a[:] = rng.standard_normal(n)
    b = rng.standard_normal(n).astype(np.float32)          # plain: staged
    dest = cuda.pagelocked_zeros(n, np.float32)
    plain_dest = np.zeros(n, np.float32)
    multiply_them(cuda.Out(dest), cuda.In(a), cuda.In(b), block=(256, 1, 1), grid=(n // 256, 1))
    assert np.array_equal(dest, a * b)
    debug.reset_rpc_counts()
    multiply_them(cuda.Out(plain_dest), cuda.In(b), cuda.In(a), block=(256, 1, 1),
                  grid=(n // 256, 1))
    assert debug.rpc_counts() == {debug.BATCH: 1}
    assert np.array_equal(plain_dest, a * b)
    assert set(kinds) == {"region_copy", "sync"}, kinds  # no bytes through gRPC
    # InOut, region-backed and plain (staged), and a small one (inline).
    expected = a + 1
    add_one(cuda.InOut(a), np.uint64(n), block=(256, 1, 1), grid=(n // 256, 1))
    assert np.array_equal(a, expected)
    expected = b + 1
    add_one(cuda.InOut(b), np.uint64(n), block=(256, 1, 1), grid=(n // 256, 1))
    assert np.array_equal(b, expected)
    assert "upload" not in kinds and "download" not in kinds
    small = np.arange(100, dtype=np.float32)
    add_one(cuda.InOut(small), np.uint64(100), block=(128, 1, 1))
    assert np.array_equal(small, np.arange(1, 101, dtype=np.float32))
    assert "upload" in kinds and "download" in kinds  # small ones inline


def test_in_out_larger_than_the_staging_region_falls_back_per_argument(
        mod: SourceModule, rctx: cuda.Context) -> None:
    multiply_them = mod.get_function("multiply_them")
    n = (STAGING // 4) // 2 + 1024  # each array a little more than half the staging region
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    dest = np.zeros(n, np.float32)
    multiply_them(cuda.Out(dest), cuda.In(a), cuda.In(b), block=(256, 1, 1), grid=(n // 256, 1))
    assert np.array_equal(dest, a * b)


# -- GPUArray ---------------------------------------------------------------------------------

def test_gpuarray_set_get_and_async_forms(rctx: cuda.Context, kinds: List[str]) -> None:
    n = 2 * MiB + 3
    host = cuda.pagelocked_empty(n, np.float32)
    host[:] = rng.standard_normal(n)
    arr = gpuarray.to_gpu(host)
    got = arr.get(pagelocked=True)
    assert region_of(rctx, got) is not None and np.array_equal(got, host)
    plain = rng.standard_normal(n).astype(np.float32)
    debug.reset_rpc_counts()
    arr.set(plain)
    assert np.array_equal(arr.get(), plain)
    assert not grpc_transfer_counts()
    stream = cuda.Stream()
    arr.set_async(host, stream=stream)
    out = cuda.pagelocked_zeros(n, np.float32)
    arr.get_async(stream=stream, ary=out)
    stream.synchronize()
    assert np.array_equal(out, host)
    f = np.asfortranarray(rng.standard_normal((300, 500)).astype(np.float32))
    farr = gpuarray.to_gpu(f)
    assert np.array_equal(farr.get(), f)
    assert "upload" not in kinds and "download" not in kinds and "region_copy" in kinds


# -- plain numpy arrays through the staging region --------------------------------------------

@pytest.mark.parametrize("nbytes", [_regions.STAGING_MIN_BYTES, MiB + 1,
                                    _regions.STAGING_HALF_BYTES,
                                    STAGING + 13, 3 * STAGING + 4097])
def test_plain_arrays_go_through_staging_exactly(rctx: cuda.Context, kinds: List[str],
                                                 nbytes: int) -> None:
    host = random_bytes(nbytes)
    buf = cuda.mem_alloc(nbytes + 3)
    debug.reset_rpc_counts()
    cuda.memcpy_htod(int(buf) + 3, host)
    back = np.zeros(nbytes, np.uint8)
    cuda.memcpy_dtoh(back, int(buf) + 3)
    assert np.array_equal(back, host)
    counts = debug.rpc_counts()
    assert not grpc_transfer_counts(), counts
    assert _regions.staging_region_id(rctx._core) is not None
    chunks = -(-nbytes // _regions.STAGING_HALF_BYTES)
    # One batch per staged chunk each way, each a copy and a sync.
    assert counts[debug.BATCH] == 2 * chunks, counts
    assert kinds == ["region_copy", "sync"] * (2 * chunks), kinds


@pytest.fixture
def fresh_copy_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next host copy makes a copy pool of its own (with the test's setting); the
    process's pool is put back afterwards."""
    for name, value in (("_pid", 0), ("_pool", None), ("_threads", 0)):
        monkeypatch.setattr(_regions._CopyPool, name, value)


@pytest.mark.parametrize("threads", ["1", "2", "3", "4"])
@pytest.mark.usefixtures("fresh_copy_pool")
def test_host_copies_split_over_threads_copy_every_byte(monkeypatch: pytest.MonkeyPatch,
                                                        threads: str) -> None:
    """The staging region's host copies (``host_copy``) split large copies over the copy
    threads; every size, even or not, comes out whole, and the pieces do run elsewhere."""
    monkeypatch.setenv("GPURPC_COPY_THREADS", threads)
    names: List[str] = []
    real_copyto = np.copyto

    def copyto(dest: np.ndarray, src: np.ndarray) -> None:
        names.append(threading.current_thread().name)
        real_copyto(dest, src)

    monkeypatch.setattr(np, "copyto", copyto)
    piece = _regions.COPY_PIECE_MIN_BYTES
    for n in (0, 1, piece - 1, 2 * piece - 1, 2 * piece, 3 * piece + 7, 4 * piece + 1,
              9 * piece + 4093):
        names.clear()
        src = random_bytes(n)
        dest = np.zeros(n + 2, np.uint8)
        _regions.host_copy(dest[1:n + 1], src)
        assert np.array_equal(dest[1:n + 1], src), n
        assert dest[0] == 0 and dest[-1] == 0, n  # nothing written outside
        expected = max(1, min(int(threads), n // piece))
        assert len(names) == expected, (n, names)
        helpers = [name for name in names if name.startswith("gpurpc-copy")]
        assert len(helpers) == expected - 1, (n, names)


@pytest.mark.parametrize("value", ["0", "65", "four", "-2", "1.5"])
@pytest.mark.usefixtures("fresh_copy_pool")
def test_copy_thread_setting_is_checked(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("GPURPC_COPY_THREADS", value)
    n = 2 * _regions.COPY_PIECE_MIN_BYTES
    with pytest.raises(cuda.LogicError, match=f"GPURPC_COPY_THREADS={value!r}: expected a whole "
                       "number from 1 to 64"):
        _regions.host_copy(np.zeros(n, np.uint8), np.ones(n, np.uint8))


def test_host_copies_without_new_threads_copy_on_the_caller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At interpreter shutdown the pool refuses new work (RuntimeError); a staged copy made
    then (an atexit handler, a late finalizer) copies everything on the calling thread."""

    class ShutDown:
        def __init__(self) -> None:
            self.submitted = 0

        def submit(self, fn: Any, *args: Any) -> Any:
            if self.submitted:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            self.submitted += 1
            return _regions.ThreadPoolExecutor(1).submit(fn, *args)

    pool = ShutDown()
    monkeypatch.setattr(_regions._CopyPool, "get", classmethod(lambda cls: (pool, 4)))
    n = 4 * _regions.COPY_PIECE_MIN_BYTES + 3
    src = random_bytes(n)
    dest = np.zeros(n, np.uint8)
    _regions.host_copy(dest, src)
    assert pool.submitted == 1
    assert np.array_equal(dest, src)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.usefixtures("fresh_copy_pool")
def test_host_copies_work_in_a_forked_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child of ``fork`` inherits the copy pool's object but none of its threads: it makes a
    pool of its own instead of waiting for threads that do not exist."""
    monkeypatch.setenv("GPURPC_COPY_THREADS", "3")
    n = 3 * _regions.COPY_PIECE_MIN_BYTES + 5
    src = random_bytes(n)
    dest = np.zeros(n, np.uint8)
    _regions.host_copy(dest, src)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only when the copy came out whole
        try:
            out = np.zeros(n, np.uint8)
            _regions.host_copy(out, src)
            os._exit(0 if np.array_equal(out, src) else 3)
        except BaseException:  # noqa: BLE001 - any failure is the exit status
            os._exit(4)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's host copy hung")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0


def test_small_plain_copies_stay_inline(rctx: cuda.Context) -> None:
    host = random_bytes(_regions.STAGING_MIN_BYTES - 1)
    buf = cuda.mem_alloc(host.nbytes)
    cuda.memcpy_htod(buf, host)
    debug.reset_rpc_counts()
    cuda.memcpy_htod(buf, host)
    assert debug.rpc_counts() == {debug.BATCH: 1}
    assert _regions.staging_region_id(rctx._core) is None


def test_copy_errors_surface_and_the_context_stays_usable(rctx: cuda.Context) -> None:
    host = cuda.pagelocked_zeros(4096, np.uint8)
    buf = cuda.mem_alloc(1024)
    with pytest.raises(cuda.LogicError) as info:
        cuda.memcpy_htod(buf, host)  # 4096 bytes into a 1024-byte buffer
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(cuda.LogicError):
        cuda.memcpy_dtoh(np.zeros(2 * MiB, np.uint8), buf)  # staged, out of the buffer
    small = np.arange(256, dtype=np.int32)
    cuda.memcpy_htod(buf, small)
    back = np.empty_like(small)
    cuda.memcpy_dtoh(back, buf)
    assert np.array_equal(back, small)


# -- choosing: auto, on, off ------------------------------------------------------------------

def test_forced_off_uses_grpc(daemon: str) -> None:
    ctx = cuda.Device(0).make_context()
    try:
        ctx.host_regions = "off"
        assert ctx.host_regions == "off"
        debug.reset_rpc_counts()
        host = cuda.pagelocked_empty(20 * MiB, np.uint8)
        assert region_of(ctx, host) is None
        host[:] = random_bytes(host.size)
        buf = cuda.mem_alloc(host.nbytes)
        cuda.memcpy_htod(buf, host)
        back = np.empty_like(host)
        cuda.memcpy_dtoh(back, buf)
        assert np.array_equal(back, host)
        counts = debug.rpc_counts()
        assert counts.get("MemoryService.UploadStream") == 1, counts
        assert not any(k.startswith("HostRegionService") for k in counts), counts
        ctx.host_regions = None  # back to the connection's
        assert ctx.host_regions == _devices._client().host_regions
    finally:
        cuda.Context.pop()
        ctx.detach()


def test_mode_settings_are_checked(daemon: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPURPC_HOST_REGIONS", " OFF ")
    assert _core.Client(daemon).host_regions == "off"
    assert _core.Client(daemon, host_regions="on").host_regions == "on"
    monkeypatch.setenv("GPURPC_HOST_REGIONS", "sometimes")
    with pytest.raises(cuda.LogicError, match="GPURPC_HOST_REGIONS.*auto, on, off"):
        _core.Client(daemon)
    monkeypatch.delenv("GPURPC_HOST_REGIONS")
    assert _core.Client(daemon).host_regions == "auto"
    with pytest.raises(cuda.LogicError, match="host_regions=.*'yes'"):
        cuda.init(address=daemon, host_regions="yes")
    ctx = cuda.Device(0).make_context()
    try:
        with pytest.raises(cuda.LogicError, match="host_regions="):
            ctx.host_regions = "maybe"
    finally:
        cuda.Context.pop()
        ctx.detach()


def test_auto_is_off_over_tcp() -> None:
    class FakeClient:
        target = "dns:///gpubox:50051"

    class FakeCore:
        host_regions = "auto"
        closed = False
        client = FakeClient()

    mgr = _regions._Manager()
    assert not _regions._usable(FakeCore(), mgr)  # type: ignore[arg-type]
    FakeCore.host_regions = "on"
    assert _regions._usable(FakeCore(), mgr)  # type: ignore[arg-type]
    FakeCore.host_regions, FakeClient.target = "auto", "unix:/run/gpurpcd.sock"
    assert _regions._usable(FakeCore(), mgr) == (_regions._UNSUPPORTED is None)  # type: ignore


# -- daemons of their own ---------------------------------------------------------------------

def _start_daemon(tmp: Path, extra: List[str], config: str = "") -> Tuple[subprocess.Popen, str]:
    binary = Path(os.environ.get("GPURPCD_BIN", REPO_ROOT / "build" / "server" / "gpurpcd"))
    if not binary.is_file():
        if os.environ.get("GPURPC_SKIP_DAEMON_TESTS") or os.environ.get("GPURPC_ADDRESS"):
            pytest.skip(f"gpurpcd binary {binary} not found: these tests start their own daemon")
        pytest.fail(f"gpurpcd binary {binary} not found: build it or set GPURPCD_BIN")
    args = [str(binary), "--backend=fake", f"--unix-socket={tmp / 'gpurpcd.sock'}", "--listen=",
            "--drain-timeout=0s",
            f"--cache-dir={tmp / 'cache'}", "--session-idle-timeout=10s"] + extra
    if config:
        (tmp / "gpurpcd.conf").write_text(config)
        args.append(f"--config={tmp / 'gpurpcd.conf'}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPURPC_")}
    log_path = tmp / "gpurpcd.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    address = f"unix:{tmp / 'gpurpcd.sock'}"
    _wait_ready(address, proc, log_path, deadline_s=30)
    return proc, address


@pytest.fixture(scope="module")
def no_socket_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, address = _start_daemon(tmp_path_factory.mktemp("noregions"), ["--region-socket="])
    saved = _devices._default_client
    yield address
    _devices._default_client = saved
    proc.terminate()
    proc.wait(timeout=15)


def test_auto_falls_back_once_and_on_raises_without_a_region_socket(
        no_socket_daemon: str, caplog: pytest.LogCaptureFixture) -> None:
    cuda.init(address=no_socket_daemon)
    ctx = cuda.Device(0).make_context()
    try:
        caplog.set_level("DEBUG", logger="gpurpc")
        debug.reset_rpc_counts()
        host = cuda.pagelocked_empty(4 * MiB, np.uint8)
        assert region_of(ctx, host) is None
        host[:] = random_bytes(host.size)
        buf = cuda.mem_alloc(host.nbytes)
        cuda.memcpy_htod(buf, host)
        back = cuda.pagelocked_zeros(host.size, np.uint8)
        cuda.memcpy_dtoh(back, buf)
        assert np.array_equal(back, host)
        counts = debug.rpc_counts()
        assert counts.get("HostRegionService.RegisterHostRegion") == 1, counts  # tried once
        reason = _regions.off_reason(ctx._core)
        assert reason is not None and "FAILED_PRECONDITION" in reason
        assert [r for r in caplog.records if "same-host regions" in r.getMessage()]
        ctx.host_regions = "on"
        with pytest.raises(cuda.Error) as info:
            cuda.pagelocked_empty(100, np.float32)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "region socket" in str(info.value)
        with pytest.raises(cuda.Error):
            cuda.memcpy_htod(buf, np.zeros(2 * MiB, np.uint8))  # staging, forced
        ctx.host_regions = "auto"
        cuda.memcpy_htod(buf, np.zeros(2 * MiB, np.uint8))  # falls back again
    finally:
        cuda.Context.pop()
        ctx.detach()


@pytest.fixture(scope="module")
def quota_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = f"""
tenant_quotas {{
  key: "{USER}"
  value {{ max_host_region_bytes: {16 * MiB} }}
}}
"""
    proc, address = _start_daemon(tmp_path_factory.mktemp("regionquota"), [], config)
    saved = _devices._default_client
    yield address
    _devices._default_client = saved
    proc.terminate()
    proc.wait(timeout=15)


def test_tenant_region_quota(quota_daemon: str) -> None:
    cuda.init(address=quota_daemon)
    ctx = cuda.Device(0).make_context()
    try:
        first = cuda.pagelocked_empty(12 * MiB, np.uint8)
        assert region_of(ctx, first) is not None
        core = ctx._core
        with pytest.raises(cuda.MemoryError) as info:
            core.call("HostRegionService.RegisterHostRegion",
                      hr.RegisterHostRegionRequest(size_bytes=8 * MiB))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_host_region_bytes" in str(info.value)
        # Auto: over the quota an array is an ordinary one, and regions stay on.
        second = cuda.pagelocked_empty(8 * MiB, np.uint8)
        assert region_of(ctx, second) is None and _regions.off_reason(core) is None
        # A staged transfer cannot get its 64 MiB staging region: gRPC carries it.
        plain = random_bytes(2 * MiB)
        buf = cuda.to_device(plain)
        assert np.array_equal(cuda.from_device_like(buf, plain), plain)
        assert _regions.staging_region_id(core) is None
        small = cuda.pagelocked_empty(MiB, np.uint8)
        assert region_of(ctx, small) is not None
        # "on": over the quota raises.
        ctx.host_regions = "on"
        with pytest.raises(cuda.MemoryError, match="max_host_region_bytes"):
            cuda.pagelocked_empty(8 * MiB, np.uint8)
        ctx.host_regions = "auto"
        # Freeing makes room (the region is unregistered at the next synchronising call).
        del first
        gc.collect()
        ctx.synchronize()
        third = cuda.pagelocked_empty(12 * MiB, np.uint8)
        assert region_of(ctx, third) is not None
    finally:
        cuda.Context.pop()
        ctx.detach()


# -- hostile use of the contract --------------------------------------------------------------

class Raw:
    """The contract without the client's helpers: a context's session, its stubs and the
    region socket."""

    def __init__(self, ctx: cuda.Context) -> None:
        self.ctx = ctx
        self.core = ctx._core

    def register(self, size: int) -> hr.RegisterHostRegionResponse:
        return self.core.call("HostRegionService.RegisterHostRegion",
                              hr.RegisterHostRegionRequest(size_bytes=size))

    def request(self, reply: hr.RegisterHostRegionResponse, *, session_id: Optional[int] = None,
                region_id: Optional[int] = None, ticket: Optional[bytes] = None) -> bytes:
        return hr.AttachHostRegionRequest(
            session_id=self.core.session_id if session_id is None else session_id,
            region_id=reply.region_id if region_id is None else region_id,
            ticket=reply.attach_ticket if ticket is None else ticket).SerializeToString()

    @staticmethod
    def send(path: str, payload: bytes, fds: List[int]) -> hr.AttachHostRegionReply:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(30)
            sock.connect(path)
            if fds:
                socket.send_fds(sock, [payload], fds)
            else:
                sock.send(payload)
            data = sock.recv(4096)
        assert data, "the daemon closed the region socket without an answer"
        return hr.AttachHostRegionReply.FromString(data)

    def copy(self, region_id: int, offset: int, address: int, size: int, to_device: bool = True,
             stream_id: int = 0) -> None:
        self.core.call("HostRegionService.CopyHostRegion", hr.CopyHostRegionRequest(
            region_id=region_id, region_offset_bytes=offset,
            device=common_pb2.DevicePointer(device_address=address), size_bytes=size,
            to_device=to_device, stream_id=stream_id))


def memfd(size: int, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) -> int:
    fd = os.memfd_create("gpurpc-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def expect(reply: hr.AttachHostRegionReply, code: grpc.StatusCode, *words: str) -> None:
    assert reply.code == code.value[0], (reply.code, reply.message)
    for word in words:
        assert word.lower() in reply.message.lower(), (word, reply.message)


def still_usable(ctx: cuda.Context) -> None:
    """The session works, regions included."""
    host = cuda.pagelocked_empty(1000, np.int32)
    host[:] = np.arange(1000)
    buf = cuda.mem_alloc(host.nbytes)
    cuda.memcpy_htod(buf, host)
    back = np.zeros(1000, np.int32)
    cuda.memcpy_dtoh(back, buf)
    assert np.array_equal(back, host)
    assert ctx.state == "active"


@pytest.fixture
def raw(rctx: cuda.Context) -> Iterator[Raw]:
    yield Raw(rctx)
    still_usable(rctx)


def test_attach_with_a_wrong_ticket_and_a_ticket_used_twice(raw: Raw) -> None:
    reply = raw.register(64 * KiB)
    assert len(reply.attach_ticket) == 16 and reply.region_socket
    fd = memfd(64 * KiB)
    try:
        named = (f"region {reply.region_id}", "ticket")
        wrong = bytes(b ^ 0xFF for b in reply.attach_ticket)
        expect(raw.send(reply.region_socket, raw.request(reply, ticket=wrong), [fd]),
               grpc.StatusCode.NOT_FOUND, *named)
        expect(raw.send(reply.region_socket, raw.request(reply, ticket=b"short"), [fd]),
               grpc.StatusCode.NOT_FOUND, *named)
        expect(raw.send(reply.region_socket, raw.request(reply, ticket=b""), [fd]),
               grpc.StatusCode.NOT_FOUND, *named)
        expect(raw.send(reply.region_socket, raw.request(reply), [fd]), grpc.StatusCode.OK,
               "attached")
        expect(raw.send(reply.region_socket, raw.request(reply), [fd]),
               grpc.StatusCode.NOT_FOUND, *named)
    finally:
        os.close(fd)
    # The attached region works through CopyHostRegion.
    buf = cuda.mem_alloc(64 * KiB)
    raw.copy(reply.region_id, 0, int(buf), 64 * KiB, to_device=True)
    raw.ctx.synchronize()


def test_attach_refuses_what_is_not_a_sealed_memfd_of_the_size(raw: Raw,
                                                                tmp_path: Path) -> None:
    size = 64 * KiB
    r, w = os.pipe()
    regular = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(regular, size)
    unsealed = memfd(size, seals=0)
    small = memfd(size - 4096)
    write_sealed = memfd(size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    good = memfd(size)
    read_only = os.open(f"/proc/self/fd/{good}", os.O_RDONLY)  # the same memfd, read-only
    try:
        for fd, words in ((r, "not a memfd (not a regular file)"),
                          (regular, "not a memfd (it takes no seals)"),
                          (unsealed, "not sealed against shrinking"),
                          (small, f"holds {size - 4096} bytes, less than the region's {size}"),
                          (write_sealed, "sealed against writing"),
                          (read_only, "cannot be mapped read-write")):
            reply = raw.register(size)
            expect(raw.send(reply.region_socket, raw.request(reply), [fd]),
                   grpc.StatusCode.INVALID_ARGUMENT, words)
            # A refused memfd leaves the region waiting: the right one attaches after it.
            expect(raw.send(reply.region_socket, raw.request(reply), [good]),
                   grpc.StatusCode.OK)
            raw.core.call("HostRegionService.UnregisterHostRegion",
                          hr.UnregisterHostRegionRequest(region_id=reply.region_id))
    finally:
        for fd in (r, w, regular, unsealed, small, write_sealed, good, read_only):
            os.close(fd)


def test_attach_refuses_several_or_no_descriptors_and_garbage(raw: Raw) -> None:
    size = 64 * KiB
    reply = raw.register(size)
    a, b = memfd(size), memfd(size)
    try:
        expect(raw.send(reply.region_socket, raw.request(reply), [a, b]),
               grpc.StatusCode.INVALID_ARGUMENT, "carries 2 descriptors")
        expect(raw.send(reply.region_socket, raw.request(reply), []),
               grpc.StatusCode.INVALID_ARGUMENT, "carries 0 descriptors")
        expect(raw.send(reply.region_socket, b"\xff\xff\xff\xff garbage", [a]),
               grpc.StatusCode.INVALID_ARGUMENT, "not an AttachHostRegionRequest")
        expect(raw.send(reply.region_socket, b"", [a]), grpc.StatusCode.INVALID_ARGUMENT,
               "session_id is required", "region_id")
        expect(raw.send(reply.region_socket, b"\x0a" * 2000, [a]),
               grpc.StatusCode.INVALID_ARGUMENT, "longer than")
        # None of that used the ticket up.
        expect(raw.send(reply.region_socket, raw.request(reply), [a]), grpc.StatusCode.OK)
    finally:
        os.close(a)
        os.close(b)


def test_regions_belong_to_their_session(raw: Raw) -> None:
    size = 64 * KiB
    reply = raw.register(size)
    other = cuda.Device(0).make_context()
    cuda.Context.pop()
    try:
        other_raw = Raw(other)
        fd = memfd(size)
        try:
            # Another session names the region: not found, as if it did not exist.
            expect(raw.send(reply.region_socket,
                            raw.request(reply, session_id=other.session_id), [fd]),
                   grpc.StatusCode.NOT_FOUND, f"region {reply.region_id}")
            # A session that does not exist gets the same answer.
            expect(raw.send(reply.region_socket, raw.request(reply, session_id=12345), [fd]),
                   grpc.StatusCode.NOT_FOUND, f"region {reply.region_id}")
            buf = cuda.mem_alloc(size)
            with pytest.raises(cuda.LogicError) as info:
                other_raw.copy(reply.region_id, 0, int(buf), size)
            assert info.value.code == grpc.StatusCode.NOT_FOUND
            assert "region" in str(info.value)
            with pytest.raises(cuda.LogicError) as info:
                other_raw.core.call("HostRegionService.UnregisterHostRegion",
                                    hr.UnregisterHostRegionRequest(region_id=reply.region_id))
            assert info.value.code == grpc.StatusCode.NOT_FOUND
            # The owner still attaches it.
            expect(raw.send(reply.region_socket, raw.request(reply), [fd]), grpc.StatusCode.OK)
        finally:
            os.close(fd)
        # A closed session's region: the attach finds no session.
        closed_reply = other_raw.register(size)
        other_id = other.session_id
    finally:
        other.detach()
    fd = memfd(size)
    try:
        expect(raw.send(closed_reply.region_socket,
                        raw.request(closed_reply, session_id=other_id), [fd]),
               grpc.StatusCode.NOT_FOUND, f"region {closed_reply.region_id}")
    finally:
        os.close(fd)


def test_copy_ranges_sizes_and_states_are_checked(raw: Raw) -> None:
    size = 64 * KiB
    buf = cuda.mem_alloc(size)
    pending = raw.register(size)  # not attached
    with pytest.raises(cuda.Error) as info:
        raw.copy(pending.region_id, 0, int(buf), 16)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "attach" in str(info.value).lower()
    reply = raw.register(size)
    fd = memfd(size)
    try:
        expect(raw.send(reply.region_socket, raw.request(reply), [fd]), grpc.StatusCode.OK)
    finally:
        os.close(fd)
    rid = reply.region_id
    invalid, not_found = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    bad = [
        (rid, 0, int(buf), 0, invalid, "size_bytes"),                     # size 0
        (rid, size - 8, int(buf), 16, invalid, f"outside region {rid}"),  # past the region
        (rid, 2**64 - 8, int(buf), 16, invalid, f"outside region {rid}"),  # offset overflows
        (rid, 0, int(buf) + 8, size, invalid, f"{int(buf) + 8:x}"),       # past the buffer
        (rid, 0, 0x10, 16, not_found, "0x10 is in no buffer"),            # no buffer there
        (rid + 1000, 0, int(buf), 16, not_found, f"no region {rid + 1000}"),
    ]
    for region_id, offset, address, n, code, words in bad:
        for to_device in (True, False):
            with pytest.raises(cuda.Error) as info:
                raw.copy(region_id, offset, address, n, to_device)
            assert info.value.code == code, (region_id, offset, address, n, info.value)
            assert words in str(info.value), (words, str(info.value))
    with pytest.raises(cuda.LogicError) as info:
        raw.copy(rid, 0, int(buf), 16, stream_id=987654)
    assert info.value.code == grpc.StatusCode.NOT_FOUND and "stream" in str(info.value)
    # The same through the command stream: the error surfaces at the drain.
    commands = raw.core.commands
    with raw.core.lock:
        commands.add("hostile region copy", auto=False, region_copy=ex.RegionCopyCommand(
            region_id=rid, region_offset_bytes=size - 8,
            device=common_pb2.DevicePointer(device_address=int(buf)), size_bytes=16,
            to_device=True))
        with pytest.raises(cuda.LogicError) as info:
            commands.sync(label="hostile region copy")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # Good copies work; then unregister, and again.
    raw.copy(rid, 0, int(buf), size, to_device=True)
    raw.copy(rid, 8, int(buf) + 16, 32, to_device=False)
    raw.ctx.synchronize()
    raw.core.call("HostRegionService.UnregisterHostRegion",
                  hr.UnregisterHostRegionRequest(region_id=rid))
    with pytest.raises(cuda.LogicError) as info:
        raw.core.call("HostRegionService.UnregisterHostRegion",
                      hr.UnregisterHostRegionRequest(region_id=rid))
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_register_size_zero_is_invalid(raw: Raw) -> None:
    with pytest.raises(cuda.LogicError) as info:
        raw.register(0)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "size" in str(info.value).lower()
    with pytest.raises(cuda.MemoryError) as info:
        raw.register(2**63)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
