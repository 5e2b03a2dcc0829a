"""The launcher reads a run's final status from the SuperLink (flwr run exits 0 anyway)."""

from __future__ import annotations

import subprocess

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
