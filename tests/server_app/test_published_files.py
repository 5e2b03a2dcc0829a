"""Nothing outside ``curator/`` of a DP run is released without the ledger's cover.

Every file and every ``metrics.csv`` column outside ``curator/`` is on an allow-list
with the reason it may be published: covered by the ledger (the released model and
what is computed from it alone), or a function of public inputs only (the run-config,
the round). Each reason is checked here by deriving the value again, and a new file or
column fails the test until it is listed with its reason.

The sampled-cohort inference: with client-side noise, fixed sampling and no secure
aggregation, the central ε is amplified by the secret sample. The worst client's ε
against the server stays flat exactly in the rounds whose cohort avoids the
most-participating clients, so publishing it tells who was sampled. It is now in
``curator/`` only; the published ``dp-epsilon-local`` is the ε of a client asked in
every round, the same whoever was sampled. The real ServerApp and ClientApp in one
process (:mod:`tests.inprocess`), with the fixed-size sampler replaced by a schedule.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from pathlib import Path

import pandas as pd
import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity

import tasks
from privacy.accounting import PrivacyLedger
from privacy.composition import gaussian_epsilon
from strategies.mechanisms import dp_fedavg
from tests.inprocess import InProcessGrid, run_config, run_server

NODES = [11, 22, 33, 44]
# One worker makes the module's runs once (a module-scoped fixture per worker otherwise).
pytestmark = pytest.mark.xdist_group("published-files")
Z, M, ROUNDS, DELTA = 0.8, 2, 4, 1e-5
CLIENT_NOISE = {
    "privacy": "dp-fedavg-fixed",
    "dp.noise-site": "client",
    "dp.sampling": "fixed",
    "dp.num-sampled-clients": M,
    "dp.clip-norm": 0.1,
    "dp.noise-multiplier": Z,
    "num-server-rounds": ROUNDS,
}
# Cohorts by round (partition ids). "flat": rounds 2 and 4 avoid the clients asked most
# so far; "busy": the same two clients every round.
SCHEDULES = {
    "flat": [[0, 1], [2, 3], [0, 2], [1, 3]],
    "busy": [[0, 1], [0, 1], [0, 1], [0, 1]],
}

# Every file outside curator/, and why it may be published. "secret": never published,
# owner-only (checked below).
PUBLISHED_FILES = {
    "config.json": "public inputs: the run-config, software versions, the start time",
    "metrics.csv": "columns: PUBLISHED_COLUMNS",
    "ledger.json": "the ledger: each round's release parameters, from the run-config "
    "(identical every round under fixed sampling) and the epsilon they compose to",
    "certificates.json": "functions of the ledger alone",
    "outcome.json": "how the run ended: under DP only the budget, the central "
    "evaluation of the released model, start-up checks or a server error end a run",
    "environment.json": "public inputs: software versions, the federation's size, the "
    "app's commit and the rerun command (the run-config)",
    "rerun.sh": "public inputs: the command that reruns the run-config",
    "model.pt": "the released model (covered by dp-epsilon)",
    "checkpoint/global.pt": "the released model of the last round (covered)",
    "checkpoint/state.json": "the last round's number (public)",
    "plots/learning_curve.png": "drawn from metrics.csv's published rows",
    "tensorboard/events.out.tfevents.*": "metrics.csv's published rows; wall time = round",
}
SECRET_FILES = {"checkpoint/server.pt": "the DP generator state (owner-only)"}
# metrics.csv: (scope, column) -> why it may be published.
PUBLISHED_COLUMNS = {
    ("*", "round"): "public: the round",
    ("*", "scope"): "public: which row",
    ("train", "dp-epsilon"): "the ledger's epsilon after the round (public inputs)",
    ("train", "dp-epsilon-local"): "epsilon against the server of a client asked in "
    "every round so far (public inputs)",
    ("train", "dp-clip-norm"): "public: dp.clip-norm (fixed clipping)",
    ("train", "dp-noise-from-seed"): "public: dp.reproducible-noise",
    ("central-eval", "eval-loss"): "the released model on the central test set",
    ("central-eval", "eval-accuracy"): "the released model on the central test set",
    ("central-eval", "num-examples"): "public: the central test set's size",
}


def _run(tmp_path: Path, monkeypatch, schedule: list[list[int]], umask: int) -> Path:
    def scheduled(node_ids, size, rng, partitions=None):
        ordered = partitions.order(node_ids)
        return [ordered[i] for i in schedule.pop(0)]

    def cohort(nodes, expected, rng, partitions, *, poisson, uniform):
        assert uniform and not poisson, "the schedule replaces the fixed-size DP sample"
        return scheduled(nodes, expected, rng, partitions), expected

    monkeypatch.setattr(dp_fedavg, "dp_cohort", cohort)
    config = run_config(**{"output-dir": str(tmp_path), **CLIENT_NOISE})
    old = os.umask(umask)
    try:
        run_server(config, InProcessGrid(config, NODES))
    finally:
        os.umask(old)
    (path,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # What Flower's runtime sets for a ServerApp (tests/conftest.py sets it per test; a
    # module-scoped fixture runs before that).
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    patch = pytest.MonkeyPatch()
    try:
        return {
            name: _run(tmp_path_factory.mktemp(name), patch, list(cohorts), umask)
            for (name, cohorts), umask in zip(SCHEDULES.items(), (0o000, 0o022), strict=True)
        }
    finally:
        patch.undo()


def _published(path: Path) -> list[str]:
    return sorted(
        str(p.relative_to(path))
        for p in path.rglob("*")
        if p.is_file() and p.relative_to(path).parts[0] != "curator"
    )


def _train(path: Path, curator: bool = False) -> pd.DataFrame:
    frame = pd.read_csv(path / ("curator/metrics.csv" if curator else "metrics.csv"))
    return frame[frame["scope"] == "train"].set_index("round")


def _most_asked_avoided(train: pd.DataFrame, column: str) -> list[int]:
    """The attack: rounds in which the worst client's epsilon stayed flat, i.e. whose
    cohort holds none of the clients asked most so far."""
    values = train[column].to_numpy()
    steps = zip(train.index[1:], values[:-1], values[1:], strict=True)
    return [int(r) for r, a, b in steps if b == a]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_published_file_is_on_the_allow_list(runs, name):
    path = runs[name]
    for file in _published(path):
        listed = [p for p in {**PUBLISHED_FILES, **SECRET_FILES} if fnmatch.fnmatch(file, p)]
        assert listed, f"{file} is published but not on the allow-list (say why it may be)"
    for pattern in PUBLISHED_FILES:  # the allow-list describes this run, nothing stale
        assert any(fnmatch.fnmatch(f, pattern) for f in _published(path)), pattern
    metrics = pd.read_csv(path / "metrics.csv")
    for scope, rows in metrics.groupby("scope"):
        for column in rows.dropna(axis=1, how="all").columns:
            assert (scope, column) in PUBLISHED_COLUMNS or ("*", column) in PUBLISHED_COLUMNS, (
                f"metrics.csv {scope} column {column!r} is published but not on the allow-list"
            )
    assert set(metrics["scope"]) == {"train", "central-eval"}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_published_columns_derive_from_public_inputs_and_the_released_model(runs, name):
    path = runs[name]
    train = _train(path)
    assert list(train.index) == list(range(1, ROUNDS + 1))
    # Public inputs: the run-config.
    assert (train["dp-clip-norm"] == CLIENT_NOISE["dp.clip-norm"]).all()
    assert (train["dp-noise-from-seed"] == 0.0).all()
    # Against the server: each upload has multiplier z / (2 sqrt(m)) (replace-one under
    # fixed sampling); a client asked in all r rounds composes r of them.
    for r in train.index:
        expected = gaussian_epsilon(Z / (2 * math.sqrt(M)) / math.sqrt(r), DELTA)
        assert train.loc[r, "dp-epsilon-local"] == pytest.approx(expected, rel=1e-9)
    # The ledger: the same release every round; dp-epsilon composes the first r.
    state = json.loads((path / "ledger.json").read_text())["state"]
    releases = state["releases"]
    assert [r["server_round"] for r in releases] == list(range(1, ROUNDS + 1))
    assert all({**r, "server_round": 0} == {**releases[0], "server_round": 0} for r in releases)
    for r in train.index:
        ledger = PrivacyLedger.from_state_dict({**state, "releases": releases[:r]})
        assert train.loc[r, "dp-epsilon"] == pytest.approx(ledger.epsilon(), rel=1e-9)
    # The released model: the last central evaluation is model.pt's on the test set.
    task = tasks.get("digits")(run_config(**CLIENT_NOISE))
    model = task.build_model(0)
    model.load_state_dict(torch.load(path / "model.pt", weights_only=True))
    central = pd.read_csv(path / "metrics.csv").query("scope == 'central-eval'")
    last = central[central["round"] == ROUNDS].iloc[0]
    evaluated = task.evaluate(model, task.load_central_test())
    for key in ("eval-loss", "eval-accuracy", "num-examples"):
        assert last[key] == pytest.approx(evaluated[key], rel=1e-6), key
    # The ledger's statement against the server is the same bound, and names nobody.
    report = json.loads((path / "ledger.json").read_text())["threat-models"]
    (local,) = [e for e in report if e["threat-model"] == "local"]
    assert local["epsilon"] == pytest.approx(train["dp-epsilon-local"].iloc[-1])
    assert "worst-client" not in local


def test_the_sampled_cohort_inference_works_on_the_curator_files_only(runs):
    # The attack on the worst client's epsilon (now curator/metrics.csv) recovers the
    # rounds whose cohort avoided the most-asked clients: 2 and 4 of the "flat" schedule.
    flat, busy = _train(runs["flat"], curator=True), _train(runs["busy"], curator=True)
    assert _most_asked_avoided(flat, "dp-epsilon-local-worst") == [2, 4]
    assert _most_asked_avoided(busy, "dp-epsilon-local-worst") == []
    # The published files of the two runs differ in nothing but the released models'
    # evaluation: the same train rows whoever was sampled, and no flat round.
    published = {name: _train(path) for name, path in runs.items()}
    pd.testing.assert_frame_equal(published["flat"], published["busy"])
    assert _most_asked_avoided(published["flat"], "dp-epsilon-local") == []
    for name, path in runs.items():  # no client named in what the server derived
        for file in ("metrics.csv", "ledger.json", "certificates.json", "outcome.json"):
            assert "partition-" not in (path / file).read_text(), (name, file)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_curator_checkpoint_and_private_state_are_owner_only(runs, name):
    # Made under umask 0o000 ("flat") and 0o022 ("busy").
    path = runs[name]
    for folder in ("curator", "checkpoint"):
        assert (path / folder).stat().st_mode & 0o777 == 0o700, folder
        for file in (path / folder).rglob("*"):
            # What the server writes; the clients' own files (curator/clients/) are
            # behind the 0700 directory, and the clients write them owner-only.
            if file.is_file() and "clients" not in file.relative_to(path).parts:
                assert file.stat().st_mode & 0o777 == 0o600, file
    assert (path / "curator" / "local-view.json").is_file()
    for file in SECRET_FILES:
        assert (path / file).stat().st_mode & 0o777 == 0o600
    assert not (path / "clients").exists()


def test_the_clients_files_of_a_privacy_run_are_the_curators(tmp_path):
    # DP-SGD clients keep their accountant's history in their saved state.
    # z = 3: DP-SGD's accounting costs less as z grows (the files are the same).
    config = run_config(**{"output-dir": str(tmp_path), "privacy": "dp-sgd",
                           "dp.noise-multiplier": 3.0, "num-server-rounds": 1})  # fmt: skip
    grid = InProcessGrid(config, NODES)
    old = os.umask(0o022)
    try:
        run_server(config, grid)
    finally:
        os.umask(old)
    (path,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    trained = [m for m in grid.sent if m.metadata.message_type == "train"]
    sent = {m.content["config"]["artifacts-dir"] for m in trained}
    assert sent == {str(path / "curator" / "clients")}
    assert not (path / "clients").exists()
    saved = list((path / "curator" / "clients" / "client-state").glob("partition-*/round-1.bin"))
    assert len(saved) == len(NODES)
    assert (path / "curator").stat().st_mode & 0o777 == 0o700
