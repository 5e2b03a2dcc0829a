"""The ClientApp's table of client halves: which message activates which half."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from client_app import app, halves
from client_app.halves import Round
from client_app.halves.dpsgd import dp_sgd
from client_app.halves.hierarchical import HierarchicalHalf
from client_app.halves.local import LocalHalf
from protocol import keys

APP = Path(app.__file__)


def _context(state: RecordDict | None = None, pid: int = 0, num: int = 4, **run_config):
    node = {"partition-id": pid, "num-partitions": num}
    return Context(0, 0, node, state or RecordDict(), run_config)


def _names(config: dict, context: Context) -> list[str]:
    return [type(h).__name__ for h in halves.active_halves(ConfigRecord(config), context)]


def test_a_plain_message_activates_only_fedprox():
    # FedProx's half always runs: every train reply carries divergence and effective-mu.
    # FedBN's runs only for a task that keeps layers on the client (digits keeps none).
    assert _names({keys.SERVER_ROUND: 1}, _context()) == ["FedProxHalf"]


def test_fedbn_runs_only_for_a_task_that_keeps_local_layers():
    plain = {keys.SERVER_ROUND: 1}
    fedbn = _context(**{"task": "finance", "finance.bn": "local"})
    assert _names(plain, fedbn) == ["FedBNHalf", "FedProxHalf"]
    assert "FedBNHalf" not in _names(plain, _context(task="finance"))


def test_each_algorithm_key_activates_its_half():
    context = _context()
    assert "LocalHalf" in _names({keys.LOCAL_ONLY: True}, context)
    assert "LocalHalf" not in _names({keys.LOCAL_ONLY: False}, context)
    assert "DPSGDHalf" in _names({keys.DPSGD_NOISE_MULTIPLIER: 1.0}, context)
    assert "HierarchicalHalf" in _names({keys.EDGE_ROUND: 2}, context)
    assert "HierarchicalHalf" in _names({keys.LOCAL_UPDATES: 5}, context)
    assert "FrontLoadedHalf" in _names({keys.FRONT_LOADED_MODE: "cp-np"}, context)


def test_the_last_partitions_are_canaries():
    canaries = {"audit.canaries": 2}
    assert "CanaryHalf" not in _names({}, _context(pid=1, num=4, **canaries))
    assert "CanaryHalf" in _names({}, _context(pid=2, num=4, **canaries))
    assert "CanaryHalf" in _names({}, _context(pid=3, num=4, **canaries))


def test_cp_np_and_the_canary_reply_before_the_default_in_that_order():
    order = [path.split(":")[1] for _, path in halves.HALVES.values()]
    assert order.index("FrontLoadedHalf") < order.index("CanaryHalf")


def test_local_half_loads_the_clients_own_model_once_it_has_one():
    received = ArrayRecord([np.zeros(2, dtype=np.float32)])
    own = ArrayRecord([np.ones(2, dtype=np.float32)])
    config = ConfigRecord({keys.LOCAL_ONLY: True})
    assert LocalHalf().weights(received, config, _context()) is received
    state = RecordDict({keys.LOCAL_MODEL: own})
    assert LocalHalf().weights(received, config, _context(state)) is own


def test_edge_rounds_add_seed_entropy_and_local_updates():
    half = HierarchicalHalf()
    assert half.seed_entropy(ConfigRecord({keys.EDGE_ROUND: 3})) == (3,)
    assert half.seed_entropy(ConfigRecord({keys.LOCAL_UPDATES: 3})) == ()


def test_dp_sgd_settings_come_from_the_config_and_the_planned_rounds():
    config = ConfigRecord(
        {
            keys.DPSGD_NOISE_MULTIPLIER: 1.1,
            keys.DPSGD_MAX_GRAD_NORM: 0.5,
            keys.DPSGD_DELTA: 1e-5,
            keys.DPSGD_TARGET_EPSILON: 8.0,
        }
    )
    settings = dp_sgd(config, {"num-server-rounds": 7})
    assert (settings.noise_multiplier, settings.max_grad_norm) == (1.1, 0.5)
    assert (settings.target_epsilon, settings.planned_rounds, settings.max_epsilon) == (
        8.0,
        7,
        0.0,
    )
    runs = {name: when for name, (when, _) in halves.HALVES.items()}
    assert runs["dpsgd"](config, _context())
    assert not runs["frontloaded"](config, _context())


def test_train_and_evaluate_branch_on_no_algorithm_key():
    tree = ast.parse(APP.read_text())
    handlers = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    tests = [
        ast.unparse(node.test)
        for f in handlers
        if f.name in ("train", "evaluate")
        for node in ast.walk(f)
        if isinstance(node, ast.If)
    ]
    assert tests and not [t for t in tests if "keys." in t or "config" in t], tests


def test_a_dp_fedavg_train_message_runs_no_half():
    # Replies restricted to the mechanism's keys carry no divergence: FedProx's half
    # (and SmartFedProx's adaptive-mu code) does not run, nor is any other half imported.
    config = {keys.SERVER_ROUND: 1, keys.REPORT_METRICS: [keys.NUM_EXAMPLES]}
    assert _names(config, _context(privacy="dp-fedavg-fixed")) == []
    with_divergence = {**config, keys.REPORT_METRICS: [keys.NUM_EXAMPLES, keys.DIVERGENCE]}
    assert _names(with_divergence, _context()) == ["FedProxHalf"]
    assert "FedProxHalf" in _names({**config, keys.PROXIMAL_MU: 0.1}, _context())


def test_the_clients_own_run_config_turns_dp_sgd_and_front_loaded_on():
    plain = {keys.SERVER_ROUND: 1}
    assert "DPSGDHalf" in _names(plain, _context(privacy="dp-sgd"))
    assert "FrontLoadedHalf" in _names(plain, _context(privacy="cg-ng"))
    assert "DPSGDHalf" not in _names(plain, _context(privacy="dp-fedavg-fixed"))


def test_a_dp_sgd_client_refuses_to_train_without_the_servers_settings():
    context = _context(privacy="dp-sgd")
    (dpsgd,) = [h for h in halves.active_halves(ConfigRecord({}), context) if "DPSGD" in str(h)]
    msg = Message(RecordDict({keys.CONFIG: ConfigRecord({})}), dst_node_id=0, message_type="train")
    r = Round(msg, context, task=None, model=None, partition=None, pid=0)
    with pytest.raises(ValueError, match="does not train without DP-SGD"):
        dpsgd.training(r)


def test_every_half_of_the_table_imports_to_its_class():
    for name, (_, path) in halves.HALVES.items():
        assert type(halves.half(path)).__name__ == path.split(":")[1], name
