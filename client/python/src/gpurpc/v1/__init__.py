"""Generated gRPC stubs of the gpurpc.v1 API (from proto/gpurpc/v1/*.proto).

Do not edit: regenerate with ``client/python/tools/generate_stubs.py``. Every RPC and field
is documented in the .proto files.
"""
