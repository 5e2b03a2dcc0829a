"""MovieLens-1M ratings: ``ratings.dat`` loading, a synthetic twin, the NCF splits.

Subspace-DP-FL lists
"MovieLens-1M Recommendations: Neural Collaborative Filtering (NCF), per-user
personalized datasets, AUC-based evaluation". The real data is GroupLens's
``ratings.dat`` (lines ``UserID::MovieID::Rating::Timestamp``); it cannot be
downloaded here, so ``movielens.data-path`` names a local copy. When it is empty,
``generate_synthetic`` draws ratings with user/item latent structure from the run
seed.

Design notes: ``docs/notes.md``, ``tasks.movielens.data``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from config.options import ConfigError

logger = logging.getLogger(__name__)

DATA_PATH_KEY = "movielens.data-path"
RATINGS_FILE = "ratings.dat"
LINE_FORMAT = "UserID::MovieID::Rating::Timestamp (non-negative integers, rating 1-5)"
LINE_PATTERN = re.compile(r"(\d+)::(\d+)::(\d+)::(\d+)")
MIN_RATING, MAX_RATING = 1, 5
EVAL_NEGATIVES = 99  # sampled negatives per held-out positive (NCF's protocol)

# Synthetic twin: shape of ML-1M, scaled down.
MIN_RATINGS = 20  # every ML-1M user rated at least 20 movies
LATENT_DIM = 8
COUNT_SHAPE = 1.5  # Lomax (Pareto II) shape of the per-user rating counts
POPULARITY_EXPONENT = 0.8  # Zipf-like item popularity
SELECTION_STRENGTH = 1.0  # users pick items they like (exp(strength * affinity))
AFFINITY_SCALE, RATING_OFFSET, RATING_NOISE = 1.5, -0.3, 0.5  # ~58 % positives (ML-1M: 57 %)
FIRST_TIMESTAMP, TIMESTAMP_SPAN = 956_703_932, 3 * 365 * 86_400  # ML-1M's first rating

# Interaction roles after the leave-one-out split.
NOT_POSITIVE, TRAIN, LOCAL_TEST, CENTRAL_TEST = -1, 0, 1, 2
EVAL_STREAM = 0xE7A1  # seed stream of the evaluation negatives


@dataclass(frozen=True)
class Ratings:
    """Explicit ratings with dense ids.

    Attributes
    ----------
    users, items : numpy.ndarray
        ``int64 (N,)`` dense indices ``0..num_users-1`` and ``0..num_items-1``.
    ratings, timestamps : numpy.ndarray
        ``int64 (N,)``, as in the file.
    user_ids, item_ids : numpy.ndarray
        ``int64``: the file's UserID of each dense user (``user_ids[users]`` gives the
        original column), likewise MovieID; sorted.
    source : str
        The file path, or ``"synthetic (seed S, U users, I items)"``.
    """

    users: np.ndarray
    items: np.ndarray
    ratings: np.ndarray
    timestamps: np.ndarray
    user_ids: np.ndarray
    item_ids: np.ndarray
    source: str

    @property
    def num_users(self) -> int:
        """Distinct users."""
        return len(self.user_ids)

    @property
    def num_items(self) -> int:
        """Distinct items (movies) that were rated at least once."""
        return len(self.item_ids)

    def __len__(self) -> int:
        return len(self.users)


def describe_source(data_path: str, num_users: int, num_items: int, seed: int) -> str:
    """The data-source line the app logs: the file path, or the synthetic recipe."""
    if data_path:
        return str(ratings_file(data_path))
    return f"synthetic (seed {seed}, {num_users} users, {num_items} items)"


def ratings_file(data_path: str) -> Path:
    """``data_path`` resolved; a directory means its ``ratings.dat``."""
    path = Path(data_path).expanduser().resolve()
    return path / RATINGS_FILE if path.is_dir() else path


def read_ratings(data_path: str) -> Ratings:
    """Parse a ``ratings.dat`` file (or the one in directory ``data_path``).

    Raises
    ------
    ConfigError
        Naming ``movielens.data-path`` and the file: missing or unreadable file, no
        ratings, a malformed line (with its number and the expected format), a rating
        outside 1-5, or a (user, movie) pair rated twice.
    """
    path = ratings_file(data_path)
    try:
        text = path.read_text(encoding="latin-1")
    except FileNotFoundError:
        raise ConfigError(f"'{DATA_PATH_KEY}' = {str(path)!r}: no such file") from None
    except OSError as err:
        raise ConfigError(f"'{DATA_PATH_KEY}' = {str(path)!r}: cannot read it ({err})") from err
    raw = parse_lines(text, str(path))
    return dense_ratings(raw, str(path))


def parse_lines(text: str, path: str) -> np.ndarray:
    """The ``(N, 4)`` int64 columns of ``ratings.dat`` text; blank lines are skipped."""
    rows, numbers = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        match = LINE_PATTERN.fullmatch(line)
        if match is None:
            raise ConfigError(
                f"'{DATA_PATH_KEY}' = {path!r}: line {number} is malformed ({line[:60]!r}); "
                f"expected {LINE_FORMAT}"
            )
        rows.append(match.groups())
        numbers.append(number)
    if not rows:
        raise ConfigError(f"'{DATA_PATH_KEY}' = {path!r}: the file has no ratings")
    raw = np.array(rows, dtype=np.int64)
    bad = np.flatnonzero((raw[:, 2] < MIN_RATING) | (raw[:, 2] > MAX_RATING))
    if len(bad):
        raise ConfigError(
            f"'{DATA_PATH_KEY}' = {path!r}: line {numbers[bad[0]]} has rating "
            f"{raw[bad[0], 2]}; expected {LINE_FORMAT}"
        )
    _check_unique_pairs(raw, np.asarray(numbers), path)
    return raw


def _check_unique_pairs(raw: np.ndarray, numbers: np.ndarray, path: str) -> None:
    """Raise ConfigError if some user rated the same movie twice."""
    _, first, counts = np.unique(raw[:, :2], axis=0, return_index=True, return_counts=True)
    if np.all(counts == 1):
        return
    pair = raw[first[np.argmax(counts > 1)], :2]
    lines = numbers[np.all(raw[:, :2] == pair, axis=1)]
    raise ConfigError(
        f"'{DATA_PATH_KEY}' = {path!r}: user {pair[0]} rated movie {pair[1]} more than "
        f"once (lines {lines.tolist()})"
    )


def dense_ratings(raw: np.ndarray, source: str) -> Ratings:
    """``Ratings`` of ``(N, 4)`` columns, ids mapped to dense indices."""
    user_ids, users = np.unique(raw[:, 0], return_inverse=True)
    item_ids, items = np.unique(raw[:, 1], return_inverse=True)
    return Ratings(
        users=users.astype(np.int64),
        items=items.astype(np.int64),
        ratings=raw[:, 2].copy(),
        timestamps=raw[:, 3].copy(),
        user_ids=user_ids,
        item_ids=item_ids,
        source=source,
    )


# --- synthetic twin -----------------------------------------------------------------


def generate_synthetic(num_users: int, num_items: int, seed: int) -> Ratings:
    """Ratings with latent structure, drawn from ``default_rng(seed)``.

    Users and items have latent factors ``p_u, q_i ~ N(0, I / sqrt(8))`` in 8
    dimensions (so the affinity ``<p_u, q_i>`` has unit variance) and biases. User
    ``u`` rates ``20 + floor(20 * Lomax(1.5))`` items (at most half the catalogue),
    chosen without replacement with probability proportional to a Zipf-like item
    popularity times ``exp(<p_u, q_i>)`` (Gumbel top-k); the rating is
    ``1 + floor(5 * sigmoid(1.5 <p_u, q_i> + b_u + b_i - 0.3 + noise))``, in 1..5, with
    biases and noise ``N(0, 0.5^2)`` (about 58 % of ratings are >= 4, as in ML-1M).
    Timestamps are uniform over three years from ML-1M's first rating. Ids are
    1-based, as in ML-1M.
    """
    if num_users < 1:
        raise ValueError(f"num_users must be >= 1, got {num_users}")
    if num_items < 2 * MIN_RATINGS:
        raise ValueError(f"num_items must be >= {2 * MIN_RATINGS}, got {num_items}")
    rng = np.random.default_rng(seed)
    scale = LATENT_DIM**-0.25
    user_factors = rng.normal(0.0, scale, (num_users, LATENT_DIM))
    item_factors = rng.normal(0.0, scale, (num_items, LATENT_DIM))
    affinity = user_factors @ item_factors.T
    counts = MIN_RATINGS + np.floor(MIN_RATINGS * rng.pareto(COUNT_SHAPE, num_users))
    counts = np.minimum(counts, num_items // 2).astype(np.int64)
    popularity = (1.0 + rng.permutation(num_items)) ** -POPULARITY_EXPONENT
    keys = np.log(popularity) + SELECTION_STRENGTH * affinity + rng.gumbel(size=affinity.shape)
    order = np.argsort(-keys, axis=1)
    chosen = np.arange(num_items)[None, :] < counts[:, None]  # top counts[u] of each row
    users = np.repeat(np.arange(num_users), counts)
    items = order[chosen]
    noise = rng.normal(0.0, RATING_NOISE, len(users))
    user_bias, item_bias = rng.normal(0.0, 0.5, num_users), rng.normal(0.0, 0.5, num_items)
    logit = AFFINITY_SCALE * affinity[users, items] + user_bias[users] + item_bias[items]
    score = 1.0 / (1.0 + np.exp(-(logit + RATING_OFFSET + noise)))
    ratings = np.minimum(1 + np.floor(5 * score), MAX_RATING).astype(np.int64)
    timestamps = FIRST_TIMESTAMP + rng.integers(0, TIMESTAMP_SPAN, len(users))
    return Ratings(
        users=users.astype(np.int64),
        items=items.astype(np.int64),
        ratings=ratings,
        timestamps=timestamps.astype(np.int64),
        user_ids=np.arange(1, num_users + 1, dtype=np.int64),
        item_ids=np.arange(1, num_items + 1, dtype=np.int64),  # even an unrated item
        source=describe_source("", num_users, num_items, seed),
    )


@lru_cache(maxsize=8)
def load_ratings(data_path: str, synthetic_users: int, synthetic_items: int, seed: int) -> Ratings:
    """Read ``data_path``, or generate the synthetic ratings when it is empty (cached)."""
    if data_path:
        ratings = read_ratings(data_path)
    else:
        ratings = generate_synthetic(synthetic_users, synthetic_items, seed)
    logger.info("movielens data source: %s (%d ratings)", ratings.source, len(ratings))
    return ratings


# --- NCF splits ---------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedRatings:
    """Ratings with the leave-one-out roles and the evaluation negatives.

    Attributes
    ----------
    ratings : Ratings
        The data.
    role : numpy.ndarray
        ``int64 (N,)``: ``TRAIN``, ``LOCAL_TEST``, ``CENTRAL_TEST`` for
        positives, ``NOT_POSITIVE`` for ratings below the threshold.
    rated_keys : numpy.ndarray
        Sorted ``int64`` keys ``user * num_items + item`` of every rating.
    heldout : numpy.ndarray
        Sorted indices of the local- and central-test interactions.
    heldout_negatives : numpy.ndarray
        ``int64 (len(heldout), 99)``: distinct never-rated items per held-out row.
    by_user, user_bounds : numpy.ndarray
        Interaction indices sorted by user, and where each user's run starts: user
        ``u``'s ratings are ``by_user[user_bounds[u] : user_bounds[u + 1]]``.
    """

    ratings: Ratings
    role: np.ndarray
    rated_keys: np.ndarray
    heldout: np.ndarray
    heldout_negatives: np.ndarray
    by_user: np.ndarray
    user_bounds: np.ndarray

    def rows_of(self, users: np.ndarray) -> np.ndarray:
        """Sorted indices of every rating of ``users``."""
        runs = [self.by_user[self.user_bounds[u] : self.user_bounds[u + 1]] for u in users]
        return np.sort(np.concatenate(runs)) if runs else np.empty(0, dtype=np.int64)


def leave_one_out(users: np.ndarray, timestamps: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """Each interaction's role: per user, the latest positive is the central test
    (>= 2 positives), the second latest the local test (>= 3 positives), other
    positives train; ties in time are ordered by position."""
    role = np.full(len(users), NOT_POSITIVE, dtype=np.int64)
    index = np.flatnonzero(positive)
    index = index[np.lexsort((index, timestamps[index], users[index]))]
    owner = users[index]
    _, starts, counts = np.unique(owner, return_index=True, return_counts=True)
    count = np.repeat(counts, counts)
    from_end = count - 1 - (np.arange(len(index)) - np.repeat(starts, counts))
    role[index] = TRAIN
    role[index[(from_end == 0) & (count >= 2)]] = CENTRAL_TEST
    role[index[(from_end == 1) & (count >= 3)]] = LOCAL_TEST
    return role


def rated_mask(
    rated_keys: np.ndarray, num_items: int, users: np.ndarray, items: np.ndarray
) -> np.ndarray:
    """Whether each (user, item) pair (same shapes) is among the sorted ``rated_keys``."""
    keys = users * num_items + items
    if len(rated_keys) == 0:
        return np.zeros(keys.shape, dtype=bool)
    found = np.minimum(np.searchsorted(rated_keys, keys), len(rated_keys) - 1)
    return rated_keys[found] == keys


def sample_negatives(
    users: np.ndarray,
    rated_keys: np.ndarray,
    num_items: int,
    k: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """``(len(users), k)`` items each user never rated, uniform with replacement
    (rejection sampling, as NCF).

    Raises
    ------
    ValueError
        If some user in ``users`` rated every item (nothing to sample).
    """
    rated_per_user = np.unique(rated_keys // num_items, return_counts=True)
    full = rated_per_user[0][rated_per_user[1] >= num_items]
    if np.isin(users, full).any():
        raise ValueError(f"users {np.intersect1d(users, full).tolist()} rated every item")
    negatives = rng.integers(num_items, size=(len(users), k))
    owners = np.broadcast_to(users[:, None], negatives.shape)
    redraw = rated_mask(rated_keys, num_items, owners, negatives)
    while redraw.any():
        negatives[redraw] = rng.integers(num_items, size=int(redraw.sum()))
        redraw[redraw] = rated_mask(rated_keys, num_items, owners[redraw], negatives[redraw])
    return negatives


def distinct_negatives(
    rated_items: np.ndarray, num_items: int, k: int, rng: np.random.Generator
) -> np.ndarray:
    """``k`` distinct items not in the sorted ``rated_items``, uniformly at random.

    The j-th unrated item is ``j + #{rated r : r - rank(r) <= j}``.
    """
    below = rated_items - np.arange(len(rated_items))  # unrated items below each rated one
    picks = rng.choice(num_items - len(rated_items), size=k, replace=False)
    return picks + np.searchsorted(below, picks, side="right")


def evaluation_negatives(
    ratings: Ratings, rated_keys: np.ndarray, heldout: np.ndarray, seed: int
) -> np.ndarray:
    """``EVAL_NEGATIVES`` distinct never-rated items for each held-out row."""
    rng = np.random.default_rng([seed, EVAL_STREAM])
    bounds = np.searchsorted(rated_keys, np.arange(ratings.num_users + 1) * ratings.num_items)
    negatives = np.empty((len(heldout), EVAL_NEGATIVES), dtype=np.int64)
    for row, user in enumerate(ratings.users[heldout]):
        rated = rated_keys[bounds[user] : bounds[user + 1]] - user * ratings.num_items
        negatives[row] = distinct_negatives(rated, ratings.num_items, EVAL_NEGATIVES, rng)
    return negatives


def check_unrated_room(ratings: Ratings, rated_keys: np.ndarray) -> None:
    """Raise ConfigError if a user leaves fewer than 99 items unrated."""
    per_user = np.bincount(ratings.users, minlength=ratings.num_users)
    worst = int(np.argmax(per_user))
    if ratings.num_items - per_user[worst] < EVAL_NEGATIVES:
        raise ConfigError(
            f"'{DATA_PATH_KEY}' = {ratings.source!r}: user {ratings.user_ids[worst]} rated "
            f"{per_user[worst]} of the {ratings.num_items} movies; NCF's evaluation needs "
            f"at least {EVAL_NEGATIVES} movies each user has not rated"
        )


def prepare(ratings: Ratings, positive_threshold: int, seed: int) -> PreparedRatings:
    """Leave-one-out roles and seeded evaluation negatives of ``ratings``. Pure."""
    rated_keys = np.sort(ratings.users * ratings.num_items + ratings.items)
    check_unrated_room(ratings, rated_keys)
    role = leave_one_out(ratings.users, ratings.timestamps, ratings.ratings >= positive_threshold)
    heldout = np.flatnonzero(role >= LOCAL_TEST)
    negatives = evaluation_negatives(ratings, rated_keys, heldout, seed)
    by_user = np.argsort(ratings.users, kind="stable")
    bounds = np.searchsorted(ratings.users[by_user], np.arange(ratings.num_users + 1))
    return PreparedRatings(ratings, role, rated_keys, heldout, negatives, by_user, bounds)


@lru_cache(maxsize=8)
def prepared_ratings(
    data_path: str, synthetic_users: int, synthetic_items: int, seed: int, threshold: int
) -> PreparedRatings:
    """``prepare`` of ``load_ratings`` (cached per process)."""
    return prepare(
        load_ratings(data_path, synthetic_users, synthetic_items, seed), threshold, seed
    )
