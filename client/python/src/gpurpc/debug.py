"""Debug counters: how many RPCs and command-stream batches this process has made.

Every unary RPC is counted under its ``Service.Method`` name, every command-stream batch under
``"ExecutionService.CommandStream/batch"`` and every opening of a command stream under
``"ExecutionService.CommandStream/open"``. Tests use this to check that an ``In``/``Out``
launch takes one round trip::

    from gpurpc import debug
    debug.reset_rpc_counts()
    func(drv.Out(dest), drv.In(a), drv.In(b), block=(400, 1, 1))
    assert debug.rpc_counts() == {"ExecutionService.CommandStream/batch": 1}

Each opening of a session's ``WatchSession`` stream (its liveness: once per session, again
after a broken connection) is counted under ``"SessionService.WatchSession"``, explicit
``KeepAlive`` calls under ``"SessionService.KeepAlive"``; both are left out unless asked for,
since the watch opens on its own thread at its own time.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Dict

__all__ = ["rpc_counts", "reset_rpc_counts", "round_trips", "BATCH", "STREAM_OPEN",
           "WATCH_OPEN"]

BATCH = "ExecutionService.CommandStream/batch"
STREAM_OPEN = "ExecutionService.CommandStream/open"
WATCH_OPEN = "SessionService.WatchSession"
_LIVENESS = ("SessionService.KeepAlive", WATCH_OPEN)

_lock = threading.Lock()
_counts: Counter = Counter()


def count(name: str, n: int = 1) -> None:
    """Adds n to the counter ``name`` (used by the client internals)."""
    with _lock:
        _counts[name] += n


def rpc_counts(include_keepalive: bool = False) -> Dict[str, int]:
    """Returns a copy of the counters, without the liveness calls (KeepAlive, WatchSession)
    unless ``include_keepalive``."""
    with _lock:
        result = {k: v for k, v in _counts.items() if v}
    if not include_keepalive:
        for name in _LIVENESS:
            result.pop(name, None)
    return result


def round_trips() -> int:
    """Unary RPCs plus command-stream batches since the last reset (liveness calls
    excluded)."""
    counts = rpc_counts()
    counts.pop(STREAM_OPEN, None)
    return sum(counts.values())


def reset_rpc_counts() -> None:
    """Sets every counter back to zero."""
    with _lock:
        _counts.clear()
