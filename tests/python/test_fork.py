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

import pytest

from conftest import CLIENT_SRC

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
