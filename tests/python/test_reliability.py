"""The Python client when things go wrong: call deadlines (``timeout=``, ``GPURPC_TIMEOUT``),
``detach`` and the exit path with the daemon stopped or killed, the reclaim of a killed
client's session after the grace period, an idle client that keeps its session by watching it,
a fault delivered by the watch, and a daemon restart (``SessionLost``; the same connection
makes a new context).

Each test starts its own daemon (fake backend) on a Unix socket in a temporary folder, since
most of them stop, kill or restart it. No timing assertions: what must happen is polled for
with generous deadlines, and what must not hang is given a generous upper bound.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import numpy as np
import pytest

import gpurpc
import gpurpc.admin
import gpurpc.driver as cuda
from gpurpc import _core, _devices, _framed
from gpurpc.compiler import SourceModule

from conftest import CLIENT_SRC, REPO_ROOT, _wait_ready
from kernels import FAKE_KERNELS

# How long something that must happen (a reclaim, a fault report) may take, and the bound of
# anything that must not hang: generous, for a loaded two-core machine.
EVENTUALLY_S = 30.0
MUST_NOT_HANG_S = 30.0
MiB = 1 << 20


def _binary() -> Path:
    binary = Path(os.environ.get("GPURPCD_BIN", REPO_ROOT / "build" / "server" / "gpurpcd"))
    if not binary.is_file():
        if os.environ.get("GPURPC_SKIP_DAEMON_TESTS") or os.environ.get("GPURPC_ADDRESS"):
            pytest.skip(f"gpurpcd binary {binary} not found: these tests start their own daemon")
        pytest.fail(f"gpurpcd binary {binary} not found: build it or set GPURPCD_BIN")
    return binary


def _eventually(condition: Callable[[], bool], timeout: float = EVENTUALLY_S) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _timed(f: Callable[[], object]) -> float:
    start = time.monotonic()
    f()
    return time.monotonic() - start


def _state(pid: int) -> str:
    """The process's state letter ("" when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            line = f.read()
    except OSError:
        return ""
    return line[line.rfind(")") + 2:][:1]


def _all_threads_stopped(pid: int) -> bool:
    """SIGSTOP takes effect a moment after kill() returns; a thread still running could
    answer a call."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    states = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                line = f.read()
        except OSError:
            continue
        states.append(line[line.rfind(")") + 2:][:1])
    return bool(states) and all(s in ("T", "t") for s in states)


class Daemon:
    """A gpurpcd (fake backend) of one test, on a Unix socket in its own folder."""

    def __init__(self, folder: Path, *flags: str, socket: Optional[Path] = None,
                 idle_timeout: str = "30s") -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.socket = socket or folder / "gpurpcd.sock"
        self.address = f"unix:{self.socket}"
        self.log_path = folder / "gpurpcd.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPURPC_")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(_binary()), "--backend=fake", "--listen=", f"--unix-socket={self.socket}",
                 "--drain-timeout=0s",
                 f"--cache-dir={folder / 'cache'}", f"--session-idle-timeout={idle_timeout}",
                 *flags],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.stopped = False
        self.stopped_workers: List[int] = []
        _wait_ready(self.address, self.proc, self.log_path, deadline_s=60)

    def workers(self) -> List[int]:
        """The pids of the daemon's worker processes (its children) now."""
        pids: List[int] = []
        try:
            for task in os.listdir(f"/proc/{self.proc.pid}/task"):
                with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                    pids.extend(int(p) for p in f.read().split())
        except OSError:
            pass
        return pids

    def stop(self) -> None:
        """Stops the front end and its workers: a same-host context's commands go straight
        to its worker (the framed channel), so stopping the front end alone stops no
        command."""
        self.stopped_workers = self.workers()
        for pid in [self.proc.pid] + self.stopped_workers:
            os.kill(pid, signal.SIGSTOP)
        self.stopped = True
        for pid in [self.proc.pid] + self.stopped_workers:
            assert _eventually(lambda: _all_threads_stopped(pid), 10), \
                f"gpurpcd process {pid} did not stop"

    def cont(self) -> None:
        if self.stopped:
            for pid in [self.proc.pid] + self.stopped_workers:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self.stopped = False

    def kill(self) -> None:
        """Kills the front end and waits until its workers, which follow it within moments
        (they watch their parent), are gone too."""
        self.cont()
        workers = self.workers()
        self.proc.kill()
        self.proc.wait(timeout=30)
        assert _eventually(lambda: all(_state(pid) in ("", "Z") for pid in workers), 10), \
            f"the workers {workers} outlived their daemon"

    def close(self) -> None:
        self.cont()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Starts daemons for a test (``daemons(*flags, ...)``) and ends them afterwards; the
    connection of ``gpurpc.driver`` is restored too."""
    started: List[Daemon] = []
    saved = _devices._default_client

    def start(*flags: str, name: str = "", socket: Optional[Path] = None,
              idle_timeout: str = "30s") -> Daemon:
        daemon = Daemon(tmp_path / (name or f"d{len(started)}"), *flags, socket=socket,
                        idle_timeout=idle_timeout)
        started.append(daemon)
        return daemon

    try:
        yield start
    finally:
        for daemon in started:
            daemon.close()
        _devices._default_client = saved


def _context() -> cuda.Context:
    """A new context on device 0 of the current connection, not left on the thread's stack."""
    ctx = cuda.Device(0).make_context()
    cuda.Context.pop()
    return ctx


def _run_python(code: str, **popen: object) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(CLIENT_SRC))
    env.update(popen.pop("env", {}))  # type: ignore[arg-type]
    return subprocess.Popen(  # type: ignore[call-overload]
        [sys.executable, "-c", code], env=env, text=True, **popen)


# -- deadlines ---------------------------------------------------------------------------------

def test_synchronize_of_a_long_kernel_ends_at_its_deadline(daemons: Callable[..., Daemon]) -> None:
    daemon = daemons()
    cuda.init(address=daemon.address, timeout=90)
    ctx = _context()
    try:
        assert ctx.timeout == 90
        spin = SourceModule(FAKE_KERNELS).get_function("spin_us")
        spin(np.uint64(30_000_000), block=(1, 1, 1), grid=(1, 1))  # 30 s of "GPU" work

        started = time.monotonic()
        with pytest.raises(gpurpc.CallTimeoutError) as info:
            ctx.synchronize(timeout=1)
        assert time.monotonic() - started < MUST_NOT_HANG_S
        assert "Context.synchronize" in str(info.value) and "1 s" in str(info.value)
        assert "does not cancel GPU work" in str(info.value)
        assert info.value.code.name == "DEADLINE_EXCEEDED"
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, cuda.Error)

        # The context's own timeout bounds a synchronize without one.
        ctx.timeout = 0.5
        started = time.monotonic()
        with pytest.raises(gpurpc.CallTimeoutError, match="0.5 s"):
            ctx.synchronize()
        assert time.monotonic() - started < MUST_NOT_HANG_S

        # A deadline does not fault the session.
        ctx.timeout = None  # back to the connection's
        assert ctx.timeout == 90
        assert ctx.state == "active" and ctx.fault is None
        ctx.push()
        try:
            free, total = cuda.mem_get_info()
            assert total > 0
        finally:
            cuda.Context.pop()
    finally:
        took = _timed(ctx.detach)  # does not wait for the kernel
    assert took < MUST_NOT_HANG_S
    assert ctx.state == "closed"


def test_calls_of_a_stopped_daemon_end_at_the_call_timeout(
        daemons: Callable[..., Daemon]) -> None:
    daemon = daemons()
    cuda.init(address=daemon.address, timeout=1)
    ctx = _context()
    ctx.push()
    try:
        buf = cuda.mem_alloc(16 * MiB)
        host = np.ones(16 * MiB // 4, np.float32)
        daemon.stop()
        with pytest.raises(gpurpc.CallTimeoutError, match="mem_get_info.*1 s"):
            cuda.mem_get_info()
        # Streamed transfers (> 8 MiB) end when a chunk makes no progress for the timeout.
        assert _timed(lambda: pytest.raises(gpurpc.CallTimeoutError, cuda.memcpy_htod, buf,
                                            host)) < MUST_NOT_HANG_S
        assert _timed(lambda: pytest.raises(gpurpc.CallTimeoutError, cuda.memcpy_dtoh, host,
                                            buf)) < MUST_NOT_HANG_S
        # Commands wait for their answer at most the timeout too.
        with pytest.raises(gpurpc.CallTimeoutError, match="Context.synchronize"):
            cuda.memset_d32_async(buf, 7, 16)
            cuda.Context.synchronize()
    finally:
        cuda.Context.pop()
        took = _timed(ctx.detach)
        daemon.cont()
    assert took < MUST_NOT_HANG_S


def test_the_timeout_comes_from_timeout_or_the_environment(
        daemons: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = daemons()
    for value, expected in (("90s", 90.0), ("2.5", 2.5), ("500ms", 0.5), ("10m", 600.0),
                            ("1h", 3600.0)):
        monkeypatch.setenv("GPURPC_TIMEOUT", value)
        assert _core.Client(daemon.address).timeout == expected
    for value in ("soon", "-3", "0", "1e999x"):
        monkeypatch.setenv("GPURPC_TIMEOUT", value)
        with pytest.raises(cuda.LogicError, match="GPURPC_TIMEOUT"):
            _core.Client(daemon.address)
    monkeypatch.setenv("GPURPC_TIMEOUT", "90s")
    assert _core.Client(daemon.address, timeout=7).timeout == 7  # the parameter wins
    assert math.isinf(_core.Client(daemon.address, timeout=math.inf).timeout)
    with pytest.raises(cuda.LogicError, match="timeout= must be positive"):
        _core.Client(daemon.address, timeout=0)
    monkeypatch.delenv("GPURPC_TIMEOUT")
    assert _core.Client(daemon.address).timeout == _core.DEFAULT_TIMEOUT_S == 300


# -- detach and exit ---------------------------------------------------------------------------

def test_detach_returns_while_the_daemon_is_stopped(daemons: Callable[..., Daemon]) -> None:
    daemon = daemons()
    cuda.init(address=daemon.address, timeout=120)
    ctx = _context()
    ctx.push()
    buf = cuda.mem_alloc(1024)
    cuda.memset_d32(buf, 0, 256)
    cuda.Context.pop()
    daemon.stop()
    try:
        # A synchronize waiting on the stopped daemon (its timeout is 120 s) ends when the
        # context is detached.
        errors: List[BaseException] = []

        def wait() -> None:
            try:
                cuda.memset_d32_async(buf, 1, 256)
                ctx.synchronize()
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        # The synchronize is on its way: its batch is sent and unanswered (the daemon is
        # stopped), so the waiter waits for it.
        assert _eventually(lambda: any(
            "Context.synchronize" in batch.labels
            for batch in list(ctx._core.commands._inflight))), "the synchronize was not sent"
        assert _timed(ctx.detach) < MUST_NOT_HANG_S
        waiter.join(MUST_NOT_HANG_S)
        assert not waiter.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], cuda.Error), errors
        with pytest.raises(cuda.LogicError, match="detached"):
            cuda.memcpy_htod(buf, np.zeros(256, np.uint32))
    finally:
        daemon.cont()
    # The connection works once the daemon runs again.
    again = _context()
    again.push()
    try:
        assert cuda.mem_get_info()[1] > 0
    finally:
        cuda.Context.pop()
        again.detach()


def test_the_exit_path_returns_while_the_daemon_is_stopped(
        daemons: Callable[..., Daemon]) -> None:
    daemon = daemons()
    child = _run_python(
        "import sys, gpurpc.autoinit, gpurpc.driver as cuda\n"
        "buf = cuda.mem_alloc(64)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n",  # then exit: autoinit detaches at exit
        env={"GPURPC_ADDRESS": daemon.address, "GPURPC_TIMEOUT": "120"},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready", child.stderr.read() if child.stderr \
            else ""
        daemon.stop()
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(MUST_NOT_HANG_S)
        assert child.returncode == 0, child.stderr.read() if child.stderr else ""
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        daemon.cont()


def test_detach_returns_when_the_daemon_was_killed(daemons: Callable[..., Daemon]) -> None:
    daemon = daemons()
    cuda.init(address=daemon.address, timeout=120)
    ctx = _context()
    ctx.push()
    try:
        buf = cuda.mem_alloc(1024)
        cuda.memset_d32(buf, 0, 256)
        daemon.kill()
        assert _timed(lambda: pytest.raises(cuda.Error, cuda.memcpy_dtoh,
                                            np.empty(256, np.uint32), buf)) < MUST_NOT_HANG_S
        assert _timed(lambda: pytest.raises(cuda.Error, cuda.Context.synchronize)) \
            < MUST_NOT_HANG_S
    finally:
        cuda.Context.pop()
        took = _timed(ctx.detach)
    assert took < MUST_NOT_HANG_S


# -- liveness ----------------------------------------------------------------------------------

def test_a_killed_clients_session_is_reclaimed_after_the_grace(
        daemons: Callable[..., Daemon]) -> None:
    # The idle timeout is far away: only the grace after the watch ended can reclaim it.
    daemon = daemons("--session-grace=2s", idle_timeout="600s")
    client = _core.Client(daemon.address, timeout=60)
    try:
        assert client.server_info().sessions_open == 0
        child = _run_python(
            "import time, gpurpc.autoinit as a\n"
            "print(a.context.session_id, flush=True)\n"
            "time.sleep(300)\n",  # held open until the test kills it: the sleep is the point
            env={"GPURPC_ADDRESS": daemon.address},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert child.stdout is not None
            line = child.stdout.readline().strip()
            assert line.isdigit(), child.stderr.read() if child.stderr else ""
            assert client.server_info().sessions_open == 1
        finally:
            child.kill()
            child.wait()
        assert _eventually(lambda: client.server_info().sessions_open == 0), \
            f"session {line} of the killed client is still open"
    finally:
        client.close()


def test_an_idle_client_keeps_its_session_by_watching_it(daemons: Callable[..., Daemon]) -> None:
    daemon = daemons("--session-grace=2s", idle_timeout="1s")
    cuda.init(address=daemon.address, timeout=60)
    ctx = _context()
    ctx.push()
    try:
        data = np.arange(16, dtype=np.float32)
        buf = cuda.to_device(data)
        time.sleep(3.5)  # no call for several idle timeouts, and longer than the grace
        assert ctx.state == "active"
        assert np.array_equal(cuda.from_device_like(buf, data), data)
    finally:
        cuda.Context.pop()
        ctx.detach()


def test_the_watch_delivers_a_fault_and_the_next_call_raises_it_at_once(
        daemons: Callable[..., Daemon]) -> None:
    daemon = daemons()
    cuda.init(address=daemon.address, timeout=120)
    ctx = _context()
    ctx.push()
    try:
        fault = SourceModule(FAKE_KERNELS).get_function("fault_illegal_address")
        fault(block=(1, 1, 1), grid=(1, 1))
        # The call that observes the fault.
        with pytest.raises(cuda.LaunchError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            cuda.Context.synchronize()
        # The watch reports it, without a call.
        assert _eventually(lambda: ctx.state == "faulted"), ctx.state
        assert isinstance(ctx.fault, cuda.LaunchError)
        assert "CUDA_ERROR_ILLEGAL_ADDRESS" in str(ctx.fault)
        # Raised from what the watch knows: no round trip (a stopped daemon would hold a call
        # for its 120 s timeout).
        daemon.stop()
        try:
            started = time.monotonic()
            with pytest.raises(cuda.LaunchError, match="FAULTED.*CUDA_ERROR_ILLEGAL_ADDRESS"):
                cuda.mem_alloc(16)
            assert time.monotonic() - started < MUST_NOT_HANG_S
            assert _timed(lambda: pytest.raises(cuda.LaunchError, cuda.mem_get_info)) \
                < MUST_NOT_HANG_S
        finally:
            daemon.cont()
    finally:
        cuda.Context.pop()
        ctx.detach()


def test_the_kernel_watchdog_faults_the_context_with_the_daemons_deadline_exceeded(
        daemons: Callable[..., Daemon]) -> None:
    daemon = daemons("--kernel-timeout=1s")
    cuda.init(address=daemon.address, timeout=120)
    ctx = _context()
    ctx.push()
    try:
        spin = SourceModule(FAKE_KERNELS).get_function("spin_us")
        spin(np.uint64(30_000_000), block=(1, 1, 1), grid=(1, 1))
        # The watchdog ends the worker after 1 s; the watch reports it.
        assert _eventually(lambda: ctx.state == "faulted"), ctx.state
        # The daemon's DEADLINE_EXCEEDED is a fault (LaunchError), not a call's own timeout.
        with pytest.raises(cuda.LaunchError, match="spin_us") as info:
            cuda.mem_get_info()
        assert info.value.code.name == "DEADLINE_EXCEEDED"
        assert not isinstance(info.value, gpurpc.CallTimeoutError)
        assert "open a new one" in str(info.value)
    finally:
        cuda.Context.pop()
        ctx.detach()


# -- restart -----------------------------------------------------------------------------------

def test_after_a_daemon_restart_the_context_is_lost_and_a_new_one_works(
        daemons: Callable[..., Daemon], tmp_path: Path) -> None:
    # Both daemons serve one socket path, as a restarted daemon does.
    socket = tmp_path / "shared" / "gpurpcd.sock"
    socket.parent.mkdir(mode=0o700)
    first = daemons(name="first", socket=socket)
    cuda.init(address=first.address, timeout=60)
    first_instance = gpurpc.admin.server_info().daemon_instance
    old = _context()
    old.push()
    old_buf = cuda.mem_alloc(64)
    cuda.Context.pop()

    first.kill()
    second = daemons(name="second", socket=socket)
    assert second.address == first.address

    # Once the connection is back, the old context's calls raise SessionLost saying why.
    old.push()
    try:
        raised: List[BaseException] = []

        def lost() -> bool:
            try:
                cuda.mem_get_info()
            except cuda.RuntimeError:  # UNAVAILABLE: not reconnected yet
                return False
            except cuda.Error as e:
                raised.append(e)
                return True
            return True

        assert _eventually(lost)
        error = raised[0] if raised else None
        assert isinstance(error, gpurpc.SessionLost), repr(error)
        assert isinstance(error, cuda.LogicError)
        assert "restarted" in str(error) and "make_context" in str(error)
        assert error.code.name == "NOT_FOUND"
        # The watch learns it too; every call raises it at once.
        assert _eventually(lambda: old.state == "lost"), old.state
        assert isinstance(old.fault, gpurpc.SessionLost)
        with pytest.raises(gpurpc.SessionLost, match="restarted"):
            cuda.memcpy_dtoh(np.empty(16, np.float32), old_buf)
    finally:
        cuda.Context.pop()

    # The same connection makes a new context right away, and it works.
    assert gpurpc.admin.server_info().daemon_instance != first_instance
    new = _context()
    new.push()
    try:
        data = np.arange(32, dtype=np.int32)
        assert np.array_equal(cuda.from_device_like(cuda.to_device(data), data), data)
        assert new.state == "active"
    finally:
        cuda.Context.pop()
    assert _timed(old.detach) < MUST_NOT_HANG_S  # prompt and harmless
    new.detach()


# -- the framed command channel (a same-host context's commands, straight to its worker) -------

@pytest.mark.parametrize("first", ["small", "large"])
def test_the_kernel_watchdog_ends_a_framed_synchronize_with_its_cause(
        daemons: Callable[..., Daemon], first: str) -> None:
    """The watchdog kills the worker, which ends the framed channel without a reply: the
    waiting synchronize raises the daemon's DEADLINE_EXCEEDED naming the kernel (the front end
    tells the session's watch), at once and not after the call timeout -- also after batches
    too large for the socket's buffer, which the channel's writer thread sends."""
    daemon = daemons("--kernel-timeout=1s")
    cuda.init(address=daemon.address, timeout=120)
    ctx = _context()
    ctx.push()
    try:
        spin = SourceModule(FAKE_KERNELS).get_function("spin_us")
        buf = cuda.mem_alloc(1 << 20)
        if first == "large":
            for _ in range(8):  # inline uploads (below the staging size), queued into batches
                cuda.memcpy_htod_async(buf, np.ones(250 << 10, np.uint8))
        cuda.Context.synchronize()
        assert isinstance(ctx._core.commands._call, _framed.FramedCall)
        spin(np.uint64(30_000_000), block=(1, 1, 1), grid=(1, 1))
        started = time.monotonic()
        with pytest.raises(cuda.LaunchError, match="spin_us") as info:
            cuda.Context.synchronize()
        assert time.monotonic() - started < MUST_NOT_HANG_S
        assert info.value.code.name == "DEADLINE_EXCEEDED"
        assert not isinstance(info.value, gpurpc.CallTimeoutError)
    finally:
        cuda.Context.pop()
        ctx.detach()


def test_a_stopped_front_end_delays_the_first_command_by_the_open_bound_at_most(
        daemons: Callable[..., Daemon]) -> None:
    """Opening the framed channel asks the front end for a ticket: while it does not answer,
    the session's first command waits at most the open's bound, then goes to the gRPC stream."""
    daemon = daemons()
    cuda.init(address=daemon.address, timeout=120)
    ctx = _context()
    ctx.push()
    try:
        buf = cuda.mem_alloc(1024)  # a unary call: no command yet
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # the front end only
        try:
            assert _eventually(lambda: _all_threads_stopped(daemon.proc.pid), 10)
            started = time.monotonic()
            cuda.memset_d32_async(buf, 7, 256)
            assert time.monotonic() - started < _framed.OPEN_TIMEOUT_S + 5
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        out = np.empty(256, np.uint32)
        cuda.memcpy_dtoh(out, buf)
        assert (out == 7).all()
        assert not isinstance(ctx._core.commands._call, _framed.FramedCall)
    finally:
        cuda.Context.pop()
        ctx.detach()
