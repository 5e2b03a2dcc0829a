"""Central warm start on public data and head-only local training (vision tasks).

Subspace-DP-FL's CIFAR-10 preset: "central warm-start ... head-only FedAvg". The
public split is part of the server's held-out set, never client data.
"""

import contextlib

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from config.options import ConfigError
from tasks.base import DPSGD, EVAL_ACCURACY, LocalTraining, Task
from tasks.vision import CentralTestSet, DigitsTask, MNISTTask, TensorSplit, hub
from tasks.vision.data import digits_central_split
from tasks.vision.models import MODEL_NAMES, build_model, head_parameter_names, train_head_only
from tasks.vision.task import WARM_START_ACCURACY, WARM_START_LOSS

DIGITS_CONFIG = {"seed": 42, "vision.batch-size": 16, "vision.lr": 0.02, "vision.local-epochs": 1}
WARM = {**DIGITS_CONFIG, "subspace.warm-start": 10}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _last_linear(model: nn.Module) -> nn.Linear:
    return [m for m in model.modules() if isinstance(m, nn.Linear)][-1]


class BatchNormNet(nn.Module):
    """conv - BatchNorm - ReLU - dropout - linear head, for 8x8 grayscale digits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 8, kernel_size=3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Flatten(),
            nn.Dropout(0.5),
        )
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class BatchNormDigits(DigitsTask):
    """Digits with a BatchNorm model (the library's models all use GroupNorm)."""

    def build_model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return BatchNormNet()


# --- head keys ------------------------------------------------------------------------


def test_head_keys_of_lenet_are_its_last_linear_layer():
    assert DigitsTask({}).head_keys() == ("classifier.4.weight", "classifier.4.bias")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_head_keys_name_the_last_linear_of_every_model(name):
    # Prepare
    task = DigitsTask({"vision.model": name})
    model = task.build_model(seed=0)

    # Execute
    keys = task.head_keys()

    # Assert
    state = model.state_dict(keep_vars=True)
    head = _last_linear(model)
    assert keys == head_parameter_names(model)
    assert [state[k] for k in keys] == [head.weight, head.bias]
    assert task.head_keys() is keys  # cached


def test_head_keys_of_a_task_without_head_only_mode_raise():
    # Prepare: a task that is not a vision task.
    class Toy(Task):
        name = "toy"
        build_model = load_partition = load_central_test = train = evaluate = None

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"'toy' has no head-only mode.*'digits'"):
        Toy({}).head_keys()


def test_head_parameter_names_of_a_model_without_linear_raise():
    with pytest.raises(ValueError, match=r"no nn\.Linear"):
        head_parameter_names(nn.Sequential(nn.Conv2d(1, 1, 3)))


# --- public split -----------------------------------------------------------------------


@pytest.mark.parametrize(("fraction", "sizes"), [(0.5, (180, 180)), (0.3, (108, 252))])
def test_public_and_central_test_split_the_held_out_set(fraction, sizes):
    # Prepare
    task = DigitsTask({**WARM, "subspace.public-fraction": fraction})
    held_out = DigitsTask(DIGITS_CONFIG).load_central_test().test

    # Execute
    public = task.load_public()
    test = task.load_central_test().test

    # Assert: disjoint, together the held-out ids, every class in both, stratified.
    _, central_ids = digits_central_split(42, 0.2)
    public_ids, test_ids = set(public.ids.tolist()), set(test.ids.tolist())
    assert (len(public), len(test)) == sizes
    assert not public_ids & test_ids
    assert public_ids | test_ids == set(central_ids.tolist()) == set(held_out.ids.tolist())
    counts = [np.bincount(s.labels.numpy(), minlength=10) for s in (public, test, held_out)]
    assert (counts[0] > 0).all() and (counts[1] > 0).all()
    assert np.abs(counts[0] - fraction * counts[2]).max() <= 1
    assert torch.equal(public.images, held_out.images[torch.isin(held_out.ids, public.ids)])


def test_public_split_is_seeded():
    # Execute
    first = DigitsTask(WARM).load_public().ids
    again = DigitsTask(WARM).load_public().ids
    other = DigitsTask({**WARM, "seed": 7}).load_public().ids

    # Assert
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_hub_task_splits_its_test_split(monkeypatch):
    # Prepare: a fake MNIST test split of 40 images, 4 per class, image i filled with i.
    images = torch.arange(40, dtype=torch.float32).view(40, 1, 1, 1).expand(40, 1, 28, 28)
    fake = CentralTestSet(TensorSplit(images, torch.arange(40) % 10))
    monkeypatch.setattr(hub, "load_hub_central_test", lambda spec, seed, central: fake)
    task = MNISTTask({"subspace.warm-start": 1})

    # Execute
    public, test = task.load_public(), task.load_central_test().test

    # Assert
    marks = [set(s.images[:, 0, 0, 0].long().tolist()) for s in (public, test)]
    assert (len(public), len(test)) == (20, 20)
    assert marks[0].isdisjoint(marks[1]) and marks[0] | marks[1] == set(range(40))
    assert (
        sorted(public.labels.tolist()) == sorted(test.labels.tolist()) == sorted(2 * [*range(10)])
    )
    assert MNISTTask({}).load_central_test() is fake


def test_without_warm_start_the_central_test_set_is_whole_and_nothing_is_public():
    task = DigitsTask(DIGITS_CONFIG)

    assert len(task.load_central_test().test) == 360
    with pytest.raises(ConfigError, match=r"subspace\.warm-start"):
        task.load_public()


def test_public_fraction_leaving_a_class_out_raises():
    # 0.01 of 360 held-out digits is 3 public examples for 10 classes.
    task = DigitsTask({**WARM, "subspace.public-fraction": 0.01})

    with pytest.raises(ConfigError, match=r"subspace\.public-fraction"):
        task.load_public()


@pytest.mark.parametrize(
    ("key", "value"),
    [("subspace.public-fraction", 1.0), ("subspace.public-fraction", 0.0),
     ("subspace.warm-start", -1), ("subspace.warm-start", 1.5), ("subspace.head-only", 1)],
)  # fmt: skip
def test_invalid_subspace_option_raises_config_error_naming_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        DigitsTask({key: value})


def test_defaults_and_parsed_subspace_config():
    # Execute
    default = DigitsTask({}).subspace
    parsed = DigitsTask(
        {"subspace.head-only": True, "subspace.warm-start": 3, "subspace.public-fraction": 0.25}
    ).subspace

    # Assert
    def fields(cfg):
        return cfg.head_only, cfg.warm_start, cfg.public_fraction

    assert fields(default) == (False, 0, 0.5)
    assert fields(parsed) == (True, 3, 0.25)


# --- warm start -----------------------------------------------------------------------


def test_warm_start_lifts_central_accuracy_of_a_fresh_lenet():
    # Prepare
    task = DigitsTask(WARM)
    model = task.build_model(seed=0)
    central = task.load_central_test()
    before = task.evaluate(model, central)[EVAL_ACCURACY]

    # Execute
    metrics = task.warm_start(model)

    # Assert: measured 0.139 -> 0.889 (last warm-start epoch: accuracy 0.944).
    after = task.evaluate(model, central)[EVAL_ACCURACY]
    assert set(metrics) == {WARM_START_LOSS, WARM_START_ACCURACY}
    assert before < 0.2
    assert after > 0.8
    assert metrics[WARM_START_ACCURACY] > 0.85
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_warm_start_is_deterministic_and_leaves_global_rng_alone():
    # Prepare
    # cnn: dropout; deterministic kernels: on a CUDA machine the warm start runs there.
    # A public split of 36 digits (3 mini-batches an epoch): determinism is the check.
    small = {**WARM, "subspace.warm-start": 2, "subspace.public-fraction": 0.1}
    task = DigitsTask({**small, "vision.model": "cnn", "vision.deterministic": True})
    models = [task.build_model(seed=0) for _ in range(3)]
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)

    # Execute
    first, again = task.warm_start(models[0]), task.warm_start(models[1])
    DigitsTask(
        {**small, "vision.model": "cnn", "seed": 7, "vision.deterministic": True}
    ).warm_start(models[2])

    # Assert
    states = [_state(m) for m in models]
    assert torch.equal(torch.rand(3), expected)
    assert first == again
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert any(not torch.equal(states[0][k], states[2][k]) for k in states[0])


def test_no_warm_start_returns_nothing_and_leaves_the_model_untouched():
    # Prepare
    task = DigitsTask(DIGITS_CONFIG)
    model = task.build_model(seed=0)
    before = _state(model)

    # Execute
    metrics = task.warm_start(model)

    # Assert
    assert metrics == {}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- head-only training -----------------------------------------------------------------


def _train_and_compare(
    task: DigitsTask, local: LocalTraining, num_partitions: int = 5
) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Train a fresh model of ``task`` on client 0 of ``num_partitions``; (model,
    before, after) states."""
    model = task.build_model(seed=0)
    before = _state(model)
    task.train(model, task.load_partition(0, num_partitions), local)
    return model, before, _state(model)


# The CIFAR-sized models train on client 0 of 40 (2 mini-batches, not 15): which
# tensors move is the check, and one step moves every head tensor.
SMALL_PARTITION = {"resnet18": 40, "mobilenet_v2": 40}


DP = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)


@pytest.mark.parametrize(
    ("name", "local"),
    [("lenet", LocalTraining(1, seed=0, proximal_mu=0.1)),
     ("lenet", LocalTraining(1, seed=0, dp_sgd=DP)),
     ("lenet", LocalTraining(1, seed=0, local_updates=5)),
     ("cnn", LocalTraining(1, seed=0)), ("resnet18", LocalTraining(1, seed=0)),
     ("mobilenet_v2", LocalTraining(1, seed=0))],
    ids=["lenet-fedprox", "lenet-dpsgd", "lenet-tau1", "cnn", "resnet18", "mobilenet_v2"],
)  # fmt: skip
def test_head_only_training_changes_only_the_head(name, local):
    # Prepare
    task = DigitsTask({**DIGITS_CONFIG, "vision.model": name, "subspace.head-only": True})

    # Execute
    model, before, after = _train_and_compare(task, local, SMALL_PARTITION.get(name, 5))

    # Assert: the body is bit-identical, every head tensor moved.
    head = task.head_keys()
    assert all(torch.equal(before[k], after[k]) for k in before if k not in head)
    assert all(not torch.equal(before[k], after[k]) for k in head)
    assert all(p.requires_grad for p in model.parameters())


def test_head_only_freezes_batchnorm_statistics_of_the_body():
    # Prepare
    head_only = BatchNormDigits({**DIGITS_CONFIG, "subspace.head-only": True})
    full = BatchNormDigits(DIGITS_CONFIG)

    # Execute
    model, before, after = _train_and_compare(head_only, LocalTraining(1, seed=0))
    _, full_before, full_after = _train_and_compare(full, LocalTraining(1, seed=0))

    # Assert: without head-only the running statistics move; with it nothing but the head.
    assert head_only.head_keys() == ("head.weight", "head.bias")
    assert not torch.equal(full_before["body.1.running_mean"], full_after["body.1.running_mean"])
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("head."))
    assert not torch.equal(before["head.weight"], after["head.weight"])
    assert all(m.training for m in model.modules())  # the train mode of the loop, restored


def test_train_head_only_runs_the_body_in_eval_mode_and_restores():
    # Prepare: record each module's mode in a forward pass of train mode.
    model = BatchNormNet()
    model.body[0].weight.requires_grad_(False)  # a flag that must come back as it was
    seen: dict[str, bool] = {}
    for name, module in model.named_modules():
        module.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, m.training))

    # Execute
    with train_head_only(model, ("head.weight", "head.bias")):
        model.train()
        model(torch.randn(4, 1, 8, 8))
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]

    # Assert
    assert trainable == ["head.weight", "head.bias"]
    assert seen == {
        "": True, "head": True, "body": False, "body.0": False, "body.1": False,
        "body.2": False, "body.3": False, "body.4": False,
    }  # fmt: skip
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["body.0.weight"]
    assert all(m.training for m in model.modules())
    assert not model._forward_pre_hooks


def test_train_head_only_rejects_unknown_keys():
    with (
        pytest.raises(ValueError, match=r"fc\.weight"),
        train_head_only(BatchNormNet(), ("fc.weight",)),
    ):
        pass


# --- CIFAR-10 shape: resnet18 and mobilenet_v2 (3x32x32, 10 classes) --------------------

CIFAR_HEADS = {
    "resnet18": ("fc.weight", "fc.bias"),
    "mobilenet_v2": ("classifier.1.weight", "classifier.1.bias"),
}


def _head_only_step(model: nn.Module, head: tuple[str, ...], *, head_only: bool) -> None:
    """One SGD step (lr 0.1) in train mode on 4 seeded CIFAR-shaped images."""
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    context = train_head_only(model, head) if head_only else contextlib.nullcontext()
    with context:
        model.train()
        loss = nn.functional.cross_entropy(model(images), torch.tensor([0, 3, 7, 9]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("name", sorted(CIFAR_HEADS))
def test_head_only_step_at_cifar10_shape_changes_only_the_head(name):
    # Prepare: the library's model as built for CIFAR-10.
    model = build_model(name, in_channels=3, num_classes=10, image_size=32, seed=0)
    head = head_parameter_names(model)
    before = _state(model)

    # Execute
    _head_only_step(model, head, head_only=True)

    # Assert: the head is the last linear (10 outputs); the body, buffers included, is
    # bit-identical; GroupNorm everywhere, so there are no running statistics to move.
    after = _state(model)
    assert head == CIFAR_HEADS[name]
    assert _last_linear(model).out_features == 10
    assert all(torch.equal(before[k], after[k]) for k in before if k not in head)
    assert all(not torch.equal(before[k], after[k]) for k in head)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("name", sorted(CIFAR_HEADS))
def test_head_only_freezes_batchnorm_running_stats_of_torchvision_models(name):
    # Prepare: torchvision's own BatchNorm variant, 10 classes, CIFAR-10 input.
    def fresh() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return getattr(torchvision.models, name)(weights=None, num_classes=10)

    model, control = fresh(), fresh()
    head = head_parameter_names(model)
    before = _state(model)

    # Execute
    _head_only_step(model, head, head_only=True)
    _head_only_step(control, head, head_only=False)

    # Assert: without head-only the running means move; with it nothing but the head.
    after, moved = _state(model), _state(control)
    stats = [
        k for k in before if k.endswith(("running_mean", "running_var", "num_batches_tracked"))
    ]
    assert head == CIFAR_HEADS[name] and stats
    assert all(not torch.equal(before[k], moved[k]) for k in stats if "running_mean" in k)
    assert all(torch.equal(before[k], after[k]) for k in before if k not in head)
    assert all(not torch.equal(before[k], after[k]) for k in head)
