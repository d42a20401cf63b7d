"""gpurpc: run PyCUDA code on a remote GPU served by gpurpcd.

Change ``pycuda`` to ``gpurpc`` in the imports (``gpurpc.autoinit``, ``gpurpc.driver``,
``gpurpc.compiler``, ``gpurpc.gpuarray``, ``gpurpc.elementwise``, ``gpurpc.reduction``,
``gpurpc.tools``) and point ``$GPURPC_ADDRESS`` at the daemon. The generated gRPC stubs
are in ``gpurpc.v1``. Importing this package itself loads nothing else.
"""
__version__ = "0.1.0"
