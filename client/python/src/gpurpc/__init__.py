"""gpurpc: run PyCUDA code on a remote GPU served by gpurpcd.

Change ``pycuda`` to ``gpurpc`` in the imports (``gpurpc.autoinit``,
``gpurpc.autoprimaryctx``, ``gpurpc.driver``, ``gpurpc.compiler``, ``gpurpc.gpuarray``,
``gpurpc.elementwise``, ``gpurpc.reduction``, ``gpurpc.scan``, ``gpurpc.cumath``,
``gpurpc.curandom``, ``gpurpc.characterize``, ``gpurpc.tools``) and point
``$GPURPC_ADDRESS`` at the daemon. The generated gRPC stubs
are in ``gpurpc.v1``. Importing this package itself loads nothing else; the exception
classes (``gpurpc.SessionLost``, ``gpurpc.CallTimeoutError``, ``gpurpc.LogicError`` ...) are
loaded on first use.
"""
__version__ = "0.1.0"

_ERRORS = ("Error", "LogicError", "LaunchError", "MemoryError", "RuntimeError", "CompileError",
           "SessionLost", "CallTimeoutError")


def __getattr__(name: str) -> object:
    """``gpurpc.SessionLost`` and the other exception classes, loaded on first use."""
    if name in _ERRORS:
        from . import _errors
        return getattr(_errors, name)
    raise AttributeError(f"module 'gpurpc' has no attribute {name!r}")
