"""The privacy audit in a run: canary clients through the real ClientApp and client mods
(:mod:`tests.inprocess`), audit.json / plots/audit.png / ledger.json, the start-up and
config refusals, and the analysis commands' exit on a failed audit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from client_app import canary
from config.options import ConfigError
from lab.checks import audit_markdown, exit_on_failed
from privacy import audit
from privacy.mechanisms import LaplaceMechanism
from protocol import keys
from server_app import config as app_config
from server_app.failures import RunFailed
from tests.fakes import record
from tests.inprocess import InProcessGrid, run_config, run_server

pytestmark = pytest.mark.usefixtures("learning_curve_not_rendered")

REAL, K = 4, 4
CLIP = 0.5


class RecordingGrid(InProcessGrid):
    """Keeps (message sent, reply) of every train and evaluate message."""

    def __init__(self, config, node_ids):
        super().__init__(config, node_ids)
        self.exchanges = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        by_node = {m.metadata.dst_node_id: m for m in messages}
        for reply in replies:
            if reply.metadata.message_type in ("train", "evaluate"):
                self.exchanges.append((by_node[reply.metadata.src_node_id], reply))
        return replies


def _run(tmp_path: Path, nodes: int = REAL + K, **overrides) -> tuple[Path, RecordingGrid]:
    config = run_config(
        **{
            "output-dir": str(tmp_path),
            "audit.canaries": K,
            "num-server-rounds": 2,
            "central-eval": False,
            **overrides,
        }
    )
    grid = RecordingGrid(config, list(range(1, nodes + 1)))
    run_server(config, grid)
    (path,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return path, grid


def _flat(record) -> np.ndarray:
    return audit.flatten([record[k].numpy() for k in record])


def test_canaries_upload_their_direction_clipped_to_c_and_the_run_is_audited(tmp_path):
    path, grid = _run(
        tmp_path,
        privacy="dp-fedavg-fixed",
        **{
            "dp.clip-norm": CLIP,
            "dp.sampling": "fixed",
            "dp.num-sampled-clients": 8,
            "audit.every": 1,
        },
    )
    seed = grid.run_config["seed"]
    truth = audit.inclusion(seed, K)
    seen = set()
    for sent, reply in grid.exchanges:
        if sent.metadata.message_type != "train":
            continue
        pid = grid.contexts[sent.metadata.dst_node_id].node_config["partition-id"]
        delta = _flat(reply.content[keys.ARRAYS]) - _flat(sent.content[keys.ARRAYS])
        index = canary.canary_index(grid.run_config, pid, REAL + K)
        if index is None:  # a real client: its own update, no canary direction
            assert 0 < np.linalg.norm(delta) <= CLIP + 1e-6
            continue
        seen.add(index)
        if truth[index]:  # after the client mod's clip: exactly C along c_j
            direction = audit.canary_direction(seed, index, delta.size)
            assert np.linalg.norm(delta) == pytest.approx(CLIP, rel=1e-5)
            assert delta @ direction / np.linalg.norm(delta) == pytest.approx(1.0, abs=1e-5)
        else:
            assert np.linalg.norm(delta) == 0.0
        assert set(reply.content[keys.METRICS]) <= {keys.NUM_EXAMPLES}  # nothing trained
    assert seen == set(range(K))
    doc = json.loads((path / "audit.json").read_text())
    ledger = json.loads((path / "ledger.json").read_text())
    assert doc["canaries"] == K and doc["inserted"] == int(truth.sum())
    assert doc["accountant_epsilon"] == pytest.approx(ledger["summary"]["epsilon"])
    assert ledger["audit"]["epsilon_lower_bound"] == doc["epsilon_lower_bound"]
    assert (path / "plots" / "audit.png").stat().st_size > 0
    assert "audit.json" in ledger["run-directory"]["covered-by-epsilon"]
    # audit.every = 1: round 1 audited on its own model (round 2 is the final audit)
    (interim,) = doc["history"]
    assert interim["round"] == 1
    assert 0 < interim["accountant_epsilon"] < doc["accountant_epsilon"]


def test_without_dp_canaries_train_their_shadow_and_evaluate_with_weight_zero(tmp_path):
    """Plain FedAvg checks that every reply has the same metric keys: a canary trains on
    the partition it shadows for them, then replies its own update."""
    path, grid = _run(tmp_path, **{"fraction-evaluate": 1.0})
    seed, evaluated = grid.run_config["seed"], 0
    for sent, reply in grid.exchanges:
        pid = grid.contexts[sent.metadata.dst_node_id].node_config["partition-id"]
        index = canary.canary_index(grid.run_config, pid, REAL + K)
        if index is None:
            continue
        metrics = reply.content[keys.METRICS]
        if sent.metadata.message_type == "evaluate":
            evaluated += 1
            assert metrics[keys.NUM_EXAMPLES] == 0
            continue
        assert "train-loss" in metrics and metrics[keys.NUM_EXAMPLES] > 0
        delta = _flat(reply.content[keys.ARRAYS]) - _flat(sent.content[keys.ARRAYS])
        # no clip to overshoot: an inserted canary's norm is dp.clip-norm (1)
        inserted = audit.inclusion(seed, K)[index]
        direction = audit.canary_direction(seed, index, delta.size)
        expected = direction if inserted else np.zeros(delta.size)
        np.testing.assert_allclose(delta, expected, atol=1e-6)
    assert evaluated == 2 * K
    doc = json.loads((path / "audit.json").read_text())
    assert doc["accountant_epsilon"] is None and not doc["exceeds_accountant"]
    assert not (path / "ledger.json").exists()


def test_real_clients_split_the_data_among_n_not_n_plus_k():
    config = {"audit.canaries": 3}
    assert canary.real_partitions(config, 10) == 7
    assert [canary.canary_index(config, p, 10) for p in (6, 7, 9)] == [None, 0, 2]
    assert canary.shadow_partition(5, 7) == 5 and canary.shadow_partition(9, 7) == 2
    with pytest.raises(ValueError, match=r"'audit\.canaries'"):
        canary.real_partitions(config, 3)


def test_a_laplace_canary_has_twice_the_l1_bound_and_is_clipped_to_it():
    received = {"w": np.zeros((3, 4)), "b": np.zeros(4)}
    config = {keys.LAPLACE_SENSITIVITY: 2.0, keys.SERVER_ROUND: 1}
    run = {"seed": 0, "audit.canaries": 4}
    index = int(np.flatnonzero(audit.inclusion(0, 4))[0])
    arrays, inserted = canary.update(record(received), config, run, index)
    assert inserted
    flat = audit.flatten(arrays)
    assert np.abs(flat).sum() == pytest.approx(4.0)
    clipped = LaplaceMechanism(sensitivity=2.0, epsilon=1.0).clip(arrays).arrays
    assert np.abs(audit.flatten(clipped)).sum() == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("run", "norm"),
    [
        # subspace-dp clips on the server in the P-norm: L2 bound C / sqrt(tau) = 2 / 2
        ({"privacy": "subspace-dp", "dp.clip-norm": 2, "subspace.tau": 4}, audit.CANARY_OVERSHOOT),
        ({"privacy": "none", "dp.clip-norm": 3}, 3.0),  # nothing clips: C is the scale
        ({"privacy": "none"}, 1.0),  # dp.clip-norm = 0 (its default): 1
    ],
)
def test_a_canary_without_a_clip_in_the_config_reads_its_scale_from_the_run_config(run, norm):
    received = {"w": np.zeros((3, 4)), "b": np.zeros(4)}
    run = {"seed": 0, "audit.canaries": 4, **run}
    index = int(np.flatnonzero(audit.inclusion(0, 4))[0])
    arrays, inserted = canary.update(record(received), {keys.SERVER_ROUND: 1}, run, index)
    assert inserted
    assert np.linalg.norm(audit.flatten(arrays)) == pytest.approx(norm)


def test_a_federation_with_no_real_client_stops_at_start_up(tmp_path):
    with pytest.raises(RunFailed, match=r"'audit\.canaries' = 4 needs num-partitions = N \+ 4"):
        _run(tmp_path, nodes=4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"audit.canaries": 2}, "too few"),
        ({"audit.canaries": 8, "strategy": "clustered"}, "valid strategies: 'fedavg'"),
        ({"audit.canaries": 8, "privacy": "dp-sgd"}, "client-level guarantee"),
    ],
)
def test_config_refuses_audits_that_cannot_hold(overrides, message):
    with pytest.raises(ConfigError, match=message):
        app_config.load(run_config(**overrides))


def test_analysis_commands_exit_non_zero_on_a_failed_audit(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    for path, bound in ((good, 0.5), (bad, 3.0)):
        path.mkdir()
        result = audit.AuditResult(
            canaries=100, inserted=50, confidence=0.95, delta=1e-5, dimension=10,
            epsilon_estimate=1.0, epsilon_estimate_interval=(0.5, 1.5),
            epsilon_estimate_two_variances=1.0, epsilon_lower_bound=bound,
            epsilon_lower_bound_max=3.5, guesses=8, correct_guesses=8, threshold=0.1,
            cosines_inserted=[], cosines_held_out=[], accountant_epsilon=2.0,
        )  # fmt: skip
        (path / "audit.json").write_text(json.dumps(result.to_json()))
    exit_on_failed("study", [good])  # passes
    with pytest.raises(SystemExit, match="AUDIT FAILED in 1 run"):
        exit_on_failed("study", [good, bad])
    table = audit_markdown({"private": [good, bad], "plain": [tmp_path / "none"]})
    assert "| private | 100 | 2.000 | 1.000 ± 0.000 | 3.000 | **FAILED** |" in table
    assert "plain" not in table  # not audited
    assert audit_markdown({"plain": [tmp_path]}) is None
