"""``gpurpc``: the command line of users and operators of a gpurpcd.

::

    gpurpc status                 the daemon as the caller sees it: version, tenant, quota and
                                  use, devices; for admin tenants every tenant's sessions
    gpurpc ping [-n COUNT]        round trips to the daemon (GetServerInfo), min/median/max
    gpurpc sessions [--tenant T]  every open session (admin tenants)
    gpurpc close SESSION_ID       closes any tenant's session (admin tenants)

The daemon and the credentials come from ``--address``/``--token`` or the environment, as for
the library (``GPURPC_ADDRESS``, ``GPURPC_TOKEN``, ``GPURPC_TOKEN_FILE``, ``GPURPC_TLS*``).
``--json`` prints the daemon's answers as JSON instead of tables. Exit status: 0 on success,
1 when the daemon refused or could not be reached (the message says why), 2 on a usage error.

With several daemons (``--address`` or ``GPURPC_ADDRESS`` listing targets separated by
commas, or a ``dns:///NAME:PORT`` with several addresses), ``status`` and ``ping`` report
each daemon in order (``status`` with each device's sessions and free memory; JSON:
``{"address": ..., "daemons": [...]}``, an entry with ``error`` for a daemon that did not
answer) and exit 1 when one did not answer; ``sessions`` and ``close`` use the first daemon
that answers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence

from google.protobuf import json_format

from . import _devices, _errors
from . import driver as _driver
from .v1 import session_service_pb2

_FAULTED = session_service_pb2.SESSION_STATE_FAULTED

__all__ = ["main"]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def _age(ms: int) -> str:
    seconds = ms // 1000
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _json(message: Any) -> Dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _table(rows: List[Sequence[str]], out: Any) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
        out.write("\n")


def _sessions_table(sessions: Sequence[Any], out: Any) -> None:
    if not sessions:
        out.write("no open sessions\n")
        return
    rows: List[Sequence[str]] = [("SESSION", "TENANT", "DEVICE", "STATE", "MEMORY", "AGE", "IDLE",
                                  "WORKER", "PEER", "LABEL")]
    for s in sessions:
        state = "FAULTED" if s.state == _FAULTED else "ACTIVE"
        rows.append((str(s.session_id), s.tenant, str(s.device_ordinal), state,
                     _mib(s.device_memory_bytes), _age(s.age_ms), _age(s.idle_ms),
                     str(s.worker_pid), s.peer, s.client_label))
    _table(rows, out)


def _status(args: argparse.Namespace, out: Any) -> int:
    client = _devices._client()
    if client.multi_daemon:
        return _status_several(client, args, out)
    info = client.server_info()
    devices = client.list_devices(refresh=True)
    sessions: Optional[List[Any]] = None
    if info.admin:
        sessions = list(client.admin_list_sessions("").sessions)
    if args.json:
        answer: Dict[str, Any] = {"server": _json(info), "devices": _json(devices)}
        if sessions is not None:
            answer["sessions"] = [_json(s) for s in sessions]
        out.write(json.dumps(answer, indent=2) + "\n")
        return 0
    _write_status(client.target, info, devices, sessions, out, load=False)
    return 0


def _write_status(target: str, info: Any, devices: Any, sessions: Optional[List[Any]], out: Any,
                  load: bool) -> None:
    """One daemon's status as text (``load``: with each device's sessions and free memory)."""
    up = max(0, int(time.time() * 1000) - info.started_unix_ms) if info.started_unix_ms else 0
    out.write(f"gpurpcd {info.version} at {target} (instance {info.daemon_instance}, "
              f"up {_age(up)})\n")
    out.write(f"backend {devices.backend}; compile sandbox: {info.compile_sandbox or 'none'}\n")
    out.write(f"you: tenant {info.tenant!r} ({info.auth_method}){', admin' if info.admin else ''}"
              f"; {info.sessions_open} session(s) open, {_mib(info.device_memory_bytes)} of "
              f"device memory\n")
    q = info.quota
    limits = [f"{name} {getattr(q, field)}" for name, field in (
        ("sessions", "max_sessions"), ("streams/session", "max_streams_per_session"),
        ("events/session", "max_events_per_session"), ("modules/session", "max_modules_per_session"),
        ("compiles at once", "max_concurrent_compiles")) if getattr(q, field)]
    if q.max_device_memory_bytes:
        limits.append(f"device memory {_mib(q.max_device_memory_bytes)}")
    if q.kernel_timeout_ms:
        limits.append(f"kernel timeout {q.kernel_timeout_ms / 1000:g}s")
    out.write("quota: " + (", ".join(limits) if limits else "none") + "\n")
    out.write("devices:\n")
    header: Sequence[str] = ("  #", "NAME", "CC", "MEMORY", "SMs")
    if load:
        header = tuple(header) + ("SESSIONS", "FREE")
    rows: List[Sequence[str]] = [header]
    for d in devices.devices:
        row: Sequence[str] = (f"  {d.ordinal}", d.name,
                              f"{d.compute_capability_major}.{d.compute_capability_minor}",
                              _mib(d.total_memory_bytes), str(d.multiprocessor_count))
        if load:
            row = tuple(row) + (str(d.load.sessions), _mib(d.load.free_memory_bytes))
        rows.append(row)
    _table(rows, out)
    if sessions is not None:
        per_tenant: Dict[str, List[int]] = defaultdict(lambda: [0, 0, 0])
        for s in sessions:
            entry = per_tenant[s.tenant]
            entry[0] += 1
            entry[1] += s.device_memory_bytes
            entry[2] += 1 if s.state == _FAULTED else 0
        out.write("sessions by tenant:\n")
        if not per_tenant:
            out.write("  none open\n")
        else:
            rows = [("  TENANT", "SESSIONS", "FAULTED", "MEMORY")]
            for tenant in sorted(per_tenant):
                count, memory, faulted = per_tenant[tenant]
                rows.append((f"  {tenant}", str(count), str(faulted), _mib(memory)))
            _table(rows, out)


def _status_several(client: Any, args: argparse.Namespace, out: Any) -> int:
    """``status`` of a client of several daemons: each daemon in order, or why it did not
    answer; exit status 1 when one did not."""
    daemons = client.daemons()
    answers: List[Dict[str, Any]] = []
    failed = 0
    for number, daemon in enumerate(daemons):
        if not args.json:
            out.write(("" if number == 0 else "\n") + f"daemon {number}: {daemon.target}\n")
        if not daemon.ok or daemon.client is None:
            failed += 1
            if args.json:
                answers.append({"target": daemon.target, "error": daemon.why()})
            else:
                out.write(f"not answering: {daemon.why()}\n")
            continue
        try:
            info = daemon.client.server_info()
            sessions = (list(daemon.client.admin_list_sessions("").sessions) if info.admin
                        else None)
        except _errors.Error as e:
            failed += 1
            if args.json:
                answers.append({"target": daemon.target, "error": str(e)})
            else:
                out.write(f"not answering: {e}\n")
            continue
        if args.json:
            answer: Dict[str, Any] = {"target": daemon.target, "server": _json(info),
                                      "devices": _json(daemon.devices)}
            if sessions is not None:
                answer["sessions"] = [_json(s) for s in sessions]
            answers.append(answer)
        else:
            if not daemon.accepting:
                out.write("draining: accepts no new session\n")
            _write_status(daemon.target, info, daemon.devices, sessions, out, load=True)
    if args.json:
        out.write(json.dumps({"address": client.target, "daemons": answers}, indent=2) + "\n")
    elif failed:
        sys.stderr.write(f"gpurpc status: {failed} of {len(daemons)} daemons did not answer\n")
    return 1 if failed else 0


def _ping(args: argparse.Namespace, out: Any) -> int:
    if args.count < 1:
        raise _UsageError("ping: -n must be at least 1")
    client = _devices._client()
    if client.multi_daemon:
        return _ping_several(client, args, out)
    times = _round_trips(client, args.count)
    if args.json:
        out.write(json.dumps({"target": client.target, "count": args.count,
                              "round_trip_us": times}) + "\n")
        return 0
    _write_ping(client.target, args.count, times, out)
    return 0


def _round_trips(client: Any, count: int) -> List[float]:
    client.server_info()  # connects (and authenticates) outside the timing
    times = []
    for _ in range(count):
        start = time.perf_counter()
        client.server_info()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def _write_ping(target: str, count: int, times: List[float], out: Any) -> None:
    out.write(f"{count} round trip(s) to {target} (GetServerInfo): min "
              f"{min(times):.0f} us, median {statistics.median(times):.0f} us, max "
              f"{max(times):.0f} us\n")


def _ping_several(client: Any, args: argparse.Namespace, out: Any) -> int:
    """``ping`` of every daemon of a client of several, in order; exit status 1 when one did
    not answer."""
    daemons = client.daemons()
    answers: List[Dict[str, Any]] = []
    failed = 0
    for daemon in daemons:
        error = daemon.why() if not daemon.ok or daemon.client is None else ""
        times: List[float] = []
        if not error:
            try:
                times = _round_trips(daemon.client, args.count)
            except _errors.Error as e:
                error = str(e)
        if error:
            failed += 1
            if args.json:
                answers.append({"target": daemon.target, "error": error})
            else:
                out.write(f"{daemon.target}: not answering: {error}\n")
            continue
        if args.json:
            answers.append({"target": daemon.target, "count": args.count,
                            "round_trip_us": times})
        else:
            _write_ping(daemon.target, args.count, times, out)
    if args.json:
        out.write(json.dumps({"address": client.target, "daemons": answers}) + "\n")
    return 1 if failed else 0


def _sessions(args: argparse.Namespace, out: Any) -> int:
    sessions = list(_devices._client().admin_list_sessions(args.tenant).sessions)
    if args.json:
        out.write(json.dumps([_json(s) for s in sessions], indent=2) + "\n")
    else:
        _sessions_table(sessions, out)
    return 0


def _close(args: argparse.Namespace, out: Any) -> int:
    tenant = _devices._client().admin_close_session(args.session_id).tenant
    if args.json:
        out.write(json.dumps({"session_id": args.session_id, "tenant": tenant}) + "\n")
    else:
        out.write(f"closed session {args.session_id} of tenant {tenant!r}\n")
    return 0


class _UsageError(Exception):
    pass


def _session_id(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a session id: {text!r}") from None
    if not 0 < value < 1 << 64:
        raise argparse.ArgumentTypeError(f"not a session id (1 to 2^64-1): {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpurpc", description="Command line of a gpurpcd: status, ping, sessions, close.")
    parser.add_argument("--address", help="daemon address (host:port, unix:PATH, "
                        "dns:///NAME:PORT; several separated by commas); default "
                        "$GPURPC_ADDRESS, else the default Unix socket")
    parser.add_argument("--token", help="bearer token (TCP); default $GPURPC_TOKEN or "
                        "$GPURPC_TOKEN_FILE")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds per call (default 30)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("status", help="the daemon, your tenant and quota, devices; sessions "
                        "by tenant for admins").set_defaults(run=_status)
    ping = commands.add_parser("ping", help="round trips to the daemon")
    ping.add_argument("-n", "--count", type=int, default=5, help="round trips (default 5)")
    ping.set_defaults(run=_ping)
    sessions = commands.add_parser("sessions", help="every open session (admin tenants)")
    sessions.add_argument("--tenant", default="", help="only this tenant's")
    sessions.set_defaults(run=_sessions)
    close = commands.add_parser("close", help="close any tenant's session (admin tenants)")
    close.add_argument("session_id", type=_session_id, help="the session's id")
    close.set_defaults(run=_close)
    return parser


def main(argv: Optional[Sequence[str]] = None, out: Any = None) -> int:
    """Runs the command line; returns the exit status."""
    out = sys.stdout if out is None else out
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _driver.init(address=args.address, token=args.token, timeout=args.timeout)
        return int(args.run(args, out))
    except _UsageError as e:
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"gpurpc: error: {e}\n")
        return 2
    except _errors.Error as e:
        message = str(e)
        code = getattr(e, "code", None)
        if code is not None and f"[{code.name}]" not in message:
            message += f" [{code.name}]"
        sys.stderr.write(f"gpurpc {args.command}: {message}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
