"""Group fairness metrics of the vision tasks (Subspace-DP-FL: "digits vs. letters").

EMNIST is on the Hugging Face Hub (offline here); the digits task with
``vision.grouping = "low-high"`` is the offline stand-in: labels 0-4 ("low") and 5-9
("high"), and ``vision.group-keep`` makes "high" a minority in training.
"""

import math

import numpy as np
import pytest
import torch
from torch import nn

from config.options import ConfigError
from tasks.base import EVAL_ACCURACY, EVAL_LOSS, NUM_EXAMPLES, LocalTraining
from tasks.vision import CIFAR10Task, DigitsTask, EMNISTTask, MNISTTask, TensorSplit
from tasks.vision.data import (
    FAIRNESS_GAP,
    group_keep_rng,
    group_metrics,
    label_groups,
    thin_labels,
)

LOW, HIGH = (0, 1, 2, 3, 4), (5, 6, 7, 8, 9)
LOW_HIGH = {"seed": 42, "vision.grouping": "low-high", "vision.batch-size": 16, "vision.lr": 0.02}
GROUP_KEYS = {
    "eval-accuracy-low", "eval-accuracy-high", "num-examples-low", "num-examples-high",
    FAIRNESS_GAP,
}  # fmt: skip


def _ids(split: TensorSplit, labels: tuple[int, ...]) -> set[int]:
    """Digits ids of the examples of ``split`` whose label is in ``labels``."""
    return set(split.with_labels(labels).ids.tolist())


# --- label groups -------------------------------------------------------------------


def test_label_groups_by_hand():
    assert label_groups("none", 10) == {}
    assert label_groups("low-high", 10) == {"low": LOW, "high": HIGH}
    assert label_groups("low-high", 62) == {
        "low": tuple(range(31)), "high": tuple(range(31, 62))
    }  # fmt: skip
    assert label_groups("low-high", 5) == {"low": (0, 1, 2), "high": (3, 4)}  # [0, 2.5)
    groups = label_groups("digits-letters", 62)
    assert list(groups) == ["digits", "letters"]
    assert groups["digits"] == tuple(range(10)) and groups["letters"] == tuple(range(10, 62))


@pytest.mark.parametrize(
    ("grouping", "num_classes", "match"),
    [("digits-letters", 10, "62 classes"), ("low-high", 1, ">= 2"), ("odd-even", 10, "valid")],
)
def test_label_groups_rejects_bad_input(grouping, num_classes, match):
    with pytest.raises(ValueError, match=match):
        label_groups(grouping, num_classes)


def test_groups_of_the_tasks_and_auto():
    # Execute
    digits, emnist = DigitsTask({}), EMNISTTask({})

    # Assert: auto is none for digits, digits-letters for emnist (ordered).
    assert digits.groups() == {} and digits.config.groups == {}
    assert list(emnist.groups()) == ["digits", "letters"]
    assert emnist.groups()["letters"] == tuple(range(10, 62))
    assert EMNISTTask({"vision.grouping": "none"}).groups() == {}
    assert DigitsTask({"vision.grouping": "low-high"}).groups() == {"low": LOW, "high": HIGH}
    assert MNISTTask({"vision.grouping": "low-high"}).groups()["high"] == HIGH
    emnist.groups()["digits"] = ()  # a copy: the config is not touched
    assert emnist.groups()["digits"] == tuple(range(10))


# --- option validation --------------------------------------------------------------


@pytest.mark.parametrize("task_cls", [DigitsTask, MNISTTask, CIFAR10Task])
def test_digits_letters_is_only_for_emnist(task_cls):
    with pytest.raises(
        ConfigError,
        match=r"'vision\.grouping' = 'digits-letters' is not valid for \w+; "
        r"valid values: 'auto', 'none', 'low-high'$",
    ):
        task_cls({"vision.grouping": "digits-letters"})


@pytest.mark.parametrize(
    ("config", "match"),
    [({"vision.grouping": "odd-even"}, r"'vision\.grouping' = 'odd-even' is not valid"),
     ({"vision.group-keep": 0.5}, r"'vision\.group-keep' = 0\.5 .*digits has none.*'low-high'"),
     ({"vision.group-keep": 0.0}, r"'vision\.group-keep' = 0\.0 is out of range; .*\(0, 1\]"),
     ({"vision.group-keep": 1.5}, r"'vision\.group-keep' = 1\.5 is out of range"),
     ({"vision.grouping": "low-high", "vision.group-keep": -0.1}, r"'vision\.group-keep'")],
)  # fmt: skip
def test_invalid_group_options_raise_config_error(config, match):
    with pytest.raises(ConfigError, match=match):
        DigitsTask(config)


def test_group_keep_needs_groups_on_emnist_too():
    # Prepare / Execute: auto gives emnist groups, so thinning is fine there.
    assert EMNISTTask({"vision.group-keep": 0.5}).config.group_keep == 0.5

    # Assert
    with pytest.raises(ConfigError, match=r"'vision\.group-keep'.*'digits-letters', 'low-high'"):
        EMNISTTask({"vision.grouping": "none", "vision.group-keep": 0.5})


# --- group metrics ------------------------------------------------------------------


def test_group_metrics_from_hand_made_tallies():
    # Prepare: group a = labels 0, 1 (4 of 8 right), b = labels 2, 3 (2 of 6 right).
    correct, counts = np.array([3, 1, 0, 2]), np.array([4, 4, 2, 4])

    # Execute
    metrics = group_metrics(correct, counts, {"a": (0, 1), "b": (2, 3)})

    # Assert
    assert metrics == pytest.approx(
        {"eval-accuracy-a": 0.5, "num-examples-a": 8, "eval-accuracy-b": 1 / 3,
         "num-examples-b": 6, FAIRNESS_GAP: 1 / 6}
    )  # fmt: skip


def test_group_without_examples_reports_zero_and_is_left_out_of_the_gap():
    # Prepare: group c has no examples; a is 3/4, b is 1/4.
    correct, counts = np.array([3, 1, 0, 0]), np.array([4, 4, 0, 0])
    groups = {"a": (0,), "b": (1,), "c": (2, 3)}

    # Execute
    metrics = group_metrics(correct, counts, groups)
    alone = group_metrics(correct, counts, {"a": (0,), "c": (2, 3)})
    empty = group_metrics(np.zeros(4), np.zeros(4), groups)

    # Assert: c reports 0.0 with count 0; the gap spans only a and b (not 0.75 - 0).
    assert metrics["eval-accuracy-c"] == 0.0 and metrics["num-examples-c"] == 0
    assert metrics[FAIRNESS_GAP] == pytest.approx(0.5)
    assert alone[FAIRNESS_GAP] == 0.0  # one group with examples: no gap
    assert empty[FAIRNESS_GAP] == 0.0 and set(empty) == set(metrics)
    assert all(not math.isnan(v) for v in [*metrics.values(), *empty.values()])


class LowOnlyOracle(nn.Module):
    """Reads the label off the image (pixel value = label); predicts it for low labels
    (logit 10 on the label) and label 0 for high ones; counts its forward passes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        label = x[:, 0, 0, 0].round().long()
        predicted = torch.where(label < 5, label, torch.zeros_like(label))
        return 10.0 * nn.functional.one_hot(predicted, 10).float()


def _labelled_split(labels: list[int]) -> TensorSplit:
    values = torch.tensor(labels, dtype=torch.float32).view(-1, 1, 1, 1)
    return TensorSplit(values.expand(-1, 1, 8, 8).contiguous(), torch.tensor(labels))


def test_evaluate_reports_exact_group_accuracies_in_one_pass():
    # Prepare: 5 low and 7 high examples, batches of 4 (3 batches).
    task = DigitsTask({**LOW_HIGH, "vision.batch-size": 4})
    split = _labelled_split([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 5, 6])
    model = LowOnlyOracle()

    # Execute
    metrics = task.evaluate(model, split)

    # Assert: right: loss log(1 + 9 e^-10); wrong: log(e^10 + 9).
    right, wrong = math.log1p(9 * math.exp(-10)), math.log(math.exp(10) + 9)
    assert metrics == pytest.approx(
        {NUM_EXAMPLES: 12, EVAL_LOSS: (5 * right + 7 * wrong) / 12, EVAL_ACCURACY: 5 / 12,
         "eval-accuracy-low": 1.0, "num-examples-low": 5, "eval-accuracy-high": 0.0,
         "num-examples-high": 7, FAIRNESS_GAP: 1.0},
        rel=1e-6,
    )  # fmt: skip
    assert model.calls == 3  # one forward pass per batch: no second pass for the groups


def test_split_without_a_group_keeps_the_same_keys():
    # Prepare
    task = DigitsTask(LOW_HIGH)

    # Execute
    both = task.evaluate(LowOnlyOracle(), _labelled_split([0, 9]))
    low_only = task.evaluate(LowOnlyOracle(), _labelled_split([1, 2, 3]))

    # Assert
    assert set(both) == set(low_only) == {NUM_EXAMPLES, EVAL_LOSS, EVAL_ACCURACY, *GROUP_KEYS}
    assert (low_only["eval-accuracy-high"], low_only["num-examples-high"]) == (0.0, 0)
    assert low_only[FAIRNESS_GAP] == 0.0 and both[FAIRNESS_GAP] == 1.0


def test_without_groups_evaluate_reports_no_group_keys():
    metrics = DigitsTask({}).evaluate(LowOnlyOracle(), _labelled_split([0, 9]))

    assert set(metrics) == {NUM_EXAMPLES, EVAL_LOSS, EVAL_ACCURACY}
    assert metrics[EVAL_ACCURACY] == 0.5


def test_digits_low_high_end_to_end():
    # Prepare
    task = DigitsTask(LOW_HIGH)
    partition = task.load_partition(0, 5)
    model = task.build_model(seed=0)
    task.train(model, partition, LocalTraining(server_round=1, seed=7))

    # Execute
    local = task.evaluate(model, partition)
    central = task.evaluate(model, task.load_central_test())

    # Assert: counts add up, accuracy is the count-weighted mean, gap is |low - high|.
    for metrics, split in ((local, partition.test), (central, task.load_central_test().test)):
        assert set(metrics) >= GROUP_KEYS
        n_low, n_high = metrics["num-examples-low"], metrics["num-examples-high"]
        assert (n_low, n_high) == (len(split.with_labels(LOW)), len(split.with_labels(HIGH)))
        assert n_low + n_high == metrics[NUM_EXAMPLES]
        low, high = metrics["eval-accuracy-low"], metrics["eval-accuracy-high"]
        assert metrics[EVAL_ACCURACY] == pytest.approx(
            (n_low * low + n_high * high) / (n_low + n_high)
        )
        assert metrics[FAIRNESS_GAP] == pytest.approx(abs(low - high))
        assert all(type(v) in (int, float) for v in metrics.values())
    assert central[NUM_EXAMPLES] == 360 and central[EVAL_ACCURACY] > 0.2  # measured 0.294


# --- group-keep: thinning the last group in training ----------------------------------


def test_group_keep_thins_only_the_last_group_of_train_splits():
    # Prepare
    full = DigitsTask(LOW_HIGH)
    thinned = DigitsTask({**LOW_HIGH, "vision.group-keep": 0.2})

    for pid in range(5):
        # Execute
        before, after = full.load_partition(pid, 5), thinned.load_partition(pid, 5)

        # Assert: low and the test split untouched; high kept max(1, round(0.2 m)) of m.
        assert _ids(after.train, LOW) == _ids(before.train, LOW)
        kept, pool = _ids(after.train, HIGH), _ids(before.train, HIGH)
        assert kept <= pool and len(kept) == max(1, round(0.2 * len(pool)))
        assert torch.equal(after.test.ids, before.test.ids)
        in_order = before.train.ids[torch.isin(before.train.ids, after.train.ids)]
        assert torch.equal(after.train.ids, in_order)  # a subsequence of the partition
    assert len(thinned.load_central_test().test) == 360
    assert thinned.load_partition(0, 5) is thinned.load_partition(0, 5)  # cached


def test_group_keep_is_deterministic_per_seed_and_client():
    # Execute
    first = DigitsTask({**LOW_HIGH, "vision.group-keep": 0.2}).load_partition(1, 5)
    again = DigitsTask({**LOW_HIGH, "vision.group-keep": 0.2}).load_partition(1, 5)

    # Assert: same seed, same examples; the generator depends on seed and client.
    assert torch.equal(first.train.ids, again.train.ids)
    split = TensorSplit(torch.zeros(40, 1, 1, 1), torch.arange(40) % 10, torch.arange(40))
    draws = [
        thin_labels(split, HIGH, 0.25, group_keep_rng(seed, pid)).ids
        for seed, pid in [(42, 0), (42, 0), (43, 0), (42, 1)]
    ]  # 5 of the 20 high examples each time (C(20, 5) = 15504 subsets)
    assert all(len(ids) == 20 + 5 for ids in draws)
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[3])


def test_thin_labels_keeps_each_matching_example_with_probability_keep():
    # Prepare: 10 examples of group (5..9) among 20; keep 0.3 -> 3 of them.
    split = TensorSplit(torch.zeros(20, 1, 1, 1), torch.arange(20) % 10, torch.arange(20))
    trials = 1000

    # Execute
    kept = np.zeros(20)
    for seed in range(trials):
        kept[thin_labels(split, HIGH, 0.3, np.random.default_rng(seed)).ids.numpy()] += 1

    # Assert: others always kept; each matching one with frequency 0.3 within 4.5 SE.
    matching = np.isin(np.arange(20) % 10, HIGH)
    assert (kept[~matching] == trials).all()
    assert kept[matching].sum() == 3 * trials
    se = math.sqrt(0.3 * 0.7 / trials)
    assert np.abs(kept[matching] / trials - 0.3).max() < 4.5 * se


def test_thin_labels_edge_cases():
    split = _labelled_split([0, 1, 5])
    rng = np.random.default_rng(0)

    assert thin_labels(split, HIGH, 1.0, rng) is split
    assert thin_labels(split, (7, 8), 0.1, rng) is split  # no matching example
    assert thin_labels(split, HIGH, 0.01, rng).labels.tolist() == [0, 1, 5]  # at least one
    with pytest.raises(ValueError, match=r"'keep' = 0\.0 .*\(0, 1\]"):
        thin_labels(split, HIGH, 0.0, rng)


def test_training_on_a_thinned_partition_counts_its_examples():
    task = DigitsTask({**LOW_HIGH, "vision.group-keep": 0.2})
    partition = task.load_partition(2, 5)

    metrics = task.train(task.build_model(seed=0), partition, LocalTraining(1, seed=3))

    assert metrics[NUM_EXAMPLES] == len(partition.train) == task.train_size(partition)
    assert len(partition.train) < len(DigitsTask(LOW_HIGH).load_partition(2, 5).train)


# --- per-group public gradients -------------------------------------------------------


def test_public_gradients_of_one_group_are_its_rows_of_all():
    # Prepare
    task = DigitsTask({**LOW_HIGH, "subspace.warm-start": 1})
    model = task.build_model(seed=0)
    keys = task.head_keys()
    public = task.load_public()

    # Execute
    every = task.public_gradients(model, keys)
    low = task.public_gradients(model, keys, labels=task.groups()["low"])
    high = task.public_gradients(model, keys, labels=set(HIGH))

    # Assert: 84 * 10 + 10 columns; rows are the group's rows of the full matrix, up to
    # float32 rounding (the forward pass runs on other batches, and CPU kernels sum in
    # a batch-size dependent order: ~1e-5 relative seen on this machine).
    is_low = np.isin(public.labels.numpy(), LOW)
    assert every.shape == (180, 850)
    assert low.shape == (int(is_low.sum()), 850) and high.shape == (int((~is_low).sum()), 850)
    np.testing.assert_allclose(low, every[is_low], rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(high, every[~is_low], rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("labels", [(), (10, 11)])
def test_public_gradients_of_an_empty_group_raise(labels):
    task = DigitsTask({**LOW_HIGH, "subspace.warm-start": 1})

    with pytest.raises(ValueError, match=r"'labels' = \[.*\]: no public example of digits"):
        task.public_gradients(task.build_model(seed=0), task.head_keys(), labels=labels)
