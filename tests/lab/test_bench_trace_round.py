"""``bench/trace_round.py``'s steady-round window: it opens at the round loop's own
``configure_train`` of round 2 (not a wrapper's call of the strategy it wraps) and closes
when the round loop's evaluation of round 2 returns."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def trace():
    sys.path.insert(0, str(BENCH))
    try:
        import trace_round

        yield trace_round
    finally:
        sys.path.remove(str(BENCH))


def _frame(name: str, caller: str | None = None, filename: str = "x.py", **local):
    code = SimpleNamespace(co_name=name, co_filename=filename)
    back = None if caller is None else _frame(caller)
    return SimpleNamespace(f_code=code, f_back=back, f_locals=local)


def test_the_window_opens_at_the_round_loops_configure_train_of_round_two(trace):
    assert trace.STEADY == 2
    assert trace._opens_round(_frame("configure_train", "run_rounds", server_round=2), 2)
    assert not trace._opens_round(_frame("configure_train", "run_rounds", server_round=1), 2)
    # A privacy wrapper calling the strategy it wraps: already inside the window.
    assert not trace._opens_round(_frame("configure_train", "configure_train", server_round=2), 2)
    assert not trace._opens_round(_frame("aggregate_train", "run_rounds", server_round=2), 2)


def test_the_window_closes_with_the_round_loops_evaluation_of_round_two(trace):
    rounds = "/repo/server_app/rounds.py"
    result = SimpleNamespace(server_round=2)
    assert trace._closes_round(_frame("_evaluate", filename=rounds, result=result), 2)
    earlier = SimpleNamespace(server_round=1)
    assert not trace._closes_round(_frame("_evaluate", filename=rounds, result=earlier), 2)
    # A strategy's own _evaluate elsewhere does not close it.
    assert not trace._closes_round(_frame("_evaluate", filename="/repo/x.py", result=result), 2)
