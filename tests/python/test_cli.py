"""The ``gpurpc`` command line (gpurpc.cli), run as a user runs it (``python -m gpurpc``, a
separate process) against daemons of its own on the fake backend: one where the caller's
tenant is an admin, one where it is not.
"""
from __future__ import annotations

import getpass
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from test_auth import Daemon, _clean_env

SRC = str(Path(__file__).resolve().parents[2] / "client" / "python" / "src")
ME = getpass.getuser()


def _cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess:
    env = _clean_env(PYTHONPATH=SRC, GPURPC_ADDRESS=f"unix:{daemon.socket}")
    return subprocess.run([sys.executable, "-m", "gpurpc", *args], env=env, text=True,
                          capture_output=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def admin_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("cli-admin")
    daemon = Daemon(tmp, [f"--unix-socket={tmp / 'gpurpcd.sock'}", f"--admin-tenants={ME}"],
                    tmp / "gpurpcd.sock")
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def plain_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("cli-plain")
    daemon = Daemon(tmp, [f"--unix-socket={tmp / 'gpurpcd.sock'}", "--admin-tenants=nobodyelse"],
                    tmp / "gpurpcd.sock")
    yield daemon
    daemon.stop()


class Holder:
    """Another process holding one session with 3 MiB allocated, until stopped."""

    def __init__(self, daemon: Daemon) -> None:
        code = ("import sys, gpurpc.driver as cuda\n"
                f"cuda.init(address='unix:{daemon.socket}')\n"
                "ctx = cuda.Device(0).make_context()\n"
                "buf = cuda.mem_alloc(3 << 20)\n"
                "print(ctx._core.session_id, flush=True)\n"
                "sys.stdin.read()\n")
        env = _clean_env(PYTHONPATH=SRC)
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip().isdigit(), f"the holder printed {line!r}"
        self.session_id = int(line)

    def stop(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=30)


@pytest.fixture
def holder(admin_daemon: Daemon) -> Iterator[Holder]:
    h = Holder(admin_daemon)
    yield h
    h.stop()


def test_status_shows_the_daemon_the_tenant_the_devices_and_every_tenants_sessions(
        admin_daemon: Daemon, holder: Holder) -> None:
    result = _cli(admin_daemon, "status")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("gpurpcd "), out
    assert f"tenant '{ME}'" in out and "admin" in out
    assert "backend fake" in out
    assert "gpurpc fake device" in out
    # The holder's session, with its 3 MiB, under the caller's tenant.
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(ME)]
    assert rows and rows[-1][1] == "1" and rows[-1][3] == "3", out


def test_status_as_json_parses(admin_daemon: Daemon, holder: Holder) -> None:
    result = _cli(admin_daemon, "--json", "status")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["server"]["tenant"] == ME and answer["server"]["admin"] is True
    assert answer["devices"]["backend"] == "fake"
    assert [int(s["session_id"]) for s in answer["sessions"]] == [holder.session_id]


def test_ping_reports_round_trips(admin_daemon: Daemon) -> None:
    result = _cli(admin_daemon, "ping", "-n", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("3 round trip(s) to unix:"), result.stdout
    assert "median" in result.stdout
    result = _cli(admin_daemon, "--json", "ping", "-n", "2")
    assert len(json.loads(result.stdout)["round_trip_us"]) == 2
    result = _cli(admin_daemon, "ping", "-n", "0")
    assert result.returncode == 2 and "at least 1" in result.stderr


def test_sessions_lists_and_close_closes_any_session(admin_daemon: Daemon,
                                                     holder: Holder) -> None:
    result = _cli(admin_daemon, "sessions")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["SESSION", "TENANT", "DEVICE", "STATE"]
    assert any(line.split()[0] == str(holder.session_id) and "3 MiB" in line for line in lines)
    assert _cli(admin_daemon, "sessions", "--tenant", "someone-else").stdout == \
        "no open sessions\n"

    result = _cli(admin_daemon, "close", str(holder.session_id))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"closed session {holder.session_id} of tenant '{ME}'\n"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        listed = json.loads(_cli(admin_daemon, "--json", "sessions").stdout)
        if not listed:
            break
        time.sleep(0.1)
    assert listed == []
    # Closing it again: the daemon's NOT_FOUND, exit status 1.
    result = _cli(admin_daemon, "close", str(holder.session_id))
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr and str(holder.session_id) in result.stderr


def test_bad_input_is_a_usage_error(admin_daemon: Daemon) -> None:
    for args in (["close", "abc"], ["close", "0"], ["close", "-5"], ["nosuchcommand"], []):
        result = _cli(admin_daemon, *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert result.stderr, args


def test_a_tenant_that_is_not_an_admin_is_refused_the_admin_commands(
        plain_daemon: Daemon) -> None:
    result = _cli(plain_daemon, "status")
    assert result.returncode == 0, result.stderr
    assert "sessions by tenant" not in result.stdout and ", admin" not in result.stdout
    for args in (["sessions"], ["close", "42"]):
        result = _cli(plain_daemon, *args)
        assert result.returncode == 1, (args, result.stdout)
        assert "PERMISSION_DENIED" in result.stderr, result.stderr


def test_an_unreachable_daemon_is_exit_status_1_with_the_reason(tmp_path: Path) -> None:
    env = _clean_env(PYTHONPATH=SRC)
    result = subprocess.run([sys.executable, "-m", "gpurpc", "--timeout", "3", "--address",
                             f"unix:{tmp_path / 'nothing.sock'}", "status"], env=env, text=True,
                            capture_output=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "nothing.sock" in result.stderr, result.stderr
