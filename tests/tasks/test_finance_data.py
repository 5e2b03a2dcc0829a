"""The finance table: synthetic twin, CSV validation, preprocessing and partition keys."""

import logging

import numpy as np
import pandas as pd
import pytest

from config.options import ConfigError
from tasks.finance import clear_caches
from tasks.finance.data import (
    CITY_TIERS,
    COLUMNS,
    EXPENSES,
    FEATURES,
    OCCUPATIONS,
    POTENTIAL_SAVINGS,
    SAVABLE,
    TARGET,
    central_split,
    encode_features,
    generate_synthetic,
    income_brackets,
    load_table,
    partition_keys,
    prepare,
)

ROWS = 2000


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    return generate_synthetic(ROWS, seed=7)


# --- synthetic twin -----------------------------------------------------------------


def test_synthetic_schema(table):
    # Assert
    assert tuple(table.columns) == COLUMNS
    assert len(COLUMNS) == 27 and len(FEATURES) == 26 and TARGET not in FEATURES
    assert len(table) == ROWS
    assert table["Age"].dtype == np.int64 and table["Dependents"].dtype == np.int64
    for column in ("Occupation", "City_Tier"):
        assert pd.api.types.is_string_dtype(table[column])
    others = [c for c in COLUMNS if c not in ("Age", "Dependents", "Occupation", "City_Tier")]
    assert all(table[c].dtype == np.float64 for c in others)
    assert set(table["Occupation"]) == set(OCCUPATIONS)
    assert set(table["City_Tier"]) == set(CITY_TIERS)
    assert not table.isna().any().any()


def test_synthetic_disposable_income_identity_is_exact(table):
    # Execute: subtract the expenses one by one, in schema order
    remaining = table["Income"].to_numpy().copy()
    for name in EXPENSES:
        remaining -= table[name].to_numpy()

    # Assert
    assert np.array_equal(remaining, table[TARGET].to_numpy())
    assert (table[TARGET] > 0).all()


def test_synthetic_savings_are_consistent(table):
    # Assert: desired savings = income x percentage (to the paisa)
    expected = table["Income"] * table["Desired_Savings_Percentage"] / 100
    assert np.allclose(table["Desired_Savings"], expected, atol=0.005)
    # Each potential saving is 2-15 % of its expense (plus rounding).
    for name, column in zip(SAVABLE, POTENTIAL_SAVINGS, strict=True):
        share = table[column] / table[name].where(table[name] > 0)
        assert share.dropna().between(0.02 - 1e-3, 0.15 + 1e-3).all(), column


def test_synthetic_relations_are_plausible(table):
    # Prepare
    rent_share = table["Rent"] / table["Income"]
    median_income = table.groupby("Occupation")["Income"].median()

    # Assert
    assert (
        rent_share[table["City_Tier"] == "Tier_1"].mean()
        > rent_share[table["City_Tier"] == "Tier_3"].mean() * 1.5
    )
    assert median_income["Professional"] > 2 * median_income["Student"]
    assert table.loc[table["Occupation"] == "Student", "Age"].max() <= 25
    assert table["Income"].corr(table[TARGET]) > 0.6


def test_synthetic_is_deterministic_per_seed(table):
    # Execute
    again = generate_synthetic(ROWS, seed=7)
    other = generate_synthetic(ROWS, seed=8)

    # Assert
    pd.testing.assert_frame_equal(table, again)
    assert not table["Income"].equals(other["Income"])


def test_load_table_caches_and_logs_source_once(caplog):
    # Prepare
    clear_caches()
    caplog.set_level(logging.INFO, logger="tasks.finance.data")

    # Execute
    first = load_table("", 500, 3)
    second = load_table("", 500, 3)

    # Assert
    assert first is second
    assert first.source == "synthetic (seed 3, 500 rows)"
    assert [r.getMessage() for r in caplog.records].count(
        "finance data source: synthetic (seed 3, 500 rows)"
    ) == 1


# --- CSV ----------------------------------------------------------------------------


def test_valid_csv_loads_in_schema_order(table, tmp_path):
    # Prepare: shuffled column order, as a user's export might have
    path = tmp_path / "finance.csv"
    table[list(reversed(COLUMNS))].head(50).to_csv(path, index=False)

    # Execute
    loaded = load_table(str(path), 0, 0)

    # Assert
    pd.testing.assert_frame_equal(loaded.frame, table.head(50), check_dtype=False)
    assert tuple(loaded.frame.columns) == COLUMNS
    assert loaded.frame["Age"].dtype == np.int64
    assert loaded.source == str(path.resolve())


def _drop_rent(frame):
    return frame.drop(columns=["Rent"])


def _add_extra(frame):
    return frame.assign(Savings_Goal=1.0)


def _nan_groceries(frame):
    frame.loc[3, "Groceries"] = np.nan
    return frame


def _unknown_occupation(frame):
    frame["Occupation"] = frame["Occupation"].astype(object)
    frame.loc[4, "Occupation"] = "Pilot"
    return frame


def _text_age(frame):
    frame["Age"] = frame["Age"].astype(object)
    frame.loc[5, "Age"] = "forty"
    return frame


def _fractional_dependents(frame):
    frame["Dependents"] = frame["Dependents"].astype(float)
    frame.loc[6, "Dependents"] = 1.5
    return frame


@pytest.mark.parametrize(
    ("corrupt", "named"),
    [(_drop_rent, ["Rent"]), (_add_extra, ["Savings_Goal"]), (_nan_groceries, ["Groceries"]),
     (_unknown_occupation, ["Occupation", "Pilot"]), (_text_age, ["Age", "forty"]),
     (_fractional_dependents, ["Dependents", "1.5"])],
)  # fmt: skip
def test_invalid_csv_is_rejected_naming_key_file_and_column(table, tmp_path, corrupt, named):
    # Prepare
    path = tmp_path / "bad.csv"
    corrupt(table.head(20).copy()).to_csv(path, index=False)

    # Execute
    with pytest.raises(ConfigError) as err:
        load_table(str(path), 0, 0)

    # Assert
    message = str(err.value)
    assert "finance.data-path" in message and "bad.csv" in message
    assert all(word in message for word in named), message


def test_missing_csv_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"finance\.data-path.*no such file"):
        load_table(str(tmp_path / "absent.csv"), 0, 0)


# --- preprocessing ------------------------------------------------------------------


def test_categories_use_the_fixed_schema_mapping():
    # Prepare: only some categories present (a LabelEncoder would renumber them)
    frame = generate_synthetic(40, seed=1)
    frame["Occupation"] = ["Student", "Retired"] * 20
    frame["City_Tier"] = "Tier_3"

    # Execute
    encoded = encode_features(frame)

    # Assert
    occupation, tier = FEATURES.index("Occupation"), FEATURES.index("City_Tier")
    assert encoded.shape == (40, 26)
    assert encoded[:2, occupation].tolist() == [3.0, 1.0]
    assert set(encoded[:, tier]) == {2.0}


def test_central_split_is_seeded_and_disjoint():
    # Execute
    pool, central = central_split(ROWS, 0.2, seed=5)
    pool_again, _ = central_split(ROWS, 0.2, seed=5)
    pool_other, _ = central_split(ROWS, 0.2, seed=6)

    # Assert
    assert len(central) == 400 and len(pool) == 1600
    assert np.array_equal(np.sort(np.concatenate([pool, central])), np.arange(ROWS))
    assert np.array_equal(pool, pool_again)
    assert not np.array_equal(pool, pool_other)


def test_scalers_are_fitted_on_pool_rows_only(table):
    # Prepare: change a central test row, then (control) a pool row
    data = prepare(table, seed=1, central_test_fraction=0.2)
    central_changed, pool_changed = table.copy(), table.copy()
    central_changed.loc[data.central[0], ["Income", TARGET]] = 1e9
    pool_changed.loc[data.pool[0], ["Income", TARGET]] = 1e9

    # Execute
    after_central = prepare(central_changed, seed=1, central_test_fraction=0.2)
    after_pool = prepare(pool_changed, seed=1, central_test_fraction=0.2)

    # Assert
    pool = data.pool
    assert data.features.shape == (ROWS, 26) and data.features.dtype == np.float32
    assert np.allclose(data.features[pool].mean(axis=0), 0.0, atol=1e-5)
    assert np.allclose(data.features[pool].std(axis=0), 1.0, atol=1e-4)
    assert abs(data.target[pool].mean()) < 1e-5 and abs(data.target[pool].std() - 1) < 1e-4
    assert np.array_equal(after_central.features[pool], data.features[pool])
    assert np.array_equal(after_central.target[pool], data.target[pool])
    assert not np.array_equal(after_pool.features[pool], data.features[pool])
    rupees = data.target_scaler.inverse_transform(data.target.reshape(-1, 1)).ravel()
    assert np.allclose(rupees, table[TARGET], rtol=1e-5)


def test_income_brackets_by_reference_quartiles():
    # Prepare: quartiles of 1..8 are 2.75, 4.5 and 6.25
    reference = np.arange(1.0, 9.0)

    # Execute
    brackets = income_brackets(np.array([1.0, 2.75, 4.5, 6.0, 6.25, 100.0]), reference)

    # Assert
    assert brackets.tolist() == [0, 1, 2, 2, 3, 3]


def test_partition_keys_combine_occupation_tier_and_bracket():
    # Prepare
    frame = pd.DataFrame(
        {"Occupation": ["Professional", "Self_Employed", "Student"],
         "City_Tier": ["Tier_1", "Tier_3", "Tier_2"]}
    )  # fmt: skip

    # Execute
    keys = partition_keys(frame, np.array([0, 1, 3]))

    # Assert: (occupation * 3 + tier) * 4 + bracket
    assert keys.tolist() == [0, (2 * 3 + 2) * 4 + 1, (3 * 3 + 1) * 4 + 3]


def test_prepared_keys_cover_groups_of_the_pool(table):
    # Execute
    data = prepare(table, seed=1, central_test_fraction=0.2)

    # Assert: each income quartile of the pool holds a quarter of it
    counts = np.bincount(data.brackets[data.pool], minlength=4)
    assert np.all(np.abs(counts - 400) <= 2)
    assert np.array_equal(data.keys % 4, data.brackets)
    assert data.keys.max() < 48 and len(np.unique(data.keys[data.pool])) > 30
