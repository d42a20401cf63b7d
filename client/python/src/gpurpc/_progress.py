"""Optional progress bars (tqdm) for large transfers.

Off by default. Turn on with :func:`gpurpc.driver.set_transfer_progress` or the environment
variable ``GPURPC_PROGRESS=1`` (``GPURPC_PROGRESS_MIN_BYTES`` sets the threshold, default
64 MiB). Without tqdm installed a single warning says so and transfers run without a bar.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Optional

_enabled = os.environ.get("GPURPC_PROGRESS", "") not in ("", "0", "false")
_min_bytes = int(os.environ.get("GPURPC_PROGRESS_MIN_BYTES", str(64 << 20)))
_warned = False


def configure(enabled: bool = True, min_bytes: Optional[int] = None) -> None:
    """Turns progress bars on or off; ``min_bytes`` is the smallest transfer that shows one."""
    global _enabled, _min_bytes
    _enabled = bool(enabled)
    if min_bytes is not None:
        _min_bytes = int(min_bytes)


class _NullBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total_bytes: int, description: str) -> Any:
    """A bar with ``update(nbytes)``/``close()``, or a do-nothing one below the threshold."""
    global _warned
    if not _enabled or total_bytes < _min_bytes:
        return _NullBar()
    try:
        from tqdm import tqdm  # type: ignore[import-not-found]
    except ImportError:
        if not _warned:
            _warned = True
            warnings.warn("gpurpc: transfer progress was asked for but tqdm is not installed "
                          "(pip install tqdm)", stacklevel=3)
        return _NullBar()
    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                desc=description, leave=False)
