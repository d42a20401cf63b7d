"""``import gpurpc.autoprimaryctx`` opens a session like ``import pycuda.autoprimaryctx``.

As in PyCUDA, it connects (:func:`gpurpc.driver.init`, with the address and credentials of the
environment, as :mod:`gpurpc.autoinit` does), takes a context with
``Device.retain_primary_context()`` on the device that
:func:`gpurpc.tools.make_default_context` chooses (``$GPURPC_DEVICE``, else ``$CUDA_DEVICE``,
else the first device where it succeeds), pushes it, and exports ``device`` and ``context``.
At interpreter exit the context is popped, the per-context kernel caches are cleared and the
session is closed.

What differs from PyCUDA: a CUDA primary context is one per device and process, shared by
every library of the process (the runtime API's context). A gpurpc context is always a daemon
session of its own, in its own worker process, and ``Device.retain_primary_context()`` opens a
new one each time it is called (without pushing it). So this module gives what
:mod:`gpurpc.autoinit` gives, reached through PyCUDA's primary-context calls: code written for
``pycuda.autoprimaryctx`` runs unchanged, but another ``retain_primary_context()`` in the same
program gets another session, not this one (use ``gpurpc.autoprimaryctx.context`` to share it),
and nothing is shared with other processes.
"""
from __future__ import annotations

import atexit

from . import driver as _cuda
from .tools import clear_context_caches, make_default_context

_cuda.init()


def _retain_primary_context(dev: _cuda.Device) -> _cuda.Context:
    ctx = dev.retain_primary_context()
    ctx.push()
    return ctx


context: _cuda.Context = make_default_context(_retain_primary_context)
device: _cuda.Device = _cuda.Context.get_device()


def _finish_up() -> None:
    try:
        if _cuda.Context.get_current() is context:
            context.pop()
    except _cuda.Error:
        pass
    clear_context_caches()
    context.detach()


atexit.register(_finish_up)
