"""The finance partitionings: disjoint, deterministic, skewed as the SmartFedProx study asks."""

import numpy as np
import pytest

from config.options import ConfigError
from tasks.finance.data import generate_synthetic, prepare
from tasks.finance.partitioning import (
    MIN_PARTITION_ROWS,
    parse_scheme,
    partition_rows,
    split_local,
)

SCHEMES = (
    "iid", "multi-key", "label-skew", "quantity-skew", "multi-key+label-skew",
    "multi-key+label-skew+quantity-skew",
)  # fmt: skip
K = 6


@pytest.fixture(scope="module")
def pool():
    """Keys, income quartiles and incomes of a 4 000-row synthetic pool."""
    data = prepare(generate_synthetic(5000, seed=11), seed=11, central_test_fraction=0.2)
    rows = data.pool
    return data.keys[rows], data.brackets[rows], data.income[rows]


def _split(pool, scheme: str, seed: int = 0, num_partitions: int = K):
    keys, brackets, _ = pool
    return partition_rows(
        keys, brackets, num_partitions, parse_scheme(scheme), np.random.default_rng(seed)
    )


# --- parsing ------------------------------------------------------------------------


def test_parse_scheme_is_order_insensitive():
    # Execute / Assert
    assert parse_scheme("iid") == ()
    assert parse_scheme("quantity-skew+multi-key") == ("multi-key", "quantity-skew")
    assert parse_scheme("label-skew+quantity-skew+multi-key") == (
        "multi-key", "label-skew", "quantity-skew",
    )  # fmt: skip


@pytest.mark.parametrize(
    "text", ["", "dirichlet", "multi-key+multi-key", "iid+label-skew", "multi-key+"]
)
def test_invalid_scheme_names_key_and_valid_parts(text):
    with pytest.raises(ConfigError) as err:
        parse_scheme(text)
    message = str(err.value)
    assert "finance.partitioning" in message
    assert all(part in message for part in ("'iid'", "multi-key", "label-skew", "quantity-skew"))


# --- every scheme -------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partitions_are_disjoint_and_large_enough(pool, scheme):
    # Execute
    parts = _split(pool, scheme)

    # Assert
    rows = np.concatenate(parts)
    assert len(parts) == K
    assert len(np.unique(rows)) == len(rows)
    assert rows.min() >= 0 and rows.max() < len(pool[0])
    assert all(len(p) >= MIN_PARTITION_ROWS for p in parts)
    assert all(np.array_equal(p, np.sort(p)) for p in parts)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partitions_are_deterministic_from_the_generator(pool, scheme):
    # Execute
    first, again, other = _split(pool, scheme, 1), _split(pool, scheme, 1), _split(pool, scheme, 2)

    # Assert
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(first, other, strict=True))


# --- each skew ----------------------------------------------------------------------


def test_iid_gives_equal_sizes(pool):
    # Execute
    parts = _split(pool, "iid")

    # Assert: 4 000 pool rows / 6 clients
    assert [len(p) for p in parts] == [666] * K


def test_iid_incomes_are_alike(pool):
    # Execute
    income = pool[2]
    means = [income[p].mean() for p in _split(pool, "iid")]

    # Assert
    assert max(means) / min(means) < 1.2


@pytest.mark.parametrize("scheme", ["multi-key", "multi-key+label-skew+quantity-skew"])
def test_multi_key_takes_70_percent_from_the_primary_group(pool, scheme):
    # Execute
    keys = pool[0]
    parts = _split(pool, scheme)

    # Assert: the most common key holds 70 % of a client's rows, a second key the rest
    for part in parts:
        counts = np.sort(np.bincount(keys[part]))[::-1]
        assert counts[0] / len(part) == pytest.approx(0.7, abs=0.02)
        assert counts[:2].sum() == len(part)
    primaries = [np.bincount(keys[p]).argmax() for p in parts]
    assert len(set(primaries)) > 1


@pytest.mark.parametrize("scheme", ["label-skew", "multi-key+label-skew+quantity-skew"])
def test_label_skew_biases_odd_clients_to_high_income(pool, scheme):
    # Execute
    _, brackets, income = pool
    parts = _split(pool, scheme)

    # Assert: odd ids only at or above the 25th percentile, even ids only below the 75th
    for pid, part in enumerate(parts):
        allowed = {1, 2, 3} if pid % 2 else {0, 1, 2}
        assert set(brackets[part]) <= allowed
    odd = np.mean([income[p].mean() for p in parts[1::2]])
    even = np.mean([income[p].mean() for p in parts[0::2]])
    assert odd > 1.5 * even


def test_label_skew_alone_uses_its_quartiles_evenly(pool):
    # Execute
    brackets = pool[1]
    parts = _split(pool, "label-skew")

    # Assert: each client spreads over its three quartiles (a third each, +-1 row)
    for part in parts:
        counts = np.bincount(brackets[part], minlength=4)
        present = counts[counts > 0]
        assert len(present) == 3 and present.max() - present.min() <= 2


@pytest.mark.parametrize("scheme", ["quantity-skew", "multi-key+label-skew+quantity-skew"])
def test_quantity_skew_sizes_follow_linspaced_factors(pool, scheme):
    # Execute
    sizes = np.array(sorted(len(p) for p in _split(pool, scheme)))

    # Assert: sorted sizes are proportional to linspace(0.5, 1.3, 6), up to flooring
    factors = np.linspace(0.5, 1.3, K)
    scale = sizes[-1] / factors[-1]
    assert np.all(np.abs(sizes - factors * scale) <= 3)
    assert sizes[-1] / sizes[0] == pytest.approx(1.3 / 0.5, rel=0.03)


def test_multi_key_on_hand_built_groups():
    # Prepare: two groups of 100 rows and two of 10, one income quartile each
    keys = np.repeat([0, 1, 2, 3], [100, 100, 10, 10])
    brackets = keys.copy()

    # Execute
    parts = partition_rows(keys, brackets, 2, ("multi-key",), np.random.default_rng(0))

    # Assert: client 0 takes the two big groups (70 + 30 rows), client 1 the same groups
    # the other way round (the greedy choice keeps the most rows per unit of demand),
    # and no small group is used
    counts = [np.bincount(keys[p], minlength=4).tolist() for p in parts]
    assert sorted(counts) == [[30, 70, 0, 0], [70, 30, 0, 0]]


def test_too_many_partitions_is_a_config_error(pool):
    with pytest.raises(ConfigError, match=r"finance\.partitioning.*fewer partitions"):
        _split(pool, "multi-key+label-skew+quantity-skew", num_partitions=400)


def test_split_local_holds_out_the_test_fraction():
    # Execute
    train, test = split_local(11, 0.2, np.random.default_rng(0))
    lone_train, lone_test = split_local(1, 0.2, np.random.default_rng(0))

    # Assert: round(0.2 * 11) = 2 test rows
    assert len(test) == 2 and len(train) == 9
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(11))
    assert lone_train.tolist() == [0] and len(lone_test) == 0
