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
* ``DynamicModule`` / ``DynamicSourceModule`` link on the daemon (``ModuleService.LinkModule``,
  the driver's ``cuLink*`` there): ``add_source`` sends the source, which the daemon compiles
  with relocatable device code (``-rdc=true``) through the same NVRTC, cache and checks as
  ``SourceModule``; ``add_stdlib("cudadevrt")`` names the device runtime of the daemon's
  toolkit (``cuda_libdir`` is ignored: the library is found on the daemon's machine).
  Nothing is sent before ``link()``; compile and link errors surface there.
"""
from __future__ import annotations

import os
import shlex
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _context
from . import driver as _drv
from ._errors import CompileError, LogicError
from .v1 import module_service_pb2 as _mod

__all__ = ["SourceModule", "DynamicModule", "DynamicSourceModule", "compile",
           "DEFAULT_NVCC_FLAGS", "CompileError", "collect_headers"]

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
    core = _context._current_core("SourceModule")
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
        core = _context._current_core("SourceModule")
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


class DynamicModule:
    """PyCUDA's ``DynamicModule``: sources, PTX/binary data and standard libraries linked into
    one module (JIT linking; with ``cudadevrt``, dynamic parallelism).

    ``add_source``/``add_data``/``add_file``/``add_stdlib`` return ``self`` and only collect;
    :meth:`link` sends everything in one call, after which ``get_function``/``get_global``
    work as on :class:`SourceModule`. ``nvcc``, ``link_options``, ``cache_dir`` and
    ``cuda_libdir`` are accepted and ignored; ``keep`` is ignored too. ``message_handler`` and
    ``log_verbose`` are :class:`gpurpc.driver.Linker`'s.

    :raises CompileError: from :meth:`link`, when a source does not compile.
    :raises LogicError: from :meth:`link`, for a failed link (undefined or duplicate
        symbols: the message has the linker's log), an unknown standard library, or one the
        daemon's machine does not have.
    """

    def __init__(self, nvcc: str = "nvcc", link_options: Optional[Sequence] = None,
                 keep: bool = False, no_extern_c: bool = False, arch: Optional[str] = None,
                 code: Optional[str] = None, cache_dir: Any = None,
                 include_dirs: Sequence[str] = (),
                 message_handler: Optional[Any] = None, log_verbose: bool = False,
                 cuda_libdir: Optional[str] = None) -> None:
        self._linker: Optional[_drv.Linker] = _drv.Linker(message_handler, link_options,
                                                          log_verbose)
        self._no_extern_c = no_extern_c
        self._arch = arch
        self._code = code
        self._include_dirs = list(include_dirs or ())
        self.module: Optional[_drv.Module] = None
        #: The linker's info log, after :meth:`link`.
        self.link_log = ""
        #: Per source, after :meth:`link`: whether the daemon's compile cache answered.
        self.cache_hits: List[bool] = []
        #: Per source, after :meth:`link`: the NVRTC options used.
        self.effective_options: List[List[str]] = []

    def _open_linker(self) -> _drv.Linker:
        if self._linker is None:
            raise LogicError("DynamicModule: link() was already called; make a new module")
        return self._linker

    def add_source(self, source: str, nvcc_options: Optional[Sequence[str]] = None,
                   name: str = "kernel.cu") -> "DynamicModule":
        """Adds CUDA source, compiled on the daemon with ``-rdc=true`` when linked."""
        linker = self._open_linker()
        request = _compile_request(source, nvcc_options, self._no_extern_c, self._arch,
                                   self._code, self._include_dirs, False)
        linker._add_input(_mod.LinkInput(source=_mod.LinkSource(
            source=request.source, program_name=name, options=list(request.options),
            headers=list(request.headers))))
        return self

    def add_data(self, data: Any, input_type: Any, name: str = "unknown") -> "DynamicModule":
        """Adds PTX or binary bytes of a :class:`gpurpc.driver.jit_input_type`."""
        self._open_linker().add_data(data, input_type, name)
        return self

    def add_file(self, filename: str, input_type: Any) -> "DynamicModule":
        """Reads a file here and adds it (see :meth:`add_data`)."""
        self._open_linker().add_file(filename, input_type)
        return self

    def add_stdlib(self, libname: str) -> "DynamicModule":
        """Adds a standard library of the daemon's CUDA toolkit by name: ``"cudadevrt"``."""
        self._open_linker()._add_input(_mod.LinkInput(standard_library=str(libname)))
        return self

    def link(self) -> "DynamicModule":
        """Links everything added on the daemon and loads the result."""
        linker = self._open_linker()
        reply = linker._link()
        self._linker = None
        self.module = _drv.Module(linker._core, reply.module_id)
        self.link_log = reply.log
        self.cache_hits = [source.cache_hit for source in reply.sources]
        self.effective_options = [list(source.effective_options) for source in reply.sources]
        return self

    def _linked(self) -> _drv.Module:
        if self.module is None:
            raise LogicError("DynamicModule: call link() before looking up kernels or globals")
        return self.module

    def get_function(self, name: str) -> _drv.Function:
        """The kernel ``name`` of the linked module."""
        return self._linked().get_function(name)

    def get_global(self, name: str) -> Tuple[int, int]:
        """``(device_address, size_bytes)`` of a global of the linked module."""
        return self._linked().get_global(name)

    def get_texref(self, name: str) -> Any:
        """Not available: raises LogicError."""
        return self._linked().get_texref(name)

    def get_surfref(self, name: str) -> Any:
        """Not available: raises LogicError."""
        return self._linked().get_surfref(name)


class DynamicSourceModule(DynamicModule):
    """PyCUDA's ``DynamicSourceModule``: a :class:`SourceModule` compiled with ``-rdc=true`` and
    linked with ``cudadevrt``, so that its kernels may launch kernels (dynamic parallelism)."""

    def __init__(self, source: str, nvcc: str = "nvcc", options: Optional[Sequence[str]] = None,
                 keep: bool = False, no_extern_c: bool = False, arch: Optional[str] = None,
                 code: Optional[str] = None, cache_dir: Any = None,
                 include_dirs: Sequence[str] = (), cuda_libdir: Optional[str] = None) -> None:
        super().__init__(nvcc=nvcc, link_options=None, keep=keep, no_extern_c=no_extern_c,
                         arch=arch, code=code, cache_dir=cache_dir, include_dirs=include_dirs,
                         cuda_libdir=cuda_libdir)
        if options is None:
            options = DEFAULT_NVCC_FLAGS
        if isinstance(options, str):
            options = shlex.split(options)
        options = list(options)
        if not any(o.startswith(("-rdc", "--relocatable-device-code")) for o in options):
            options.append("-rdc=true")
        self.add_source(source, nvcc_options=options)
        self.add_stdlib("cudadevrt")
        self.link()


def __getattr__(name: str) -> Any:
    raise AttributeError(f"module 'gpurpc.compiler' has no attribute {name!r}")
