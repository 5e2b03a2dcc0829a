"""Partitioning of the digits pool with the flwr-datasets partitioners."""

import itertools

import numpy as np
import pytest

from tasks.options import ConfigError
from tasks.vision import data as vdata
from tasks.vision.data import load_digits_central_test, load_digits_partition
from tasks.vision.partitioning import PartitionSettings, split_local

NUM_DIGITS = 1797
CENTRAL = 0.2
NUM_CENTRAL = 360  # ceil(0.2 * 1797), scikit-learn's rounding of test_size
POOL = NUM_DIGITS - NUM_CENTRAL


def _partitions(settings: PartitionSettings, num_partitions: int):
    return [
        load_digits_partition(settings, CENTRAL, i, num_partitions) for i in range(num_partitions)
    ]


def _ids(partition) -> np.ndarray:
    return np.concatenate([partition.train.ids.numpy(), partition.test.ids.numpy()])


def _labels(partition) -> np.ndarray:
    return np.concatenate([partition.train.labels.numpy(), partition.test.labels.numpy()])


def _clear_caches() -> None:
    vdata.load_digits_partition.cache_clear()
    vdata.digits_partitioner.cache_clear()
    vdata.digits_central_split.cache_clear()


@pytest.mark.parametrize(
    ("mode", "num_partitions"),
    [("iid", 10), ("dirichlet", 10), ("pathological", 10), ("linear", 10), ("square", 10),
     ("exponential", 5)],
)  # fmt: skip
def test_partitions_cover_pool_exactly_once(mode, num_partitions):
    # Prepare
    settings = PartitionSettings(partitioner=mode, seed=3)

    # Execute
    parts = _partitions(settings, num_partitions)
    central = load_digits_central_test(3, CENTRAL).test.ids.numpy()

    # Assert
    ids = np.concatenate([_ids(p) for p in parts])
    assert len(central) == NUM_CENTRAL
    assert len(ids) == POOL
    assert len(np.unique(ids)) == POOL
    assert not set(ids) & set(central)
    assert all(len(p.train) >= 1 and len(p.test) >= 1 for p in parts)


def _mean_tv_distance(parts) -> float:
    all_labels = np.concatenate([_labels(p) for p in parts])
    global_dist = np.bincount(all_labels, minlength=10) / len(all_labels)
    distances = []
    for p in parts:
        labels = _labels(p)
        dist = np.bincount(labels, minlength=10) / len(labels)
        distances.append(0.5 * np.abs(dist - global_dist).sum())
    return float(np.mean(distances))


def test_dirichlet_label_skew_grows_as_alpha_falls():
    # Execute
    skewed = _mean_tv_distance(_partitions(PartitionSettings("dirichlet", alpha=0.1), 10))
    mild = _mean_tv_distance(_partitions(PartitionSettings("dirichlet", alpha=10.0), 10))

    # Assert: alpha = 0.1 leaves clients with a few classes; alpha = 10 is near IID.
    assert skewed > mild + 0.3
    assert mild < 0.2


def test_pathological_gives_each_client_exactly_its_classes():
    # Prepare: first-deterministic assignment: client i holds class i % 10 and one
    # seeded random other class.
    settings = PartitionSettings("pathological", classes_per_client=2, seed=5)

    # Execute
    parts = _partitions(settings, 10)

    # Assert
    for i, p in enumerate(parts):
        classes = set(np.unique(_labels(p)).tolist())
        assert len(classes) == 2
        assert i % 10 in classes
    assert set(np.concatenate([_labels(p) for p in parts]).tolist()) == set(range(10))


def _expected_sizes(units: np.ndarray) -> list[int]:
    # flwr-datasets IdToSizeFncPartitioner: floor of each share, remainder to the last.
    sizes = np.array(units / units.sum() * POOL, dtype=np.int64)
    sizes[-1] += POOL - sizes.sum()
    return sizes.tolist()


@pytest.mark.parametrize(
    ("mode", "num_partitions", "size_fn"),
    [("linear", 10, lambda k: k), ("square", 10, np.square), ("exponential", 5, np.exp)],
)
def test_quantity_skew_sizes_follow_partition_id(mode, num_partitions, size_fn):
    # Prepare
    units = size_fn(np.arange(1, num_partitions + 1, dtype=float))

    # Execute
    parts = _partitions(PartitionSettings(partitioner=mode), num_partitions)
    sizes = [len(p.train) + len(p.test) for p in parts]

    # Assert
    assert sizes == _expected_sizes(units)
    assert all(a < b for a, b in itertools.pairwise(sizes))


def test_quantity_skew_keeps_labels_iid():
    parts = _partitions(PartitionSettings(partitioner="linear"), 5)

    assert _mean_tv_distance(parts[2:]) < 0.1


@pytest.mark.filterwarnings("ignore:Classes")  # 6 clients x 2 classes leave some unused
@pytest.mark.parametrize("mode", ["iid", "dirichlet", "pathological", "square"])
def test_same_seed_same_partitions_different_seed_different(mode):
    # Execute (caches cleared so that each call rebuilds everything)
    first = [_ids(p) for p in _partitions(PartitionSettings(mode, seed=11), 6)]
    _clear_caches()
    again = [_ids(p) for p in _partitions(PartitionSettings(mode, seed=11), 6)]
    _clear_caches()
    other = [_ids(p) for p in _partitions(PartitionSettings(mode, seed=12), 6)]

    # Assert
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_repeated_loads_are_cached():
    settings = PartitionSettings("dirichlet", alpha=0.5, seed=1)

    assert load_digits_partition(settings, CENTRAL, 2, 4) is load_digits_partition(
        settings, CENTRAL, 2, 4
    )


def test_infeasible_partitioning_raises_config_error():
    # e^1 / sum(e^1..e^10) of 1437 examples rounds to an empty partition 0.
    with pytest.raises(ConfigError, match=r"data\.partitioner"):
        load_digits_partition(PartitionSettings("exponential"), CENTRAL, 0, 10)


def test_partition_id_out_of_range_raises():
    with pytest.raises(ValueError, match="partition_id"):
        load_digits_partition(PartitionSettings(), CENTRAL, 5, 5)


@pytest.mark.parametrize(
    ("n", "fraction", "expected"), [(1, 0.2, (1, 0)), (2, 0.05, (1, 1)), (2, 0.5, (1, 1)),
                                    (10, 0.2, (8, 2)), (3, 0.05, (2, 1))]
)  # fmt: skip
def test_split_local_sizes(n, fraction, expected):
    # Execute
    train, test = split_local(n, fraction, np.random.default_rng(0))

    # Assert
    assert (len(train), len(test)) == expected
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(n))
