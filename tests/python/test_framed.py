"""The framed command channel (gpurpc._framed): a same-host session's command stream on a
socket straight to its worker, without gRPC.

The transport is tested alone against a socketpair whose other end plays the worker (order,
a peer that does not read, half-close, cancel, hostile replies), then through the driver
against the session daemon (which channel a context uses, and that the gRPC stream takes over
whenever the framed channel cannot be had or has ended).
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Iterator, List, Tuple

import grpc
import numpy as np
import pytest

import gpurpc.driver as cuda
import gpurpc.gpuarray as gpuarray
from gpurpc import _core, _framed, debug
from gpurpc.compiler import SourceModule
from gpurpc.v1 import execution_service_pb2 as ex

from kernels import FAKE_KERNELS

MiB = 1 << 20


# -- the transport alone ----------------------------------------------------------------------

@pytest.fixture
def pair() -> Iterator[Tuple[_framed.FramedCall, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    call = _framed.FramedCall(ours)
    try:
        yield call, theirs
    finally:
        call.cancel()
        theirs.close()


def read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"EOF after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def read_frame(sock: socket.socket) -> bytes:
    (length,) = struct.unpack("<I", read_exactly(sock, 4))
    return read_exactly(sock, length)


def frame(message: bytes) -> bytes:
    return struct.pack("<I", len(message)) + message


def reply(seq: int, data: bytes = b"") -> bytes:
    r = ex.CommandReply(processed_through_sequence=seq)
    if data:
        r.downloads.add(sequence=seq, data=data)
    return r.SerializeToString()


def test_batches_arrive_framed_and_in_order(pair) -> None:
    call, worker = pair
    payloads = [bytes([i]) * n for i, n in enumerate((0, 1, 5, 70_000, 3))]
    for p in payloads:
        call.put(p, None)
    assert [read_frame(worker) for _ in payloads] == payloads


def test_a_peer_that_does_not_read_never_blocks_the_sender(pair) -> None:
    """Far more than the socket buffers: put() returns at once, the writer thread delivers
    everything in order once the peer reads."""
    call, worker = pair
    payloads = [bytes([i]) * (4 * MiB) for i in range(8)] + [b"tail"]
    started = time.monotonic()
    for p in payloads:
        call.put(p, None)
    elapsed = time.monotonic() - started
    assert elapsed < 30, "put() waited for the peer"  # generous: never a timing check
    received = [read_frame(worker) for _ in payloads]
    assert [len(r) for r in received] == [len(p) for p in payloads]
    assert received == payloads


def test_replies_are_read_whole_whatever_their_size_and_split(pair) -> None:
    call, worker = pair
    big = bytes(range(256)) * (3 * MiB // 256)  # larger than the reader's buffer
    stream = frame(reply(1)) + frame(reply(2, big)) + frame(reply(3, b"xy"))
    # Sent in awkward pieces: across headers and bodies.
    def send() -> None:
        for i in range(0, len(stream), 77_777):
            worker.sendall(stream[i:i + 77_777])
        worker.shutdown(socket.SHUT_WR)
    sender = threading.Thread(target=send)
    sender.start()
    got = []
    with pytest.raises(grpc.RpcError) as ended:  # the worker ended the channel, unasked
        for r in call:
            got.append(r)
    sender.join()
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "ended the framed command channel" in ended.value.details()
    assert [r.processed_through_sequence for r in got] == [1, 2, 3]
    assert got[1].downloads[0].data == big
    assert got[2].downloads[0].data == b"xy"


def test_close_half_closes_after_what_was_sent(pair) -> None:
    call, worker = pair
    call.put(b"a" * (2 * MiB), None)
    call.put(b"b", None)
    call.close()
    call.put(b"after close", None)  # dropped: the stream took no more batches
    assert read_frame(worker) == b"a" * (2 * MiB)
    assert read_frame(worker) == b"b"
    assert worker.recv(1) == b""  # EOF: the worker answers what it has and ends
    worker.sendall(frame(reply(7)))
    worker.shutdown(socket.SHUT_WR)
    assert [r.processed_through_sequence for r in call] == [7]


def test_cancel_ends_the_reader_with_cancelled(pair) -> None:
    call, worker = pair
    errors: List[BaseException] = []

    def read() -> None:
        try:
            for _ in call:
                pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    call.cancel()
    reader.join(10)
    assert not reader.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], grpc.RpcError)
    assert errors[0].code() == grpc.StatusCode.CANCELLED


@pytest.mark.parametrize("stream, why", [
    (struct.pack("<I", (80 << 20) + 1), "more than"),
    (struct.pack("<I", 100) + b"short", "mid-message"),
    (b"\x01\x00", "mid-message"),
    (frame(b"\xff\xff\xff"), "no CommandReply"),
])
def test_a_broken_reply_stream_ends_with_unavailable(pair, stream: bytes, why: str) -> None:
    call, worker = pair
    worker.sendall(frame(reply(1)) + stream)
    worker.shutdown(socket.SHUT_WR)
    it = iter(call)
    assert next(it).processed_through_sequence == 1
    with pytest.raises(grpc.RpcError) as ended:
        next(it)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert why in ended.value.details()


def test_a_peer_gone_while_sending_shuts_the_channel(pair) -> None:
    call, worker = pair
    worker.close()
    for _ in range(3):
        call.put(b"x" * MiB, None)  # never raises: the reader reports the end
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


# -- through the driver -----------------------------------------------------------------------

@pytest.fixture
def mod(ctx: cuda.Context) -> SourceModule:
    return SourceModule(FAKE_KERNELS)


def uses_framed(context: cuda.Context) -> bool:
    return isinstance(context._core.commands._call, _framed.FramedCall)


def test_a_same_host_context_sends_its_commands_framed(ctx: cuda.Context,
                                                        mod: SourceModule) -> None:
    if not _core._is_unix(ctx._core.client.target):
        pytest.skip("the framed channel needs a Unix-socket daemon")
    a = gpuarray.to_gpu(np.arange(1000, dtype=np.float32))
    add_one = mod.get_function("add_one_f32")
    debug.reset_rpc_counts()
    add_one(a, np.uint64(a.size), block=(256, 1, 1), grid=(4, 1))
    ctx.synchronize()
    counts = debug.rpc_counts()
    assert uses_framed(ctx)
    # The launch and the synchronize: batches, no unary call.
    assert set(counts) <= {debug.BATCH, debug.STREAM_OPEN}, counts
    assert np.array_equal(a.get(), np.arange(1000, dtype=np.float32) + 1)
    # Many asynchronous launches and a download, in order.
    for _ in range(500):
        add_one(a, np.uint64(a.size), block=(256, 1, 1), grid=(4, 1))
    assert np.array_equal(a.get(), np.arange(1000, dtype=np.float32) + 501)
    assert uses_framed(ctx)


def test_host_regions_off_keeps_the_grpc_stream(daemon: str) -> None:
    context = cuda.Device(0).make_context()
    try:
        context.host_regions = "off"
        a = gpuarray.to_gpu(np.ones(64, np.float32))
        context.synchronize()
        assert not uses_framed(context)
        assert context._core.commands._call is not None
        assert np.array_equal(a.get(), np.ones(64, np.float32))
    finally:
        cuda.Context.pop()
        context.detach()


def test_a_refused_framed_channel_leaves_the_grpc_stream(ctx: cuda.Context,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A ticket the worker does not know (as after any failure to open): the session goes
    on over gRPC, without an error."""
    original = _framed.open_framed_call
    results: List[object] = []

    def with_a_wrong_ticket(client, metadata, session_id, timeout):  # type: ignore[no-untyped-def]
        method = client.method

        def patched(name):  # type: ignore[no-untyped-def]
            fn = method(name)
            if name != "HostRegionService.OpenDirectChannel":
                return fn

            class Wrong:
                def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                    r = fn(*args, **kwargs)
                    r.attach_ticket = b"\x00" * len(r.attach_ticket)
                    return r
            return Wrong()

        monkeypatch.setattr(client, "method", patched)
        try:
            result = original(client, metadata, session_id, timeout)
        finally:
            monkeypatch.setattr(client, "method", method)
        results.append(result)
        return result

    ctx._core.commands.framed_opener = lambda: with_a_wrong_ticket(
        ctx._core.client, ctx._core.metadata, ctx._core.session_id, ctx._core.timeout)
    a = gpuarray.to_gpu(np.arange(16, dtype=np.int32))
    assert np.array_equal(a.get(), np.arange(16))
    assert results == [None]
    assert not uses_framed(ctx)


def test_after_a_fault_on_the_framed_channel_calls_name_the_cause(ctx: cuda.Context,
                                                                  mod: SourceModule,
                                                                  is_fake: bool) -> None:
    if not _core._is_unix(ctx._core.client.target):
        pytest.skip("the framed channel needs a Unix-socket daemon")
    cuda.mem_alloc(64)
    ctx.synchronize()
    assert uses_framed(ctx)
    mod.get_function("fault_illegal_address")(block=(1, 1, 1))
    with pytest.raises(cuda.LaunchError) as first:
        ctx.synchronize()
    assert first.value.code == grpc.StatusCode.ABORTED
    assert "ILLEGAL_ADDRESS" in str(first.value).upper().replace(" ", "_")
    # The channel has ended; the next stream is a gRPC one, refused with the cause.
    with pytest.raises(cuda.LaunchError) as later:
        ctx.synchronize()
    assert later.value.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED)
    assert "ILLEGAL_ADDRESS" in str(later.value).upper().replace(" ", "_")
    assert not uses_framed(ctx)


def test_detach_with_work_in_flight_on_the_framed_channel(daemon: str) -> None:
    context = cuda.Device(0).make_context()
    try:
        spin = SourceModule(FAKE_KERNELS).get_function("spin_us")
        spin(np.uint64(200_000), block=(1, 1, 1))
        spin(np.uint64(200_000), block=(1, 1, 1))
        assert context._core.commands.has_pending
    finally:
        cuda.Context.pop()
        context.detach()
    with pytest.raises(cuda.LogicError, match="detached"):
        context.synchronize()


def test_detach_while_the_framed_channel_opens_does_not_wait_for_it(daemon: str) -> None:
    """The channel is opened by the first flush outside the stream's lock: a detach meanwhile
    (say the daemon is slow to answer) returns at once, the flush raises that the context was
    detached, and a channel opened too late is closed."""
    context = cuda.Device(0).make_context()
    cuda.Context.pop()
    commands = context._core.commands
    real = commands.framed_opener
    assert real is not None
    opening, release = threading.Event(), threading.Event()
    opened: List[object] = []
    errors: List[BaseException] = []

    def slow() -> object:
        opening.set()
        release.wait(30)
        call = real()
        opened.append(call)
        return call

    commands.framed_opener = slow

    def first_command() -> None:
        context.push()
        try:
            cuda.mem_alloc(64)
            cuda.Context.synchronize()
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)
        finally:
            cuda.Context.pop()

    worker = threading.Thread(target=first_command)
    worker.start()
    try:
        assert opening.wait(30), "the first command did not open the framed channel"
        started = time.monotonic()
        context.detach()
        assert time.monotonic() - started < 10, "detach waited for the channel's opening"
    finally:
        release.set()
        worker.join(30)
    assert not worker.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], cuda.LogicError), errors
    assert "detached" in str(errors[0])
    assert len(opened) == 1
    if opened[0] is not None:  # opened after all: closed, never used
        assert opened[0]._sock.fileno() == -1


# -- two streams in flight at once (a stream ended by a fault and the one opened after it) ------

class _FaultingStream:
    """A stream whose first reply reports a sticky fault and whose end is read late."""

    def __init__(self) -> None:
        self.sent = threading.Event()
        self.end = threading.Event()

    def put(self, payload: bytes, batch: object = None) -> None:
        self.sent.set()

    def close(self) -> None:
        pass

    def cancel(self) -> None:
        self.end.set()

    def extend_last(self, *args: object) -> bool:
        return False

    def __iter__(self) -> Iterator[ex.CommandReply]:
        self.sent.wait(10)
        reply = ex.CommandReply(processed_through_sequence=1)
        reply.error.sequence, reply.error.code = 1, grpc.StatusCode.ABORTED.value[0]
        reply.error.message = "sticky fault: CUDA_ERROR_ILLEGAL_ADDRESS"
        yield reply
        self.end.wait(10)


class _RefusedStream(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self) -> str:
        return "session 1 is FAULTED: CUDA_ERROR_ILLEGAL_ADDRESS"


class _AnsweringStream:
    """A gRPC stream stand-in: answers each batch, or refuses the call at once."""

    def __init__(self, outbox: object, refuse: bool) -> None:
        self.outbox, self.refuse = outbox, refuse

    def __iter__(self) -> Iterator[ex.CommandReply]:
        if self.refuse:
            raise _RefusedStream()
        for payload in self.outbox:  # type: ignore[attr-defined]
            batch = ex.CommandBatch.FromString(payload)
            last = batch.commands[-1]
            reply = ex.CommandReply(processed_through_sequence=last.sequence)
            reply.downloads.add(sequence=last.sequence, data=b"new stream")
            yield reply

    def cancel(self) -> None:
        pass


class _FakeClient:
    target = "unix:/nowhere"
    auth_metadata = ()

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse

    def command_stream(self, outbox: object, metadata: object = ()) -> _AnsweringStream:
        return _AnsweringStream(outbox, self.refuse)


class _State:
    timeout = 10.0


@pytest.mark.parametrize("refuse", [True, False])
def test_the_next_stream_settles_its_batches_before_the_old_one_has_ended(refuse: bool) -> None:
    """A fault ends the framed stream after the reply that reports it; the batch sent behind
    that reply goes to a new stream, which may answer or end before the old stream's end has
    been read. Its batch must be settled by its own stream (answered with its bytes, or
    dropped with that stream's error), and leave the queue once the old stream's are gone:
    neither lost nor counted before the batches sent earlier."""
    commands = _core.CommandStream(_FakeClient(refuse), (), 1, {}, _State(), threading.RLock())
    old = _FaultingStream()
    commands.framed_opener = lambda: old
    memset = ex.MemsetCommand()
    commands.add("memset #1", auto=False, memset=memset)
    commands.flush()
    commands.add("memset #2", auto=False, memset=memset)
    commands.flush()  # in flight on the old stream, never answered
    deadline = time.monotonic() + 10
    while not commands._broken and time.monotonic() < deadline:
        time.sleep(0.01)
    assert commands._broken, "the fault's reply did not end the old stream"
    got: List[bytes] = []
    commands.add("download #3", auto=False, sink=got.append,
                 download=ex.DownloadCommand(size_bytes=10))
    commands.flush()  # the new stream
    if refuse:
        time.sleep(0.5)  # the refused stream ends first: the order this test is about
    else:
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    # Settled by its stream, but still in the queue behind the old stream's batch.
    assert [b.first_seq for b in commands._inflight] == [2, 3]
    assert commands.acked_batches == 1
    assert got == ([] if refuse else [b"new stream"])
    old.end.set()  # the old stream's end is read now
    with pytest.raises(cuda.LaunchError) as raised:
        commands.drain(timeout=10)
    assert raised.value.code == grpc.StatusCode.ABORTED  # the first error: the fault
    assert not commands._inflight and commands.acked_batches == 3


def test_an_interrupt_after_a_partial_send_ends_the_channel(pair) -> None:
    """Half a message on the wire would make the worker read the next batch as its rest: an
    interrupt between a partial send and queueing the rest ends the channel instead."""
    call, worker = pair
    worker.settimeout(10)
    real = call._sock

    class Interrupting:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def sendmsg(self, buffers: List[bytes], *args: object) -> int:
            real.sendmsg([b"".join(buffers)[:3]])  # part of the header
            raise KeyboardInterrupt

    call._sock = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        call.put(b"x" * 100, None)
    call._sock = real
    call.put(b"later", None)  # dropped: the channel is ending
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "interrupted by KeyboardInterrupt" in ended.value.details()
    assert worker.recv(100) == b"\x64\x00\x00"  # the partial header, then the end
    assert worker.recv(100) == b""


def test_the_reader_ends_while_the_writer_thread_waits(pair) -> None:
    """Once a batch too large for the socket's buffer started the writer thread, an end of the
    channel that the client did not ask for must still end the reader (it joins the writer)."""
    call, worker = pair
    big = b"y" * (4 * MiB)
    call.put(big, None)  # the writer thread takes what the socket cannot
    assert read_frame(worker) == big
    assert call._writer is not None
    worker.sendall(frame(reply(1)))
    worker.shutdown(socket.SHUT_RDWR)  # the worker ends the channel, unasked
    done = threading.Event()
    errors: List[BaseException] = []

    def read() -> None:
        try:
            list(call)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(10), "the reader hung joining the writer thread"
    assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.UNAVAILABLE
