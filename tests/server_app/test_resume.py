"""Checkpoint and ``resume-from``: a run killed at any moment and resumed ends exactly
where the uninterrupted run ends, and a charged round is never released twice.

Each case runs the ServerApp against the real ClientApp in this process
(:mod:`tests.inprocess`) once, uninterrupted, copying its directory at the two sides
of round 2's commit (``checkpoint/server.pt``): before it (the resumed run re-runs
round 2) and after it (round 2 committed, none of its results written). For FedAvg and
DP-FedAvg the run is also killed for real and its directory checked against the copy.
Each copy is resumed with new node ids and must leave the same model bit for bit, the
same ledger (no double charge, no lost round), metrics with no gap or duplicate round,
and the same per-client tables (DP runs use ``dp.reproducible-noise``). What may have
been sent in the round under way is charged on resume, so those cases end with a
larger, sound epsilon: docs/results.md, "Checkpoints and resume".
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch

from config.options import ConfigError
from server_app.results import TIMING_COLUMNS, RunDirectory, load_metrics
from tests.inprocess import InProcessGrid, run_config, run_server

pytestmark = pytest.mark.usefixtures("learning_curve_not_rendered")

NODES = [11, 22, 33, 44]
NEW_NODES = [505, 606, 707, 808]  # a new run: new ids, same partitions
KILLED_AT = 2

SEEDED = {"dp.reproducible-noise": True}
DP = {"dp.num-sampled-clients": 2, "dp.noise-multiplier": 1.0, "dp.clip-norm": 0.5, **SEEDED}
CASES = {
    "fedavg": ("fedavg", "none", {"fraction-train": 0.5}),
    "fedprox": ("fedprox", "none", {}),
    "local": ("local", "none", {}),
    "clustered": ("clustered", "none", {"cluster.k": 2}),
    "smart-fedprox": ("smart-fedprox", "none", {"smart.cold-start-rounds": 1}),
    "hierarchical": ("hierarchical", "none", {}),
    "hierarchical-cp-np": ("hierarchical", "cp-np", SEEDED),
    "dp-fedavg-fixed": ("fedavg", "dp-fedavg-fixed", DP),
    "dp-fedavg-adaptive": ("fedavg", "dp-fedavg-adaptive", DP),
    "dp-fedavg-client-noise": (
        "fedavg",
        "dp-fedavg-fixed",
        {**DP, "dp.noise-site": "client", "dp.sampling": "fixed"},
    ),
    "dp-fedavg-secagg-distributed": (
        "fedavg",
        "dp-fedavg-fixed",
        {**DP, "dp.noise-site": "client", "dp.sampling": "fixed", "secagg.enabled": True},
    ),
    "subspace-dp": ("fedavg", "subspace-dp", {**DP, "subspace.rank": 2, "subspace.sketch-dim": 8}),
    "laplace": ("fedavg", "laplace", {**SEEDED, "dp.num-sampled-clients": 2}),
    # z = 3: DP-SGD's sample-level accounting (RDP at fractional orders, per client and
    # round, by the client and again by the server) is most of its run's cost, and
    # falls as z grows (a 3-round run: 10 s of CPU at z = 1, 4 s at z = 3).
    "dp-sgd": ("fedavg", "dp-sgd", {**SEEDED, "dp.noise-multiplier": 3.0}),
}
# Cases killed on both sides of the commit (the others: after it, the moment that
# checks re-evaluation); "before" re-runs a round and so exercises the resume charges.
BOTH_SIDES = ("fedavg", "dp-fedavg-fixed", "dp-fedavg-client-noise", "laplace", "dp-sgd",
              "hierarchical-cp-np", "dp-fedavg-secagg-distributed")  # fmt: skip
# Train-row columns that the resume charge raises (per case), and what else may differ.
RESUME_CHARGED = {
    "dp-fedavg-client-noise": ("dp-epsilon-local", "dp-epsilon-local-worst"),
    "laplace": ("dp-epsilon-local", "dp-epsilon-local-worst"),
    "dp-sgd": ("local-epsilon",),
    "hierarchical-cp-np": ("dp-epsilon", "dp-epsilon-edge-view"),
    "dp-fedavg-secagg-distributed": ("dp-epsilon",),
}


# Cases also killed for real, whose directory must equal the uninterrupted run's copy.
KILLED_FOR_REAL = ("fedavg", "dp-fedavg-fixed")
# The moment's hook: the RunDirectory method that round KILLED_AT is in at that moment.
HOOK = {"before": "commit", "after": "record_round"}
# Written by each process in its own way: TensorBoard's event files (host, time) and the
# outcome a dying ServerApp writes if it lives long enough (a hard kill writes none).
PER_PROCESS = ("tensorboard", "outcome.json")
# In server.pt: the round's wall time, and Python's global generator, which the app
# neither seeds nor draws from (its state is the process's history).
PER_PROCESS_STATE = (("result", "seconds"), ("rng", "python"))


class Killed(Exception):
    """The ServerApp process dies here."""


@dataclass(frozen=True)
class FullRun:
    """A case's uninterrupted run: its config, its directory, and copies of it as a run
    killed at each moment of round KILLED_AT leaves it."""

    config: dict
    path: Path
    killed_at: dict[str, Path]


def _only_run(root: Path) -> Path:
    (path,) = [p for p in root.iterdir() if p.is_dir()]
    return path


def _round_of(name: str, first) -> int:
    return first if name == "commit" else first.server_round


def _kill(monkeypatch, moment: str) -> None:
    """Die in round KILLED_AT: while committing it ("before": not committed), or while
    writing its results once it is committed and evaluated ("after")."""
    name = HOOK[moment]
    original = getattr(RunDirectory, name)

    def dying(self, first, *args, **kwargs):
        if _round_of(name, first) == KILLED_AT:
            raise Killed(f"killed in {name} of round {KILLED_AT}")
        return original(self, first, *args, **kwargs)

    monkeypatch.setattr(RunDirectory, name, dying)


def _copy_at_each_moment(monkeypatch, into: Path) -> None:
    """Copy the run directory to ``into/<moment>/`` where :func:`_kill` would kill it."""
    for moment, name in HOOK.items():
        original = getattr(RunDirectory, name)

        def copying(self, first, *args, _moment=moment, _name=name, _original=original, **kw):
            if _round_of(_name, first) == KILLED_AT:
                shutil.copytree(self.path, into / _moment / self.path.name, symlinks=True)
            return _original(self, first, *args, **kw)

        monkeypatch.setattr(RunDirectory, name, copying)


def _case_config(case: str, output_dir: Path) -> dict:
    strategy, privacy, extra = CASES[case]
    return run_config(
        strategy=strategy, privacy=privacy, **extra, **{"output-dir": str(output_dir)}
    )


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    """``case -> FullRun``: each case's uninterrupted run, made once (per worker) when a
    test first asks for it."""
    made: dict[str, FullRun] = {}

    def full_run(case: str) -> FullRun:
        if case not in made:
            root = tmp_path_factory.mktemp(f"full-{case}")
            config = _case_config(case, root / "full")
            with pytest.MonkeyPatch.context() as patch:
                _copy_at_each_moment(patch, root / "killed")
                run_server(config, InProcessGrid(config, NODES))
            killed_at = {m: _only_run(root / "killed" / m) for m in HOOK}
            made[case] = FullRun(config, _only_run(root / "full"), killed_at)
        return made[case]

    return full_run


def _table(path: Path, drop: tuple[str, ...] = ()) -> pd.DataFrame:
    """A CSV without what differs between processes by design: wall time, node ids."""
    frame = pd.read_csv(path)
    dropped = [c for c in frame.columns if c in TIMING_COLUMNS or "node" in c or c in drop]
    return frame.drop(columns=dropped)


def _csvs(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.csv"))


def _files(run_dir: Path) -> list[str]:
    return sorted(
        str(p.relative_to(run_dir))
        for p in run_dir.rglob("*")
        if p.is_file() and p.relative_to(run_dir).parts[0] not in PER_PROCESS
    )


def _same_content(a, b) -> bool:
    """Equal, tensors bit for bit (a checkpoint loaded with ``torch.load``)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_same_content(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same_content(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


OUTPUT_DIR = re.compile(r"output-dir='[^']*'")


def _assert_same_directory(killed: Path, copy: Path) -> None:
    """What a killed run left is what the uninterrupted run held at that moment: the same
    files, the same tables (but wall time), checkpoints and client states bit for bit,
    the same run-config and environment (but the output directory)."""
    assert _files(killed) == _files(copy)
    for name in _files(copy):
        if name.endswith(".csv"):
            pd.testing.assert_frame_equal(_table(killed / name), _table(copy / name), obj=name)
        elif name == "config.json":
            configs = [json.loads((d / name).read_text())["run-config"] for d in (killed, copy)]
            for config in configs:
                del config["output-dir"]
            assert configs[0] == configs[1]
        elif name.endswith(".pt"):
            loaded = [torch.load(d / name, weights_only=True) for d in (killed, copy)]
            if name == "checkpoint/server.pt":
                for state in loaded:
                    for key, entry in PER_PROCESS_STATE:
                        del state[key][entry]
            assert _same_content(*loaded), name
        elif name in ("environment.json", "rerun.sh"):  # they name the output directory
            texts = [OUTPUT_DIR.sub("", (d / name).read_text()) for d in (killed, copy)]
            assert texts[0] == texts[1], name
        else:
            assert (killed / name).read_bytes() == (copy / name).read_bytes(), name


def _cut_run(case: str, moment: str, full: FullRun, tmp_path: Path, monkeypatch) -> Path:
    """The directory of a run killed at ``moment`` of round KILLED_AT, in ``tmp_path/cut``:
    the uninterrupted run's copy, or (KILLED_FOR_REAL) a run killed there, checked
    against that copy."""
    if case not in KILLED_FOR_REAL:
        copy = full.killed_at[moment]
        return Path(shutil.copytree(copy, tmp_path / "cut" / copy.name, symlinks=True))
    cut = _case_config(case, tmp_path / "cut")
    with monkeypatch.context() as patch:
        _kill(patch, moment)
        with pytest.raises(Killed):
            run_server(cut, InProcessGrid(cut, NODES))
    cut_dir = _only_run(tmp_path / "cut")
    _assert_same_directory(cut_dir, full.killed_at[moment])
    return cut_dir


@pytest.mark.parametrize(
    ("case", "moment"),
    [
        # Both moments of a case on one worker, which makes its uninterrupted run once.
        pytest.param(case, moment, marks=pytest.mark.xdist_group(f"resume-{case}"))
        for case, moment in [(c, "after") for c in CASES] + [(c, "before") for c in BOTH_SIDES]
    ],
)
def test_resumed_run_equals_uninterrupted_run(case, moment, full_runs, tmp_path, monkeypatch):
    privacy = CASES[case][1]
    full = full_runs(case)
    full_dir = full.path
    cut_dir = _cut_run(case, moment, full, tmp_path, monkeypatch)
    committed = torch.load(cut_dir / "checkpoint" / "server.pt", weights_only=True)["round"]
    assert committed == (KILLED_AT if moment == "after" else KILLED_AT - 1)
    # Nothing of the killed round was published: no row, no model file of it.
    assert KILLED_AT not in set(pd.read_csv(cut_dir / "metrics.csv")["round"])
    assert json.loads((cut_dir / "checkpoint" / "state.json").read_text())["round"] < KILLED_AT
    assert not (cut_dir / "model.pt").exists()

    cut = _case_config(case, tmp_path / "cut")
    resumed = {**cut, "resume-from": str(cut_dir)}
    run_server(resumed, InProcessGrid(resumed, NEW_NODES))
    assert _only_run(tmp_path / "cut") == cut_dir  # continued in place

    want = torch.load(full_dir / "model.pt", weights_only=True)
    got = torch.load(cut_dir / "model.pt", weights_only=True)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key

    charged = RESUME_CHARGED.get(case, ())
    metrics = pd.read_csv(cut_dir / "metrics.csv")
    assert not metrics.duplicated(["round", "scope"]).any()
    assert sorted(set(metrics["round"])) == sorted(
        set(pd.read_csv(full_dir / "metrics.csv")["round"])
    )
    assert _csvs(full_dir) == _csvs(cut_dir)
    for name in _csvs(full_dir):
        pd.testing.assert_frame_equal(
            _table(cut_dir / name, charged), _table(full_dir / name, charged), obj=name
        )
    if charged:  # charged for the interrupted round: larger, never smaller
        # (curator/metrics.csv's columns merged in: the worst client's own epsilon)
        metrics, reference = load_metrics(cut_dir), load_metrics(full_dir)
        later = metrics["round"] > committed
        for column in charged:
            assert (
                metrics.loc[later, column].dropna() > reference.loc[later, column].dropna()
            ).all()

    if privacy != "none":
        ledger_full = json.loads((full_dir / "ledger.json").read_text())
        ledger_cut = json.loads((cut_dir / "ledger.json").read_text())
        if case == "hierarchical-cp-np" and charged:
            interrupted = [
                r for r in ledger_cut["state"]["releases"] if "interrupted" in r["note"]
            ]
            assert [r["count"] for r in interrupted] == [2]  # tau_2 edge aggregations
            rest = [r for r in ledger_cut["state"]["releases"] if r not in interrupted]
            assert rest == ledger_full["state"]["releases"]
        elif case == "dp-fedavg-secagg-distributed":
            # One more sum for every client; the busiest client's later sums are charged
            # in the same rounds as in the uninterrupted run.
            interrupted = [r for r in ledger_cut["state"]["releases"] if r["server_round"] == 0]
            assert [r["count"] for r in interrupted] == [1]
            assert "resume" in interrupted[0]["note"]
            rest = [r for r in ledger_cut["state"]["releases"] if r not in interrupted]
            assert rest == ledger_full["state"]["releases"]
        elif case == "dp-sgd" and charged:
            assert ledger_cut["state"]["releases"] == ledger_full["state"]["releases"]
            worst = max(g["epsilon"] for g in ledger_cut["state"]["local_guarantees"])
            assert worst > max(g["epsilon"] for g in ledger_full["state"]["local_guarantees"])
        else:
            assert ledger_cut["state"] == ledger_full["state"]
            if not charged:
                assert ledger_cut["summary"] == ledger_full["summary"]


# A one-round run of its own, with secret noise (the cases' runs draw it from the seed).
def test_checkpoint_is_owner_only(tmp_path):
    # server.pt holds the secret DP generator: whoever reads it can subtract the noise.
    config = run_config(
        **{"output-dir": str(tmp_path), "num-server-rounds": 1, "privacy": "dp-fedavg-fixed"},
        **{"dp.num-sampled-clients": 2},
    )
    run_server(config, InProcessGrid(config, NODES))
    server = _only_run(tmp_path) / "checkpoint" / "server.pt"
    assert server.stat().st_mode & 0o777 == 0o600


@pytest.mark.xdist_group("resume-fedavg")  # the worker that makes fedavg's full run
def test_resume_refuses_another_run_config(full_runs, tmp_path):
    full = full_runs("fedavg")
    copy = shutil.copytree(full.path, tmp_path / full.path.name, symlinks=True)
    other = {**full.config, "resume-from": str(copy), "fedprox.mu": 0.7}
    with pytest.raises(ConfigError, match=r"'fedprox.mu': 0.1 then, 0.7 now"):
        run_server(other, InProcessGrid(other, NODES))


def test_resume_from_a_directory_without_checkpoint_is_refused(tmp_path):
    config = run_config(**{"resume-from": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"'resume-from' = .* is not a run directory"):
        run_server(config, InProcessGrid(config, NODES))
