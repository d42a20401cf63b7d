"""The kernel watchdog and the reclaim of abandoned sessions, through the raw ``gpurpc.v1``
stubs (not the client library, which watches its sessions by itself) against a daemon started
here on the fake backend with ``--kernel-timeout=1s`` and ``--session-grace=1s``.

The fake's ``spin_us`` kernel runs on a stream thread: a launch returns at once, and a kernel
that runs past the timeout ends the session's worker; the session is then FAULTED and its
calls answer DEADLINE_EXCEEDED naming the kernel and the timeout. A session whose only
WatchSession stream ends (its client exited) is reclaimed after the grace period.

No timing assertions: what must happen is polled for with generous deadlines.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import grpc
import pytest

from conftest import REPO_ROOT, _wait_ready
from gpurpc.v1 import (device_service_pb2, device_service_pb2_grpc, execution_service_pb2,
                       execution_service_pb2_grpc, memory_service_pb2, memory_service_pb2_grpc,
                       module_service_pb2, module_service_pb2_grpc, session_service_pb2,
                       session_service_pb2_grpc)
from kernels import FAKE_KERNELS

MiB = 1 << 20
EVENTUALLY_S = 30.0
ACTIVE = session_service_pb2.SESSION_STATE_ACTIVE
FAULTED = session_service_pb2.SESSION_STATE_FAULTED
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


def eventually(condition: Callable[[], bool], timeout_s: float = EVENTUALLY_S) -> bool:
    """Polls ``condition`` every 100 ms until it holds (True) or the time is up (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = Path(os.environ.get("GPURPCD_BIN", REPO_ROOT / "build" / "server" / "gpurpcd"))
    if not binary.is_file():
        if os.environ.get("GPURPC_SKIP_DAEMON_TESTS") or os.environ.get("GPURPC_ADDRESS"):
            pytest.skip(f"gpurpcd binary {binary} not found: these tests start their own daemon")
        pytest.fail(f"gpurpcd binary {binary} not found: build it or set GPURPCD_BIN")
    tmp = tmp_path_factory.mktemp("watchdog")
    socket = tmp / "gpurpcd.sock"
    log_path = tmp / "gpurpcd.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPURPC_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(binary), "--backend=fake", f"--unix-socket={socket}", "--listen=",
             "--drain-timeout=0s",
             f"--cache-dir={tmp / 'cache'}", "--session-idle-timeout=60s",
             "--session-grace=1s", "--kernel-timeout=1s", "--log-level=debug"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        reply = _wait_ready(f"unix:{socket}", proc, log_path, deadline_s=60)
        if reply.backend != "fake":
            pytest.skip(f"needs the fake backend's spin_us kernel, the daemon runs {reply.backend}")
        yield f"unix:{socket}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Raw:
    """The raw stubs on one channel; every session-scoped call names its session itself."""

    _image: Optional[bytes] = None  # the compiled fake kernels, shared by the tests

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.sessions = session_service_pb2_grpc.SessionServiceStub(self.channel)
        self.devices = device_service_pb2_grpc.DeviceServiceStub(self.channel)
        self.memory = memory_service_pb2_grpc.MemoryServiceStub(self.channel)
        self.modules = module_service_pb2_grpc.ModuleServiceStub(self.channel)
        self.execution = execution_service_pb2_grpc.ExecutionServiceStub(self.channel)

    @staticmethod
    def md(session_id: int) -> list:
        return [("gpurpc-session", str(session_id))]

    def open(self) -> int:
        return self.sessions.OpenSession(
            session_service_pb2.OpenSessionRequest(client_label="test_watchdog"),
            timeout=60).session_id

    def close(self, session_id: int) -> None:
        self.sessions.CloseSession(session_service_pb2.CloseSessionRequest(),
                                   metadata=self.md(session_id), timeout=60)

    def keep_alive(self, session_id: int) -> session_service_pb2.KeepAliveResponse:
        return self.sessions.KeepAlive(session_service_pb2.KeepAliveRequest(),
                                       metadata=self.md(session_id), timeout=60)

    def info(self) -> device_service_pb2.GetServerInfoResponse:
        return self.devices.GetServerInfo(device_service_pb2.GetServerInfoRequest(), timeout=60)

    def allocate(self, session_id: int, size: int) -> int:
        return self.memory.Allocate(memory_service_pb2.AllocateRequest(size_bytes=size),
                                    metadata=self.md(session_id), timeout=60).buffer.buffer_id

    def spin_us(self, session_id: int) -> int:
        """The function id of the fake's spin_us kernel in ``session_id``."""
        if Raw._image is None:
            reply = self.modules.Compile(
                module_service_pb2.CompileRequest(source='extern "C" {\n' + FAKE_KERNELS + "\n}\n",
                                                  program_name="watchdog.cu"),
                metadata=self.md(session_id), timeout=120)
            assert reply.success, reply.log
            Raw._image = reply.image
            module_id = reply.module_id
        else:
            module_id = self.modules.LoadModule(
                module_service_pb2.LoadModuleRequest(image=Raw._image),
                metadata=self.md(session_id), timeout=60).module_id
        return self.modules.GetFunction(
            module_service_pb2.GetFunctionRequest(module_id=module_id, name="spin_us"),
            metadata=self.md(session_id), timeout=60).function_id

    def create_stream(self, session_id: int) -> int:
        return self.execution.CreateStream(execution_service_pb2.CreateStreamRequest(),
                                           metadata=self.md(session_id), timeout=60).stream_id

    def launch_spin(self, session_id: int, function_id: int, microseconds: int,
                    stream_id: int = 0) -> None:
        launch = execution_service_pb2.LaunchCommand(function_id=function_id, stream_id=stream_id)
        for dim in (launch.grid, launch.block):
            dim.x, dim.y, dim.z = 1, 1, 1
        launch.args.add().u64 = microseconds
        self.execution.Launch(execution_service_pb2.LaunchRequest(launch=launch),
                              metadata=self.md(session_id), timeout=60)

    def synchronize_stream(self, session_id: int, stream_id: int) -> None:
        self.execution.SynchronizeStream(
            execution_service_pb2.SynchronizeStreamRequest(stream_id=stream_id),
            metadata=self.md(session_id), timeout=60)


class Watch:
    """One WatchSession stream, read on a thread; ``code`` is its final status once it ended."""

    def __init__(self, raw: Raw, session_id: int) -> None:
        self.call = raw.sessions.WatchSession(session_service_pb2.WatchSessionRequest(),
                                              metadata=raw.md(session_id))
        self.events: List[session_service_pb2.SessionEvent] = []
        self.code: Optional[grpc.StatusCode] = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        code = grpc.StatusCode.OK
        try:
            for event in self.call:
                with self._changed:
                    self.events.append(event)
                    self._changed.notify_all()
        except grpc.RpcError as error:
            code = error.code()
        with self._changed:
            self.code = code
            self._changed.notify_all()

    def wait_for(self, matches: Callable[[session_service_pb2.SessionEvent], bool],
                 timeout_s: float = EVENTUALLY_S) -> Optional[session_service_pb2.SessionEvent]:
        found: List[session_service_pb2.SessionEvent] = []

        def ready() -> bool:
            found[:] = [e for e in self.events if matches(e)][:1]
            return bool(found) or self.code is not None

        with self._changed:
            self._changed.wait_for(ready, timeout=timeout_s)
        return found[0] if found else None

    def wait_end(self, timeout_s: float = EVENTUALLY_S) -> Optional[grpc.StatusCode]:
        with self._changed:
            self._changed.wait_for(lambda: self.code is not None, timeout=timeout_s)
        return self.code

    def cancel(self) -> None:
        self.call.cancel()


@pytest.fixture
def raw(address: str) -> Iterator[Raw]:
    client = Raw(address)
    yield client
    client.channel.close()


def usage(raw: Raw) -> tuple:
    info = raw.info()
    return info.sessions_open, info.device_memory_bytes


def test_hung_kernel_is_ended_by_the_watchdog(raw: Raw) -> None:
    baseline = usage(raw)
    session = raw.open()
    watch = Watch(raw, session)
    try:
        first = watch.wait_for(lambda e: True)
        assert first is not None and first.state == ACTIVE
        assert raw.info().quota.kernel_timeout_ms == 1000
        raw.allocate(session, 4 * MiB)
        spin = raw.spin_us(session)
        stream = raw.create_stream(session)
        raw.launch_spin(session, spin, 30_000_000, stream)  # returns at once

        state: List[session_service_pb2.KeepAliveResponse] = []

        def faulted() -> bool:
            state[:] = [raw.keep_alive(session)]
            return state[0].state == FAULTED

        assert eventually(faulted), f"still {state} {EVENTUALLY_S}s after a 1s kernel timeout"
        assert state[0].fault_code == DEADLINE_EXCEEDED
        assert "spin_us" in state[0].fault_cause
        assert "kernel timeout of 1s" in state[0].fault_cause
        # Every session-scoped call answers DEADLINE_EXCEEDED naming the kernel and the timeout.
        with pytest.raises(grpc.RpcError) as error:
            raw.memory.GetMemInfo(memory_service_pb2.GetMemInfoRequest(),
                                  metadata=raw.md(session), timeout=60)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "spin_us" in error.value.details() and "1s" in error.value.details()
        event = watch.wait_for(lambda e: e.state == FAULTED)
        assert event is not None and event.fault_code == DEADLINE_EXCEEDED
        # The worker, and its memory, are gone; the session keeps its slot until closed.
        assert eventually(lambda: usage(raw) == (baseline[0] + 1, baseline[1])), usage(raw)
        raw.close(session)
        assert watch.wait_end() == grpc.StatusCode.OK
        assert usage(raw) == baseline
    finally:
        watch.cancel()


def test_kernels_within_the_timeout_complete(raw: Raw) -> None:
    session = raw.open()
    try:
        spin = raw.spin_us(session)
        stream = raw.create_stream(session)
        # 1.5 s of work in all under a 1 s timeout: the timeout is per kernel.
        for _ in range(5):
            raw.launch_spin(session, spin, 300_000, stream)
        raw.synchronize_stream(session, stream)
        alive = raw.keep_alive(session)
        assert alive.state == ACTIVE, alive.fault_cause
    finally:
        raw.close(session)


def test_session_is_reclaimed_after_the_grace_once_its_watch_ends(raw: Raw) -> None:
    baseline = usage(raw)
    session = raw.open()
    raw.allocate(session, 2 * MiB)
    watch = Watch(raw, session)
    first = watch.wait_for(lambda e: True)
    assert first is not None and first.state == ACTIVE
    assert usage(raw) == (baseline[0] + 1, baseline[1] + 2 * MiB)
    # The client stops watching (as when it exits). GetServerInfo is no session call: polling
    # it does not keep the session alive.
    watch.cancel()
    assert watch.wait_end() == grpc.StatusCode.CANCELLED
    assert eventually(lambda: usage(raw) == baseline), usage(raw)
    with pytest.raises(grpc.RpcError) as error:
        raw.keep_alive(session)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
