"""``bench/correlated.py``'s sweep over the amplified schema's b and the app's own
least-error choice (``correlated.choose-separation``) agree: same b, same z and error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from privacy import correlated as cr

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cr.CACHE_ENV, str(tmp_path))


def test_the_benchs_sweep_is_the_apps_least_error_choice():
    sys.path.insert(0, str(BENCH))  # the script imports bench/peer_digits.py as a module
    try:
        import correlated as bench
    finally:
        sys.path.remove(str(BENCH))
    # N = 8 clients, m = 2 a round, n = 6 rounds: b in 1..4, groups of 8 // b
    best, errors = bench.best_amplified_groups(3.0, rounds=6, clients=8, cohort=2)
    app = cr.least_error_separation(
        rounds=6, cohort=2, group_sizes={b: 8 // b for b in range(1, 5)},
        target_epsilon=3.0, delta=1e-5,
    )  # fmt: skip
    assert app.separation == best
    assert [(b, z, e) for b, _, z, e in app.sweep] == pytest.approx(
        [(b, z, e) for b, (z, e) in errors.items()], rel=1e-9
    )


def test_one_reads_the_engines_run(tmp_path, monkeypatch):
    # ``one`` on a stand-in for the engine (no run): it reads run_engine's (wall, CPU,
    # metrics, timing) and the ledger's calibration, and reports the last round's
    # accuracy and ε and the median warm round (rounds >= 2: 0.5 and 0.7 -> 0.6).
    import pandas as pd

    sys.path.insert(0, str(BENCH))
    try:
        import correlated as bench
    finally:
        sys.path.remove(str(BENCH))
    seen = {}

    def engine(run_config, clients, root):
        seen["config"], seen["clients"] = run_config, clients
        run = root / "run"
        run.mkdir()
        calibration = {"min-separation": 20, "bands": 5}
        (run / "ledger.json").write_text(bench.json.dumps({"calibration": calibration}))
        metrics = pd.DataFrame(
            {
                "round": [1, 1, 2, 2],
                "scope": ["train", "central-eval"] * 2,
                "dp-epsilon": [1.0, None, 1.9998, None],
                "eval-accuracy": [None, 0.25, None, 0.5],
            }
        )
        timing = pd.DataFrame(
            {"round": [1, 2, 3], "scope": ["train"] * 3, "round-seconds": [9.0, 0.5, 0.7]}
        )
        return 12.5, 10.0, metrics, timing

    monkeypatch.setattr(bench.peer_digits, "run_engine", engine)
    row = bench.one("banded-mf", 2.0, 0, 2, tmp_path, 1000, 50, bands=5, cooldown=0.25)
    assert seen["clients"] == 1000
    assert "correlated.bands=5" in seen["config"] and "server.cooldown=0.25" in seen["config"]
    assert row["accuracy"] == 0.5 and row["ledger epsilon"] == 1.9998
    assert row["warm round s"] == pytest.approx(0.6)
    assert (row["process s"], row["process CPU s"], row["groups"], row["bands"]) == (
        12.5, 10.0, 20, 5,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "runs"),
    [([], [False]), (["--pfl-what-runs"], [False, True]), (["--pfl-what-runs-only"], [True])],
)
def test_arm_f_runs_pfl_as_stated_and_or_at_the_epsilon_that_runs(
    tmp_path, monkeypatch, flags, runs
):
    sys.path.insert(0, str(BENCH))
    try:
        import correlated as bench
    finally:
        sys.path.remove(str(BENCH))
    ran = []

    def peer(python, epsilon, seed, *sizes, fair=False):
        ran.append(fair)
        return {"arm": "f", "epsilon": epsilon, "seed": seed, "ledger epsilon": epsilon,
                "accuracy": 0.5, "warm round s": 0.1}  # fmt: skip

    monkeypatch.setattr(bench, "peer", peer)
    argv = ["--arms", "pfl-banded-mf", "--pfl-python", "py", "--eps", "2", "--out", str(tmp_path)]
    assert bench.main(argv + flags) == 0
    assert ran == runs  # False: pfl as it states itself; True: its noise for what runs
