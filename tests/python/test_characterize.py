"""gpurpc.characterize (pycuda.characterize) and gpurpc.autoprimaryctx. The sizeof kernel
compiles and bad types fail on the fake backend; the sizes themselves need a GPU (marked gpu)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import warnings

import grpc
import pytest

import gpurpc.driver as cuda
from gpurpc import characterize
from gpurpc._core import _make_callable
from gpurpc.compiler import CompileError, SourceModule
from gpurpc.v1 import session_service_pb2

from conftest import CLIENT_SRC

POINT_PREAMBLE = "struct point3 { double x; float y; char tag; };"


def test_platform_bits() -> None:
    assert characterize.platform_bits() == 8 * ctypes.sizeof(ctypes.c_void_p)
    assert characterize.platform_bits() in (32, 64)


def test_capabilities_follow_the_compute_capability(ctx: cuda.Context) -> None:
    cc = cuda.Context.get_device().compute_capability()
    assert characterize.has_stack() is (cc >= (2, 0))
    assert characterize.has_double_support() is (cc >= (1, 3))


@pytest.mark.parametrize("type_name,preamble", [
    ("int", ""), ("double", ""), ("float4", ""), ("void *", ""), ("unsigned long long", ""),
    ("point3", POINT_PREAMBLE), ("struct point3", POINT_PREAMBLE),
])
def test_sizeof_kernel_compiles(ctx: cuda.Context, type_name: str, preamble: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mod = SourceModule(characterize._sizeof_source(type_name, preamble), no_extern_c=True)
    assert mod.cubin


def test_sizeof_of_an_unknown_type_is_a_compile_error(ctx: cuda.Context) -> None:
    with pytest.raises(CompileError, match="no_such_type"):
        characterize.sizeof("no_such_type")
    with pytest.raises(CompileError):
        characterize.sizeof("point3")  # defined only by a preamble


def test_sizeof_checks_its_arguments(ctx: cuda.Context) -> None:
    with pytest.raises(TypeError, match="type_name must be a non-empty string"):
        characterize.sizeof(4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="type_name must be a non-empty string"):
        characterize.sizeof("  ")
    with pytest.raises(TypeError, match="preamble must be a string"):
        characterize.sizeof("int", preamble=None)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_sizeof_measures_device_types(ctx: cuda.Context) -> None:
    assert characterize.sizeof("char") == 1
    assert characterize.sizeof("int") == 4
    assert characterize.sizeof("double") == 8
    assert characterize.sizeof("long long") == 8
    assert characterize.sizeof("void *") == 8
    assert characterize.sizeof("float4") == 16
    assert characterize.sizeof("double3") == 24
    assert characterize.sizeof("point3", POINT_PREAMBLE) == 16
    assert characterize.sizeof("point3", preamble=POINT_PREAMBLE) == 16
    assert characterize.sizeof(" int ") == 4  # memoized under the stripped name


@pytest.mark.gpu
def test_gpu_capabilities(ctx: cuda.Context) -> None:
    assert characterize.has_stack() and characterize.has_double_support()


# -- autoprimaryctx (in a subprocess: it acts at import and at exit) --------------------------

def _run_python(code: str, env: dict = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=str(CLIENT_SRC))
    full_env.pop("GPURPC_DEVICE", None)
    full_env.pop("CUDA_DEVICE", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def _session_gone(address: str, session_id: int) -> bool:
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        keep_alive = _make_callable(channel, "SessionService.KeepAlive")
        try:
            keep_alive(session_service_pb2.KeepAliveRequest(),
                       metadata=(("gpurpc-session", str(session_id)),), timeout=10)
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.NOT_FOUND
    return False


def test_autoprimaryctx_opens_a_current_session_and_closes_it_at_exit(daemon: str) -> None:
    result = _run_python(
        "import gpurpc.autoprimaryctx as a, gpurpc.driver as cuda\n"
        "assert cuda.Context.get_current() is a.context\n"
        "assert a.device == cuda.Device(0)\n"
        "assert a.context.state == 'active'\n"
        "x = cuda.mem_alloc(64)\n"
        "cuda.memset_d32(x, 7, 16)\n"
        "print(a.context.session_id)\n")
    assert result.returncode == 0, result.stderr
    assert _session_gone(daemon, int(result.stdout.strip()))


def test_autoprimaryctx_honours_the_device_variables(daemon: str) -> None:
    code = "import gpurpc.autoprimaryctx as a\nprint(a.device.ordinal)\n"
    for var in ("GPURPC_DEVICE", "CUDA_DEVICE"):
        result = _run_python(code, {var: "0"})
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "0"
    result = _run_python(code, {"GPURPC_DEVICE": "99"})
    assert result.returncode != 0
    assert "invalid device ordinal 99" in result.stderr


def test_autoprimaryctx_reports_an_unreachable_daemon(daemon: str) -> None:
    result = _run_python("import gpurpc.autoprimaryctx\n",
                         {"GPURPC_ADDRESS": "unix:/nonexistent/gpurpcd.sock"})
    assert result.returncode != 0
    assert "unix:/nonexistent/gpurpcd.sock" in result.stderr
