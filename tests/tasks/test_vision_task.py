"""Vision tasks without Flower: digits end to end, options, Hugging Face loading.

Tasks are built from their classes, not through ``tasks.build``: without
``pythonpath`` set for pytest, ``tests/tasks`` shadows the ``tasks`` package as a
namespace package and ``tasks/__init__.py`` does not run.
"""

import time

import datasets
import huggingface_hub.constants
import numpy as np
import pytest
import torch
from PIL import Image

from config.options import ConfigError
from tasks.base import EVAL_ACCURACY, EVAL_LOSS, NUM_EXAMPLES, TRAIN_LOSS, LocalTraining
from tasks.vision import (
    TRAIN_ACCURACY,
    CIFAR10Task,
    DatasetUnavailableError,
    DigitsTask,
    EMNISTTask,
    MNISTTask,
    clear_caches,
)
from tasks.vision import hub as vhub
from tasks.vision import task as vtask
from tasks.vision.task import EPOCHS_DONE_KEY, decayed_lr, deterministic_torch

# A small learning rate and batch: 3 epochs on one client's ~230 digits is ~45 steps.
DIGITS_CONFIG = {
    "task": "digits",
    "seed": 42,
    "vision.batch-size": 16,
    "vision.lr": 0.02,
    "vision.local-epochs": 3,
}


def test_digits_end_to_end():
    # Prepare
    task = DigitsTask(DIGITS_CONFIG)
    partition = task.load_partition(0, 5)
    central = task.load_central_test()
    model = task.build_model(seed=0)

    # Execute
    train_metrics = task.train(model, partition, LocalTraining(server_round=1, seed=7))
    local_metrics = task.evaluate(model, partition)
    central_metrics = task.evaluate(model, central)

    # Assert
    assert train_metrics[NUM_EXAMPLES] == len(partition.train)
    assert set(train_metrics) == {NUM_EXAMPLES, TRAIN_LOSS, TRAIN_ACCURACY}
    assert local_metrics[NUM_EXAMPLES] == len(partition.test)
    assert local_metrics[EVAL_ACCURACY] > 0.5
    assert central_metrics[NUM_EXAMPLES] == 360
    assert central_metrics[EVAL_ACCURACY] > 0.5
    assert all(type(v) in (int, float) for v in {**train_metrics, **central_metrics}.values())
    assert central_metrics[EVAL_LOSS] > 0
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_training_is_reproducible_from_local_seed():
    # Prepare
    # (deterministic kernels: on a CUDA machine vision.device = auto trains on the GPU)
    task = DigitsTask(
        {
            **DIGITS_CONFIG,
            "vision.model": "cnn",
            "vision.local-epochs": 1,
            "vision.deterministic": True,
        }
    )
    partition = task.load_partition(1, 5)
    models = [task.build_model(seed=0) for _ in range(3)]

    # Execute (cnn has dropout: the local seed drives it and the shuffling)
    task.train(models[0], partition, LocalTraining(1, seed=3))
    task.train(models[1], partition, LocalTraining(1, seed=3))
    task.train(models[2], partition, LocalTraining(1, seed=4))

    # Assert
    weights = [torch.cat([p.flatten() for p in m.parameters()]) for m in models]
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])


def test_proximal_term_keeps_model_closer_to_global():
    # Prepare
    task = DigitsTask({**DIGITS_CONFIG, "vision.local-epochs": 2})
    partition = task.load_partition(2, 5)
    start = task.build_model(seed=0)
    anchor = torch.cat([p.detach().flatten() for p in start.parameters()])

    def drift(mu: float) -> float:
        model = task.build_model(seed=0)
        task.train(model, partition, LocalTraining(1, seed=1, proximal_mu=mu))
        return float(
            torch.cat([p.detach().flatten() for p in model.parameters()]).sub(anchor).norm()
        )

    # Execute / Assert
    assert drift(1.0) < drift(0.0)


def test_defaults_and_parsed_config():
    # Execute
    task = DigitsTask({})
    cifar = CIFAR10Task({"vision.model": "auto"})

    # Assert
    assert task.config.partitioner == "iid"
    assert task.config.model == "lenet"
    assert task.config.seed == 42
    assert task.config.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert cifar.config.model == "cnn"
    assert (task.config.lr_decay, task.config.lr_decay_epochs) == (1.0, 1)
    assert task.config.deterministic is False
    assert (task.config.num_edges, task.config.edge_iid) == (1, True)


def test_edge_options_reach_partition_settings_of_one_class_only():
    # Execute
    one_class = DigitsTask(
        {"vision.partitioner": "one-class", "hier.num-edges": 3, "vision.edge-iid": False}
    )
    iid = DigitsTask({"hier.num-edges": 3, "vision.edge-iid": False})

    # Assert: other modes ignore the edges, so their cache key does not depend on them.
    settings = one_class.config.partition_settings
    ignored = iid.config.partition_settings
    assert (settings.num_edges, settings.edge_iid) == (3, False)
    assert iid.config.num_edges == 3
    assert (ignored.num_edges, ignored.edge_iid) == (1, True)


@pytest.mark.parametrize(
    ("key", "value"),
    [("vision.partitioner", "nope"), ("vision.lr", -1), ("vision.alpha", 0.0),
     ("vision.test-fraction", 0.9), ("vision.batch-size", 0), ("vision.momentum", 1.0),
     ("vision.model", "vgg"), ("vision.classes-per-client", 1.5), ("vision.lr-decay", 0.0),
     ("vision.lr-decay", 1.5), ("vision.lr-decay-epochs", 0), ("vision.edge-iid", "yes"),
     ("vision.deterministic", 1), ("hier.num-edges", 0), ("hier.num-edges", 2.5)],
)  # fmt: skip
def test_invalid_option_raises_config_error_naming_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        DigitsTask({key: value})


@pytest.mark.parametrize(
    ("epochs_done", "expected"),
    [(0, 0.1), (1, 0.1), (2, 0.05), (3, 0.05), (4, 0.025), (7, 0.0125)],
)
def test_decayed_lr_halves_every_two_epochs(epochs_done, expected):
    assert decayed_lr(0.1, 0.5, 2, epochs_done) == pytest.approx(expected)


def _record_epochs(monkeypatch) -> list[tuple[float, bool, bool, bool]]:
    """Replace train_epoch by a recorder of (lr, deterministic algorithms, cuDNN
    deterministic, cuDNN benchmark) at each epoch."""
    calls = []

    def fake_epoch(model, loader, optimizer, device, global_params, proximal_mu):
        calls.append(
            (
                optimizer.param_groups[0]["lr"],
                torch.are_deterministic_algorithms_enabled(),
                torch.backends.cudnn.deterministic,
                torch.backends.cudnn.benchmark,
            )
        )
        return 1.0, 0.5

    monkeypatch.setattr(vtask, "train_epoch", fake_epoch)
    return calls


def test_lr_decays_over_cumulative_local_epochs_across_rounds(monkeypatch):
    # Prepare: lr 0.1, halved every 2 local epochs, 3 epochs per round.
    calls = _record_epochs(monkeypatch)
    task = DigitsTask(
        {**DIGITS_CONFIG, "vision.lr": 0.1, "vision.lr-decay": 0.5, "vision.lr-decay-epochs": 2}
    )
    partition = task.load_partition(0, 5)
    state: dict = {}

    # Execute: two rounds; the client's state carries the epoch count between them.
    task.train(task.build_model(0), partition, LocalTraining(1, seed=0, state=state))
    after_first = dict(state)
    task.train(task.build_model(0), partition, LocalTraining(2, seed=1, state=state))

    # Assert: epochs 0..5 at 0.1 * 0.5 ** floor(t / 2).
    lrs = [c[0] for c in calls]
    assert lrs == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    assert after_first == {EPOCHS_DONE_KEY: 3}
    assert state == {EPOCHS_DONE_KEY: 6}


def test_no_decay_keeps_lr_constant(monkeypatch):
    calls = _record_epochs(monkeypatch)
    task = DigitsTask({**DIGITS_CONFIG, "vision.lr": 0.03})
    state = {EPOCHS_DONE_KEY: 40}

    task.train(task.build_model(0), task.load_partition(0, 5), LocalTraining(9, 0, state=state))

    assert [c[0] for c in calls] == [0.03] * 3
    assert state == {EPOCHS_DONE_KEY: 40}  # nothing counted: the count only decays the LR
    fresh: dict = {}
    task.train(task.build_model(0), task.load_partition(0, 5), LocalTraining(9, 0, state=fresh))
    assert fresh == {}  # so a FedAvg client keeps no state (and writes no state file)


def test_deterministic_flag_applies_during_training_and_restores(monkeypatch):
    # Prepare: non-default global settings, to see them restored.
    calls = _record_epochs(monkeypatch)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    task = DigitsTask({**DIGITS_CONFIG, "vision.local-epochs": 1, "vision.deterministic": True})
    off = DigitsTask({**DIGITS_CONFIG, "vision.local-epochs": 1})
    partition = task.load_partition(0, 5)

    # Execute
    task.train(task.build_model(0), partition, LocalTraining(1, seed=0))
    restored = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    off.train(off.build_model(0), partition, LocalTraining(1, seed=0))

    # Assert
    assert calls[0][1:] == (True, True, False)
    assert restored == (False, False, True)
    assert calls[1][1:] == (False, False, True)


def test_deterministic_context_restores_after_an_error():
    # Prepare
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic

    # Execute
    with pytest.raises(KeyError), deterministic_torch(True):
        assert torch.are_deterministic_algorithms_enabled()
        raise KeyError("boom")

    # Assert
    after = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic
    assert after == before


def test_deterministic_training_is_real_and_reproducible():
    # Prepare
    task = DigitsTask({**DIGITS_CONFIG, "vision.local-epochs": 1, "vision.deterministic": True})
    partition = task.load_partition(3, 5)
    models = [task.build_model(seed=0) for _ in range(2)]

    # Execute
    for model in models:
        task.train(model, partition, LocalTraining(1, seed=2))

    # Assert
    first, second = ([p.detach().flatten() for p in m.parameters()] for m in models)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not torch.are_deterministic_algorithms_enabled()


def test_missing_deterministic_kernel_becomes_config_error(monkeypatch):
    # Prepare: what torch raises for e.g. adaptive average pooling's CUDA backward.
    def no_kernel(*args):
        raise RuntimeError("op does not have a deterministic implementation, but you set ...")

    monkeypatch.setattr(vtask, "train_epoch", no_kernel)
    task = DigitsTask({**DIGITS_CONFIG, "vision.deterministic": True})

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"vision\.deterministic.*vision\.model"):
        task.train(task.build_model(0), task.load_partition(0, 5), LocalTraining(1, seed=0))


def test_more_classes_per_client_than_classes_raises():
    with pytest.raises(ConfigError, match=r"vision\.classes-per-client"):
        DigitsTask({"vision.partitioner": "pathological", "vision.classes-per-client": 11})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_raises_config_error():
    with pytest.raises(ConfigError, match=r"vision\.device"):
        DigitsTask({"vision.device": "cuda"})


def test_mnist_fails_fast_offline(monkeypatch, tmp_path):
    # Prepare: an unreachable Hub endpoint and an empty local cache, whatever the network.
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    clear_caches()
    task = MNISTTask({"seed": 1})
    start = time.monotonic()

    # Execute
    with pytest.raises(DatasetUnavailableError) as info:
        task.load_partition(0, 5)

    # Assert
    assert time.monotonic() - start < 20
    assert "digits" in str(info.value)
    assert "ylecun/mnist" in str(info.value)
    assert "could not be reached" in str(info.value)


def _fake_hub_dataset(num_train: int, num_test: int, size: int, mode: str, label: str, image):
    """A DatasetDict shaped like the Hub dataset (PIL images, class labels)."""
    rng = np.random.default_rng(0)
    channels = {"L": (size, size), "RGB": (size, size, 3)}[mode]

    def split(n: int) -> datasets.Dataset:
        pixels = rng.integers(0, 256, size=(n, *channels), dtype=np.uint8)
        return datasets.Dataset.from_dict(
            {image: [Image.fromarray(p, mode=mode) for p in pixels], label: np.arange(n) % 10},
            features=datasets.Features(
                {image: datasets.Image(), label: datasets.ClassLabel(num_classes=10)}
            ),
        )

    splits = {"train": split(num_train)}
    if num_test:
        splits["test"] = split(num_test)
    return datasets.DatasetDict(splits)


@pytest.fixture
def fake_hub(monkeypatch):
    """Serve fake datasets instead of the Hub; caches cleared before and after."""
    fakes = {
        "ylecun/mnist": _fake_hub_dataset(120, 30, 28, "L", "label", "image"),
        "uoft-cs/cifar10": _fake_hub_dataset(120, 30, 32, "RGB", "label", "img"),
        "flwrlabs/femnist": _fake_hub_dataset(200, 0, 28, "L", "character", "image"),
    }
    monkeypatch.setattr(vhub, "hub_reachable", lambda timeout=0: True)
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name=None, **kw: fakes[path])
    clear_caches()
    yield
    clear_caches()


@pytest.mark.parametrize(
    ("task_cls", "shape", "pool", "central"),
    [(MNISTTask, (1, 28, 28), 120, 30), (CIFAR10Task, (3, 32, 32), 120, 30),
     (EMNISTTask, (1, 28, 28), 160, 40)],
)  # fmt: skip
def test_hub_tasks_load_through_federated_dataset(fake_hub, task_cls, shape, pool, central):
    # Prepare
    task = task_cls({"vision.partitioner": "dirichlet", "vision.alpha": 1.0, "seed": 0})

    # Execute
    parts = [task.load_partition(i, 3) for i in range(3)]
    test_set = task.load_central_test()
    model = task.build_model(seed=0)
    metrics = task.train(model, parts[0], LocalTraining(1, seed=0))

    # Assert
    assert tuple(parts[0].train.images.shape[1:]) == shape
    assert sum(len(p.train) + len(p.test) for p in parts) == pool
    assert len(test_set.test) == central
    assert parts[0].train.images.dtype == torch.float32
    assert int(test_set.test.labels.max()) == 9
    assert metrics[NUM_EXAMPLES] == len(parts[0].train)
    assert task.load_partition(1, 3) is parts[1]


def test_one_class_on_a_hub_dataset(fake_hub):
    # Prepare: 120 CIFAR-shaped images, 12 per class; 10 clients in 2 edges, edge-non-iid.
    task = CIFAR10Task(
        {"vision.partitioner": "one-class", "hier.num-edges": 2, "vision.edge-iid": False}
    )

    # Execute
    parts = [task.load_partition(i, 10) for i in range(10)]

    # Assert: one class (12 images) per client; each edge of 5 clients holds 5 classes.
    labels = [set(torch.cat([p.train.labels, p.test.labels]).tolist()) for p in parts]
    assert all(len(c) == 1 for c in labels)
    assert [len(p.train) + len(p.test) for p in parts] == [12] * 10
    assert len(set().union(*labels[:5])) == 5
    assert not set().union(*labels[:5]) & set().union(*labels[5:])


def test_one_class_with_more_edges_than_clients_raises(fake_hub):
    task = MNISTTask({"vision.partitioner": "one-class", "hier.num-edges": 4})

    with pytest.raises(ConfigError, match=r"hier\.num-edges.*\[1, 3\]"):
        task.load_partition(0, 3)


def test_array_split_is_the_peer_workloads_split_whatever_the_seed():
    # the peer workload's description: X / 16; train_test_split(test_size=0.2, random_state=0,
    # stratify=y); clients np.array_split(default_rng(0).permutation(n_train), N).
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, _, _ = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    shards = np.array_split(np.random.default_rng(0).permutation(len(x_train)), 100)
    peer = {
        "vision.partitioner": "array-split",
        "vision.normalize": False,
        "vision.test-fraction": 0.0,
    }
    for seed in (0, 7):
        task = DigitsTask({"task": "digits", "seed": seed, **peer})
        for client in (0, 37, 99):
            part = task.load_partition(client, 100)
            assert len(part.test) == 0  # every example trains
            ours = part.train.images.reshape(len(part.train), -1).numpy()
            np.testing.assert_array_equal(
                np.sort(ours, axis=0), np.sort(x_train[shards[client]], axis=0)
            )
        central = task.load_central_test().test.images.reshape(-1, 64).numpy()
        np.testing.assert_array_equal(np.sort(central, axis=0), np.sort(x_test, axis=0))


def test_peer_workload_options_are_digits_only():
    with pytest.raises(ConfigError, match="valid tasks: 'digits'"):
        MNISTTask({"task": "mnist", "vision.normalize": False})
