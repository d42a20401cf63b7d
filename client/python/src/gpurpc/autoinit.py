"""``import gpurpc.autoinit`` opens a session like ``import pycuda.autoinit``.

Connects to ``$GPURPC_ADDRESS`` (default: the first of ``$XDG_RUNTIME_DIR/gpurpc/gpurpcd.sock``,
``/run/gpurpc/gpurpcd.sock`` and ``/tmp/gpurpc-<uid>/gpurpcd.sock`` that exists, so a daemon
run with its defaults by the same user needs no setting) with the credentials of the
environment (``$GPURPC_TOKEN`` or ``$GPURPC_TOKEN_FILE``, ``$GPURPC_TLS``, ``$GPURPC_TLS_CA``,
``$GPURPC_TLS_CERT``/``$GPURPC_TLS_KEY``, ``$GPURPC_TLS_SERVER_NAME``; see
:func:`gpurpc.driver.init`), opens a context on device ``$GPURPC_DEVICE`` (else
``$CUDA_DEVICE``, else 0) and makes it current. Exports ``device`` and ``context``; the
session is closed at interpreter exit.
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
