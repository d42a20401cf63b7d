"""PyCUDA's ``pycuda.compiler``: ``SourceModule`` and ``compile``, compiled by the daemon's NVRTC.

Differences from PyCUDA (which runs nvcc locally):

* ``options`` are NVRTC options (``-DX=1``, ``--use_fast_math``, ``-std=c++17``, ``-lineinfo``
  ...). ``nvcc`` is ignored. The architecture defaults to the session's device, chosen by the
  daemon; ``arch``/``code`` become ``-arch``.
* ``include_dirs`` (and ``-I`` options) are read *here*: every text file below those
  directories is sent with the source as a named header, so ``#include "mylib/vec.h"`` works
  without the daemon reading its own disk.
* ``cache_dir`` is accepted and ignored: the daemon caches compiles for everybody, and reports
  a hit in ``SourceModule.cache_hit``.
* ``keep=True`` writes the source, the NVRTC log and the image into a local directory and
  prints its name, like PyCUDA's ``*** compiler output in ...``.
* A failed compile raises :class:`CompileError` whose ``str()`` has PyCUDA's layout, with
  the NVRTC options as ``command_line`` and the NVRTC log as ``stderr``.
"""
from __future__ import annotations

import os
import shlex
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import driver as _drv
from ._errors import CompileError, LogicError
from .v1 import module_service_pb2 as _mod

__all__ = ["SourceModule", "compile", "DEFAULT_NVCC_FLAGS", "CompileError", "collect_headers"]

#: Options used when ``options=None`` (from ``$GPURPC_DEFAULT_NVCC_FLAGS``, else
#: ``$PYCUDA_DEFAULT_NVCC_FLAGS``, split like a shell would).
DEFAULT_NVCC_FLAGS: List[str] = shlex.split(
    os.environ.get("GPURPC_DEFAULT_NVCC_FLAGS", os.environ.get("PYCUDA_DEFAULT_NVCC_FLAGS", "")))

_MAX_HEADER_BYTES = 4 << 20
_MAX_HEADERS_TOTAL_BYTES = 64 << 20


def collect_headers(include_dirs: Sequence[str]) -> List[Tuple[str, str]]:
    """Every text file below the given directories as ``(relative name, content)``.

    The first directory that has a name wins (like ``-I`` order). Hidden directories, files
    with NUL bytes or that are not UTF-8/Latin-1 text, and files over 4 MiB are skipped.
    """
    headers: Dict[str, str] = {}
    total = 0
    for directory in include_dirs:
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise LogicError(f"include directory {directory!r} does not exist (it is read on this "
                             "machine and its headers are sent to the daemon)")
        for root, dirs, files in os.walk(directory):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, directory).replace(os.sep, "/")
                if rel in headers:
                    continue
                try:
                    if os.path.getsize(path) > _MAX_HEADER_BYTES:
                        continue
                    with open(path, "rb") as f:
                        raw = f.read()
                except OSError:
                    continue
                if b"\0" in raw:
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = raw.decode("latin-1")
                total += len(raw)
                if total > _MAX_HEADERS_TOTAL_BYTES:
                    raise LogicError(f"include_dirs {list(include_dirs)!r} hold more than 64 MiB "
                                     "of text; name a narrower directory")
                headers[rel] = text
    return sorted(headers.items())


def _split_include_options(options: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Removes -I/--include-path options, returning (other options, include dirs)."""
    rest: List[str] = []
    dirs: List[str] = []
    it = iter(options)
    for opt in it:
        if opt in ("-I", "--include-path"):
            value = next(it, None)
            if value is None:
                raise LogicError(f"option {opt} needs a directory")
            dirs.append(value)
        elif opt.startswith("--include-path="):
            dirs.append(opt.split("=", 1)[1])
        elif opt.startswith("-I"):
            dirs.append(opt[2:])
        else:
            rest.append(opt)
    return rest, dirs


def _arch_option(arch: Optional[str], code: Optional[str]) -> List[str]:
    target = code or arch
    return [f"-arch={target}"] if target else []


def _compile_request(source: str, options: Optional[Sequence[str]], no_extern_c: bool,
                     arch: Optional[str], code: Optional[str], include_dirs: Sequence[str],
                     compile_only: bool, name_expressions: Sequence[str] = (),
                     ) -> _mod.CompileRequest:
    if options is None:
        options = DEFAULT_NVCC_FLAGS
    if isinstance(options, str):
        options = shlex.split(options)
    opts, extra_dirs = _split_include_options(list(options))
    if not no_extern_c:
        source = 'extern "C" {\n%s\n}\n' % source
    opts = opts + _arch_option(arch, code)
    headers = [_mod.Header(name=n, content=c)
               for n, c in collect_headers(list(include_dirs) + extra_dirs)]
    return _mod.CompileRequest(source=source, program_name="kernel.cu", options=opts,
                               headers=headers, name_expressions=list(name_expressions),
                               compile_only=compile_only)


def _run_compile(request: _mod.CompileRequest, keep: bool) -> _mod.CompileResponse:
    core = _drv._current_core("SourceModule")
    reply = core.call("ModuleService.Compile", request, op="ModuleService.Compile")
    if keep:
        directory = tempfile.mkdtemp(prefix="gpurpc-compile-")
        with open(os.path.join(directory, "kernel.cu"), "w") as f:
            f.write(request.source)
        for header in request.headers:
            path = os.path.join(directory, "include", *header.name.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(header.content)
        with open(os.path.join(directory, "nvrtc.log"), "w") as f:
            f.write(reply.log)
        if reply.image:
            with open(os.path.join(directory, "kernel.cubin"), "wb") as f:
                f.write(reply.image)
        print(f"*** compiler output in {directory}")
    if not reply.success:
        raise CompileError("NVRTC compilation of kernel.cu failed",
                           command_line=list(reply.effective_options) or list(request.options),
                           stdout="", stderr=reply.log)
    if reply.log.strip():
        warnings.warn("The CUDA compiler succeeded, but said the following:\n" + reply.log,
                      stacklevel=3)
    return reply


def compile(source: str, nvcc: str = "nvcc", options: Optional[Sequence[str]] = None,
            keep: bool = False, no_extern_c: bool = False, arch: Optional[str] = None,
            code: Optional[str] = None, cache_dir: Any = None,
            include_dirs: Sequence[str] = (), target: str = "cubin") -> bytes:
    """Compiles on the daemon without loading; returns the cubin (or PTX for ``target="ptx"``).

    :raises CompileError: NVRTC rejected the source (``str()`` includes the log).
    """
    if target == "ptx" and not (arch or code):
        major, minor = _drv.Context.get_device().compute_capability()
        arch = f"compute_{major}{minor}"
    elif target not in ("cubin", "ptx"):
        raise LogicError(f"target {target!r} is not available (use 'cubin' or 'ptx')")
    request = _compile_request(source, options, no_extern_c, arch, code, include_dirs, True)
    return bytes(_run_compile(request, keep).image)


class SourceModule:
    """Compiles CUDA source on the daemon and loads it (``pycuda.compiler.SourceModule``).

    Has the module's ``get_function``/``get_global``. ``cubin`` is the image, ``log`` the
    NVRTC log, ``cache_hit`` whether the daemon's cache answered, ``arch`` the target, and
    ``effective_options`` the NVRTC options used.

    :raises CompileError: NVRTC rejected the source; ``str(e)`` shows the log.
    """

    def __init__(self, source: str, nvcc: str = "nvcc", options: Optional[Sequence[str]] = None,
                 keep: bool = False, no_extern_c: bool = False, arch: Optional[str] = None,
                 code: Optional[str] = None, cache_dir: Any = None,
                 include_dirs: Sequence[str] = ()) -> None:
        request = _compile_request(source, options, no_extern_c, arch, code, include_dirs, False)
        reply = _run_compile(request, keep)
        core = _drv._current_core("SourceModule")
        self.module = _drv.Module(core, reply.module_id)
        self.cubin: bytes = bytes(reply.image)
        self.log: str = reply.log
        self.cache_hit: bool = reply.cache_hit
        self.arch: str = reply.arch
        self.effective_options: List[str] = list(reply.effective_options)
        self.source = request.source

    def get_function(self, name: str) -> _drv.Function:
        """The kernel ``name`` (an ``extern "C"`` name unless ``no_extern_c``)."""
        return self.module.get_function(name)

    def get_global(self, name: str) -> Tuple[int, int]:
        """``(device_address, size_bytes)`` of a ``__constant__``/``__device__`` variable."""
        return self.module.get_global(name)

    def get_texref(self, name: str) -> Any:
        """Not available: raises LogicError."""
        return self.module.get_texref(name)

    def get_surfref(self, name: str) -> Any:
        """Not available: raises LogicError."""
        return self.module.get_surfref(name)


def __getattr__(name: str) -> Any:
    if name in ("DynamicModule", "DynamicSourceModule"):
        raise AttributeError(
            f"gpurpc.compiler.{name} is not available: JIT linking with cudadevrt (dynamic "
            "parallelism) is not served by gpurpcd yet; SourceModule compiles whole programs")
    raise AttributeError(f"module 'gpurpc.compiler' has no attribute {name!r}")
