"""Who am I to the daemon, and administration of a shared daemon (not part of PyCUDA).

Every function uses the connection of :func:`gpurpc.driver.init` (made from the environment
when there is none yet) and returns the daemon's protobuf answer (fields documented in
``proto/gpurpc/v1/device_service.proto`` and ``admin_service.proto``)::

    import gpurpc.admin
    info = gpurpc.admin.server_info()
    print(info.tenant, info.auth_method, info.admin)
    for s in gpurpc.admin.list_sessions():          # admin tenants only
        print(s.session_id, s.tenant, s.device_memory_bytes)

Errors are :mod:`gpurpc.driver`'s exceptions; their ``code`` is UNAUTHENTICATED without valid
credentials and PERMISSION_DENIED for a tenant that is not an admin.
"""
from __future__ import annotations

from typing import List

from . import _devices
from .v1 import admin_service_pb2, device_service_pb2

__all__ = ["server_info", "list_sessions", "close_session"]


def server_info() -> device_service_pb2.GetServerInfoResponse:
    """The caller's tenant, auth method, admin flag, quota and use, and the compile sandbox."""
    return _devices._client().server_info()


def list_sessions(tenant: str = "") -> List[admin_service_pb2.SessionSummary]:
    """Every open session of every tenant (of ``tenant`` only, when given), ordered by tenant
    then age. Admin tenants only."""
    return list(_devices._client().admin_list_sessions(tenant).sessions)


def close_session(session_id: int) -> str:
    """Closes any tenant's session, freeing what it holds; returns the tenant that held it.
    Admin tenants only; NOT_FOUND (a LogicError) for an unknown id."""
    return _devices._client().admin_close_session(session_id).tenant
