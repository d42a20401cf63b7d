"""``import gpurpc.autoinit`` opens a session like ``import pycuda.autoinit``.

Connects to ``$GPURPC_ADDRESS`` (default: the first of ``$XDG_RUNTIME_DIR/gpurpc/gpurpcd.sock``,
``/run/gpurpc/gpurpcd.sock`` and ``/tmp/gpurpc-<uid>/gpurpcd.sock`` that exists, so a daemon
run with its defaults by the same user needs no setting) with the credentials of the
environment (``$GPURPC_TOKEN`` or ``$GPURPC_TOKEN_FILE``, ``$GPURPC_TLS``, ``$GPURPC_TLS_CA``,
``$GPURPC_TLS_CERT``/``$GPURPC_TLS_KEY``, ``$GPURPC_TLS_SERVER_NAME``; see
:func:`gpurpc.driver.init`), opens a context on device ``$GPURPC_DEVICE`` (else
``$CUDA_DEVICE``) and makes it current. When neither names a device, the session is placed
(:func:`gpurpc.driver.pick_device`): on the device with the most free memory, then the fewest
sessions, over every daemon of the address list, passing on to the next device when an
open fails for want of room or a daemon; with one daemon of one device that is device 0,
with no extra round trip. Exports ``device`` and ``context``; the session is closed at
interpreter exit.
"""
from __future__ import annotations

import atexit
import os
from typing import Optional

from . import _devices
from . import driver as _cuda

_cuda.init()


def _named_device() -> Optional[int]:
    for variable in ("GPURPC_DEVICE", "CUDA_DEVICE"):
        value = os.environ.get(variable)
        if value is not None:
            return int(value)
    return None


def _open(dev: _cuda.Device) -> _cuda.Context:
    return dev.make_context()


_number = _named_device()
context: _cuda.Context = (_cuda.Device(_number).make_context() if _number is not None
                          else _devices._place(_open, "gpurpc.autoinit"))
device: _cuda.Device = context._device


def _finish_up() -> None:
    try:
        if _cuda.Context.get_current() is context:
            context.pop()
    except _cuda.Error:
        pass
    context.detach()


atexit.register(_finish_up)
