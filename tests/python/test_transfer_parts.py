"""Large streamed transfers in parts, each on a connection of its own (GPURPC_TRANSFER_CONNECTIONS).

A synchronous memcpy_htod/memcpy_dtoh above 8 MiB that takes no same-host region is an
UploadStream or a DownloadStream; one of 16 MiB or more is split into min(connections,
n // 8 MiB) parts moved at once, each on a channel of its own (as the C++ client does). These
tests force the gRPC path (``host_regions = "off"``), or the split would never be exercised.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List

import grpc
import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import _core, _devices, _memory, debug

from conftest import CLIENT_SRC, REPO_ROOT, _free_port

MiB = 1 << 20
rng = np.random.default_rng(20240607)


def random_bytes(n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def grpc_ctx(ctx: cuda.Context) -> Iterator[cuda.Context]:
    """A fresh session on the gRPC path (no same-host regions) whose connection splits
    transfers over 4 connections."""
    ctx.host_regions = "off"
    client = _devices._client()
    saved = client.transfer_connections
    client.transfer_connections = 4
    try:
        yield ctx
    finally:
        client.transfer_connections = saved


def parts_of(counts: Dict[str, int]) -> Dict[str, int]:
    return {"up": counts.get(_core.UPLOAD_PARTS, 0), "down": counts.get(_core.DOWNLOAD_PARTS, 0)}


# -- 1. byte-exact round trips in parts -----------------------------------------------------

@pytest.mark.parametrize("nbytes", [64 * MiB, 48 * MiB + 12345, 16 * MiB + 1])
def test_round_trip_in_parts_is_byte_exact(grpc_ctx: cuda.Context, nbytes: int) -> None:
    host = random_bytes(nbytes)
    buf = cuda.mem_alloc(nbytes)
    debug.reset_rpc_counts()
    cuda.memcpy_htod(buf, host)
    back = np.zeros_like(host)
    cuda.memcpy_dtoh(back, buf)
    counts = debug.rpc_counts()
    expected = min(4, nbytes // (8 * MiB))
    assert parts_of(counts) == {"up": expected, "down": expected}, counts
    # One transfer each, as ever (its parts counted apart).
    assert counts.get("MemoryService.UploadStream") == 1, counts
    assert counts.get("MemoryService.DownloadStream") == 1, counts
    assert np.array_equal(back, host)


def test_transfer_inside_a_bigger_allocation(grpc_ctx: cuda.Context) -> None:
    size = 80 * MiB
    base = random_bytes(size)
    buf = cuda.mem_alloc(size)
    cuda.memcpy_htod(buf, base)
    offset, n = 3 * MiB + 5, 40 * MiB + 777  # neither aligned nor whole chunks
    middle = random_bytes(n)
    debug.reset_rpc_counts()
    cuda.memcpy_htod(int(buf) + offset, middle)
    assert parts_of(debug.rpc_counts())["up"] == 4
    expected = base.copy()
    expected[offset:offset + n] = middle
    whole = np.empty(size, np.uint8)
    cuda.memcpy_dtoh(whole, buf)
    assert np.array_equal(whole[:offset], base[:offset]), "bytes before the range changed"
    assert np.array_equal(whole[offset + n:], base[offset + n:]), "bytes after it changed"
    assert np.array_equal(whole, expected)
    # A download from inside the allocation, into the middle of a bigger host array.
    debug.reset_rpc_counts()
    host = np.zeros(n + 2 * MiB, np.uint8)
    cuda.memcpy_dtoh(host[MiB:MiB + n], int(buf) + offset)
    assert parts_of(debug.rpc_counts())["down"] == 4
    assert np.array_equal(host[MiB:MiB + n], middle)
    assert not host[:MiB].any() and not host[MiB + n:].any(), "bytes outside dest written"


def test_typed_arrays_and_gpuarray_round_trip(grpc_ctx: cuda.Context) -> None:
    from gpurpc import gpuarray
    host = rng.standard_normal(5 * MiB + 3)  # 40 MiB + 24 bytes
    debug.reset_rpc_counts()
    dev = gpuarray.to_gpu(host)
    back = dev.get()
    assert parts_of(debug.rpc_counts()) == {"up": 4, "down": 4}
    assert back.dtype == host.dtype and np.array_equal(back, host)


def test_sessions_in_threads_transfer_in_parts_at_once(grpc_ctx: cuda.Context,
                                                       daemon: str) -> None:
    """Two sessions moving split transfers at the same time share the transfer channels."""
    datas = [random_bytes(24 * MiB + i) for i in range(2)]
    results: List[object] = [None, None]

    def work(i: int) -> None:
        try:
            own = cuda.Device(0).make_context()
            own.host_regions = "off"
            try:
                buf = cuda.mem_alloc(datas[i].nbytes)
                cuda.memcpy_htod(buf, datas[i])
                back = np.empty_like(datas[i])
                cuda.memcpy_dtoh(back, buf)
                results[i] = bool(np.array_equal(back, datas[i]))
            finally:
                cuda.Context.pop()
                own.detach()
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [True, True]


# -- 2. the split happened: debug counters, the client's sockets, the daemon's metrics -------

_PROBE = r"""
import json, os, sys
import numpy as np
import gpurpc.driver as cuda
from gpurpc import debug

def sockets():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n

ctx = cuda.Device(0).make_context()
assert ctx.host_regions == "off", ctx.host_regions
data = np.random.default_rng(7).integers(0, 256, 40 * (1 << 20) + 5, dtype=np.uint8)
buf = cuda.mem_alloc(data.nbytes)
cuda.memcpy_htod(buf, data[:16])  # the session's connection and command stream are up
before = sockets()
debug.reset_rpc_counts()
cuda.memcpy_htod(buf, data)
back = np.empty_like(data)
cuda.memcpy_dtoh(back, buf)
after = sockets()
assert np.array_equal(back, data)
print(json.dumps({"counts": debug.rpc_counts(), "new_sockets": after - before}))
ctx.pop()
ctx.detach()
"""

_EXTERNAL_DAEMON = bool(os.environ.get("GPURPC_ADDRESS")) and not os.environ.get("GPURPCD_BIN")


class MetricsDaemon:
    """A gpurpcd of its own, on a Unix socket, serving its metrics at ``metrics_url``."""

    def __init__(self, tmp: Path) -> None:
        binary = Path(os.environ.get("GPURPCD_BIN", REPO_ROOT / "build" / "server" / "gpurpcd"))
        if not binary.is_file() or _EXTERNAL_DAEMON:
            pytest.skip(f"starts a daemon of its own: gpurpcd binary {binary} not found or the "
                        "daemon is external ($GPURPC_ADDRESS)")
        self.socket = tmp / "gpurpcd.sock"
        self.address = "unix:" + str(self.socket)
        port = _free_port()
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        self.log_path = tmp / "gpurpcd.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(binary), "--backend=fake", "--listen=", "--drain-timeout=0s",
                 f"--cache-dir={tmp / 'cache'}", f"--unix-socket={self.socket}",
                 f"--metrics-listen=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"gpurpcd exited ({self.proc.returncode}):\n{self.log()}")
            try:
                self.metrics()
                if self.socket.exists():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"gpurpcd with metrics not ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as reply:
            return reply.read().decode()

    def calls(self, method: str) -> int:
        """gpurpc_rpcs_total of MemoryService/``method`` answered OK."""
        total = 0
        for line in self.metrics().splitlines():
            if line.startswith("gpurpc_rpcs_total{") and f'MemoryService/{method}"' in line \
                    and 'code="OK"' in line:
                total += int(float(line.rsplit(" ", 1)[1]))
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def metrics_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetricsDaemon]:
    d = MetricsDaemon(tmp_path_factory.mktemp("parts-metrics"))
    try:
        yield d
    finally:
        d.stop()


def _probe(address: str, connections: str) -> Dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPURPC_")}
    env.update(GPURPC_ADDRESS=address, GPURPC_HOST_REGIONS="off",
               GPURPC_TRANSFER_CONNECTIONS=connections,
               PYTHONPATH=os.pathsep.join([str(CLIENT_SRC), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets in /proc")
def test_four_connections_split_and_one_does_not(metrics_daemon: MetricsDaemon) -> None:
    up0, down0 = metrics_daemon.calls("UploadStream"), metrics_daemon.calls("DownloadStream")
    four = _probe(metrics_daemon.address, "4")
    counts = four["counts"]
    assert isinstance(counts, dict)
    assert counts.get(_core.UPLOAD_PARTS) == 4 and counts.get(_core.DOWNLOAD_PARTS) == 4, counts
    # Three more connections to the daemon (the first part takes the session's own).
    assert four["new_sockets"] == 3, four
    up1, down1 = metrics_daemon.calls("UploadStream"), metrics_daemon.calls("DownloadStream")
    assert (up1 - up0, down1 - down0) == (4, 4), metrics_daemon.metrics()

    one = _probe(metrics_daemon.address, "1")
    counts = one["counts"]
    assert isinstance(counts, dict)
    assert _core.UPLOAD_PARTS not in counts and _core.DOWNLOAD_PARTS not in counts, counts
    assert counts.get("MemoryService.UploadStream") == 1, counts
    assert "MemoryService.GetAllocation" not in counts, counts  # nothing to split: not asked
    assert one["new_sockets"] == 0, one
    up2, down2 = metrics_daemon.calls("UploadStream"), metrics_daemon.calls("DownloadStream")
    assert (up2 - up1, down2 - down1) == (1, 1)


def test_small_streamed_transfers_stay_one_stream(grpc_ctx: cuda.Context) -> None:
    """Below 2 x 8 MiB there is one part: no GetAllocation, no further connection."""
    host = random_bytes(16 * MiB - 1)
    buf = cuda.mem_alloc(host.nbytes)
    debug.reset_rpc_counts()
    cuda.memcpy_htod(buf, host)
    back = np.empty_like(host)
    cuda.memcpy_dtoh(back, buf)
    counts = debug.rpc_counts()
    assert parts_of(counts) == {"up": 0, "down": 0}, counts
    assert "MemoryService.GetAllocation" not in counts, counts
    assert np.array_equal(back, host)


def test_part_sizes_mirror_the_cpp_client() -> None:
    """min(connections, n // 8 MiB) parts of whole 1 MiB chunks, the last taking the rest."""
    class FakeClient:
        transfer_connections = 4

    class FakeCore:
        client = FakeClient()

        def call(self, name: str, request: object, op: str = "") -> object:
            from gpurpc.v1 import memory_service_pb2 as mem
            return mem.GetAllocationResponse(buffer=mem.BufferInfo(
                buffer_id=1, device_address=0x1000_0000, size_bytes=1 << 40))

    core = FakeCore()
    split = _memory._transfer_parts
    chunk = MiB
    assert split(core, 0x1000_0000, 16 * MiB - 1, chunk, "t") == [(0, 16 * MiB - 1)]
    assert split(core, 0x1000_0000, 16 * MiB, chunk, "t") == [(0, 8 * MiB), (8 * MiB, 8 * MiB)]
    assert split(core, 0x1000_0000, 40 * MiB + 7, chunk, "t") == [
        (0, 10 * MiB), (10 * MiB, 10 * MiB), (20 * MiB, 10 * MiB), (30 * MiB, 10 * MiB + 7)]
    assert split(core, 0x1000_0000, 27 * MiB + 1, chunk, "t") == [
        (0, 9 * MiB), (9 * MiB, 9 * MiB), (18 * MiB, 9 * MiB + 1)]
    for n in (16 * MiB, 33 * MiB + 1, 1000 * MiB + 3):
        parts = split(core, 0x1000_0000, n, chunk, "t")
        assert sum(size for _, size in parts) == n
        assert all(offset % chunk == 0 for offset, _ in parts)
        assert all(size % chunk == 0 for _, size in parts[:-1])
        assert all(size >= 8 * MiB for _, size in parts)
    FakeClient.transfer_connections = 1
    assert split(core, 0x1000_0000, 64 * MiB, chunk, "t") == [(0, 64 * MiB)]


def test_every_part_runs_to_its_end_and_the_first_error_wins() -> None:
    ran: List[int] = []
    lock = threading.Lock()

    def run(index: int, offset: int, size: int) -> None:
        time.sleep(0.05 * (4 - index))  # later parts end first
        with lock:
            ran.append(index)
        if index in (1, 3):
            raise cuda.LogicError(f"part {index} failed")

    parts = [(i * 8, 8) for i in range(4)]
    with pytest.raises(cuda.LogicError, match="part 1 failed"):
        _memory._run_parts(parts, _memory._Parts(), run)
    assert sorted(ran) == [0, 1, 2, 3]


# -- 3. a bad range is refused whole --------------------------------------------------------

def test_range_past_the_end_is_refused_whole(grpc_ctx: cuda.Context) -> None:
    size = 32 * MiB
    base = random_bytes(size)
    buf = cuda.mem_alloc(size)
    cuda.memcpy_htod(buf, base)
    debug.reset_rpc_counts()
    with pytest.raises(cuda.LogicError) as info:  # 32 MiB at 8 MiB: 8 MiB past the end
        cuda.memcpy_htod(int(buf) + 8 * MiB, random_bytes(size))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    counts = debug.rpc_counts()
    assert counts.get("MemoryService.GetAllocation") == 1, counts  # asked, then one stream
    assert parts_of(counts)["up"] == 0, counts
    back = np.empty(size, np.uint8)
    cuda.memcpy_dtoh(back, buf)
    assert np.array_equal(back, base), "a refused upload wrote bytes"

    dest = np.zeros(size, np.uint8)
    with pytest.raises(cuda.LogicError) as info:
        cuda.memcpy_dtoh(dest, int(buf) + 8 * MiB)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert not dest.any(), "a refused download wrote bytes"
    # The session goes on, in parts.
    debug.reset_rpc_counts()
    cuda.memcpy_dtoh(back, buf)
    assert parts_of(debug.rpc_counts())["down"] == 4
    assert np.array_equal(back, base)


def test_address_in_no_buffer_gets_the_daemons_error(grpc_ctx: cuda.Context) -> None:
    buf = cuda.mem_alloc(MiB)
    host = random_bytes(32 * MiB)
    with pytest.raises(cuda.Error) as info:
        cuda.memcpy_htod(int(buf) + 64 * MiB, host)
    assert info.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    with pytest.raises(cuda.Error):
        cuda.memcpy_dtoh(host, int(buf) + 64 * MiB)
    cuda.memcpy_htod(buf, host[:MiB])  # the session is fine


# -- 4. GPURPC_TRANSFER_CONNECTIONS and transfer_connections= -------------------------------

@pytest.mark.parametrize("value", ["0", "17", "x", "-1", "4.0", "1e3", "99999999999999"])
def test_invalid_environment_value_is_a_clear_error(daemon: str, value: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPURPC_TRANSFER_CONNECTIONS", value)
    with pytest.raises(cuda.LogicError) as info:
        _core.Client(daemon)
    text = str(info.value)
    assert "GPURPC_TRANSFER_CONNECTIONS" in text and repr(value) in text, text
    assert "1 to 16" in text, text
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("value,expected", [("1", 1), (" 16 ", 16), ("+2", 2), ("", 4)])
def test_valid_environment_values(daemon: str, value: str, expected: int,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPURPC_TRANSFER_CONNECTIONS", value)
    client = _core.Client(daemon)
    try:
        assert client.transfer_connections == expected
    finally:
        client.close()


def test_invalid_environment_value_fails_init_in_a_program(daemon: str) -> None:
    """Through the public API: driver.init() (here implicit) refuses to connect."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPURPC_")}
    env.update(GPURPC_ADDRESS=daemon, GPURPC_TRANSFER_CONNECTIONS="x",
               PYTHONPATH=os.pathsep.join([str(CLIENT_SRC), os.environ.get("PYTHONPATH", "")]))
    program = textwrap.dedent("""
        import gpurpc.driver as cuda
        try:
            cuda.Device(0)
        except cuda.LogicError as e:
            print("REFUSED", e)
        else:
            print("CONNECTED")
        """)
    result = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                            text=True, timeout=60)
    assert "REFUSED" in result.stdout, result.stdout + result.stderr
    assert "GPURPC_TRANSFER_CONNECTIONS='x'" in result.stdout, result.stdout


@pytest.mark.parametrize("value", [0, 17, -3, "4", 2.0, True])
def test_invalid_keyword_is_a_clear_error(daemon: str, value: object) -> None:
    with pytest.raises(cuda.LogicError, match="transfer_connections="):
        _core.Client(daemon, transfer_connections=value)  # type: ignore[arg-type]


def test_keyword_beats_the_environment_and_the_attribute_is_checked(
        daemon: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPURPC_TRANSFER_CONNECTIONS", "2")
    client = _core.Client(daemon, transfer_connections=np.int64(16))
    try:
        assert client.transfer_connections == 16
        client.transfer_connections = 1
        assert client.transfer_connections == 1
        with pytest.raises(cuda.LogicError, match="transfer_connections="):
            client.transfer_connections = 0
        assert client.transfer_connections == 1
        client.transfer_connections = None  # back to the environment's
        assert client.transfer_connections == 2
        assert client.reopened().transfer_connections == 2
    finally:
        client.close()


def test_transfer_channels_open_lazily_and_close_with_the_client(daemon: str) -> None:
    client = _core.Client(daemon, transfer_connections=3)
    try:
        assert client._transfer_channels == ()
        first = client.transfer_method(2, "MemoryService.DownloadStream")
        assert len(client._transfer_channels) == 2
        assert client.transfer_method(2, "MemoryService.DownloadStream") is first
        assert client.transfer_method(0, "MemoryService.DownloadStream") is \
            client.method("MemoryService.DownloadStream")
    finally:
        client.close()
    assert client._transfer_channels == ()
    with pytest.raises(ValueError, match="closed"):
        client.transfer_method(1, "MemoryService.UploadStream")


# -- fork: the parent's transfer channels stay the parent's ---------------------------------

_FORK_PROGRAM = r"""
import os
import numpy as np
import gpurpc.driver as cuda

ctx = cuda.Device(0).make_context()
ctx.host_regions = "off"
data = np.random.default_rng(3).integers(0, 256, 24 * (1 << 20) + 9, dtype=np.uint8)
buf = cuda.mem_alloc(data.nbytes)
cuda.memcpy_htod(buf, data)  # in parts: the transfer channels are open
client = ctx._core.client
assert len(client._transfer_channels) == 2, client._transfer_channels
pid = os.fork()
if pid == 0:
    code = 0
    try:
        try:
            cuda.memcpy_dtoh(np.empty_like(data), buf)
            code = 4
        except cuda.LogicError as e:
            assert "fork" in str(e), str(e)
        try:
            client.transfer_method(1, "MemoryService.UploadStream")
            code = 5
        except cuda.LogicError as e:
            assert "belongs to process" in str(e), str(e)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 3
    os._exit(code)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
back = np.empty_like(data)
cuda.memcpy_dtoh(back, buf)  # in parts, on the same channels
assert np.array_equal(back, data)
cuda.memcpy_htod(buf, data[::-1].copy())
cuda.memcpy_dtoh(back, buf)
assert np.array_equal(back, data[::-1])
ctx.pop()
ctx.detach()
print("PARENT OK", flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_leaves_the_parents_transfer_channels(daemon: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPURPC_")}
    env.update(GPURPC_ADDRESS=daemon, GPURPC_TRANSFER_CONNECTIONS="3",
               PYTHONPATH=os.pathsep.join([str(CLIENT_SRC), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _FORK_PROGRAM], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "PARENT OK" in result.stdout, (
        f"exit status {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")


def test_progress_counts_the_bytes_of_every_part(grpc_ctx: cuda.Context,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seen: List[int] = []
    closed: List[bool] = []

    class Bar:
        def update(self, n: int) -> None:
            seen.append(n)

        def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(_memory._progress, "bar", lambda total, label: Bar())
    n = 40 * MiB + 3
    host = random_bytes(n)
    buf = cuda.mem_alloc(n)
    cuda.memcpy_htod(buf, host)
    assert sum(seen) == n and closed == [True]
    seen.clear()
    back = np.empty_like(host)
    cuda.memcpy_dtoh(back, buf)
    assert sum(seen) == n and closed == [True, True]
    assert np.array_equal(back, host)



# -- downloads take their replies serialized: the parse of DownloadResponse ----------------

def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _core.varint((number << 3) | wire) + payload


def _encodings() -> List[bytes]:
    """DownloadResponse encodings a daemon (or a later protocol) may send: the data field
    alone, none, fields it does not know of every wire type around it, several data fields."""
    data = bytes(random_bytes(3000))
    out = [
        b"",
        _field(1, 2, _core.varint(0)),
        _field(1, 2, _core.varint(len(data)) + data),
        _field(7, 0, _core.varint(300)) + _field(1, 2, _core.varint(5) + data[:5]),
        _field(1, 2, _core.varint(5) + data[:5]) + _field(2, 1, bytes(8)) + _field(3, 5, bytes(4)),
        _field(9, 2, _core.varint(4) + b"abcd") + _field(1, 2, _core.varint(200) + data[:200]),
        _field(1, 2, _core.varint(3) + b"one") + _field(1, 2, _core.varint(3) + b"two"),
        _field(1000, 0, _core.varint(1 << 62)) + _field(1, 2, _core.varint(129) + data[:129]),
    ]
    return out


def _parsed(message: bytes) -> bytes:
    start, length = _memory._download_data(message, "memcpy_dtoh")
    return message[start:start + length]


def test_download_reply_parse_matches_protobuf() -> None:
    for message in _encodings():
        assert _parsed(message) == _memory._mem.DownloadResponse.FromString(message).data


def test_download_reply_parse_refuses_what_protobuf_refuses() -> None:
    """Every cut of every encoding, and a few bytes no encoding can hold: where protobuf's
    parse fails, ours fails with an error naming the malformed reply; where it succeeds, both
    find the same bytes."""
    bad = [b"\x0a", b"\x0a\x05abc", b"\x80", b"\xff" * 11, b"\x00\x00", b"\x0b", b"\x0c",
           b"\x09abc", b"\x0d\x01"]
    cuts = [m[:k] for m in _encodings() for k in range(len(m) + 1) if len(m) < 400]
    refused = 0
    for message in bad + cuts:
        try:
            expected = _memory._mem.DownloadResponse.FromString(message).data
        except Exception:  # noqa: BLE001 - protobuf's DecodeError, whatever its module
            expected = None
        if expected is None:
            with pytest.raises(cuda.Error, match="memcpy_dtoh: the daemon sent a malformed "
                                                 "DownloadResponse"):
                _parsed(message)
            refused += 1
        else:
            assert _parsed(message) == expected, message
    assert refused > len(bad)  # the cuts hold malformed ones too, and each was refused


def test_transfer_method_with_raw_replies_is_its_own_callable(daemon: str) -> None:
    client = _core.Client(daemon, transfer_connections=2)
    try:
        parsed = client.transfer_method(0, "MemoryService.DownloadStream")
        raw = client.transfer_method(0, "MemoryService.DownloadStream", raw_responses=True)
        assert raw is not parsed
        assert client.transfer_method(0, "MemoryService.DownloadStream",
                                      raw_responses=True) is raw
        assert client.transfer_method(1, "MemoryService.DownloadStream",
                                      raw_responses=True) is not raw
    finally:
        client.close()


def test_download_into_typed_and_offset_views(grpc_ctx: cuda.Context) -> None:
    """Replies are copied into the caller's buffer through a byte view of it: typed arrays,
    Fortran-ordered ones and a memoryview into the middle of a bytearray all get every byte."""
    n = 24 * MiB + 8
    host = random_bytes(n)
    buf = cuda.mem_alloc(n)
    cuda.memcpy_htod(buf, host)
    floats = np.empty(n // 8, np.float64)
    cuda.memcpy_dtoh(floats, buf)
    assert floats.tobytes() == host.tobytes()
    fortran = np.empty((n // 32, 4), np.float64, order="F")  # 24 MiB: all but the last 8
    cuda.memcpy_dtoh(fortran, buf)
    assert fortran.T.tobytes() == host[:fortran.nbytes].tobytes()
    backing = bytearray(n + 100)
    cuda.memcpy_dtoh(memoryview(backing)[50:50 + n], buf)
    assert backing[:50] == bytes(50) and backing[50 + n:] == bytes(50)
    assert bytes(backing[50:50 + n]) == host.tobytes()


def test_init_takes_transfer_connections(daemon: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``driver.init(transfer_connections=)``: on a new connection and on the one kept; a bad
    value is named and changes nothing (neither it nor the other settings given with it)."""
    monkeypatch.setattr(_devices, "_default_client", None)
    monkeypatch.delenv("GPURPC_TRANSFER_CONNECTIONS", raising=False)
    cuda.init(address=daemon, transfer_connections=3)
    client = _devices._client()
    try:
        assert client.transfer_connections == 3
        cuda.init(address=daemon, transfer_connections=np.int32(5))
        assert _devices._client() is client and client.transfer_connections == 5
        timeout = client.timeout
        for bad in (0, 17, 2.5, "4"):
            with pytest.raises(cuda.LogicError, match="transfer_connections="):
                cuda.init(address=daemon, transfer_connections=bad,  # type: ignore[arg-type]
                          timeout=timeout + 7)
            assert client.transfer_connections == 5 and client.timeout == timeout
        cuda.init()
        assert client.transfer_connections == 5
    finally:
        client.close()
