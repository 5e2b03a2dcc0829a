"""The console of a real (in-process) run: Flower's per-round chatter only when asked
for, an ETA only once a round without start-up finished."""

from __future__ import annotations

import re

import pytest

from tests.inprocess import run_like_flwr

TINY = "num-server-rounds=3 fraction-train=1.0 vision.local-epochs=1 central-eval=false"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("console")
    quiet = run_like_flwr(f"{TINY} output-dir='{root}'")
    verbose = run_like_flwr(f"{TINY} output-dir='{root}' log.flower-rounds=true")
    for result in (quiet, verbose):
        assert result.returncode == 0, result.output
    return quiet.output, verbose.output


def test_flowers_per_round_lines_are_debug_unless_asked_for(outputs):
    quiet, verbose = outputs
    assert "Sampled" not in quiet and "aggregate_train: Received" not in quiet
    # three rounds of training and federated evaluation, each configured and aggregated
    assert len(re.findall(r"configure_(train|evaluate): Sampled \d+ nodes", verbose)) == 6
    assert len(re.findall(r"aggregate_(train|evaluate): Received \d+ results", verbose)) == 6


def test_the_eta_starts_at_round_two(outputs):
    quiet, _ = outputs
    lines = [line for line in quiet.splitlines() if "[round " in line]
    assert len(lines) == 3, quiet
    assert "ETA after round 2" in lines[0]
    assert re.search(r"ETA \d+:\d\d", lines[1]) and "ETA 0:00" in lines[2]
