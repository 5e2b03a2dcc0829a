"""The in-process engine (``lab.engine``, ``python -m lab.run``): the same results as the
test harness's runs for strategy x mechanism combinations, the run directory that says
which engine ran it, refusals of what it cannot run. Against a real ``flwr run``:
``tests/e2e/test_engine_parity.py``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode
from threadpoolctl import threadpool_limits

from lab import engine
from lab.run import main as run_main
from server_app.results import TIMING_COLUMNS
from tests.inprocess import InProcessGrid, run_config, run_server

SEEDED = {"dp.reproducible-noise": True}  # DP noise from the seed: metrics comparable too
DP = {"dp.num-sampled-clients": 2, "dp.noise-multiplier": 1.0, "dp.clip-norm": 0.5, **SEEDED}
CASES = {
    "fedavg-none": {"strategy": "fedavg", "fraction-train": 0.5},
    "fedprox-dp-fixed": {"strategy": "fedprox", "privacy": "dp-fedavg-fixed", **DP},
    "clustered-dp-adaptive": {
        "strategy": "clustered", "privacy": "dp-fedavg-adaptive", "cluster.k": 2, **DP,
    },
    "smart-fedprox-dp-adaptive": {
        "strategy": "smart-fedprox", "privacy": "dp-fedavg-adaptive",
        "smart.cold-start-rounds": 1, **DP,
    },
    "hierarchical-none": {"strategy": "hierarchical"},
    "fedavg-laplace": {"privacy": "laplace", "dp.num-sampled-clients": 2, **SEEDED},
    "fedavg-subspace": {
        "privacy": "subspace-dp", "subspace.rank": 2, "subspace.sketch-dim": 8, **DP,
    },
    # The noise calibrated to a target epsilon under PLD: the calibrated z is in the ledger.
    # Target 3: z ~1.4, a PLD search of ~0.3 s of CPU (target 8: z ~0.7, ~2 s, each run).
    "fedavg-dp-target-pld": {
        "privacy": "dp-fedavg-fixed", "dp.noise-multiplier": 0.0, "dp.target-epsilon": 3.0,
        "dp.accountant": "pld", "dp.num-sampled-clients": 2, "dp.clip-norm": 0.5, **SEEDED,
    },
    # SecAgg+'s four exchanges run in process, message by message (not skipped).
    "fedavg-secagg-distributed-dp": {
        **DP, "privacy": "dp-fedavg-fixed", "dp.noise-site": "client", "dp.sampling": "fixed",
        "secagg.enabled": True,
    },
}  # fmt: skip


def _only_dir(root: Path) -> Path:
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    return run_dir


def _harness(root: Path, options: dict) -> Path:
    config = run_config(**options, **{"output-dir": str(root)})
    # The ServerApp's main limits BLAS to one thread (a multi-threaded SVD differs in its
    # last bits: subspace-dp's eigengap); the harness calls its body, so limit it here.
    # The engine runs the clients and the server at the federation's torch threads (1).
    with threadpool_limits(limits=1, user_api="blas"), engine._torch_threads(1):
        run_server(config, InProcessGrid(config, [11, 22, 33, 44]))
    return _only_dir(root)


def _engine(root: Path, options: dict) -> engine.EngineRun:
    config = run_config(**options, **{"output-dir": str(root)})
    result = engine.run(config, engine.Federation(num_supernodes=4))
    assert result.returncode == 0, result.error
    return result


def _metrics(run_dir: Path) -> pd.DataFrame:
    metrics = pd.read_csv(run_dir / "metrics.csv")
    return metrics.drop(columns=[c for c in metrics if c in TIMING_COLUMNS or "node" in c])


def _ledger(run_dir: Path) -> dict:
    return json.loads((run_dir / "ledger.json").read_text())


# Two rounds: the second starts from the first's aggregate, state and ledger (clusters,
# adaptive clip, smart-fedprox past its cold start), so what is carried between rounds
# is compared too; a third round adds nothing the second does not.
PARITY_ROUNDS = {"num-server-rounds": 2}


@pytest.mark.parametrize("name", list(CASES))
def test_engine_gives_the_harness_results(name, tmp_path):
    expected = _harness(tmp_path / "harness", {**CASES[name], **PARITY_ROUNDS})
    result = _engine(tmp_path / "engine", {**CASES[name], **PARITY_ROUNDS})
    got = result.run_dir
    assert got is not None and got.parent == tmp_path / "engine"
    pd.testing.assert_frame_equal(_metrics(got), _metrics(expected), check_exact=True)
    ours, theirs = (torch.load(d / "model.pt", weights_only=True) for d in (got, expected))
    assert list(ours) == list(theirs)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    if (expected / "ledger.json").exists():
        assert _ledger(got) == _ledger(expected)
    else:
        assert not (got / "ledger.json").exists()
    outcome = json.loads((got / "outcome.json").read_text())
    assert outcome["status"] == "completed"
    if name == "fedavg-dp-target-pld":
        calibration = _ledger(got)["calibration"]
        assert calibration["accountant"] == "pld" and calibration["value"] > 0


@pytest.mark.parametrize("strategy", ["fedavg", "clustered"])
def test_federated_evaluation_without_test_examples_skips_the_round(strategy, tmp_path, caplog):
    """Every client's local test split empty: no federated-eval row, a warning, and the
    run completes (Flower's weighted mean divided by zero after the round's work)."""
    options = {"num-server-rounds": 2, "vision.test-fraction": 0.0, "strategy": strategy}
    options |= {"fraction-evaluate": 1.0, "min-evaluate-nodes": 2}
    _engine(tmp_path, options)
    scopes = set(pd.read_csv(_only_dir(tmp_path) / "metrics.csv")["scope"])
    assert "federated-eval" not in scopes and {"train", "central-eval"} <= scopes
    assert "hold no test examples" in caplog.text


def test_run_directory_says_which_engine_ran_it(tmp_path):
    result = _engine(tmp_path, {"num-server-rounds": 1})
    outcome = json.loads((result.run_dir / "outcome.json").read_text())
    config = json.loads((result.run_dir / "config.json").read_text())
    expected = {"name": "inprocess", "num-supernodes": 4, "client-threads": 1}
    assert outcome["engine"] == expected and config["environment"]["engine"] == expected
    assert engine.engine_of(result.run_dir) == "inprocess"
    (tmp_path / "flwr-run").mkdir()
    (tmp_path / "flwr-run" / "outcome.json").write_text('{"status": "completed"}')
    assert engine.engine_of(tmp_path / "flwr-run") == "flwr"


def test_the_cli_runs_the_run_config_string(tmp_path, capsys):
    code = run_main(
        [
            "--run-config",
            f"num-server-rounds=1 min-available-nodes=3 vision.deterministic=true "
            f"output-dir='{tmp_path}'",
            "--federation-config",
            "num-supernodes=3",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    run_dir = _only_dir(tmp_path)
    assert "finished:completed" in out and str(run_dir) in out
    rows = pd.read_csv(run_dir / "metrics.csv")
    assert sorted(set(rows["round"])) == [0, 1]
    assert (
        json.loads((run_dir / "config.json").read_text())["run-config"]["min-available-nodes"] == 3
    )


def test_a_run_the_serverapp_fails_exits_1(tmp_path):
    # 5 nodes needed, 3 connected: the start-up check fails the run after the directory.
    code = run_main(
        [
            "--run-config",
            f"num-server-rounds=1 min-available-nodes=5 round-timeout=1.0 output-dir='{tmp_path}'",
            "--federation-config",
            "num-supernodes=3",
        ]
    )
    assert code == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--run-config", "no-such-key=1"], "'no-such-key' are not declared by the app"),
        (["--federation-config", "num-supernode=3"], "valid keys: num-supernodes"),
        (["--federation-config", "num-supernodes=0"], "'num-supernodes' must be an integer >= 1"),
        (["--engine", "ray"], "invalid choice: 'ray'"),
        (["--run-config", "a=["], "--run-config: The provided configuration string is in"),
    ],
)
def test_bad_arguments_exit_2_naming_the_key(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        run_main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _query(node: int) -> Message:
    return Message(
        RecordDict({"config": ConfigRecord({})}), dst_node_id=node, message_type="query"
    )


def test_a_clientapp_that_raises_answers_with_flowers_error_reply():
    def broken(message, context):
        raise RuntimeError(f"partition {context.node_config['partition-id']} broke")

    grid = engine.InProcessGrid({}, [7, 8], client_app=broken)
    replies = grid.send_and_receive([_query(8), _query(99)])
    (reply,) = replies  # node 99 does not exist: no reply, as from a node that is gone
    assert reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert reply.error.reason == "<class 'RuntimeError'>:<'partition 1 broke'>"
    assert reply.metadata.src_node_id == 8
    grid.errors_as_replies = False
    with pytest.raises(RuntimeError, match="partition 0 broke"):
        grid.send_and_receive([_query(7)])


def test_each_clientapp_call_gets_its_threads_and_they_are_restored():
    seen = []

    def client(message, context):
        seen.append(torch.get_num_threads())
        return Message(RecordDict(), reply_to=message)

    before = torch.get_num_threads()
    grid = engine.InProcessGrid({}, [1, 2], client_app=client)
    grid.client_threads = 2
    replies = grid.send_and_receive([_query(1), _query(2)])
    assert seen == [2, 2] and torch.get_num_threads() == before
    # Each message got an id, and its reply names it, as Flower's grid does.
    assert [r.metadata.reply_to_message_id for r in replies] == ["inprocess-1", "inprocess-2"]


# --- the ClientApp's per-client costs cut for the engine: each must change no bit --------


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
        np.arange(5, dtype=np.int64),
        np.array(2.5),  # a 0-d array (a scalar buffer)
        np.zeros((0, 3), dtype=np.float16),
        np.array([True, False]),
        np.arange(6, dtype=">f8").reshape(2, 3),  # big-endian
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),  # not C-contiguous: Flower's
        np.arange(10.0)[::2],  # a strided view: Flower's
    ],
)
def test_reply_arrays_are_flowers_bytes(array):
    from flwr.app import Array

    from client_app import node

    ours, flowers = node.to_array(array), Array.from_numpy_ndarray(array)
    assert ours.data == flowers.data
    assert (ours.dtype, tuple(ours.shape), ours.stype) == (
        flowers.dtype,
        tuple(flowers.shape),
        flowers.stype,
    )
    assert node.to_array(array).data == flowers.data  # the header cached: the same again


def test_reply_record_is_flowers_state_dict_record():
    from flwr.app import ArrayRecord

    from client_app import node

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    ours, flowers = node.array_record(model.state_dict()), ArrayRecord(model.state_dict())
    assert list(ours) == list(flowers) == list(model.state_dict())
    assert [ours[k].data for k in ours] == [flowers[k].data for k in flowers]


class _OwnLoader(torch.nn.Linear):
    """A module with its own loader: the weights go through torch's."""

    calls = 0

    def _load_from_state_dict(self, *args, **kwargs):
        type(self).calls += 1
        super()._load_from_state_dict(*args, **kwargs)


@pytest.mark.parametrize("with_hook", [False, True])
def test_load_weights_is_torchs_loader(with_hook):
    from client_app import node

    def model():
        return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))

    ours, torchs = model(), model()
    calls = []
    if with_hook:  # a loading hook: torch's loader, which runs it
        ours.register_load_state_dict_post_hook(lambda module, keys: calls.append(keys))
    source = model()
    source[1].running_mean += 0.5
    source[1].num_batches_tracked += 3
    tensors = {k: v.clone() for k, v in source.state_dict().items()}
    node.load_weights(ours, tensors)
    torchs.load_state_dict(tensors, strict=True)
    got, want = ours.state_dict(), torchs.state_dict()
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]) and got[key].dtype == want[key].dtype, key
    assert len(calls) == (1 if with_hook else 0)
    weight = ours[0].weight
    assert weight.requires_grad and weight.grad_fn is None  # still a leaf parameter
    assert not any(t is tensors[k] for k, t in ours.state_dict(keep_vars=True).items())


def test_load_weights_hands_other_models_and_bad_keys_to_torch():
    from client_app import node

    model = torch.nn.Sequential(_OwnLoader(3, 2))
    tensors = {k: torch.ones_like(v) for k, v in model.state_dict().items()}
    node.load_weights(model, tensors)
    assert _OwnLoader.calls == 1 and torch.equal(model[0].weight, torch.ones(2, 3))
    plain = torch.nn.Linear(3, 2)
    with pytest.raises(RuntimeError, match="Missing key"):
        node.load_weights(plain, {"weight": torch.ones(2, 3)})
    with pytest.raises(RuntimeError, match="size mismatch"):
        node.load_weights(plain, {"weight": torch.ones(3, 3), "bias": torch.ones(2)})


def test_settings_are_parsed_once_per_run_config_and_follow_a_change():
    from client_app import node
    from privacy.settings import DPSettings

    config = engine.fused_run_config({"dp.clip-norm": 0.5})
    first = node.settings(DPSettings, config)
    assert first == DPSettings.from_run_config(config) and first.clip_norm == 0.5
    assert node.settings(DPSettings, config) is first  # cached
    config["dp.clip-norm"] = 2.0  # the same object changed: parsed again
    assert node.settings(DPSettings, config).clip_norm == 2.0
    config["dp.clip-norm"] = -1.0
    with pytest.raises(ValueError, match=r"dp\.clip-norm"):
        node.settings(DPSettings, config)


@pytest.mark.parametrize(("n", "batch_size"), [(1, 16), (2, 16), (16, 16), (37, 16), (5, 2)])
def test_shuffled_batches_are_the_dataloaders(n, batch_size):
    from tasks.vision.data import ShuffledBatches, TensorSplit, make_loader

    images = torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(n))
    split = TensorSplit(images, torch.arange(n) % 10)
    loader = make_loader(split, batch_size, shuffle=True, seed=7 + n)
    ours = ShuffledBatches(split, batch_size, seed=7 + n)
    assert len(ours) == len(loader)
    for _ in range(3):  # epochs: the generators advance alike
        theirs = list(loader)
        mine = list(ours)
        assert len(mine) == len(theirs)
        for (a, b), (c, d) in zip(mine, theirs, strict=True):
            assert torch.equal(a, c) and torch.equal(b, d)
            assert (a.dtype, b.dtype, a.shape, b.shape) == (c.dtype, d.dtype, c.shape, d.shape)
    assert torch.equal(ours.generator.get_state(), loader.generator.get_state())


@pytest.mark.parametrize(("n", "batch_size"), [(0, 16), (1, 16), (16, 16), (37, 16), (5, 2)])
def test_ordered_batches_are_the_dataloaders(n, batch_size):
    from tasks.vision.data import TensorSplit, make_loader, ordered_batches
    from tasks.vision.steps import tally_split

    images = torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(n))
    split = TensorSplit(images, torch.arange(n) % 10)
    theirs = list(make_loader(split, batch_size, shuffle=False))
    mine = list(ordered_batches(split, batch_size))
    assert len(mine) == len(theirs)
    for (a, b), (c, d) in zip(mine, theirs, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
        assert (a.dtype, b.dtype, a.shape, b.shape) == (c.dtype, d.dtype, c.shape, d.shape)
        assert a.is_contiguous() and b.is_contiguous()
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    loss, _, counts = tally_split(model, split, batch_size, torch.device("cpu"), 10)
    with torch.no_grad():  # the same pass over the DataLoader's batches, summed alike
        want = 0.0
        for a, c in theirs:
            want += torch.nn.functional.cross_entropy(model(a), c, reduction="sum").item()
    assert loss == want and int(counts.sum()) == n
