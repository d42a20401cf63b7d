"""What a synchronize after asynchronous work costs: one batch and one round trip, as in the
C++ client.

A launch on an idle command stream is sent at once (the GPU should not wait for the next
synchronizing call). On the gRPC command stream the synchronize that follows it joins that
batch while gRPC's sending thread has not taken it yet, which is nearly always (it needs the
GIL, which the caller holds until it waits). The counts below allow for the rare exception;
they fail when joining never happens, and the error and result checks hold either way. On the
framed channel (a same-host context's default) a batch leaves on the calling thread, so the
synchronize is a second batch: two messages, still one wait, and never a unary call. Each
test runs on both (``channel``).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import _core, _framed, debug
from gpurpc.compiler import SourceModule
from gpurpc.v1 import execution_service_pb2

from kernels import FAKE_KERNELS

ROUNDS = 200


@pytest.fixture(params=["framed", "grpc"])
def channel(request: pytest.FixtureRequest, ctx: cuda.Context) -> str:
    """The command channel of the test's context, chosen before its first command."""
    if request.param == "grpc":
        ctx.host_regions = "off"
    elif not _core._is_unix(ctx._core.client.target):
        pytest.skip("the framed channel needs a Unix-socket daemon")
    return request.param


@pytest.fixture
def mod(ctx: cuda.Context, channel: str) -> SourceModule:
    return SourceModule(FAKE_KERNELS)


def most_batches(channel: str, commands_per_round: int = 2) -> int:
    """More batches than this for ROUNDS rounds fail the test. On the framed channel a
    command queued while the launch before it is in flight may leave alone (the reader sends
    what waits behind an answered batch), so a round may take as many batches as it has
    commands: none empty, none sent twice."""
    return ROUNDS * 3 // 2 if channel == "grpc" else ROUNDS * commands_per_round


def check_channel(channel: str) -> None:
    framed = isinstance(cuda.Context.get_current()._core.commands._call, _framed.FramedCall)
    assert framed == (channel == "framed"), f"the context does not use the {channel} channel"


def test_launch_then_context_synchronize_is_one_batch(mod: SourceModule, channel: str) -> None:
    add_one = mod.get_function("add_one_f32").prepare("PQ")
    buf = cuda.to_device(np.zeros(32, np.float32))
    cuda.Context.synchronize()
    check_channel(channel)
    debug.reset_rpc_counts()
    for _ in range(ROUNDS):
        add_one.prepared_async_call((1, 1), (32, 1, 1), None, buf, 32)
        cuda.Context.synchronize()
    counts = debug.rpc_counts()
    assert set(counts) == {debug.BATCH}, counts
    batches = counts[debug.BATCH]
    assert batches <= most_batches(channel), f"{batches} batches for {ROUNDS} launch+synchronize"
    out = np.empty(32, np.float32)
    cuda.memcpy_dtoh(out, buf)
    assert (out == ROUNDS).all()


def test_launch_then_stream_synchronize_is_one_batch(mod: SourceModule, channel: str) -> None:
    add_one = mod.get_function("add_one_f32").prepare("PQ")
    stream = cuda.Stream()
    buf = cuda.to_device(np.zeros(32, np.float32))
    cuda.Context.synchronize()
    check_channel(channel)
    debug.reset_rpc_counts()
    for _ in range(ROUNDS):
        add_one.prepared_async_call((1, 1), (32, 1, 1), stream, buf, 32)
        stream.synchronize()
    counts = debug.rpc_counts()
    assert set(counts) == {debug.BATCH}, counts
    batches = counts[debug.BATCH]
    assert batches <= most_batches(channel), f"{batches} batches for {ROUNDS} launch+synchronize"
    out = np.empty(32, np.float32)
    cuda.memcpy_dtoh(out, buf)
    assert (out == ROUNDS).all()


def test_launch_record_then_event_synchronize_is_one_batch(mod: SourceModule,
                                                           channel: str) -> None:
    # Event.synchronize is a sync marker on the command stream (SyncCommand.event_id), not a
    # drain plus a unary SynchronizeEvent: one batch and one round trip, no unary call.
    add_one = mod.get_function("add_one_f32").prepare("PQ")
    stream = cuda.Stream()
    done = cuda.Event()
    buf = cuda.to_device(np.zeros(32, np.float32))
    cuda.Context.synchronize()
    debug.reset_rpc_counts()
    for _ in range(ROUNDS):
        add_one.prepared_async_call((1, 1), (32, 1, 1), stream, buf, 32)
        done.record(stream)
        done.synchronize()
        assert done.query()
    counts = debug.rpc_counts()
    assert counts[debug.BATCH] <= most_batches(channel, 3), f"{counts} for {ROUNDS} rounds"
    assert "ExecutionService.SynchronizeEvent" not in counts, counts
    out = np.empty(32, np.float32)
    cuda.memcpy_dtoh(out, buf)
    assert (out == ROUNDS).all()


def test_work_queued_behind_a_batch_in_flight_goes_out_when_it_is_answered(
        mod: SourceModule) -> None:
    """Launches made while a batch is in flight are only queued; once it is answered they are
    sent without waiting for the program's next call: a program that launches a few kernels
    and then computes on the CPU must not leave the GPU idle meanwhile (in PyCUDA a launch is
    on the GPU's queue when the call returns)."""
    spin = mod.get_function("spin_us").prepare("Q")
    add_one = mod.get_function("add_one_f32").prepare("PQ")
    buf = cuda.to_device(np.zeros(32, np.float32))
    cuda.Context.synchronize()
    core = cuda.Context.get_current()._core
    commands = core.commands
    sent = commands.sent_batches
    with core.lock:
        # A 0.3 s kernel and a sync marker behind it: the batch is answered after 0.3 s.
        spin.prepared_call((1, 1), (1, 1, 1), np.uint64(300_000))
        commands.add("hold a batch in flight", auto=False,
                     sync=execution_service_pb2.SyncCommand(stream_id=0))
        commands.flush()
    for _ in range(5):
        add_one.prepared_call((1, 1), (32, 1, 1), buf, 32)
    with core.lock:
        queued = len(commands._cmds)
    assert queued == 5, f"{queued} launches queued behind the batch in flight, expected 5"
    deadline = time.monotonic() + 20
    while commands.has_pending and time.monotonic() < deadline:
        time.sleep(0.01)  # no call of ours: only the reader thread can send them
    assert not commands.has_pending, (
        f"launches still queued: {commands.sent_batches - sent} batches sent, "
        f"{commands.acked_batches - sent} answered")
    out = np.empty(32, np.float32)
    cuda.memcpy_dtoh(out, buf)
    assert (out == 5).all()


def test_event_synchronize_waits_for_the_work_before_the_record(mod: SourceModule) -> None:
    spin = mod.get_function("spin_us")
    add_one = mod.get_function("add_one_f32").prepare("PQ")
    stream = cuda.Stream()
    done = cuda.Event()
    buf = cuda.to_device(np.zeros(32, np.float32))
    spin(np.uint64(200_000), block=(1, 1, 1), grid=(1, 1), stream=stream)  # 0.2 s, then
    add_one.prepared_async_call((1, 1), (32, 1, 1), stream, buf, 32)
    done.record(stream)
    assert done.synchronize() is done
    assert done.query()
    out = np.empty(32, np.float32)
    cuda.memcpy_dtoh(out, buf)
    assert (out == 1).all()


def test_an_error_of_the_work_before_a_synchronize_is_raised_by_it(ctx: cuda.Context) -> None:
    buf = cuda.mem_alloc(64)
    cuda.Context.synchronize()
    # Refused by the worker when the batch runs (outside every buffer): the synchronize
    # that follows raises it, whether or not it travelled in the same batch.
    cuda.memset_d32_async(int(buf) + (1 << 40), 7, 4)
    with pytest.raises(cuda.LogicError):
        cuda.Context.synchronize()
    # Raised once; the context works on.
    cuda.memset_d32_async(buf, 5, 16)
    cuda.Context.synchronize()
    out = np.empty(16, np.uint32)
    cuda.memcpy_dtoh(out, buf)
    assert (out == 5).all()


def test_a_synchronize_with_nothing_queued_still_waits_for_the_work(mod: SourceModule) -> None:
    spin = mod.get_function("spin_us")
    add_one = mod.get_function("add_one_f32").prepare("PQ")
    buf = cuda.to_device(np.zeros(32, np.float32))
    spin(np.uint64(200_000), block=(1, 1, 1), grid=(1, 1))  # 0.2 s of "GPU" work, then
    add_one.prepared_async_call((1, 1), (32, 1, 1), None, buf, 32)
    cuda.Context.synchronize()  # joins the launch's batch or follows it: waits for both
    out = np.empty(32, np.float32)
    cuda.memcpy_dtoh(out, buf)
    assert (out == 1).all()


def test_launch_then_a_small_download_is_one_batch(mod: SourceModule, channel: str) -> None:
    # float(gpuarray.sum(a)), .get() of a small result: the launch went out at once, and the
    # download that synchronises joins its batch (one message, one round trip; on the framed
    # channel the second launch and the download are the second batch).
    add_one = mod.get_function("add_one_f32").prepare("PQ")
    buf = cuda.to_device(np.zeros(32, np.float32))
    out = np.empty(32, np.float32)
    cuda.Context.synchronize()
    check_channel(channel)
    debug.reset_rpc_counts()
    for i in range(ROUNDS):
        add_one.prepared_async_call((1, 1), (32, 1, 1), None, buf, 32)
        add_one.prepared_async_call((1, 1), (32, 1, 1), None, buf, 32)
        cuda.memcpy_dtoh(out, buf)
        assert (out == 2 * (i + 1)).all()  # the download ran after both launches
    counts = debug.rpc_counts()
    assert set(counts) == {debug.BATCH}, counts
    batches = counts[debug.BATCH]
    assert batches <= most_batches(channel, 3), \
        f"{batches} batches for {ROUNDS} launches+download"


def test_a_download_behind_failed_work_raises_its_error(ctx: cuda.Context) -> None:
    buf = cuda.to_device(np.full(32, 3, np.float32))
    out = np.zeros(32, np.float32)
    cuda.Context.synchronize()
    # Refused by the worker when the batch runs (outside every buffer); the download joined
    # behind it or was sent after it.
    cuda.memset_d32_async(int(buf) + (1 << 40), 7, 4)
    with pytest.raises(cuda.LogicError):
        cuda.memcpy_dtoh(out, buf)
    # Raised once; the context works on and the data is intact.
    cuda.memcpy_dtoh(out, buf)
    assert (out == 3).all()
