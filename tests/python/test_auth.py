"""Authentication and tenancy through the Python client, against daemons started here.

One daemon per configuration (module-scoped), each on the fake backend:

* ``default_daemon``: gpurpcd with its defaults (no --listen, no --unix-socket) and
  ``XDG_RUNTIME_DIR`` pointing at a temporary directory, so that its socket is where clients
  look by default; the peer's uid is the tenant.
* ``token_daemon``: TCP with a tokens file (alice, bob; alice is an admin), plain text, and
  a Unix socket.
* ``tls_daemon``: TCP with TLS and the same tokens.
* ``mtls_daemon``: TCP with TLS and client certificates (the certificate's CN is the tenant).

Certificates are made at test time with the ``openssl`` command (the TLS tests skip when it
is missing); tokens are made with ``secrets`` and hashed with ``hashlib`` the way the
tokens file wants them (``tenant:salt_hex:sha256_hex(salt || token)``).
"""
from __future__ import annotations

import hashlib
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import grpc
import numpy as np
import pytest

import gpurpc.admin
import gpurpc.driver as cuda
from gpurpc import _core, _devices
from gpurpc.v1 import device_service_pb2, session_service_pb2

from conftest import CLIENT_SRC, REPO_ROOT, _free_port, _token_line

OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None,
                                   reason="needs the openssl command to make test certificates")

USER = pwd.getpwuid(os.getuid()).pw_name
SESSION_KEY = _core.SESSION_METADATA_KEY
# Variables that would change what a client does; every test starts without them.
CLIENT_ENV = ("GPURPC_ADDRESS", "GPURPC_TOKEN", "GPURPC_TOKEN_FILE", "GPURPC_TLS",
              "GPURPC_TLS_CA", "GPURPC_TLS_CERT", "GPURPC_TLS_KEY", "GPURPC_TLS_SERVER_NAME")


@pytest.fixture(autouse=True)
def _clean_client_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No GPURPC_* settings leak in, and the driver's default connection is restored."""
    for name in CLIENT_ENV:
        monkeypatch.delenv(name, raising=False)
    saved = _devices._default_client
    yield
    _devices._default_client = saved


# Set by the user (a run against a daemon started elsewhere, e.g. on a GPU box), read before
# any fixture changes the environment.
_EXTERNAL_DAEMON = os.environ.get("GPURPC_ADDRESS")


def _binary() -> Path:
    binary = Path(os.environ.get("GPURPCD_BIN", REPO_ROOT / "build" / "server" / "gpurpcd"))
    if not binary.is_file():
        message = (f"gpurpcd binary {binary} not found: these tests start their own daemons; "
                   "build it or set GPURPCD_BIN")
        if os.environ.get("GPURPC_SKIP_DAEMON_TESTS") or _EXTERNAL_DAEMON:
            pytest.skip(message)
        pytest.fail(message)
    return binary


def _clean_env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
    env.update(extra)
    return env


# -- daemons ---------------------------------------------------------------------------------

class Daemon:
    """A gpurpcd started for this module; ``socket`` is its Unix socket (always served)."""

    def __init__(self, tmp: Path, flags: List[str], socket: Path,
                 env: Optional[Dict[str, str]] = None, tcp: Optional[str] = None) -> None:
        self.socket = socket
        self.tcp = tcp  # "127.0.0.1:PORT" or None
        self.log_path = tmp / "gpurpcd.log"
        args = [str(_binary()), "--backend=fake", "--session-idle-timeout=10s",
                "--drain-timeout=0s",
                f"--cache-dir={tmp / 'cache'}", *flags]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=_clean_env(**(env or {})))
        self._wait_ready(args)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def _wait_ready(self, args: List[str], deadline_s: float = 30.0) -> None:
        deadline = time.monotonic() + deadline_s
        last: object = "its socket did not appear"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"gpurpcd {' '.join(args[1:])} exited with status "
                            f"{self.proc.returncode} at start:\n{self.log()}")
            if self.socket.exists():
                try:
                    with grpc.insecure_channel("unix:" + str(self.socket)) as channel:
                        _core._make_callable(channel, "DeviceService.ListDevices")(
                            device_service_pb2.ListDevicesRequest(), timeout=2)
                    return
                except grpc.RpcError as e:
                    last = e
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"gpurpcd {' '.join(args[1:])} not ready after {deadline_s:.0f}s: {last}\n"
                    f"{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def default_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("auth-default")
    runtime_dir = tmp / "xdg"
    runtime_dir.mkdir(mode=0o700)
    daemon = Daemon(tmp, [], runtime_dir / "gpurpc" / "gpurpcd.sock",
                    env={"XDG_RUNTIME_DIR": str(runtime_dir)})
    yield daemon
    daemon.stop()


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run([OPENSSL or "openssl", *args], cwd=cwd, capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.fail(f"openssl {' '.join(args)} failed:\n{result.stderr}")


_OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost,IP:127.0.0.1
[client]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
"""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """A CA, a server certificate for localhost/127.0.0.1, client certificates with CN=alice
    and CN=bob, and a client certificate (CN=alice) from another, untrusted CA."""
    if OPENSSL is None:
        pytest.skip("needs the openssl command to make test certificates")
    d = tmp_path_factory.mktemp("auth-certs")
    (d / "openssl.cnf").write_text(_OPENSSL_CONFIG)

    def key(name: str) -> None:
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
                 "-out", f"{name}.key", cwd=d)

    def ca(name: str, cn: str) -> None:
        key(name)
        _openssl("req", "-x509", "-new", "-key", f"{name}.key", "-subj", f"/CN={cn}",
                 "-days", "2", "-config", "openssl.cnf", "-extensions", "ca",
                 "-out", f"{name}.pem", cwd=d)

    def leaf(name: str, cn: str, issuer: str, kind: str, serial: int) -> None:
        key(name)
        _openssl("req", "-new", "-key", f"{name}.key", "-subj", f"/CN={cn}",
                 "-config", "openssl.cnf", "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{issuer}.pem",
                 "-CAkey", f"{issuer}.key", "-set_serial", str(serial), "-days", "2",
                 "-extfile", "openssl.cnf", "-extensions", kind, "-out", f"{name}.pem", cwd=d)

    ca("ca", "gpurpc test CA")
    ca("rogue-ca", "gpurpc untrusted CA")
    leaf("server", "localhost", "ca", "server", 2)
    leaf("alice", "alice", "ca", "client", 3)
    leaf("bob", "bob", "ca", "client", 4)
    leaf("rogue", "alice", "rogue-ca", "client", 5)
    return {p.stem if p.suffix == ".pem" else p.name: p for p in d.iterdir()}


def _pem(certs: Dict[str, Path], name: str) -> bytes:
    return certs[name].read_bytes()


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, object]:
    """Tokens of alice and bob, and a tokens file that holds their hashes."""
    d = tmp_path_factory.mktemp("auth-tokens")
    values = {"alice": secrets.token_urlsafe(32), "bob": secrets.token_urlsafe(32)}
    path = d / "tokens"
    path.write_text("# test tokens\n" + "".join(
        _token_line(tenant, token) + "\n" for tenant, token in values.items()))
    path.chmod(0o600)
    return {"alice": values["alice"], "bob": values["bob"], "file": path}


def _tcp_daemon(tmp_path_factory: pytest.TempPathFactory, name: str,
                flags: List[str]) -> Daemon:
    tmp = tmp_path_factory.mktemp(name)
    tcp = f"127.0.0.1:{_free_port()}"
    socket = tmp / "gpurpcd.sock"
    return Daemon(tmp, [f"--listen={tcp}", f"--unix-socket={socket}", *flags], socket, tcp=tcp)


@pytest.fixture(scope="module")
def token_daemon(tmp_path_factory: pytest.TempPathFactory,
                 tokens: Dict[str, object]) -> Iterator[Daemon]:
    daemon = _tcp_daemon(tmp_path_factory, "auth-token",
                         [f"--tokens-file={tokens['file']}", "--admin-tenants=alice"])
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory: pytest.TempPathFactory, tokens: Dict[str, object],
               certs: Dict[str, Path]) -> Iterator[Daemon]:
    daemon = _tcp_daemon(tmp_path_factory, "auth-tls",
                         [f"--tokens-file={tokens['file']}", f"--tls-cert={certs['server']}",
                          f"--tls-key={certs['server.key']}"])
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def mtls_daemon(tmp_path_factory: pytest.TempPathFactory,
                certs: Dict[str, Path]) -> Iterator[Daemon]:
    daemon = _tcp_daemon(tmp_path_factory, "auth-mtls",
                         [f"--tls-cert={certs['server']}", f"--tls-key={certs['server.key']}",
                          f"--tls-client-ca={certs['ca']}"])
    yield daemon
    daemon.stop()


# -- helpers ---------------------------------------------------------------------------------

def _expect_error(fn, code: grpc.StatusCode, *secrets_: str) -> cuda.Error:
    """Runs fn, expects a gpurpc error with `code` whose text shows none of `secrets_`."""
    with pytest.raises(cuda.Error) as info:
        fn()
    err = info.value
    assert err.code == code, f"expected {code.name}, got {err!r}"
    for secret in secrets_:
        for text in (str(err), err.details, repr(err), err.operation):
            assert secret not in text, "the token leaked into the exception"
    return err


def _keepalive(client: _core.Client, session_id: int) -> session_service_pb2.KeepAliveResponse:
    return client.call("SessionService.KeepAlive", session_service_pb2.KeepAliveRequest(),
                       ((SESSION_KEY, str(session_id)),), timeout=10)


def _run_python(code: str, env: Dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(env, PYTHONPATH=str(CLIENT_SRC)))


# -- address resolution ----------------------------------------------------------------------

def test_default_socket_paths_follow_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/4242")
    assert _core.default_socket_paths() == [
        "/run/user/4242/gpurpc/gpurpcd.sock", "/run/gpurpc/gpurpcd.sock",
        f"/tmp/gpurpc-{os.getuid()}/gpurpcd.sock"]
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert _core.default_socket_paths()[0] == "/run/gpurpc/gpurpcd.sock"


def test_no_address_and_no_socket_names_every_place(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    paths = _core.default_socket_paths()
    if any(os.path.exists(p) for p in paths[1:]):
        pytest.skip(f"a daemon socket exists here ({paths[1:]}): cannot test its absence")
    with pytest.raises(cuda.RuntimeError) as info:
        _core.Client()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    for path in paths:
        assert path in str(info.value)
    assert "GPURPC_ADDRESS" in str(info.value)


def test_explicit_address_and_env_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPURPC_ADDRESS", "gpu-box:7000")
    assert _core.resolve_address() == "gpu-box:7000"
    assert _core.resolve_address("/run/x.sock") == "unix:/run/x.sock"
    monkeypatch.setenv("GPURPC_ADDRESS", " /run/y.sock ")
    assert _core.resolve_address() == "unix:/run/y.sock"


def test_default_socket_found_and_tenant_is_the_user(default_daemon: Daemon,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(default_daemon.socket.parent.parent))
    assert stat.S_ISSOCK(default_daemon.socket.stat().st_mode)
    assert _core.resolve_address() == "unix:" + str(default_daemon.socket)
    client = _core.Client()
    try:
        info = client.server_info()
        assert info.tenant == USER
        assert info.auth_method == "unix-peer"
        assert info.version
    finally:
        client.close()


def test_autoinit_with_nothing_set(default_daemon: Daemon) -> None:
    env = _clean_env(XDG_RUNTIME_DIR=str(default_daemon.socket.parent.parent))
    result = _run_python(
        "import numpy as np\n"
        "import gpurpc.autoinit\n"
        "import gpurpc.driver as cuda, gpurpc.admin\n"
        "buf = cuda.to_device(np.arange(4, dtype=np.int32))\n"
        "print(cuda.from_device(buf, 4, np.int32).tolist(), gpurpc.admin.server_info().tenant)\n",
        env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == f"[0, 1, 2, 3] {USER}"


# -- bearer tokens over TCP ------------------------------------------------------------------

def test_token_gives_its_tenant(token_daemon: Daemon, tokens: Dict[str, object]) -> None:
    for tenant in ("alice", "bob"):
        client = _core.Client(token_daemon.tcp, token=str(tokens[tenant]))
        try:
            info = client.server_info()
            assert (info.tenant, info.auth_method) == (tenant, "token")
            assert info.admin == (tenant == "alice")
            assert "authorization" not in repr(client) and str(tokens[tenant]) not in repr(client)
        finally:
            client.close()


def test_no_token_is_unauthenticated(token_daemon: Daemon) -> None:
    client = _core.Client(token_daemon.tcp)
    try:
        err = _expect_error(client.list_devices, grpc.StatusCode.UNAUTHENTICATED)
        assert type(err) is cuda.Error
        assert "GPURPC_TOKEN" in str(err)
    finally:
        client.close()
    # The driver's init says the same.
    _expect_error(lambda: cuda.init(address=token_daemon.tcp), grpc.StatusCode.UNAUTHENTICATED)


def test_wrong_token_is_unauthenticated_and_never_shown(token_daemon: Daemon,
                                                        tokens: Dict[str, object]) -> None:
    wrong = "not-" + str(tokens["alice"])
    client = _core.Client(token_daemon.tcp, token=wrong)
    try:
        _expect_error(client.list_devices, grpc.StatusCode.UNAUTHENTICATED, wrong,
                      str(tokens["alice"]))
        _expect_error(client.server_info, grpc.StatusCode.UNAUTHENTICATED, wrong)
    finally:
        client.close()


def test_token_from_environment(token_daemon: Daemon, tokens: Dict[str, object],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPURPC_TOKEN", str(tokens["bob"]))
    client = _core.Client(token_daemon.tcp)
    try:
        assert client.server_info().tenant == "bob"
    finally:
        client.close()


def test_token_from_token_file(token_daemon: Daemon, tokens: Dict[str, object],
                               monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {tokens['alice']}\n\n")
    monkeypatch.setenv("GPURPC_TOKEN_FILE", str(path))
    client = _core.Client(token_daemon.tcp)
    try:
        assert client.server_info().tenant == "alice"
    finally:
        client.close()
    # An explicit token wins over the file.
    client = _core.Client(token_daemon.tcp, token=str(tokens["bob"]))
    try:
        assert client.server_info().tenant == "bob"
    finally:
        client.close()


def test_missing_token_file_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    missing = tmp_path / "no-such-token"
    monkeypatch.setenv("GPURPC_TOKEN_FILE", str(missing))
    with pytest.raises(cuda.LogicError) as info:
        _core.Client("127.0.0.1:1")
    assert str(missing) in str(info.value) and "GPURPC_TOKEN_FILE" in str(info.value)
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    monkeypatch.setenv("GPURPC_TOKEN_FILE", str(empty))
    with pytest.raises(cuda.LogicError, match="empty"):
        _core.Client("127.0.0.1:1")


def test_a_token_that_cannot_be_sent_is_refused_without_showing_it() -> None:
    with pytest.raises(cuda.LogicError) as info:
        _core.Client("127.0.0.1:1", token="secret part\nother")
    assert "secret" not in str(info.value)


def test_token_reaches_every_path_of_a_session(token_daemon: Daemon,
                                               tokens: Dict[str, object]) -> None:
    """init/Context with a token: unary calls, the command stream and streamed transfers."""
    cuda.init(address=token_daemon.tcp, token=str(tokens["alice"]))
    ctx = cuda.Device(0).make_context()
    try:
        small = np.arange(1000, dtype=np.int32)
        buf = cuda.to_device(small)                       # command stream
        assert np.array_equal(cuda.from_device_like(buf, small), small)
        big = np.random.default_rng(1).integers(0, 255, 9 << 20, dtype=np.uint8)
        big_buf = cuda.mem_alloc(big.nbytes)
        cuda.memcpy_htod(big_buf, big)                    # UploadStream
        back = np.empty_like(big)
        cuda.memcpy_dtoh(back, big_buf)                   # DownloadStream
        assert np.array_equal(back, big)
        cuda.Context.synchronize()
        assert gpurpc.admin.server_info().tenant == "alice"
    finally:
        cuda.Context.pop()
        ctx.detach()


def test_init_keeps_or_replaces_the_connection(token_daemon: Daemon,
                                               tokens: Dict[str, object]) -> None:
    cuda.init(address=token_daemon.tcp, token=str(tokens["alice"]))
    first = _devices._default_client
    cuda.init()                                                    # nothing asked: kept
    cuda.init(address=token_daemon.tcp, token=str(tokens["alice"]))  # the same: kept
    assert _devices._default_client is first
    cuda.init(address=token_daemon.tcp, token=str(tokens["bob"]))    # other credentials
    assert _devices._default_client is not first
    assert gpurpc.admin.server_info().tenant == "bob"
    # A refused init leaves the working connection in place.
    _expect_error(lambda: cuda.init(address=token_daemon.tcp, token="xyzzy-not-a-token"),
                  grpc.StatusCode.UNAUTHENTICATED, "xyzzy-not-a-token")
    assert gpurpc.admin.server_info().tenant == "bob"


def test_tenants_cannot_use_each_others_sessions(token_daemon: Daemon,
                                                 tokens: Dict[str, object]) -> None:
    alice = _core.Client(token_daemon.tcp, token=str(tokens["alice"]))
    bob = _core.Client(token_daemon.tcp, token=str(tokens["bob"]))
    session = _core.SessionCore(alice, 0, "alice's session")
    try:
        assert _keepalive(alice, session.session_id).state == \
            session_service_pb2.SESSION_STATE_ACTIVE
        unknown = session.session_id + 1_000_003
        theirs = _expect_error(lambda: _keepalive(bob, session.session_id),
                               grpc.StatusCode.NOT_FOUND, str(tokens["bob"]))
        nobodys = _expect_error(lambda: _keepalive(bob, unknown), grpc.StatusCode.NOT_FOUND)
        # Indistinguishable from an id that does not exist: no oracle for other tenants' ids.
        assert theirs.details.replace(str(session.session_id), "ID") == \
            nobodys.details.replace(str(unknown), "ID")
        from gpurpc.v1 import memory_service_pb2
        _expect_error(lambda: bob.call("MemoryService.Allocate",
                                       memory_service_pb2.AllocateRequest(size_bytes=64),
                                       ((SESSION_KEY, str(session.session_id)),), timeout=10),
                      grpc.StatusCode.NOT_FOUND)
        # alice's session is untouched.
        assert _keepalive(alice, session.session_id).state == \
            session_service_pb2.SESSION_STATE_ACTIVE
    finally:
        session.close()
        alice.close()
        bob.close()


def test_admin_lists_and_closes_sessions(token_daemon: Daemon,
                                         tokens: Dict[str, object]) -> None:
    alice = _core.Client(token_daemon.tcp, token=str(tokens["alice"]))
    bob = _core.Client(token_daemon.tcp, token=str(tokens["bob"]))
    session = _core.SessionCore(bob, 0, "bob's session")
    try:
        listed = [s for s in alice.admin_list_sessions().sessions
                  if s.session_id == session.session_id]
        assert len(listed) == 1
        assert listed[0].tenant == "bob" and listed[0].client_label == "bob's session"
        assert all(s.tenant == "bob" for s in alice.admin_list_sessions("bob").sessions)
        assert not [s for s in alice.admin_list_sessions("alice").sessions
                    if s.session_id == session.session_id]
        # bob is no admin.
        _expect_error(bob.admin_list_sessions, grpc.StatusCode.PERMISSION_DENIED)
        _expect_error(lambda: bob.admin_close_session(session.session_id),
                      grpc.StatusCode.PERMISSION_DENIED)
        # The gpurpc.admin module, on the driver's connection.
        cuda.init(address=token_daemon.tcp, token=str(tokens["alice"]))
        assert session.session_id in [s.session_id for s in gpurpc.admin.list_sessions()]
        assert gpurpc.admin.close_session(session.session_id) == "bob"
        _expect_error(lambda: _keepalive(bob, session.session_id), grpc.StatusCode.NOT_FOUND)
        _expect_error(lambda: gpurpc.admin.close_session(session.session_id),
                      grpc.StatusCode.NOT_FOUND)
    finally:
        session.close()
        alice.close()
        bob.close()


def test_unix_socket_needs_no_token_on_a_token_daemon(token_daemon: Daemon) -> None:
    client = _core.Client(str(token_daemon.socket))
    try:
        info = client.server_info()
        assert (info.tenant, info.auth_method) == (USER, "unix-peer")
    finally:
        client.close()


def test_new_token_prints_a_matching_line() -> None:
    result = subprocess.run([str(_binary()), "--new-token=carol"], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    token, line = result.stdout.splitlines()[:2]
    tenant, salt_hex, digest = line.split(":")
    assert tenant == "carol"
    assert hashlib.sha256(bytes.fromhex(salt_hex) + token.encode()).hexdigest() == digest


# -- TLS -------------------------------------------------------------------------------------

def _port(daemon: Daemon) -> str:
    assert daemon.tcp is not None
    return daemon.tcp.rsplit(":", 1)[1]


@needs_openssl
def test_tls_with_token(tls_daemon: Daemon, certs: Dict[str, Path],
                        tokens: Dict[str, object]) -> None:
    for address in (f"localhost:{_port(tls_daemon)}", tls_daemon.tcp):
        client = _core.Client(address, token=str(tokens["alice"]),
                              root_certificates=_pem(certs, "ca"))
        try:
            info = client.server_info()
            assert (info.tenant, info.auth_method) == ("alice", "token")
        finally:
            client.close()


@needs_openssl
def test_tls_from_environment(tls_daemon: Daemon, certs: Dict[str, Path],
                              tokens: Dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPURPC_TLS_CA", str(certs["ca"]))
    monkeypatch.setenv("GPURPC_TOKEN", str(tokens["bob"]))
    monkeypatch.setenv("GPURPC_TLS_SERVER_NAME", "localhost")
    client = _core.Client(tls_daemon.tcp)
    try:
        assert client.tls
        assert client.server_info().tenant == "bob"
    finally:
        client.close()


@needs_openssl
def test_tls_needs_the_token_too(tls_daemon: Daemon, certs: Dict[str, Path]) -> None:
    client = _core.Client(tls_daemon.tcp, root_certificates=_pem(certs, "ca"))
    try:
        _expect_error(client.server_info, grpc.StatusCode.UNAUTHENTICATED)
    finally:
        client.close()


@needs_openssl
def test_tls_with_the_wrong_ca_fails_clearly(tls_daemon: Daemon, certs: Dict[str, Path],
                                             tokens: Dict[str, object]) -> None:
    client = _core.Client(tls_daemon.tcp, token=str(tokens["alice"]),
                          root_certificates=_pem(certs, "rogue-ca"))
    try:
        err = _expect_error(lambda: client.call("DeviceService.ListDevices",
                                                device_service_pb2.ListDevicesRequest(),
                                                timeout=10),
                            grpc.StatusCode.UNAVAILABLE, str(tokens["alice"]))
        assert isinstance(err, cuda.RuntimeError)
        assert "TLS" in str(err) and "GPURPC_TLS_CA" in str(err)
    finally:
        client.close()


@needs_openssl
def test_tls_server_name_override_is_applied(tls_daemon: Daemon, certs: Dict[str, Path],
                                             tokens: Dict[str, object]) -> None:
    client = _core.Client(tls_daemon.tcp, token=str(tokens["alice"]),
                          root_certificates=_pem(certs, "ca"), server_name="not-this.example")
    try:
        _expect_error(lambda: client.call("DeviceService.ListDevices",
                                          device_service_pb2.ListDevicesRequest(), timeout=10),
                      grpc.StatusCode.UNAVAILABLE)
    finally:
        client.close()


@needs_openssl
def test_plain_text_client_against_tls_daemon_fails(tls_daemon: Daemon,
                                                    tokens: Dict[str, object]) -> None:
    client = _core.Client(tls_daemon.tcp, token=str(tokens["alice"]), tls=False)
    try:
        _expect_error(lambda: client.call("DeviceService.ListDevices",
                                          device_service_pb2.ListDevicesRequest(), timeout=10),
                      grpc.StatusCode.UNAVAILABLE, str(tokens["alice"]))
    finally:
        client.close()


@needs_openssl
def test_environment_tls_is_not_applied_to_unix_sockets(tls_daemon: Daemon,
                                                        certs: Dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPURPC_TLS", "1")
    monkeypatch.setenv("GPURPC_TLS_CA", str(certs["ca"]))
    client = _core.Client(str(tls_daemon.socket))
    try:
        assert not client.tls
        assert client.server_info().tenant == USER
    finally:
        client.close()


# -- mutual TLS ------------------------------------------------------------------------------

@needs_openssl
def test_mtls_certificate_names_the_tenant(mtls_daemon: Daemon, certs: Dict[str, Path]) -> None:
    for tenant in ("alice", "bob"):
        client = _core.Client(mtls_daemon.tcp, root_certificates=_pem(certs, "ca"),
                              certificate_chain=_pem(certs, tenant),
                              private_key=_pem(certs, f"{tenant}.key"))
        try:
            info = client.server_info()
            assert (info.tenant, info.auth_method) == (tenant, "mtls")
        finally:
            client.close()


@needs_openssl
def test_mtls_from_environment_with_a_session(mtls_daemon: Daemon, certs: Dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPURPC_ADDRESS", str(mtls_daemon.tcp))
    monkeypatch.setenv("GPURPC_TLS_CA", str(certs["ca"]))
    monkeypatch.setenv("GPURPC_TLS_CERT", str(certs["bob"]))
    monkeypatch.setenv("GPURPC_TLS_KEY", str(certs["bob.key"]))
    result = _run_python(
        "import numpy as np\n"
        "import gpurpc.autoinit\n"
        "import gpurpc.driver as cuda, gpurpc.admin\n"
        "buf = cuda.to_device(np.arange(3, dtype=np.float32))\n"
        "print(cuda.from_device(buf, 3, np.float32).tolist(), gpurpc.admin.server_info().tenant)\n",
        dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "[0.0, 1.0, 2.0] bob"


@needs_openssl
def test_mtls_untrusted_client_certificate_is_refused(mtls_daemon: Daemon,
                                                      certs: Dict[str, Path]) -> None:
    client = _core.Client(mtls_daemon.tcp, root_certificates=_pem(certs, "ca"),
                          certificate_chain=_pem(certs, "rogue"),
                          private_key=_pem(certs, "rogue.key"))
    try:
        with pytest.raises(cuda.Error) as info:
            client.call("DeviceService.GetServerInfo", device_service_pb2.GetServerInfoRequest(),
                        timeout=10)
        # Refused at the handshake (UNAVAILABLE) or at the call (UNAUTHENTICATED); never alice.
        assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
    finally:
        client.close()


@needs_openssl
def test_mtls_without_a_client_certificate_is_refused(mtls_daemon: Daemon,
                                                      certs: Dict[str, Path]) -> None:
    client = _core.Client(mtls_daemon.tcp, root_certificates=_pem(certs, "ca"))
    try:
        with pytest.raises(cuda.Error) as info:
            client.call("DeviceService.GetServerInfo", device_service_pb2.GetServerInfoRequest(),
                        timeout=10)
        assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
    finally:
        client.close()


@needs_openssl
def test_client_certificate_needs_its_key(certs: Dict[str, Path]) -> None:
    with pytest.raises(cuda.LogicError, match="private key"):
        _core.Client("127.0.0.1:1", certificate_chain=_pem(certs, "alice"))
