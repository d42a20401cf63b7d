"""``import gpurpc.autoinit`` opens a session like ``import pycuda.autoinit``.

Connects to ``$GPURPC_ADDRESS`` (default ``localhost:50051``), opens a context on device
``$GPURPC_DEVICE`` (else ``$CUDA_DEVICE``, else 0) and makes it current. Exports ``device``
and ``context``; the session is closed at interpreter exit.
"""
from __future__ import annotations

import atexit
import os

from . import driver as _cuda

_cuda.init()
device: _cuda.Device = _cuda.Device(int(os.environ.get("GPURPC_DEVICE",
                                                       os.environ.get("CUDA_DEVICE", "0"))))
context: _cuda.Context = device.make_context()


def _finish_up() -> None:
    try:
        if _cuda.Context.get_current() is context:
            context.pop()
    except _cuda.Error:
        pass
    context.detach()


atexit.register(_finish_up)
