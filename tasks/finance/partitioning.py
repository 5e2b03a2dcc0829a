"""The SmartFedProx study's three non-IID partitionings of the finance pool (section 4.3),
composable, disjoint and deterministic.

Written by hand: flwr-datasets has no partitioner that combines key groups, an
income filter by partition parity and per-client size factors.

Run-config ``finance.partitioning``: ``iid`` or a ``+``-joined combination of

Design notes: ``docs/notes.md``, ``tasks.finance.partitioning``.
"""

from __future__ import annotations

import numpy as np

from config.options import ConfigError

PARTITIONING_KEY = "finance.partitioning"
IID = "iid"
PARTS = ("multi-key", "label-skew", "quantity-skew")
PRIMARY_SHARE = 0.7
QUANTITY_RANGE = (0.5, 1.3)
HIGH_INCOME_BRACKETS = (1, 2, 3)  # odd partition ids: at or above the 25th percentile
LOW_INCOME_BRACKETS = (0, 1, 2)  # even partition ids: below the 75th percentile
MIN_PARTITION_ROWS = 10

Source = tuple[np.ndarray, float]  # (cell ids, share of the client's rows)


def parse_scheme(text: str) -> tuple[str, ...]:
    """The parts of a ``finance.partitioning`` value, in ``PARTS`` order.

    ``"iid"`` gives ``()``; ``"quantity-skew+multi-key"`` gives
    ``("multi-key", "quantity-skew")``.

    Raises
    ------
    ConfigError
        Naming the key and the valid parts, for an unknown, repeated or empty part,
        or ``iid`` combined with another part.
    """
    if text == IID:
        return ()
    parts = [part.strip() for part in text.split("+")]
    unknown = [part for part in parts if part not in PARTS]
    repeated = sorted({part for part in parts if parts.count(part) > 1})
    if unknown or repeated:
        problem = f"unknown parts {unknown}" if unknown else f"repeated parts {repeated}"
        raise ConfigError(
            f"'{PARTITIONING_KEY}' = {text!r} is not valid ({problem}); valid values: "
            f"'{IID}' or a '+'-joined combination of " + ", ".join(repr(p) for p in PARTS)
        )
    return tuple(part for part in PARTS if part in parts)


def quantity_factors(num_partitions: int, rng: np.random.Generator) -> np.ndarray:
    """``linspace(0.5, 1.3, K)`` in a random order: client ``k``'s size factor."""
    return rng.permutation(np.linspace(*QUANTITY_RANGE, num_partitions))


def eligible_brackets(partition_id: int) -> tuple[int, ...]:
    """Income quartiles a client may draw under ``label-skew`` (by id parity)."""
    return HIGH_INCOME_BRACKETS if partition_id % 2 else LOW_INCOME_BRACKETS


def cell_brackets(cells: np.ndarray, brackets: np.ndarray, num_cells: int) -> np.ndarray:
    """The income quartile of each cell (-1 for an empty cell).

    Raises
    ------
    ValueError
        If a cell mixes quartiles (a key must determine its income bracket).
    """
    out = np.full(num_cells, -1, dtype=np.int64)
    out[cells] = brackets
    if np.any(out[cells] != brackets):
        raise ValueError("every key group must lie in a single income bracket")
    return out


def assign_key_groups(
    sizes: np.ndarray,
    eligible: list[np.ndarray],
    factors: np.ndarray,
    rng: np.random.Generator,
) -> list[tuple[int, int]]:
    """Greedy (primary, secondary) key groups of each client, balancing demand.

    Parameters
    ----------
    sizes : numpy.ndarray
        Rows of each cell (key group).
    eligible : list of numpy.ndarray
        The cells each client may draw from.
    factors : numpy.ndarray
        Size factor of each client.
    rng : numpy.random.Generator
        Tie-breaking order of the cells.

    Returns
    -------
    list of (int, int)
        Per client, its primary and secondary cell (equal if only one is eligible).
    """
    tie_break = rng.permutation(len(sizes))
    demand = np.zeros(len(sizes))
    chosen: list[list[int]] = [[] for _ in factors]
    for k in sorted(range(len(factors)), key=lambda k: (-factors[k], k)):
        for share in (PRIMARY_SHARE, 1.0 - PRIMARY_SHARE):
            candidates = (
                np.setdiff1d(eligible[k], chosen[k]) if len(eligible[k]) > 1 else eligible[k]
            )
            want = share * factors[k]
            room = sizes[candidates] / (demand[candidates] + want)
            best = int(candidates[np.lexsort((tie_break[candidates], -room))[0]])
            demand[best] += want
            chosen[k].append(best)
    return [(pair[0], pair[1]) for pair in chosen]


def client_sources(
    cells: np.ndarray,
    brackets: np.ndarray,
    num_cells: int,
    scheme: tuple[str, ...],
    factors: np.ndarray,
    rng: np.random.Generator,
) -> list[list[Source]]:
    """Each client's sources: (cells, share) pairs, step 2 of the module algorithm."""
    sizes = np.bincount(cells, minlength=num_cells)
    nonempty = np.flatnonzero(sizes)
    eligible = [nonempty] * len(factors)
    if "label-skew" in scheme:
        bracket_of = cell_brackets(cells, brackets, num_cells)
        eligible = [nonempty[np.isin(bracket_of[nonempty], eligible_brackets(k))]
                    for k in range(len(factors))]  # fmt: skip
        for k, allowed in enumerate(eligible):
            if len(allowed) == 0:
                raise ConfigError(
                    f"'{PARTITIONING_KEY}': no rows in income quartiles "
                    f"{[b + 1 for b in eligible_brackets(k)]} for partition {k}"
                )
    if "multi-key" not in scheme:
        return [[(allowed, 1.0)] for allowed in eligible]
    pairs = assign_key_groups(sizes.astype(np.float64), eligible, factors, rng)
    return [
        [(np.array([p]), PRIMARY_SHARE), (np.array([s]), 1.0 - PRIMARY_SHARE)]
        if p != s
        else [(np.array([p]), 1.0)]
        for p, s in pairs
    ]


def claim_counts(
    sizes: np.ndarray, sources: list[list[Source]], factors: np.ndarray
) -> list[dict[int, int]]:
    """Rows each client takes from each cell, step 3 of the module algorithm.

    Returns
    -------
    list of dict
        Per client, ``{cell: rows}``; no cell is asked for more rows than it has.
    """
    load = np.zeros(len(sizes))
    for k, client in enumerate(sources):
        for source_cells, share in client:
            load[source_cells] += share * factors[k] / sizes[source_cells].sum()
    scale = 1.0 / load.max()
    counts: list[dict[int, int]] = []
    for k, client in enumerate(sources):
        wanted: dict[int, int] = {}
        for source_cells, share in client:
            rows = scale * share * factors[k] * sizes[source_cells] / sizes[source_cells].sum()
            for cell, count in zip(source_cells, np.floor(rows + 1e-9).astype(int), strict=True):
                wanted[int(cell)] = wanted.get(int(cell), 0) + int(count)
        counts.append(wanted)
    _trim_oversubscribed(sizes, counts)
    return counts


def _trim_oversubscribed(sizes: np.ndarray, counts: list[dict[int, int]]) -> None:
    """Guard against float rounding: take rows back from the largest claims of a cell
    until it is not over-subscribed (a no-op in exact arithmetic)."""
    for cell in range(len(sizes)):
        claims = [c for c in counts if c.get(cell, 0) > 0]
        while sum(c[cell] for c in claims) > sizes[cell]:
            max(claims, key=lambda c: c[cell])[cell] -= 1


def hand_out(
    cells: np.ndarray, counts: list[dict[int, int]], rng: np.random.Generator
) -> list[np.ndarray]:
    """Shuffle each cell's rows and give consecutive slices to the clients in order."""
    taken: list[list[np.ndarray]] = [[] for _ in counts]
    for cell in np.unique(cells):
        rows = rng.permutation(np.flatnonzero(cells == cell))
        start = 0
        for k, wanted in enumerate(counts):
            count = wanted.get(int(cell), 0)
            taken[k].append(rows[start : start + count])
            start += count
    return [np.sort(np.concatenate(parts)).astype(np.int64) for parts in taken]


def partition_rows(
    keys: np.ndarray,
    brackets: np.ndarray,
    num_partitions: int,
    scheme: tuple[str, ...],
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Split rows among ``num_partitions`` clients by ``scheme`` (module docstring).

    Parameters
    ----------
    keys : numpy.ndarray
        Non-negative int key group of each row (Occupation x City_Tier x quartile).
    brackets : numpy.ndarray
        Income quartile (0-3) of each row; a key group must lie in one quartile.
    num_partitions : int
        Number of clients ``K``.
    scheme : tuple of str
        Parts from ``parse_scheme`` (``()`` for iid).
    rng : numpy.random.Generator
        Every random choice (factors, tie-breaks, shuffles) draws from it.

    Returns
    -------
    list of numpy.ndarray
        Sorted, disjoint row positions of each client.

    Raises
    ------
    ConfigError
        If a client would get fewer than ``MIN_PARTITION_ROWS`` rows.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    keys, brackets = np.asarray(keys, np.int64), np.asarray(brackets, np.int64)
    if "multi-key" in scheme:
        cells = keys
    elif "label-skew" in scheme:
        cells = brackets
    else:
        cells = np.zeros(len(keys), dtype=np.int64)
    num_cells = int(cells.max()) + 1 if len(cells) else 1
    if "quantity-skew" in scheme:
        factors = quantity_factors(num_partitions, rng)
    else:
        factors = np.ones(num_partitions)
    sources = client_sources(cells, brackets, num_cells, scheme, factors, rng)
    counts = claim_counts(np.bincount(cells, minlength=num_cells), sources, factors)
    parts = hand_out(cells, counts, rng)
    _check_sizes(parts, len(keys), scheme)
    return parts


def _check_sizes(parts: list[np.ndarray], num_rows: int, scheme: tuple[str, ...]) -> None:
    """Raise ConfigError if a client got fewer than ``MIN_PARTITION_ROWS`` rows."""
    sizes = [len(part) for part in parts]
    smallest = int(np.argmin(sizes))
    if sizes[smallest] < MIN_PARTITION_ROWS:
        name = "+".join(scheme) or IID
        raise ConfigError(
            f"'{PARTITIONING_KEY}' = {name!r} leaves partition {smallest} only "
            f"{sizes[smallest]} rows (minimum {MIN_PARTITION_ROWS}) when {num_rows} pool "
            f"rows are split among {len(parts)} partitions; use fewer partitions, more "
            "rows ('finance.synthetic-rows' or a larger 'finance.data-path' file) or a "
            f"milder partitioning (e.g. {IID!r})"
        )


def split_local(
    num_rows: int, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(num_rows)`` into sorted local train and test positions.

    The test split gets ``round(test_fraction * n)`` rows, clamped so that both splits
    are non-empty whenever ``n >= 2``.
    """
    order = rng.permutation(num_rows)
    if num_rows < 2:
        return np.sort(order), np.empty(0, dtype=np.int64)
    num_test = min(max(round(test_fraction * num_rows), 1), num_rows - 1)
    return np.sort(order[num_test:]), np.sort(order[:num_test])
