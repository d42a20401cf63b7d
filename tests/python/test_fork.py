"""fork(): a child inherits its parent's connection and contexts but must never use or close
them (a CloseSession, a cancelled call or a stray batch from the child would end or corrupt
the parent's session). The child gets a clear error for the parent's contexts and can make
contexts of its own; the parent goes on as if nothing happened.

Each case runs a program in a fresh interpreter, so that the child's exit is a normal one
(atexit handlers and finalizers run, as in a program that forks), not pytest's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

from conftest import CLIENT_SRC, REPO_ROOT, _wait_ready

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

# The parent: a context made by autoinit (whose atexit handler detaches it, in the child
# too), a buffer and a GPUArray with known bytes, then a fork. The child's checks are
# CHILD; it exits normally with status 0 when they all pass. The parent then checks that its
# session still holds its bytes and works.
_PROGRAM = """
import gc, os, sys
import numpy as np
import gpurpc.autoinit
import gpurpc.driver as cuda
import gpurpc.gpuarray as gpuarray
from gpurpc import _core

ctx = gpurpc.autoinit.context
device = gpurpc.autoinit.device
data = np.arange(4096, dtype=np.float32)
buf = cuda.mem_alloc(data.nbytes)
cuda.memcpy_htod(buf, data)
array = gpuarray.to_gpu(data * 2)
cuda.Context.synchronize()
session_id = ctx._core.session_id

def expect_fork_error(what, call):
    try:
        call()
    except cuda.LogicError as e:
        text = str(e)
        assert f"belongs to process {os.getppid()}" in text, (what, text)
        assert "fork" in text, (what, text)
        assert f"session {session_id}" in text, (what, text)
        return
    raise AssertionError(f"{what}: the parent's context was usable in the child")

pid = os.fork()
if pid == 0:
    try:
{child}
    except BaseException as e:
        import traceback
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(3)
    sys.exit(0)  # a normal exit: atexit (autoinit detaches its context) and finalizers run

_, status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(status)
assert code == 0, f"the child failed (exit status {code})"
out = np.empty_like(data)
cuda.memcpy_dtoh(out, buf)
assert np.array_equal(out, data), "the parent's buffer changed"
assert np.array_equal(array.get(), data * 2), "the parent's GPUArray changed"
more = gpuarray.to_gpu(data + 1)
assert np.array_equal(more.get(), data + 1)
cuda.Context.synchronize()
assert ctx.state == "active", ctx.state
print("PARENT OK", flush=True)
"""


def _run(daemon: str, child: str, fork_support: bool = False) -> subprocess.CompletedProcess:
    program = _PROGRAM.replace("{child}", textwrap.indent(textwrap.dedent(child), " " * 8))
    env = dict(os.environ, GPURPC_ADDRESS=daemon,
               PYTHONPATH=os.pathsep.join([str(CLIENT_SRC), os.environ.get("PYTHONPATH", "")]))
    env.pop("GPURPC_DEVICE", None)
    if fork_support:
        # gRPC's rule: a child makes connections of its own reliably only with this set
        # before grpc is imported (without it they fail now and then).
        env["GRPC_ENABLE_FORK_SUPPORT"] = "1"
    result = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "PARENT OK" in result.stdout, (
        f"exit status {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def test_a_child_that_only_exits_leaves_the_parent_session(daemon: str) -> None:
    _run(daemon, "pass")


def test_the_parents_context_raises_in_the_child_and_stays_the_parents(daemon: str) -> None:
    _run(daemon, """
        out = np.empty_like(data)
        expect_fork_error("memcpy_dtoh", lambda: cuda.memcpy_dtoh(out, buf))
        expect_fork_error("GPUArray.get", lambda: array.get())
        expect_fork_error("mem_alloc", lambda: cuda.mem_alloc(16))
        expect_fork_error("Context.synchronize", lambda: cuda.Context.synchronize())
        expect_fork_error("to_gpu", lambda: gpuarray.to_gpu(data))
        # Garbage of the parent's handles frees nothing of the parent's.
        del buf, array
        gc.collect()
        ctx.detach()  # closes nothing on the daemon: the session is the parent's
        """)


def test_a_child_makes_contexts_of_its_own(daemon: str) -> None:
    _run(daemon, """
        # The parent's Device object reconnects for the child.
        own = device.make_context()
        assert own._core.session_id != session_id
        mine = gpuarray.to_gpu(data * 3)
        assert np.array_equal(mine.get(), data * 3)
        # A context made from a new Device object, and the parent's connection left alone.
        other = cuda.Device(0).make_context()
        assert np.array_equal(gpuarray.to_gpu(data).get(), data)
        other.pop()
        other.detach()
        own.pop()
        own.detach()
        """, fork_support=True)


def test_an_inherited_connection_refuses_calls(daemon: str) -> None:
    _run(daemon, """
        inherited = ctx._core.client
        assert inherited.inherited_from == os.getppid()
        try:
            inherited.list_devices(refresh=True)
        except cuda.LogicError as e:
            assert "gpurpc.driver.init()" in str(e), str(e)
        else:
            raise AssertionError("the parent's connection answered in the child")
        inherited.close()  # leaves the parent's channel open
        """)


_POOL_PROGRAM = """
import multiprocessing, sys
import numpy as np
import gpurpc.driver as cuda
import gpurpc.gpuarray as gpuarray

def work(i):
    # A new Device in the child: its connection goes where the parent's init() went.
    ctx = cuda.Device(0).make_context()
    try:
        return float(gpuarray.to_gpu(np.full(256, i, np.float32)).get().sum())
    finally:
        ctx.pop()
        ctx.detach()

if __name__ == "__main__":
    cuda.init(address=sys.argv[1])
    ctx = cuda.Device(0).make_context()
    kept = gpuarray.to_gpu(np.arange(64, dtype=np.float32))
    with multiprocessing.get_context("fork").Pool(3) as pool:
        sums = pool.map(work, range(6))
    assert sums == [256.0 * i for i in range(6)], sums
    assert np.array_equal(kept.get(), np.arange(64, dtype=np.float32))
    assert ctx.state == "active", ctx.state
    print("PARENT OK", flush=True)
"""


def test_a_fork_pool_works_beside_the_parents_context(daemon: str) -> None:
    """multiprocessing with fork: an address given to init() (not in the environment) is
    where the children connect; the parent's context is untouched by their exits."""
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(CLIENT_SRC), os.environ.get("PYTHONPATH", "")]))
    env.pop("GPURPC_ADDRESS", None)
    env.pop("GPURPC_DEVICE", None)
    env["GRPC_ENABLE_FORK_SUPPORT"] = "1"  # gRPC's rule for connections made in a child
    result = subprocess.run([sys.executable, "-c", _POOL_PROGRAM, daemon], env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 and "PARENT OK" in result.stdout, (
        f"exit status {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")


def test_a_child_without_grpc_fork_support_is_told_to_set_it(daemon: str) -> None:
    """Without GRPC_ENABLE_FORK_SUPPORT, a connection made in a child forked after gRPC was in
    use may fail at random or abort inside gRPC: every way to connect raises a LogicError
    that names the variable instead. A process started by 'spawn' is no forked child."""
    _run(daemon, """
        import multiprocessing
        from grpc._cython import cygrpc
        assert not cygrpc.is_fork_support_enabled()
        tries = (("the parent's Device.make_context", lambda: device.make_context()),
                 ("Device(0)", lambda: cuda.Device(0)),
                 ("init()", lambda: cuda.init()),
                 ("Client()", lambda: cuda.Client(os.environ["GPURPC_ADDRESS"])))
        for what, call in tries:
            try:
                call()
            except cuda.LogicError as e:
                text = str(e)
                assert "GRPC_ENABLE_FORK_SUPPORT=1" in text, (what, text)
                assert "fork" in text and "spawn" in text, (what, text)
            else:
                raise AssertionError(f"{what} connected without gRPC's fork support")
        spawned = multiprocessing.get_context("spawn").Process(target=cuda.get_driver_version)
        spawned.start()
        spawned.join(60)
        assert spawned.exitcode == 0, spawned.exitcode
        """)


@pytest.fixture(scope="module")
def second_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Another gpurpcd on the fake backend (a Unix socket), for programs that use two."""
    binary = Path(os.environ.get("GPURPCD_BIN", REPO_ROOT / "build" / "server" / "gpurpcd"))
    if not binary.is_file():
        message = f"gpurpcd binary {binary} not found: build it or set GPURPCD_BIN"
        if os.environ.get("GPURPC_SKIP_DAEMON_TESTS"):
            pytest.skip(message)
        pytest.fail(message)
    tmp = tmp_path_factory.mktemp("second-gpurpcd")
    log_path = tmp / "gpurpcd.log"
    socket_path = tmp / "gpurpcd.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPURPC_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(binary), "--backend=fake", "--listen=", "--session-idle-timeout=5s",
             "--drain-timeout=0s", f"--cache-dir={tmp / 'cache'}",
             f"--unix-socket={socket_path}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        address = f"unix:{socket_path}"
        _wait_ready(address, proc, log_path)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# Two daemons: SETUP (per case) leaves device_a on the default daemon, device_b (and
# device_b2, the same device in another Device object) on the other one, and a context of
# the parent's on each; then a fork. The child reconnects the inherited devices (CHILD's
# checks), the parent then checks that its contexts still hold their bytes.
_TWO_DAEMONS_PROGRAM = """
import os, sys
import numpy as np
import gpurpc.driver as cuda
import gpurpc.gpuarray as gpuarray

default, other = sys.argv[1], sys.argv[2]
data = np.arange(1024, dtype=np.float32)
{setup}
assert device_a.daemon_target == default and device_b.daemon_target == other
kept = []
for device in (device_a, device_b):
    ctx = device.make_context()
    kept.append((ctx, gpuarray.to_gpu(data * 2)))
    cuda.Context.pop()

def opened_on(device, target):
    ctx = device.make_context()
    assert ctx._core.client.target == target, (ctx._core.client.target, target)
    assert np.array_equal(gpuarray.to_gpu(data).get(), data)
    cuda.Context.pop()
    return ctx

pid = os.fork()
if pid == 0:
    try:
{child}
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(3)
    sys.exit(0)

_, status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(status)
assert code == 0, f"the child failed (exit status {code})"
for ctx, array in kept:
    ctx.push()
    assert np.array_equal(array.get(), data * 2), "the parent's GPUArray changed"
    cuda.Context.pop()
print("PARENT OK", flush=True)
"""


def _run_two(daemon: str, other: str, setup: str, child: str) -> None:
    program = (_TWO_DAEMONS_PROGRAM.replace("{setup}", textwrap.dedent(setup))
               .replace("{child}", textwrap.indent(textwrap.dedent(child), " " * 8)))
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(CLIENT_SRC), os.environ.get("PYTHONPATH", "")]))
    env.pop("GPURPC_ADDRESS", None)
    env.pop("GPURPC_DEVICE", None)
    env["GRPC_ENABLE_FORK_SUPPORT"] = "1"  # gRPC's rule for connections made in a child
    result = subprocess.run([sys.executable, "-c", program, daemon, other], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "PARENT OK" in result.stdout, (
        f"exit status {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")


def test_an_inherited_device_of_another_daemon_leaves_the_default_connection(
        daemon: str, second_daemon: str) -> None:
    """Devices of two connections (init() to the other daemon, then to the default one):
    in the child, the other daemon's devices reconnect there through one connection of their
    own, and the child's default connection stays the default daemon's."""
    _run_two(daemon, second_daemon, """
        cuda.init(address=other)
        device_b, device_b2 = cuda.Device(0), cuda.Device(0)
        cuda.init(address=default)  # devices made before keep their connection
        device_a = cuda.Device(0)
        """, """
        own_b = opened_on(device_b, other)
        assert cuda.Device(0).daemon_target == default, cuda.Device(0).daemon_target
        own_b2 = opened_on(device_b2, other)
        assert device_b2 == device_b  # the other daemon's devices share one connection
        assert own_b2._core.client is own_b._core.client
        own_a = opened_on(device_a, default)
        assert device_a == cuda.Device(0)  # the child's default connection
        assert own_a._core.client is not own_b._core.client
        assert cuda.Device(0).daemon_target == default
        assert opened_on(device_b, other)._core.client is own_b._core.client
        """)


def test_an_inherited_device_of_a_daemon_list_goes_through_the_childs_list(
        daemon: str, second_daemon: str) -> None:
    """init() with both daemons: in the child, a device of the second one reconnects through
    the child's own connection to both (where the parent's init() went); it does not become
    a connection to that daemon alone."""
    _run_two(daemon, second_daemon, """
        cuda.init(address=f"{default},{other}")
        devices = [cuda.Device(i) for i in range(cuda.Device.count())]
        device_a = [d for d in devices if d.daemon_target == default][0]
        device_b = [d for d in devices if d.daemon_target == other][0]
        count = len(devices)
        """, """
        opened_on(device_b, other)
        assert cuda.Device.count() == count, (cuda.Device.count(), count)
        assert device_b in [cuda.Device(i) for i in range(count)]
        opened_on(device_a, default)
        assert device_a == cuda.Device(0)
        assert cuda.Device.count() == count
        """)
