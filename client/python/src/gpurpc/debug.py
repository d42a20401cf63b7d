"""Debug counters: how many RPCs and command-stream batches this process has made.

Every unary RPC is counted under its ``Service.Method`` name, every command-stream batch under
``"ExecutionService.CommandStream/batch"`` and every opening of a command stream under
``"ExecutionService.CommandStream/open"``. Tests use this to check that an ``In``/``Out``
launch takes one round trip::

    from gpurpc import debug
    debug.reset_rpc_counts()
    func(drv.Out(dest), drv.In(a), drv.In(b), block=(400, 1, 1))
    assert debug.rpc_counts() == {"ExecutionService.CommandStream/batch": 1}

KeepAlive calls of the background thread are counted under ``"SessionService.KeepAlive"``.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Dict

__all__ = ["rpc_counts", "reset_rpc_counts", "round_trips", "BATCH", "STREAM_OPEN"]

BATCH = "ExecutionService.CommandStream/batch"
STREAM_OPEN = "ExecutionService.CommandStream/open"

_lock = threading.Lock()
_counts: Counter = Counter()


def count(name: str, n: int = 1) -> None:
    """Adds n to the counter ``name`` (used by the client internals)."""
    with _lock:
        _counts[name] += n


def rpc_counts(include_keepalive: bool = False) -> Dict[str, int]:
    """Returns a copy of the counters, without KeepAlive unless asked."""
    with _lock:
        result = {k: v for k, v in _counts.items() if v}
    if not include_keepalive:
        result.pop("SessionService.KeepAlive", None)
    return result


def round_trips() -> int:
    """Unary RPCs plus command-stream batches since the last reset (KeepAlive excluded)."""
    counts = rpc_counts()
    counts.pop(STREAM_OPEN, None)
    return sum(counts.values())


def reset_rpc_counts() -> None:
    """Sets every counter back to zero."""
    with _lock:
        _counts.clear()
