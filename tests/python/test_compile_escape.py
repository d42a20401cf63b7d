"""The compile sandbox through the Python client (``gpurpc.compiler.SourceModule``).

A secret with a random marker is planted in a temporary folder; a ``gpurpcd --backend=fake``
of this test's own is started in that folder, with the marker in its environment and the
secret open on an inherited descriptor. Sources then try every route we know to make NVRTC
read it -- respelled directives, computed includes, /proc and /dev/fd paths of the daemon and
its workers, and symlinks in a toolkit include folder (``--cuda-include-dir``) that point
out of it. The marker must never come back, nor reach the daemon's log. A daemon that runs
NVRTC unconfined (``--compile-sandbox=none --allow-unsandboxed-compile``) shows that the
symlink routes are real.

Needs a local ``gpurpcd`` (``$GPURPCD_BIN``, default ``build/server/gpurpcd``); skipped with
the reason otherwise.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Iterator, List, NamedTuple, Optional, Tuple

import pytest

import gpurpc.driver as drv
from gpurpc import _devices
from gpurpc.compiler import SourceModule

REPO_ROOT = Path(__file__).resolve().parents[2]
SECRET_ENV = "GPURPC_SANDBOX_TEST_SECRET"
KERNEL = '\nextern "C" __global__ void k(int* p) { *p = 1; }\n'
SECRET_FD = 100


class Secret(NamedTuple):
    marker: str
    dir: Path
    file: Path
    link: Path
    toolkit: Path  # evil.h -> secret.h, up -> dir, ok.h


@pytest.fixture(scope="module")
def secret(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secret]:
    marker = "GPURPC_SECRET_" + secrets.token_hex(16)
    root = tmp_path_factory.mktemp("compile_escape")
    file = root / "secret.h"
    file.write_text(f"#error {marker}\n{marker} garbage;\nstatic_assert(false, \"{marker}\");\n")
    (root / "links").mkdir()
    link = root / "links" / "link.h"
    link.symlink_to(file)
    toolkit = root / "toolkit"
    toolkit.mkdir()
    (toolkit / "evil.h").symlink_to(file)
    (toolkit / "up").symlink_to(root)
    (toolkit / "ok.h").write_text("#define FAKE_TOOLKIT_OK 1\n")
    fd = os.open(file, os.O_RDONLY)
    os.dup2(fd, SECRET_FD, inheritable=True)
    os.close(fd)
    try:
        yield Secret(marker, root, file, link, toolkit)
    finally:
        os.close(SECRET_FD)


class Daemon(NamedTuple):
    address: str
    proc: subprocess.Popen
    log: Path

    def pids(self) -> List[int]:
        """The daemon and its workers."""
        pids = [self.proc.pid]
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:
                pids.append(int(entry.name))
        return pids

    def compile_sandbox(self) -> str:
        return _devices._client().list_devices(refresh=True).compile_sandbox


def _binary() -> Path:
    binary = Path(os.environ.get("GPURPCD_BIN", REPO_ROOT / "build" / "server" / "gpurpcd"))
    if not binary.is_file():
        pytest.skip(f"needs a local gpurpcd: {binary} not found (set GPURPCD_BIN)")
    return binary


# GPURPC_ESCAPE_TEST_BACKEND=cuda runs the routes against workers that hold a real CUDA
# context (the GPU run); the default is the fake backend.
BACKEND = os.environ.get("GPURPC_ESCAPE_TEST_BACKEND") or "fake"


def _start(secret: Secret, name: str, flags: List[str]) -> Daemon:
    folder = secret.dir / name
    folder.mkdir()
    socket_path = folder / "gpurpcd.sock"
    log = folder / "gpurpcd.log"
    env = dict(os.environ, **{SECRET_ENV: secret.marker})
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(_binary()), f"--backend={BACKEND}", f"--unix-socket={socket_path}",
             "--drain-timeout=0s",
             f"--cache-dir={folder / 'cache'}", *flags],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            cwd=secret.dir, pass_fds=(SECRET_FD,))
    address = f"unix:{socket_path}"
    deadline = time.monotonic() + 60
    while not socket_path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"gpurpcd did not start:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.05)
    return Daemon(address, proc, log)


def _stop(daemon: Daemon) -> None:
    daemon.proc.terminate()
    try:
        daemon.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        daemon.proc.kill()
        daemon.proc.wait()


@pytest.fixture
def session_on(secret: Secret):
    """Starts a daemon with the given flags and opens a session on it, current in this thread;
    the test's usual daemon connection is put back afterwards."""
    started: List[Tuple[Daemon, drv.Context]] = []
    previous = _devices._default_client

    def start(name: str, flags: List[str]) -> Daemon:
        daemon = _start(secret, name, flags)
        _devices._default_client = None
        deadline = time.monotonic() + 60
        while True:
            try:
                drv.init(address=daemon.address)
                break
            except Exception:  # noqa: BLE001 - not ready yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        context = drv.Device(0).make_context()
        started.append((daemon, context))
        return daemon

    try:
        yield start
    finally:
        for daemon, context in started:
            try:
                context.detach()
            except Exception:  # noqa: BLE001 - the daemon may be gone already
                pass
            _stop(daemon)
        if _devices._default_client is not None and _devices._default_client is not previous:
            _devices._default_client.close()
        _devices._default_client = previous


def _compile(source: str, options: Optional[List[str]] = None) -> str:
    """Everything a compile sends back (module log, or the error), as text."""
    try:
        module = SourceModule(source, options=options or [], no_extern_c=True)
        return module.log + module.cubin.decode("latin-1")
    except Exception as error:  # noqa: BLE001 - CompileError, or a refused request
        return f"{type(error).__name__}: {error}"


def _routes(secret: Secret, pids: List[int]) -> List[Tuple[str, str, List[str]]]:
    f = str(secret.file)
    q = f'"{f}"'
    routes = [
        ("include quoted", f"#include {q}", []),
        ("include angled", f"#include <{f}>", []),
        ("continuation in 'include'", f"#inc\\\nlude {q}", []),
        ("continuation inside the name", f'#include "{f[:4]}\\\n{f[4:]}"', []),
        ("comment after '#'", f"#/**/include {q}", []),
        ("multi-line comment", f"# /*\n*/ include {q}", []),
        ("digraph", f"%:include {q}", []),
        ("trigraph (c++03)", "?" + f"?=include {q}", ["-std=c++03"]),
        ("__has_include", f"#if __has_include({q})\n#include {q}\n#endif", []),
        ("computed include", f"#define F {q}\n#include F", []),
        ("option macro", "#include SECRET", [f"-DSECRET={q}"]),
        ("#line then __FILE__", f"#line 1 {q}\n#include __FILE__", []),
        ("identifier ending in R", f'#define FOOR 1\nint y = FOOR"(";\n#include {q}\n)";', []),
        ("symlink", f'#include "{secret.link}"', []),
        ("/proc/self/root", f'#include "/proc/self/root{f}"', []),
        ("/dev/fd", f'#include "/dev/fd/{SECRET_FD}"', []),
        ("/proc/self/environ", '#include "/proc/self/environ"', []),
        ("cwd-relative", '#include "secret.h"', []),
        ("-include", "", ["-include", f]),
        ("--pre-include", "", [f"--pre-include={f}"]),
        ("--options-file", "", [f"--options-file={f}"]),
    ]
    for pid in pids:
        for entry in ("root" + f, "cwd/secret.h", f"fd/{SECRET_FD}", "environ"):
            routes.append((f"/proc/<pid>/{entry.split('/')[0]}",
                           f'#include "/proc/{pid}/{entry}"', []))
    return [(name, text + KERNEL, options) for name, text, options in routes]


TOOLKIT_ROUTES = ["#include <evil.h>", '#include "evil.h"', "#include <up/secret.h>",
                  "#include <up/links/link.h>"]


@pytest.mark.parametrize("mode", ["auto", "namespace"])
def test_no_route_reaches_the_secret(secret: Secret, session_on, mode: str) -> None:
    daemon = session_on(mode, [f"--compile-sandbox={mode}"])
    sandbox = daemon.compile_sandbox()
    if sandbox.startswith("unavailable") and mode != "auto":
        pytest.skip(f"--compile-sandbox={mode} does not work here: {sandbox}")
    assert sandbox.endswith(" + seccomp"), sandbox
    for name, source, options in _routes(secret, daemon.pids()):
        assert secret.marker not in _compile(source, options), name
    # Normal compiles work in there.
    module = SourceModule('#include <curand_kernel.h>\n#include <cuda_fp16.h>\n' + KERNEL,
                          options=[], no_extern_c=True)
    assert module.cubin
    assert secret.marker not in daemon.log.read_text(errors="replace")


@pytest.mark.parametrize("mode", ["auto", "namespace"])
def test_toolkit_symlinks_lead_nowhere(secret: Secret, session_on, mode: str) -> None:
    daemon = session_on(f"toolkit-{mode}",
                        [f"--compile-sandbox={mode}", f"--cuda-include-dir={secret.toolkit}"])
    sandbox = daemon.compile_sandbox()
    if sandbox.startswith("unavailable") and mode != "auto":
        pytest.skip(f"--compile-sandbox={mode} does not work here: {sandbox}")
    for include in TOOLKIT_ROUTES:
        out = _compile(f"#include <ok.h>\n{include}{KERNEL}")
        assert "cannot open source file" in out, out
        assert secret.marker not in out, include
    assert secret.marker not in daemon.log.read_text(errors="replace")


def test_toolkit_symlinks_are_real_routes_without_a_sandbox(secret: Secret, session_on) -> None:
    daemon = session_on("toolkit-none", ["--compile-sandbox=none", "--allow-unsandboxed-compile",
                                         f"--cuda-include-dir={secret.toolkit}"])
    assert daemon.compile_sandbox() == (
        "none (unsandboxed compiles accepted by --allow-unsandboxed-compile)")
    for include in TOOLKIT_ROUTES:
        assert secret.marker in _compile(f"#include <ok.h>\n{include}{KERNEL}"), include


def test_unconfined_compiles_need_the_flag(secret: Secret, session_on) -> None:
    daemon = session_on("none", ["--compile-sandbox=none"])
    assert daemon.compile_sandbox().startswith("unavailable: ")
    out = _compile(KERNEL)
    assert "FAILED_PRECONDITION" in out or "failed precondition" in out.lower(), out
    assert "--allow-unsandboxed-compile" in out, out
