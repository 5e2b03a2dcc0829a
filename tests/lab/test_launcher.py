"""The launcher reads a run's final status from the SuperLink (flwr run exits 0 anyway)."""

from __future__ import annotations

import socket
import subprocess

from lab import launcher
from lab.launcher import LocalSimulation


def _simulation(runs):
    sim = object.__new__(LocalSimulation)  # no SuperLink needed to read a status

    def list_runs():
        if isinstance(runs, Exception):
            raise runs
        return runs

    sim.list_runs = list_runs
    return sim


def test_status_is_the_started_runs_own():
    runs = [
        {"run-id": "7", "status": "finished:completed"},
        {"run-id": "42", "status": "finished:failed"},
    ]
    output = "Loading project configuration...\nSuccessfully started run 42\n..."
    assert _simulation(runs)._status(output) == "finished:failed"
    assert _simulation(runs)._status("Successfully started run 7") == "finished:completed"


def test_no_run_or_no_listing_gives_no_status():
    assert _simulation([])._status("Invalid run-config") == ""
    assert _simulation([])._status("Successfully started run 3") == ""
    error = subprocess.CalledProcessError(1, ["flwr", "list"])
    assert _simulation(error)._status("Successfully started run 3") == ""


def test_free_port_lies_below_the_kernels_ephemeral_range_and_is_bindable():
    # The kernel hands out ephemeral ports to outgoing connections at any moment; a
    # port we pick for a process to bind seconds later must not come from there.
    low, high = launcher.ephemeral_range()
    assert 1024 < low <= high
    ports = [launcher.free_port() for _ in range(50)]
    assert all(10_000 <= port < low for port in ports)
    assert len(set(ports)) > 40  # drawn at random, not the first free one each time
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


def test_free_port_skips_a_port_in_use(monkeypatch):
    with socket.socket() as taken, socket.socket() as probe:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        probe.bind(("127.0.0.1", 0))
        busy, free = taken.getsockname()[1], probe.getsockname()[1]
        probe.close()
        top = max(busy, free) + 1
        monkeypatch.setattr(launcher, "ephemeral_range", lambda: (top, 60999))
        draws = iter([busy, busy, free])

        class Draws:
            def randrange(self, start, stop):
                assert (start, stop) == (10_000, top)
                return next(draws)

        monkeypatch.setattr(launcher.random, "SystemRandom", Draws)
        assert launcher.free_port() == free


def test_a_toml_beside_pairs_is_refused_before_anything_starts():
    sim = object.__new__(LocalSimulation)  # no Flower home: nothing may be started
    outcome = sim.run("experiments/digits-dp-eps8.toml num-server-rounds=5")
    assert outcome.returncode == 2 and outcome.run_dir is None
    assert outcome.output == (
        "error: --run-config 'experiments/digits-dp-eps8.toml num-server-rounds=5': Flower "
        "drops 'experiments/digits-dp-eps8.toml' when it shares the string with key=value "
        "pairs (the run would not use it); write preset='digits-dp-eps8' instead\n"
    )
