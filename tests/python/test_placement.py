"""Several daemons: address lists, dns:/// names, one device numbering, and the placement of
new sessions by load (issue 11, "Beyond one machine").

The daemon tests start their own gpurpcd processes on the fake backend (one Unix socket, one
loopback TCP port and one runtime folder each), three that live for the module and fresh
ones for the tests that kill or drain a daemon. The fake device reports
``--fake-memory-bytes`` of memory: 2 GiB here, so that one 512 MiB buffer moves its device
two 256 MiB steps down the ranking. The unit tests at the top need no daemon.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import grpc
import pytest

import gpurpc.driver as cuda
from gpurpc import _context, _core, _devices, cli, tools
from gpurpc.v1 import device_service_pb2 as dev_pb

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_MEMORY = 2 << 30
MiB = 1 << 20

# ---------------------------------------------------------------------------------------------
# Unit tests: address parsing, resolution and ranking (no daemon)


def test_an_address_list_is_split_and_normalized() -> None:
    specs = _core.parse_targets("unix:/a.sock, /b.sock ,gpu1:50051,dns:///gpus.svc:50051,"
                                "[::1]:7,dns:///[fd00::1]:9,gpubox")
    assert [s.target for s in specs] == ["unix:/a.sock", "unix:/b.sock", "gpu1:50051",
                                         "dns:///gpus.svc:50051", "[::1]:7",
                                         "dns:///[fd00::1]:9", "gpubox"]
    assert [(s.host, s.port) for s in specs if s.resolve] == [("gpus.svc", "50051"),
                                                              ("fd00::1", "9")]
    assert _core.resolve_address("/a.sock, /b.sock") == "unix:/a.sock,unix:/b.sock"
    assert _core.resolve_address(" unix:/one.sock ") == "unix:/one.sock"  # as before


@pytest.mark.parametrize("address, entry", [
    ("unix:/a.sock,,unix:/b.sock", "entry 2"),
    ("unix:/a.sock,", "entry 2"),
    (",unix:/a.sock", "entry 1"),
    ("gpu1:50051,dns:///gpus", "'dns:///gpus' (entry 2"),
    ("dns:///:50051", "'dns:///:50051' (entry 1"),
    ("dns:///gpus:", "'dns:///gpus:' (entry 1"),
    ("dns:///gpus:http", "'dns:///gpus:http' (entry 1"),
    ("gpu1:50051,gpu2:port", "'gpu2:port' (entry 2"),
    ("gpu1:50051,gpu2:99999", "'gpu2:99999' (entry 2"),
    ("gpu1 gpu2:50051", "'gpu1 gpu2:50051' (entry 1"),
    ("unix:,gpu1:1", "'unix:' (entry 1"),
    ("http://gpu1:50051", "'http://gpu1:50051' (entry 1"),
])
def test_a_bad_entry_is_a_clear_error_naming_it(address: str, entry: str) -> None:
    with pytest.raises(cuda.LogicError) as info:
        _core.Client(address)
    assert entry in str(info.value)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_init_refuses_a_bad_list_before_connecting() -> None:
    saved = _devices._default_client
    try:
        with pytest.raises(cuda.LogicError, match="empty entry"):
            cuda.init(address="unix:/nowhere/a.sock,,unix:/nowhere/b.sock")
    finally:
        _devices._default_client = saved


def _fake_getaddrinfo(table: Dict[str, List[str]]) -> Callable:
    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):  # noqa: A002
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        out = []
        for ip in table[host]:
            if ":" in ip:
                out.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, int(port), 0, 0)))
            else:
                out.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, int(port))))
        return out
    return getaddrinfo


def test_a_dns_name_stands_for_every_address_deduplicated_and_sorted(monkeypatch) -> None:
    monkeypatch.setattr(_core.socket, "getaddrinfo", _fake_getaddrinfo(
        {"gpus.test": ["10.0.0.9", "10.0.0.10", "fd00::2", "10.0.0.9", "fe80::1%eth0"]}))
    assert _core.resolve_all("gpus.test", "50051") == [
        "ipv4:10.0.0.10:50051", "ipv4:10.0.0.9:50051", "ipv6:[fd00::2]:50051",
        "ipv6:[fe80::1]:50051"]
    with pytest.raises(cuda.RuntimeError, match="cannot resolve nothing.test:1") as info:
        _core.resolve_all("nothing.test", "1")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_one_target_stays_one_channel_and_a_name_with_several_addresses_does_not(
        monkeypatch) -> None:
    monkeypatch.setattr(_core.socket, "getaddrinfo", _fake_getaddrinfo(
        {"one.test": ["10.0.0.1"], "three.test": ["10.0.0.1", "10.0.0.2", "10.0.0.3"]}))
    for address in ("unix:/nowhere/gpurpcd.sock", "gpubox:50051", "dns:///one.test:50051",
                    "dns:///missing.test:50051"):
        client = _core.Client(address)
        try:
            assert not client.multi_daemon and client.channel is not None
            assert client.target == address
        finally:
            client.close()
    for address in ("dns:///three.test:50051", "gpu1:50051,gpu2:50051"):
        client = _core.Client(address)
        try:
            assert client.multi_daemon and client.channel is None
        finally:
            client.close()


def test_tls_checks_a_resolved_address_against_the_name(monkeypatch) -> None:
    for variable in ("GPURPC_TLS", "GPURPC_TLS_CA", "GPURPC_TLS_CERT", "GPURPC_TLS_KEY",
                     "GPURPC_TLS_SERVER_NAME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(_core.socket, "getaddrinfo", _fake_getaddrinfo(
        {"gpus.test": ["10.0.0.1", "10.0.0.2"]}))

    def override(client: _core.Client, target: str, name: Optional[str]) -> Optional[str]:
        _creds, options, tls, _cert = client._channel_settings(target, name)
        assert tls
        return dict(options).get("grpc.ssl_target_name_override")

    client = _core.Client("dns:///gpus.test:50051", tls=True)
    assert override(client, "ipv4:10.0.0.1:50051", "gpus.test") == "gpus.test"
    assert [a[:2] for a in client._addresses()] == [("ipv4:10.0.0.1:50051", "gpus.test"),
                                                    ("ipv4:10.0.0.2:50051", "gpus.test")]
    client.close()
    client = _core.Client("dns:///gpus.test:50051", tls=True, server_name="gpu.example")
    assert override(client, "ipv4:10.0.0.1:50051", "gpus.test") == "gpu.example"
    client.close()
    monkeypatch.setenv("GPURPC_TLS_SERVER_NAME", "env.example")
    client = _core.Client("dns:///gpus.test:50051", tls=True)
    assert override(client, "ipv4:10.0.0.1:50051", "gpus.test") == "env.example"
    client.close()


def _device(ordinal: int, free: int, sessions: int, total: int = 80 << 30) -> dev_pb.DeviceInfo:
    return dev_pb.DeviceInfo(ordinal=ordinal, total_memory_bytes=total, load=dev_pb.DeviceLoad(
        sessions=sessions, allocated_bytes=total - free, free_memory_bytes=free))


def _status(target: str, *devices: dev_pb.DeviceInfo, accepting: bool = True,
            instance: str = "i") -> _core.DaemonStatus:
    reply = dev_pb.ListDevicesResponse(devices=list(devices), daemon_instance=instance + target,
                                       accepting_sessions=accepting)
    return _core.DaemonStatus(target, None, reply, None)


def _ranked(daemons: List[_core.DaemonStatus]) -> List[str]:
    return [f"{d.target}/{info.ordinal}" for d, info in _core.rank_devices(daemons)]


def test_ranking_prefers_free_memory_in_256_mib_steps_then_sessions_then_order() -> None:
    GiB = 1 << 30
    daemons = [
        _status("a", _device(0, 10 * GiB, 3), _device(1, 10 * GiB + 100 * MiB, 1)),
        _status("b", _device(0, 10 * GiB + 300 * MiB, 5), _device(1, 10 * GiB, 1)),
        _status("c", _device(0, 9 * GiB, 0)),
    ]
    # b/0 is one step ahead; a/1 and b/1 tie on memory and sessions: daemon order decides.
    assert _ranked(daemons) == ["b/0", "a/1", "b/1", "a/0", "c/0"]
    assert _core.placement_key(10 * GiB, 2, 1, 0) == (-40, 2, 1, 0)
    # Ties all the way: daemon position, then ordinal.
    assert _ranked([_status("x", _device(1, GiB, 0), _device(0, GiB, 0)),
                    _status("y", _device(0, GiB, 0))]) == ["x/0", "x/1", "y/0"]


def test_ranking_passes_over_failed_and_draining_daemons() -> None:
    failed = _core.DaemonStatus("down", None, None, cuda.RuntimeError(
        "connection refused", code=grpc.StatusCode.UNAVAILABLE))
    draining = _status("draining", _device(0, 80 << 30, 0), accepting=False)
    busy = _status("busy", _device(0, 1 << 30, 9))
    empty = _status("empty")
    assert _ranked([failed, draining, busy, empty]) == ["busy/0"]
    why = _core.describe_unavailable([failed, draining, busy, empty])
    assert why == ("down: UNAVAILABLE: connection refused; draining: draining (accepts no new "
                   "session); empty: serves no device")
    # A daemon too old to report load, instance and draining: all memory free, accepting.
    old = _core.DaemonStatus("old", None, dev_pb.ListDevicesResponse(
        devices=[dev_pb.DeviceInfo(ordinal=0, total_memory_bytes=8 << 30)]), None)
    assert old.accepting and _core.device_load(old.devices.devices[0]) == (8 << 30, 0)


def test_unreachable_error_names_every_daemon_and_prefers_refused_credentials() -> None:
    client = _core.Client("unix:/nowhere/a.sock,unix:/nowhere/b.sock")
    try:
        down = [_core.DaemonStatus(t, None, None, cuda.RuntimeError(
            "refused", code=grpc.StatusCode.UNAVAILABLE)) for t in ("unix:/a", "unix:/b")]
        error = client.unreachable_error(down)
        assert isinstance(error, cuda.RuntimeError) and error.code == grpc.StatusCode.UNAVAILABLE
        assert "unix:/a: UNAVAILABLE: refused; unix:/b: UNAVAILABLE: refused" in str(error)
        down[1].error = cuda.Error("bad token", code=grpc.StatusCode.UNAUTHENTICATED)
        error = client.unreachable_error(down)
        assert error.code == grpc.StatusCode.UNAUTHENTICATED and "unix:/b" in str(error)
    finally:
        client.close()


# ---------------------------------------------------------------------------------------------
# Daemons


def _binary() -> Path:
    binary = Path(os.environ.get("GPURPCD_BIN", REPO_ROOT / "build" / "server" / "gpurpcd"))
    if not binary.is_file():
        message = f"gpurpcd binary {binary} not found: build it or set GPURPCD_BIN"
        if os.environ.get("GPURPC_SKIP_DAEMON_TESTS"):
            pytest.skip(message)
        pytest.fail(message)
    return binary


def _free_port(hosts: List[str]) -> int:
    """A TCP port free on every host (loopback addresses)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise AssertionError("no common free port")


class Daemon:
    """One gpurpcd on the fake backend: a Unix socket and a loopback TCP port, its own
    runtime folder."""

    def __init__(self, folder: Path, host: str, port: int, *flags: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.socket = folder / "gpurpcd.sock"
        self.unix = f"unix:{self.socket}"
        self.tcp = f"{host}:{port}"
        self.log_path = folder / "gpurpcd.log"
        args = [str(_binary()), "--backend=fake", f"--unix-socket={self.socket}",
                f"--listen={self.tcp}", "--insecure", f"--cache-dir={folder / 'cache'}",
                f"--fake-memory-bytes={FAKE_MEMORY}", "--session-idle-timeout=30s", *flags]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPURPC_")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)
        self.instance = self._wait_ready().daemon_instance

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def list_devices(self, timeout: float = 5.0) -> dev_pb.ListDevicesResponse:
        with grpc.insecure_channel(self.unix) as channel:
            method = channel.unary_unary(
                "/gpurpc.v1.DeviceService/ListDevices",
                request_serializer=dev_pb.ListDevicesRequest.SerializeToString,
                response_deserializer=dev_pb.ListDevicesResponse.FromString)
            return method(dev_pb.ListDevicesRequest(), timeout=timeout)

    def load(self) -> dev_pb.DeviceLoad:
        return self.list_devices().devices[0].load

    def _wait_ready(self, deadline_s: float = 60.0) -> dev_pb.ListDevicesResponse:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"gpurpcd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                reply = self.list_devices(timeout=2)
                if reply.daemon_instance:
                    return reply
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        pytest.fail(f"gpurpcd at {self.unix} not ready after {deadline_s:.0f}s:\n{self.log()}")

    def signal(self, number: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(number)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def _poll(what: str, check: Callable[[], bool], deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {deadline_s:.0f} s")
        time.sleep(0.05)


def _start(tmp: Path, count: int, *flags: str) -> List[Daemon]:
    hosts = [f"127.0.0.{i + 1}" for i in range(count)]
    port = _free_port(hosts)
    daemons: List[Daemon] = []
    try:
        for i, host in enumerate(hosts):
            daemons.append(Daemon(tmp / f"d{i}", host, port, *flags))
    except BaseException:
        for daemon in daemons:
            daemon.stop()
        raise
    return daemons


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[List[Daemon]]:
    """Three daemons for the module: 127.0.0.1-3, one port."""
    daemons = _start(tmp_path_factory.mktemp("trio"), 3)
    try:
        yield daemons
    finally:
        for daemon in daemons:
            daemon.stop()


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[Callable[..., List[Daemon]]]:
    """Starts daemons for one test (to kill or drain them)."""
    started: List[Daemon] = []

    def start(count: int, *flags: str) -> List[Daemon]:
        daemons = _start(tmp_path, count, *flags)
        started.extend(daemons)
        return daemons

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture
def connect(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[[str], None]]:
    """``connect(address)``: gpurpc.driver's connection for this test only; every context
    made meanwhile is detached afterwards."""
    for variable in ("GPURPC_DEVICE", "CUDA_DEVICE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.cuda_device
    saved = _devices._default_client
    saved_stack = list(_context._stack())
    made: List[cuda.Client] = []

    def connect(address: str) -> None:
        _devices._default_client = None
        cuda.init(address=address, timeout=30)
        made.append(_devices._client())

    yield connect
    _context._stack()[:] = saved_stack
    _devices._default_client = saved
    for client in made:
        client.close()


class Contexts:
    """Contexts of a test, detached at its end (and taken off the context stack)."""

    def __init__(self) -> None:
        self.items: List[cuda.Context] = []

    def add(self, ctx: cuda.Context) -> cuda.Context:
        self.items.append(ctx)
        stack = _context._stack()
        if stack and stack[-1] is ctx:
            stack.pop()
        return ctx

    def close(self) -> None:
        for ctx in self.items:
            ctx.detach()
        self.items.clear()


@pytest.fixture
def contexts() -> Iterator[Contexts]:
    made = Contexts()
    yield made
    made.close()


def _idle(daemons: List[Daemon]) -> None:
    """Waits until no session is open on any of ``daemons`` (earlier tests' are closing)."""
    _poll("the daemons idle", lambda: all(d.load().sessions == 0 and d.load().allocated_bytes == 0
                                          for d in daemons))


def _where(ctx: cuda.Context, daemons: List[Daemon]) -> int:
    """Which daemon holds the context's session (by its client's target)."""
    target = ctx._core.client.target
    for i, daemon in enumerate(daemons):
        if target in (daemon.unix, "ipv4:" + daemon.tcp, daemon.tcp):
            return i
    raise AssertionError(f"{target} is none of the daemons")


def _unix_list(daemons: List[Daemon]) -> str:
    return ",".join(d.unix for d in daemons)


def test_devices_are_numbered_over_the_daemons_in_order(trio, connect, contexts) -> None:
    connect(_unix_list(trio))
    client = _devices._client()
    assert client.multi_daemon
    assert cuda.Device.count() == 3
    devices = [cuda.Device(i) for i in range(3)]
    assert [d.daemon_target for d in devices] == [d.unix for d in trio]
    assert [d.ordinal for d in devices] == [0, 0, 0]
    assert all(d.is_fake and d.total_memory() == FAKE_MEMORY for d in devices)
    assert devices[1] == cuda.Device(1) and devices[1] != devices[2]
    with pytest.raises(cuda.LogicError, match="invalid device ordinal 3 .*serve 3"):
        cuda.Device(3)
    # The daemon-wide calls go to the first daemon.
    assert client.primary().target == trio[0].unix
    assert client.list_devices().daemon_instance == trio[0].instance
    # Reversed list, reversed numbering.
    connect(",".join(d.unix for d in reversed(trio)))
    assert [cuda.Device(i).daemon_target for i in range(3)] == [d.unix for d in reversed(trio)]


def test_a_context_and_its_calls_stay_on_its_daemon(trio, connect, contexts) -> None:
    import numpy as np
    _idle(trio)
    connect(_unix_list(trio))
    ctx = contexts.add(cuda.Device(2).make_context())
    assert _where(ctx, trio) == 2 and ctx.get_device().daemon_target == trio[2].unix
    ctx.push()
    try:
        buf = cuda.mem_alloc(64 * MiB)
        data = np.arange(1024, dtype=np.float32)
        cuda.memcpy_htod(buf, data)
        out = np.empty_like(data)
        cuda.memcpy_dtoh(out, buf)
        assert (out == data).all()
        loads = [d.load() for d in trio]
        assert [ld.sessions for ld in loads] == [0, 0, 1]
        # Memory is reported in 256 MiB steps, rounded up (no finer view of others' use).
        assert [ld.allocated_bytes for ld in loads] == [0, 0, 256 * MiB]
        assert loads[2].free_memory_bytes == FAKE_MEMORY - 256 * MiB
        assert cuda.mem_get_info()[1] == FAKE_MEMORY
        buf.free()
        cuda.Context.synchronize()
    finally:
        cuda.Context.pop()
    _poll("the buffer freed on daemon 2", lambda: trio[2].load().allocated_bytes == 0)


def test_new_sessions_spread_over_the_daemons(trio, connect, contexts) -> None:
    _idle(trio)
    connect(_unix_list(trio))
    for _ in range(3):
        contexts.add(cuda.pick_device().make_context())
    for _ in range(3):
        contexts.add(tools.make_default_context())
    where = [_where(ctx, trio) for ctx in contexts.items]
    assert where == [0, 1, 2, 0, 1, 2]
    assert [d.load().sessions for d in trio] == [2, 2, 2]


def test_memory_steers_placement(trio, connect, contexts) -> None:
    _idle(trio)
    connect(_unix_list(trio))
    # One session on each daemon; the one on daemon 1 holds 512 MiB (two 256 MiB steps).
    for i in range(3):
        contexts.add(cuda.Device(i).make_context())
    big = contexts.items[1]
    big.push()
    try:
        buffer = cuda.mem_alloc(512 * MiB)
    finally:
        cuda.Context.pop()
    assert trio[1].load().free_memory_bytes == FAKE_MEMORY - 512 * MiB
    # Daemon 1 has as few sessions as any, and later fewer, but less free memory.
    picked = [_where(contexts.add(tools.make_default_context()), trio) for _ in range(3)]
    assert 1 not in picked, picked
    assert picked == [0, 2, 0]
    buffer.free()


def test_autoinit_places_its_session(trio) -> None:
    _idle(trio)
    # A session on daemon 0: autoinit opens its own on daemon 1 (fewest sessions, then order).
    client = _core.Client(trio[0].unix)
    busy = _core.SessionCore(client, 0, "busy")
    try:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("GPURPC_") and k != "CUDA_DEVICE"}
        env["GPURPC_ADDRESS"] = _unix_list(trio)
        env["PYTHONPATH"] = str(REPO_ROOT / "client" / "python" / "src")
        result = subprocess.run(
            ["python3", "-c", "import gpurpc.autoinit as a; print(a.device.daemon_target, "
             "a.context.get_device().daemon_target, a.device.ordinal)"],
            env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [trio[1].unix, trio[1].unix, "0"]
        # A device named in the environment wins: the third of the list.
        env["CUDA_DEVICE"] = "2"
        result = subprocess.run(
            ["python3", "-c", "import gpurpc.autoinit as a; print(a.device.daemon_target)"],
            env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [trio[2].unix]
    finally:
        busy.close()
        client.close()


def test_the_same_daemon_under_two_addresses_counts_once(trio, connect, contexts) -> None:
    # Unix socket and TCP port of daemon 0, then daemon 1, then daemon 0's socket again.
    connect(f"{trio[0].unix},{trio[0].tcp},{trio[1].unix},{trio[0].unix}")
    daemons = _devices._client().daemons()
    assert [d.target for d in daemons] == [trio[0].unix, trio[1].unix]
    assert cuda.Device.count() == 2
    assert [cuda.Device(i).daemon_target for i in range(2)] == [trio[0].unix, trio[1].unix]


def test_a_dns_name_stands_for_its_addresses(trio, connect, contexts, monkeypatch) -> None:
    _idle(trio)
    port = trio[0].tcp.rsplit(":", 1)[1]
    # localhost: the name of the first daemon's address (one address: one channel, as ever).
    connect(f"dns:///localhost:{port}")
    assert not _devices._client().multi_daemon and cuda.Device.count() == 1
    contexts.add(cuda.pick_device().make_context())
    assert trio[0].load().sessions == 1
    contexts.close()
    # Two dns:/// names: several daemons, each name resolved to its addresses.
    connect(f"dns:///localhost:{port},dns:///{trio[1].tcp}")
    daemons = _devices._client().daemons()
    assert [d.target for d in daemons] == [f"ipv4:{trio[0].tcp}", f"ipv4:{trio[1].tcp}"]
    # A name with three addresses (a headless Service): 127.0.0.1-3 behind one name.
    monkeypatch.setattr(_core.socket, "getaddrinfo", _fake_getaddrinfo(
        {"gpus.test": ["127.0.0.3", "127.0.0.1", "127.0.0.2"]}))
    _idle(trio)
    connect(f"dns:///gpus.test:{port}")
    client = _devices._client()
    assert client.multi_daemon and cuda.Device.count() == 3
    assert [d.daemon_target for d in (cuda.Device(i) for i in range(3))] == [
        f"ipv4:{d.tcp}" for d in trio]
    for _ in range(3):
        contexts.add(cuda.pick_device().make_context())
    assert sorted(_where(ctx, trio) for ctx in contexts.items) == [0, 1, 2]


def test_a_daemon_that_is_down_is_passed_over(fresh, connect, contexts) -> None:
    daemons = fresh(3)
    connect(_unix_list(daemons))
    assert cuda.Device.count() == 3
    daemons[1].stop()
    assert cuda.Device.count() == 2
    assert [cuda.Device(i).daemon_target for i in range(2)] == [daemons[0].unix, daemons[2].unix]
    status = _devices._client().daemons()
    assert [d.ok for d in status] == [True, False, True]
    assert status[1].target == daemons[1].unix and status[1].error is not None
    for _ in range(4):
        contexts.add(tools.make_default_context())
    assert sorted(_where(ctx, daemons) for ctx in contexts.items) == [0, 0, 2, 2]
    contexts.close()
    # A new connection while one is down: init succeeds with the others.
    connect(_unix_list(daemons))
    assert cuda.Device.count() == 2
    # All down: every call that needs a daemon names each one and why.
    daemons[0].stop()
    daemons[2].stop()
    for call in (cuda.pick_device, cuda.Device.count, lambda: cuda.Device(0),
                 tools.make_default_context):
        with pytest.raises(cuda.RuntimeError) as info:
            call()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert all(d.unix in str(info.value) for d in daemons), str(info.value)
    with pytest.raises(cuda.RuntimeError, match="cannot reach any of the 3 gpurpcd addresses"):
        connect(_unix_list(daemons))


def test_a_draining_daemon_is_passed_over(fresh, connect, contexts) -> None:
    daemons = fresh(2, "--drain-timeout=120s")
    connect(_unix_list(daemons))
    # Daemon 1 has two sessions, daemon 0 one: without draining, daemon 0 would win.
    held = contexts.add(cuda.Device(0).make_context())
    contexts.add(cuda.Device(1).make_context())
    contexts.add(cuda.Device(1).make_context())
    daemons[0].signal(signal.SIGTERM)
    _poll("daemon 0 draining", lambda: not daemons[0].list_devices().accepting_sessions)
    status = _devices._client().daemons()
    assert [d.accepting for d in status] == [False, True]
    assert cuda.pick_device().daemon_target == daemons[1].unix
    placed = contexts.add(tools.make_default_context())
    assert _where(placed, daemons) == 1
    # The draining daemon's session works on; numbering still counts its device.
    assert cuda.Device.count() == 2 and held.state == "active"
    held.detach()
    _poll("daemon 0 exited after its last session", lambda: daemons[0].proc.poll() is not None)
    # Only draining or down daemons: the error says why for each.
    daemons[1].signal(signal.SIGTERM)
    _poll("daemon 1 draining", lambda: not daemons[1].list_devices().accepting_sessions)
    with pytest.raises(cuda.RuntimeError, match="no daemon can take a new session") as info:
        cuda.pick_device()
    assert f"{daemons[1].unix}: draining" in str(info.value)
    assert daemons[0].unix in str(info.value)


def test_an_open_refused_passes_on_and_every_refusal_is_named(fresh, connect,
                                                              contexts) -> None:
    daemons = fresh(2, "--tenant-max-sessions=2")
    connect(_unix_list(daemons))
    # Daemon 0: two empty sessions (this tenant's quota there is full). Daemon 1: one
    # session holding 512 MiB. Daemon 0 ranks first (more free memory) but refuses the open
    # (RESOURCE_EXHAUSTED): the session goes to daemon 1.
    contexts.add(cuda.Device(0).make_context())
    contexts.add(cuda.Device(0).make_context())
    holder = contexts.add(cuda.Device(1).make_context())
    holder.push()
    try:
        buffer = cuda.mem_alloc(512 * MiB)
    finally:
        cuda.Context.pop()
    assert cuda.pick_device().daemon_target == daemons[0].unix
    placed = contexts.add(tools.make_default_context())
    assert _where(placed, daemons) == 1
    # Both full now: the last refusal, naming every device tried.
    with pytest.raises(cuda.MemoryError) as info:
        tools.make_default_context()
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    message = str(info.value)
    assert "no device took the session" in message
    assert f"{daemons[0].unix} device 0" in message and f"{daemons[1].unix} device 0" in message
    buffer.free()


def test_one_daemon_places_without_an_extra_round_trip(trio, connect, contexts) -> None:
    from gpurpc import debug
    connect(trio[0].unix)
    assert not _devices._client().multi_daemon
    debug.reset_rpc_counts()
    contexts.add(cuda.pick_device().make_context())
    contexts.add(tools.make_default_context())
    counts = debug.rpc_counts()
    assert counts.get("DeviceService.ListDevices", 0) == 0, counts
    assert counts.get("SessionService.OpenSession", 0) == 2


def test_cli_reports_each_daemon(fresh, monkeypatch) -> None:
    import io
    import json
    daemons = fresh(3)
    daemons[2].stop()
    saved = _devices._default_client
    try:
        out = io.StringIO()
        assert cli.main(["--address", _unix_list(daemons), "status"], out) == 1
        text = out.getvalue()
        assert f"daemon 0: {daemons[0].unix}" in text and f"daemon 1: {daemons[1].unix}" in text
        assert f"daemon 2: {daemons[2].unix}\nnot answering:" in text
        assert text.count("backend fake") == 2 and "SESSIONS" in text
        out = io.StringIO()
        assert cli.main(["--address", _unix_list(daemons), "--json", "ping", "-n", "2"],
                        out) == 1
        answer = json.loads(out.getvalue())
        assert [d["target"] for d in answer["daemons"]] == [d.unix for d in daemons]
        assert [len(d.get("round_trip_us", [])) for d in answer["daemons"]] == [2, 2, 0]
        assert "error" in answer["daemons"][2]
        out = io.StringIO()
        assert cli.main(["--address", _unix_list(daemons[:2]), "ping", "-n", "1"], out) == 0
        assert out.getvalue().count("round trip(s) to") == 2
        # One daemon: the output of before (no daemon headers, no load columns).
        out = io.StringIO()
        assert cli.main(["--address", daemons[0].unix, "status"], out) == 0
        assert out.getvalue().startswith("gpurpcd ") and "SESSIONS" not in out.getvalue()
    finally:
        if _devices._default_client is not None and _devices._default_client is not saved:
            _devices._default_client.close()
        _devices._default_client = saved
