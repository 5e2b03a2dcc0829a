"""Partitioning of the digits pool with the flwr-datasets partitioners and one-class."""

import itertools

import datasets
import numpy as np
import pytest

from config.options import ConfigError
from tasks.topology import edge_members
from tasks.vision import data as vdata
from tasks.vision.data import load_digits_central_test, load_digits_partition
from tasks.vision.one_class import OneClassPartitioner
from tasks.vision.partitioning import (
    PartitionSettings,
    one_class_partition,
    split_local,
)

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
    vdata.digits_pool.cache_clear()
    vdata.digits_partitioner.cache_clear()
    vdata.digits_central_split.cache_clear()


@pytest.mark.parametrize(
    ("mode", "num_partitions"),
    [("iid", 10), ("dirichlet", 10), ("pathological", 10), ("linear", 10), ("square", 10),
     ("exponential", 5), ("one-class", 10)],
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
@pytest.mark.filterwarnings("ignore:one-class partitioning")  # 6 clients, 10 classes
@pytest.mark.parametrize("mode", ["iid", "dirichlet", "pathological", "square", "one-class"])
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


@pytest.mark.parametrize("mode", vdata.CONTIGUOUS)
@pytest.mark.parametrize("num_partitions", [1, 2, 7, 100, 1000, 1437])
def test_contiguous_shards_are_flwr_datasets_iid_partitions(mode, num_partitions):
    """iid and array-split cut the pool with np.array_split, without building each
    partition through Hugging Face datasets: the same ids as flwr-datasets'
    IidPartitioner gives, for every partition (N = 1437: one example each)."""
    settings = PartitionSettings(partitioner=mode, seed=5)
    partitioner = vdata.digits_partitioner(settings, CENTRAL, num_partitions)
    for pid in {0, min(1, num_partitions - 1), num_partitions // 2, num_partitions - 1}:
        expected = np.asarray(partitioner.load_partition(pid)["id"], dtype=np.int64)
        pool = vdata.digits_pool(settings, CENTRAL)
        np.testing.assert_array_equal(np.array_split(pool, num_partitions)[pid], expected)
        got = load_digits_partition(settings, CENTRAL, pid, num_partitions)
        assert sorted(_ids(got)) == sorted(expected)


@pytest.mark.parametrize("length", [0, 1, 9, 10, 11, 1437])
@pytest.mark.parametrize("sections", [1, 2, 3, 7, 10, 1000])
def test_array_split_shard_is_numpys_shard(length, sections):
    """Every shard is np.array_split's, also with fewer elements than shards."""
    values = np.arange(100, 100 + length)
    shards = np.array_split(values, sections)
    for index in range(sections):
        shard = vdata.array_split_shard(values, sections, index)
        np.testing.assert_array_equal(shard, shards[index])


@pytest.mark.parametrize("mode", vdata.CONTIGUOUS)
def test_more_contiguous_partitions_than_examples_is_refused_naming_the_key(mode):
    """More clients than pool examples would leave clients without data: refused for
    every partition id (not only those past the data), and by the server's check."""
    settings = PartitionSettings(partitioner=mode)
    pool = len(vdata.digits_pool(settings, CENTRAL))
    vdata.check_digits_partitioning(settings, CENTRAL, pool)  # one example each: fine
    assert len(_ids(load_digits_partition(settings, CENTRAL, pool - 1, pool))) == 1
    message = rf"'vision\.partitioner'.*{pool} digits examples into {pool + 1} partitions: 1 "
    with pytest.raises(ConfigError, match=message):
        vdata.check_digits_partitioning(settings, CENTRAL, pool + 1)
    with pytest.raises(ConfigError, match=message):
        load_digits_partition(settings, CENTRAL, 0, pool + 1)


def test_infeasible_partitioning_raises_config_error():
    # e^1 / sum(e^1..e^10) of 1437 examples rounds to an empty partition 0.
    with pytest.raises(ConfigError, match=r"vision\.partitioner"):
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


# --- one-class (frontloaded-dp-hfl, --iid -2) -------------------------------------------------

# 4 classes of 10, 12, 9 and 11 examples, interleaved.
LABELS = np.array([c for c, k in enumerate([10, 12, 9, 11]) for _ in range(k)])[
    np.random.default_rng(0).permutation(42)
]


def _classes(parts, labels=LABELS) -> list[set[int]]:
    return [set(np.unique(labels[p]).tolist()) for p in parts]


def _edge_coverage(parts, num_edges: int, labels=LABELS) -> list[int]:
    classes = _classes(parts, labels)
    members = edge_members(len(parts), num_edges)
    return [len(set().union(*(classes[p] for p in block))) for block in members]


@pytest.mark.parametrize("edge_iid", [True, False])
def test_one_class_gives_each_client_one_class_and_covers_pool(edge_iid):
    # Execute
    parts = one_class_partition(LABELS, 8, 2, edge_iid, np.random.default_rng(1))

    # Assert
    assert all(len(c) == 1 for c in _classes(parts))
    flat = np.concatenate(parts)
    assert sorted(flat.tolist()) == list(range(42))  # disjoint and complete
    assert all(np.array_equal(p, np.sort(p)) for p in parts)


def test_one_class_edge_iid_covers_all_classes_in_each_edge():
    # Prepare: 8 clients, 2 edges of 4, 4 classes: client p holds class order[p % 4].
    rng = np.random.default_rng(1)

    # Execute
    parts = one_class_partition(LABELS, 8, 2, True, rng)

    # Assert: each edge covers min(4, 4) = 4 classes; p and p + 4 share a class.
    classes = _classes(parts)
    assert _edge_coverage(parts, 2) == [4, 4]
    assert all(classes[p] == classes[p + 4] for p in range(4))
    # Each class is split between its 2 clients: 10 -> 5+5, 12 -> 6+6, 9 -> 5+4, 11 -> 6+5.
    sizes = {}
    for p, c in enumerate(classes):
        sizes.setdefault(c.pop(), []).append(len(parts[p]))
    assert {k: sorted(v) for k, v in sizes.items()} == {0: [5, 5], 1: [6, 6], 2: [4, 5], 3: [5, 6]}


def test_one_class_edge_iid_with_small_edges_covers_edge_size_classes():
    # 12 clients in 6 edges of 2, 4 classes: each edge covers min(4, 2) = 2 classes.
    parts = one_class_partition(LABELS, 12, 6, True, np.random.default_rng(2))

    assert _edge_coverage(parts, 6) == [2] * 6
    assert all(len(c) == 1 for c in _classes(parts))


def test_one_class_edge_non_iid_edges_share_no_class():
    # Prepare: 8 clients, 2 edges, 4 classes: edge e gets the class slice
    # [floor(4e * 4 / 8), floor(4(e + 1) * 4 / 8)) = [2e, 2e + 2) of the class order.

    # Execute
    parts = one_class_partition(LABELS, 8, 2, False, np.random.default_rng(1))

    # Assert: 2 classes per edge (edge-iid: 4), disjoint between edges, all used.
    classes = _classes(parts)
    assert _edge_coverage(parts, 2) == [2, 2]
    edge0 = set().union(*classes[:4])
    edge1 = set().union(*classes[4:])
    assert not edge0 & edge1
    assert edge0 | edge1 == {0, 1, 2, 3}


def test_one_class_edge_non_iid_with_more_edges_than_classes():
    # 12 clients, 6 edges of 2, 4 classes: every edge holds a single class; each class
    # sits in one or two edges.
    parts = one_class_partition(LABELS, 12, 6, False, np.random.default_rng(3))

    assert _edge_coverage(parts, 6) == [1] * 6
    assert set().union(*_classes(parts)) == {0, 1, 2, 3}


@pytest.mark.parametrize(("num_partitions", "num_edges"), [(20, 2), (30, 3), (25, 4), (40, 5)])
def test_one_class_edge_non_iid_covers_fewer_classes_than_edge_iid(num_partitions, num_edges):
    # Prepare: 10 classes of 50 examples
    labels = np.repeat(np.arange(10), 50)

    # Execute
    iid = one_class_partition(labels, num_partitions, num_edges, True, np.random.default_rng(0))
    niid = one_class_partition(labels, num_partitions, num_edges, False, np.random.default_rng(0))

    # Assert
    sizes = [len(block) for block in edge_members(num_partitions, num_edges)]
    assert _edge_coverage(iid, num_edges, labels) == [min(10, m) for m in sizes]
    assert all(
        n < i
        for n, i in zip(
            _edge_coverage(niid, num_edges, labels),
            _edge_coverage(iid, num_edges, labels),
            strict=True,
        )
    )
    for parts in (iid, niid):
        assert set().union(*_classes(parts, labels)) == set(range(10))
        assert sum(len(p) for p in parts) == 500


def test_one_class_is_deterministic_in_the_generator():
    # Execute
    first = one_class_partition(LABELS, 8, 2, True, np.random.default_rng(5))
    again = one_class_partition(LABELS, 8, 2, True, np.random.default_rng(5))
    other = one_class_partition(LABELS, 8, 2, True, np.random.default_rng(6))

    # Assert
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_one_class_with_fewer_clients_than_classes_warns():
    with pytest.warns(UserWarning, match="held by no client"):
        parts = one_class_partition(LABELS, 3, 1, True, np.random.default_rng(0))

    assert all(len(c) == 1 for c in _classes(parts))


def test_one_class_rejects_bad_num_edges_and_tiny_classes():
    with pytest.raises(ValueError, match=r"hier\.num-edges"):
        one_class_partition(LABELS, 4, 5, True, np.random.default_rng(0))
    # 4 clients, 2 classes: each class held by 2 clients; class 0 has 1 example.
    with pytest.raises(ValueError, match="examples for"):
        one_class_partition(np.array([0, 1, 1, 1]), 4, 1, True, np.random.default_rng(0))


def test_one_class_partitioner_wraps_the_function():
    # Prepare
    partitioner = OneClassPartitioner(8, "label", num_edges=2, edge_iid=False, seed=4)
    partitioner.dataset = datasets.Dataset.from_dict({"label": LABELS, "row": np.arange(42)})

    # Execute
    rows = [np.asarray(partitioner.load_partition(i)["row"]) for i in range(8)]

    # Assert
    expected = one_class_partition(LABELS, 8, 2, False, np.random.default_rng(4))
    assert all(np.array_equal(r, e) for r, e in zip(rows, expected, strict=True))
    assert partitioner.num_partitions == 8


@pytest.mark.parametrize(("edge_iid", "coverage"), [(True, [10, 10]), (False, [5, 5])])
def test_one_class_digits_edges(edge_iid, coverage):
    # Prepare: 20 clients in 2 edges of 10; 10 digit classes.
    settings = PartitionSettings("one-class", seed=7, num_edges=2, edge_iid=edge_iid)

    # Execute
    parts = _partitions(settings, 20)

    # Assert
    classes = [set(np.unique(_labels(p)).tolist()) for p in parts]
    assert all(len(c) == 1 for c in classes)
    assert [len(set().union(*classes[:10])), len(set().union(*classes[10:]))] == coverage
    assert len(np.unique(np.concatenate([_ids(p) for p in parts]))) == POOL


def test_one_class_digits_too_many_edges_raises_config_error():
    settings = PartitionSettings("one-class", num_edges=6)

    with pytest.raises(ConfigError, match=r"hier\.num-edges"):
        load_digits_partition(settings, CENTRAL, 0, 5)
