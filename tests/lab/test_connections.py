"""`python -m lab.connections` (the install command's second half): it writes the
`local-simulation` connection and starts the local SuperLink with runtime dependency
installation off, so that the first `flwr run` runs the app in the installed
environment. Flower's launcher is replaced by a recorder here (no SuperLink starts);
`bench/first_run.py` measures the real thing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tomllib

import click
import pytest

from lab import connections
from lab.connections import RUNTIME_INSTALL_ENV, main


@pytest.fixture
def flwr_home(tmp_path, monkeypatch):
    """A private Flower home, and an environment this test may change."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    monkeypatch.delenv(RUNTIME_INSTALL_ENV, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(connections, "_is_local_superlink_started", lambda: False)
    return tmp_path


@pytest.fixture
def launches(monkeypatch):
    """The environments Flower's launcher would have started the SuperLink with."""
    seen: list[dict] = []
    monkeypatch.setattr(
        connections, "_start_local_superlink", lambda: seen.append(dict(os.environ))
    )
    return seen


def test_starts_the_local_superlink_with_runtime_installation_off(flwr_home, launches, capsys):
    main([])

    assert len(launches) == 1
    assert launches[0][RUNTIME_INSTALL_ENV] == "1"
    assert "RAY_ADDRESS" not in launches[0]
    conn = tomllib.loads((flwr_home / "config.toml").read_text())["superlink"]["local-simulation"]
    assert conn["address"] == ":local:"
    assert "runtime dependency installation off" in capsys.readouterr().out


def test_a_ray_connection_starts_it_joined_to_the_cluster(flwr_home, launches):
    main(["--ray-address", "head:6379"])

    assert launches[0]["RAY_ADDRESS"] == "head:6379"
    assert launches[0][RUNTIME_INSTALL_ENV] == "1"


def test_no_start_and_real_superlinks_start_nothing(flwr_home, launches):
    main(["--no-start"])
    main(["lab", "--address", "10.0.0.5:9093", "--insecure"])

    assert launches == []


def _stand_in(flwr_home, **env) -> subprocess.Popen:
    """A process whose command line names this home's local-superlink log file, as the
    SuperLink's does, with ``env`` in its environment."""
    log_file = str(flwr_home / "local-superlink" / "superlink.log")
    cmd = [sys.executable, "-c", "import time; time.sleep(60)", log_file]
    # In a session of its own, as Flower's launcher detaches the SuperLink (--stop signals
    # its process group).
    return subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True)


def _wait_found(pid: int) -> None:
    deadline = time.monotonic() + 10
    while pid not in connections.local_superlink_environments():
        assert time.monotonic() < deadline, "the stand-in process was not found"
        time.sleep(0.05)


@pytest.mark.parametrize(("installs", "says"), [("0", "kill"), ("1", "already running")])
def test_a_running_superlink_is_left_alone_and_named(flwr_home, launches, capsys, installs, says):
    proc = _stand_in(flwr_home, **{RUNTIME_INSTALL_ENV: installs})
    try:
        _wait_found(proc.pid)
        main([])
        out = capsys.readouterr().out
    finally:
        proc.kill()
        proc.wait()

    assert launches == []
    assert f"PID {proc.pid}" in out and says in out
    assert ("Warning" in out) == (installs != "1")


def test_a_superlink_that_cannot_start_is_a_clear_error(flwr_home, monkeypatch):
    def fail():
        raise click.ClickException("Unable to launch `flower-superlink`")

    monkeypatch.setattr(connections, "_start_local_superlink", fail)
    with pytest.raises(SystemExit, match="did not start: Unable to launch") as info:
        main([])
    assert RUNTIME_INSTALL_ENV in str(info.value)
    assert (flwr_home / "config.toml").is_file()  # the connection is written first


def test_stop_ends_this_homes_local_superlink_by_pid_and_no_other(flwr_home, tmp_path_factory):
    ours, other = _stand_in(flwr_home), _stand_in(tmp_path_factory.mktemp("other-home"))
    try:
        _wait_found(ours.pid)
        main(["--stop"])
        ours.wait(timeout=1)  # stopped (and reaped by --stop, which waits for it)
        assert other.poll() is None  # another Flower home's SuperLink runs on
        assert not (flwr_home / "config.toml").exists()  # --stop writes nothing
        assert (
            connections.stop_local_superlink() == f"No local SuperLink of {flwr_home} is running"
        )
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()
