"""The Indian personal-finance table: schema, CSV loading, synthetic twin, preprocessing.

Design notes: ``docs/notes.md``, ``tasks.finance.data``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.preprocessing import StandardScaler

from config.options import ConfigError

logger = logging.getLogger(__name__)

DATA_PATH_KEY = "finance.data-path"
OCCUPATIONS = ("Professional", "Retired", "Self_Employed", "Student")  # sorted
CITY_TIERS = ("Tier_1", "Tier_2", "Tier_3")  # sorted
CATEGORIES: dict[str, tuple[str, ...]] = {"Occupation": OCCUPATIONS, "City_Tier": CITY_TIERS}
EXPENSES = (
    "Rent", "Loan_Repayment", "Insurance", "Groceries", "Transport", "Eating_Out",
    "Entertainment", "Utilities", "Healthcare", "Education", "Miscellaneous",
)  # fmt: skip
SAVABLE = (
    "Groceries", "Transport", "Eating_Out", "Entertainment", "Utilities", "Healthcare",
    "Education", "Miscellaneous",
)  # fmt: skip
POTENTIAL_SAVINGS = tuple(f"Potential_Savings_{name}" for name in SAVABLE)
TARGET = "Disposable_Income"
COLUMNS: tuple[str, ...] = (
    "Income", "Age", "Dependents", "Occupation", "City_Tier", *EXPENSES,
    "Desired_Savings_Percentage", "Desired_Savings", TARGET, *POTENTIAL_SAVINGS,
)  # fmt: skip
FEATURES: tuple[str, ...] = tuple(c for c in COLUMNS if c != TARGET)  # 26 inputs
INTEGER_COLUMNS = ("Age", "Dependents")
NUMERIC_COLUMNS: tuple[str, ...] = tuple(c for c in COLUMNS if c not in CATEGORIES)
NUM_BRACKETS = 4  # income quartiles
NUM_KEYS = len(OCCUPATIONS) * len(CITY_TIERS) * NUM_BRACKETS

CENTRAL_STREAM = 0xCE7  # seed streams: central split, partitioning, local splits
PARTITION_STREAM = 0x9A27
SPLIT_STREAM = 0x5B1


@dataclass(frozen=True)
class FinanceTable:
    """The raw table and where it came from.

    Attributes
    ----------
    frame : pandas.DataFrame
        The 27 columns of ``COLUMNS``, in that order; ``Age`` and ``Dependents``
        ``int64``, the categories strings, every other column ``float64``.
    source : str
        The file path, or ``"synthetic (seed S, N rows)"``.
    """

    frame: pd.DataFrame
    source: str


def describe_source(data_path: str, synthetic_rows: int, seed: int) -> str:
    """The data-source line the app logs: the file path, or the synthetic recipe."""
    if data_path:
        return str(Path(data_path).expanduser().resolve())
    return f"synthetic (seed {seed}, {synthetic_rows} rows)"


@lru_cache(maxsize=8)
def load_table(data_path: str, synthetic_rows: int, seed: int) -> FinanceTable:
    """Read and validate ``data_path``, or generate the synthetic table (cached).

    Parameters
    ----------
    data_path : str
        CSV file of the real dataset (``finance.data-path``); ``""``: synthetic.
    synthetic_rows : int
        Rows of the synthetic table (ignored for a file).
    seed : int
        Run seed of the synthetic table (ignored for a file).
    """
    source = describe_source(data_path, synthetic_rows, seed)
    if data_path:
        frame = validate_table(read_csv(source), source)
    else:
        frame = generate_synthetic(synthetic_rows, seed)
    logger.info("finance data source: %s", source)
    return FinanceTable(frame, source)


def read_csv(path: str) -> pd.DataFrame:
    """``pandas.read_csv(path)``, with unreadable files reported as ConfigError."""
    try:
        return pd.read_csv(path)
    except FileNotFoundError:
        raise ConfigError(f"'{DATA_PATH_KEY}' = {path!r}: no such file") from None
    except (OSError, ValueError, pd.errors.ParserError) as err:
        raise ConfigError(f"'{DATA_PATH_KEY}' = {path!r}: cannot read it as CSV ({err})") from err


def validate_table(frame: pd.DataFrame, path: str) -> pd.DataFrame:
    """Check ``frame`` against the schema; return it in schema order and dtypes.

    Raises
    ------
    ConfigError
        Naming ``finance.data-path``, the file and the offending columns or values:
        missing or unexpected columns, empty cells, non-numeric or non-integral
        numbers, unknown categories.
    """

    def fail(problem: str) -> ConfigError:
        return ConfigError(f"'{DATA_PATH_KEY}' = {path!r}: {problem}")

    missing = [c for c in COLUMNS if c not in frame.columns]
    extra = [str(c) for c in frame.columns if c not in COLUMNS]
    if missing or extra:
        raise fail(f"missing columns {missing}, unexpected columns {extra}; expected {COLUMNS}")
    if frame.empty:
        raise fail("the file has no rows")
    frame = frame.loc[:, list(COLUMNS)].copy()
    empty = {c: int(n) for c, n in frame.isna().sum().items() if n}
    if empty:
        raise fail(f"empty (NaN) cells in columns {empty} (column: count)")
    for column in NUMERIC_COLUMNS:
        frame[column] = _numeric_column(frame[column], fail)
    for column, valid in CATEGORIES.items():
        values = frame[column].astype(str)
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise fail(f"column {column!r} has unknown values {unknown}; valid values: {valid}")
        frame[column] = values
    return frame.reset_index(drop=True)


def _numeric_column(values: pd.Series, fail) -> pd.Series:
    """``values`` as float64 (int64 for ``INTEGER_COLUMNS``), or raise ``fail``."""
    column = str(values.name)
    numbers = pd.to_numeric(values, errors="coerce")
    bad = values[numbers.isna()]
    if len(bad):
        raise fail(f"column {column!r} has non-numeric values {bad.unique()[:5].tolist()}")
    numbers = numbers.astype(np.float64)
    if column not in INTEGER_COLUMNS:
        return numbers
    fractional = numbers[numbers != np.round(numbers)]
    if len(fractional):
        raise fail(f"column {column!r} must hold integers, got {fractional.unique()[:5]}")
    return numbers.astype(np.int64)


# --- synthetic twin -----------------------------------------------------------------

OCCUPATION_SHARE = {"Professional": 0.35, "Retired": 0.15, "Self_Employed": 0.3, "Student": 0.2}
TIER_SHARE = {"Tier_1": 0.3, "Tier_2": 0.4, "Tier_3": 0.3}
AGE_RANGE = {"Professional": (22, 60), "Retired": (58, 64), "Self_Employed": (22, 64),
             "Student": (18, 25)}  # fmt: skip
DEPENDENTS_MEAN = {"Professional": 1.5, "Retired": 0.8, "Self_Employed": 1.6, "Student": 0.2}
LOG_INCOME_OCCUPATION = {"Professional": 0.45, "Retired": -0.3, "Self_Employed": 0.3,
                         "Student": -0.9}  # fmt: skip
LOG_INCOME_TIER = {"Tier_1": 0.3, "Tier_2": 0.0, "Tier_3": -0.25}
MEDIAN_INCOME = 30_000.0  # rupees per month, before the effects above
RENT_TIER = {"Tier_1": 1.35, "Tier_2": 1.0, "Tier_3": 0.7}
SPENDING_TIER = {"Tier_1": 1.15, "Tier_2": 1.0, "Tier_3": 0.85}  # transport, eating out
MAX_SPENT_SHARE = 0.95  # expenses never exceed this share of income


def generate_synthetic(num_rows: int, seed: int) -> pd.DataFrame:
    """A synthetic table with the real schema, drawn from ``default_rng(seed)``.

    Income is log-normal around 30 000 rupees, shifted by occupation, city tier and
    (for the employed) age; each expense is an income share with log-normal noise
    (rent higher in Tier_1, groceries and education growing with dependents,
    healthcare with age, loans for about half the people); ``Disposable_Income`` is
    income minus the 11 expenses, exactly (income and expenses are whole rupees, so
    the float64 sums are exact in any order); ``Desired_Savings`` is
    ``Income * Desired_Savings_Percentage / 100``; each potential saving is 2-15 % of
    its expense.
    """
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    rng = np.random.default_rng(seed)
    occupation = rng.choice(
        list(OCCUPATION_SHARE), size=num_rows, p=list(OCCUPATION_SHARE.values())
    )
    tier = rng.choice(list(TIER_SHARE), size=num_rows, p=list(TIER_SHARE.values()))
    low, high = (np.array([AGE_RANGE[o][i] for o in occupation]) for i in (0, 1))
    age = rng.integers(low, high + 1)
    dependents = np.minimum(rng.poisson(_lookup(DEPENDENTS_MEAN, occupation)), 4)
    age, dependents = age.astype(np.int64), dependents.astype(np.int64)
    income = _incomes(occupation, tier, age, rng)
    expenses = _expenses(income, occupation, tier, age, dependents, rng)
    frame = pd.DataFrame({"Income": income, "Age": age, "Dependents": dependents,
                          "Occupation": occupation, "City_Tier": tier, **expenses})  # fmt: skip
    wish = 10.0 + 4.0 * np.log(income / MEDIAN_INCOME) + rng.normal(0.0, 3.0, num_rows)
    percentage = np.clip(wish, 2.0, 30.0).round(2)
    frame["Desired_Savings_Percentage"] = percentage
    frame["Desired_Savings"] = (income * percentage / 100.0).round(2)
    frame[TARGET] = income - np.sum([expenses[name] for name in EXPENSES], axis=0)
    for name, column in zip(SAVABLE, POTENTIAL_SAVINGS, strict=True):
        frame[column] = (expenses[name] * rng.uniform(0.02, 0.15, num_rows)).round(2)
    for column in CATEGORIES:
        frame[column] = frame[column].astype(str)
    return frame.loc[:, list(COLUMNS)]


def _lookup(table: dict[str, float], labels: np.ndarray) -> np.ndarray:
    """``table[label]`` for each label, as a float array."""
    return np.array([table[label] for label in labels], dtype=np.float64)


def _incomes(
    occupation: np.ndarray, tier: np.ndarray, age: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Log-normal monthly incomes in whole rupees (at least 1 000)."""
    employed = (occupation == "Professional") | (occupation == "Self_Employed")
    experience = np.where(employed, 0.012 * np.minimum(age - 22, 30), 0.0)
    log_income = (
        np.log(MEDIAN_INCOME)
        + _lookup(LOG_INCOME_OCCUPATION, occupation)
        + _lookup(LOG_INCOME_TIER, tier)
        + experience
        + rng.normal(0.0, 0.45, len(age))
    )
    return np.maximum(np.round(np.exp(log_income)), 1000.0)


def _expenses(
    income: np.ndarray,
    occupation: np.ndarray,
    tier: np.ndarray,
    age: np.ndarray,
    dependents: np.ndarray,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """The 11 expenses in whole rupees, as noisy shares of income."""
    n = len(income)
    student, retired = occupation == "Student", occupation == "Retired"
    has_loan = rng.random(n) < np.where(student, 0.2, 0.45)
    tier_scale = _lookup(SPENDING_TIER, tier)
    shares = {
        "Rent": 0.18 * _lookup(RENT_TIER, tier) * np.where(retired, 0.6, 1.0),
        "Loan_Repayment": np.where(has_loan, 0.12, 0.0),
        "Insurance": 0.03 + 0.005 * dependents,
        "Groceries": 0.10 + 0.02 * dependents,
        "Transport": 0.06 * tier_scale,
        "Eating_Out": 0.04 * tier_scale**2,
        "Entertainment": np.full(n, 0.035),
        "Utilities": np.full(n, 0.05),
        "Healthcare": 0.03 + 0.0008 * (age - 18),
        "Education": 0.03 * dependents + np.where(student, 0.08, 0.0),
        "Miscellaneous": np.full(n, 0.025),
    }
    noisy = np.stack([shares[name] * rng.lognormal(0.0, 0.25, n) for name in EXPENSES])
    noisy *= np.minimum(1.0, MAX_SPENT_SHARE / noisy.sum(axis=0))
    return {name: np.round(income * row) for name, row in zip(EXPENSES, noisy, strict=True)}


# --- preprocessing ------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedData:
    """The table as standardised arrays, with the central split and partition keys.

    Attributes
    ----------
    features : numpy.ndarray
        ``float32 (N, 26)``: ``FEATURES``, categories encoded, standardised with
        the pool's statistics.
    target : numpy.ndarray
        ``float32 (N,)``: ``Disposable_Income`` standardised with the pool's statistics.
    income : numpy.ndarray
        ``float64 (N,)``: raw income (rupees).
    brackets : numpy.ndarray
        ``int64 (N,)``: income quartile 0-3 by the pool's quartiles.
    keys : numpy.ndarray
        ``int64 (N,)``: the partition key, see ``partition_keys``.
    pool, central : numpy.ndarray
        Sorted row indices of the client pool and of the central test set.
    feature_scaler, target_scaler : StandardScaler
        Fitted on the pool rows (``target_scaler.inverse_transform`` gives rupees).
    source : str
        Where the table came from.
    """

    features: np.ndarray
    target: np.ndarray
    income: np.ndarray
    brackets: np.ndarray
    keys: np.ndarray
    pool: np.ndarray
    central: np.ndarray
    feature_scaler: StandardScaler
    target_scaler: StandardScaler
    source: str


def encode_features(frame: pd.DataFrame) -> np.ndarray:
    """The 26 ``FEATURES`` as ``float64 (N, 26)``; categories as their index in the
    schema's sorted category list (Professional 0, Retired 1, Self_Employed 2,
    Student 3; Tier_1 0, Tier_2 1, Tier_3 2)."""
    columns = []
    for name in FEATURES:
        if name in CATEGORIES:
            codes = {value: code for code, value in enumerate(CATEGORIES[name])}
            columns.append(frame[name].map(codes).to_numpy(dtype=np.float64))
        else:
            columns.append(frame[name].to_numpy(dtype=np.float64))
    return np.stack(columns, axis=1)


def central_split(
    num_rows: int, central_test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of ``range(num_rows)`` into sorted (pool, central test) indices.

    The central test set gets ``round(fraction * N)`` rows, at least one, and the pool
    keeps at least one.
    """
    order = np.random.default_rng([seed, CENTRAL_STREAM]).permutation(num_rows)
    num_central = min(max(round(central_test_fraction * num_rows), 1), num_rows - 1)
    return np.sort(order[num_central:]), np.sort(order[:num_central])


def income_brackets(income: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Quartile (0-3) of each income among ``reference`` incomes.

    Bracket 0 is below the 25th percentile, 3 at or above the 75th.
    """
    quartiles = np.quantile(reference, [0.25, 0.5, 0.75])
    return np.searchsorted(quartiles, income, side="right").astype(np.int64)


def partition_keys(frame: pd.DataFrame, brackets: np.ndarray) -> np.ndarray:
    """The SmartFedProx study's partition key: ``(occupation * 3 + city_tier) * 4 + bracket``,
    0-47."""
    occupation = frame["Occupation"].map({v: i for i, v in enumerate(OCCUPATIONS)})
    tier = frame["City_Tier"].map({v: i for i, v in enumerate(CITY_TIERS)})
    groups = occupation.to_numpy(np.int64) * len(CITY_TIERS) + tier.to_numpy(np.int64)
    return groups * NUM_BRACKETS + brackets


def prepare(
    frame: pd.DataFrame, seed: int, central_test_fraction: float, source: str = ""
) -> PreparedData:
    """Split off the central test set, encode, standardise (fitted on the pool only)
    and compute partition keys. Pure: the same inputs give the same arrays."""
    if len(frame) < 2:
        raise ConfigError(f"'{DATA_PATH_KEY}': the table needs at least 2 rows, has {len(frame)}")
    pool, central = central_split(len(frame), central_test_fraction, seed)
    raw = encode_features(frame)
    target = frame[TARGET].to_numpy(np.float64).reshape(-1, 1)
    feature_scaler = StandardScaler().fit(raw[pool])
    target_scaler = StandardScaler().fit(target[pool])
    income = frame["Income"].to_numpy(np.float64)
    brackets = income_brackets(income, income[pool])
    return PreparedData(
        features=feature_scaler.transform(raw).astype(np.float32),
        target=target_scaler.transform(target).ravel().astype(np.float32),
        income=income,
        brackets=brackets,
        keys=partition_keys(frame, brackets),
        pool=pool,
        central=central,
        feature_scaler=feature_scaler,
        target_scaler=target_scaler,
        source=source,
    )


@lru_cache(maxsize=8)
def prepared_data(
    data_path: str, synthetic_rows: int, seed: int, central_test_fraction: float
) -> PreparedData:
    """``prepare`` of ``load_table`` (cached per process)."""
    table = load_table(data_path, synthetic_rows, seed)
    return prepare(table.frame, seed, central_test_fraction, table.source)
