"""The participation schemas of the correlated-noise mechanisms (banded MF, DP-FTRL).

Their run-config keys (``correlated.*``); the :class:`Plan` fixed from the first
round's nodes (b groups, k participations, the strategy matrix and its sensitivity),
with the cohort it allows in each round and the releases the ledger is charged; the
one-line refusals when the federation cannot provide the schema. The mechanism that
uses it: :class:`strategies.mechanisms.correlated_noise.CorrelatedNoiseDP`.

Design notes: ``docs/notes.md``, ``strategies.mechanisms.correlated_noise``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from config.settings import Choice, Settings, SettingsError, setting
from privacy import correlated
from privacy.accounting import Release
from privacy.events import AccountingError
from strategies.errors import StopTraining
from strategies.mechanisms.base import DATA_DEPENDENT_SELECTION, DPSettings
from strategies.runtime.partitions import PartitionMap, poisson_sample
from strategies.secure.secagg_plus import SecAggSettings

MECHANISMS = ("banded-mf", "dp-ftrl")
SCHEMAS = ("cyclic", "amplified")
SEPARATION_CHOICES = ("given", "least-error")


@dataclass(frozen=True)
class CorrelatedSettings(Settings):
    """The correlated-noise mechanisms' run-config keys (``correlated.*``)."""

    PREFIX: ClassVar[str] = "correlated"
    schema: str = setting(
        "cyclic",
        "Participation schema the server enforces (banded-mf, dp-ftrl): `cyclic` (b "
        "fixed cohorts of dp.num-sampled-clients, each client at most once every b "
        "rounds, no amplification) or `amplified` (banded-mf: Poisson sampling within "
        "the round's group of b).",
        choices=SCHEMAS,
    )
    min_separation: int = setting(
        0,
        "b: groups of the population and the minimum separation of a client's rounds "
        "(0: N // dp.num-sampled-clients at round 1).",
        low=0,
    )
    bands: int = setting(
        0,
        "banded-mf: bands of the strategy matrix, at most the separation (0: the "
        "separation, capped at the rounds).",
        low=0,
    )
    restart_every: int = setting(
        0,
        "dp-ftrl: a fresh tree every r rounds (0: one tree over the run).",
        low=0,
    )
    choose_separation: str = setting(
        "given",
        "How b is set: `given` (correlated.min-separation) or `least-error` (amplified "
        "banded-mf: the b in 1..N // m with the least error of the released models at "
        "dp.target-epsilon, from public quantities only; recorded in the ledger).",
        choices=SEPARATION_CHOICES,
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """What the correlated-noise mechanisms cannot run or account for."""
        if choice.privacy not in MECHANISMS:
            return
        dp, corr = choice.part(DPSettings), choice.part(CorrelatedSettings)
        if SecAggSettings.on_in(choice) or dp.noise_site != "server":
            raise SettingsError(
                f"'privacy' = {choice.privacy!r} adds its noise at the server: it needs "
                "'dp.noise-site' = 'server' and 'secagg.enabled' = false"
            )
        if choice.strategy in DATA_DEPENDENT_SELECTION:
            raise SettingsError(
                f"'privacy' = {choice.privacy!r} enforces its own participation schema; "
                f"'strategy' = {choice.strategy!r} selects clients by their data"
            )
        if choice.privacy == "dp-ftrl" and corr.schema == "amplified":
            raise SettingsError(
                "'correlated.schema' = 'amplified' is banded MF's; 'privacy' = 'dp-ftrl' "
                "takes 'cyclic'"
            )
        given, target = float(dp.noise_multiplier), float(dp.target_epsilon)
        if bool(given) == bool(target):
            raise SettingsError(
                f"'privacy' = {choice.privacy!r} needs exactly one of "
                f"'dp.noise-multiplier' (> 0) and 'dp.target-epsilon' (> 0), got "
                f"{given:g} and {target:g}"
            )
        if corr.choose_separation == "least-error":
            _check_least_error(choice.privacy, corr, target)
        bands, separation = corr.bands, corr.min_separation
        if bands and separation and bands > separation:
            raise SettingsError(
                f"'correlated.bands' = {bands} exceeds 'correlated.min-separation' = "
                f"{separation}: valid values 1..{separation} (or 0: the separation)"
            )


def _check_least_error(privacy: str, corr: CorrelatedSettings, target: float) -> None:
    """What ``correlated.choose-separation = 'least-error'`` needs."""
    key = "'correlated.choose-separation' = 'least-error'"
    if privacy != "banded-mf" or corr.schema != "amplified":
        raise SettingsError(
            f"{key} chooses the amplified schema's b: it needs 'privacy' = 'banded-mf' and "
            f"'correlated.schema' = 'amplified' (got {privacy!r}, {corr.schema!r}); "
            "valid values otherwise: 'given'"
        )
    if not target:
        raise SettingsError(f"{key} weighs the error at 'dp.target-epsilon': set it (> 0)")
    if corr.min_separation:
        raise SettingsError(
            f"{key} chooses b itself: 'correlated.min-separation' must be 0, got "
            f"{corr.min_separation}"
        )


def group_of(partitions: PartitionMap, node: int, separation: int, mechanism: str) -> int:
    """The group (partition id mod b) of ``node``; StopTraining if it has no partition."""
    partition = partitions.partition_of(node)
    if partition is None:
        raise StopTraining(
            f"'privacy' = {mechanism!r}: node {node} reported no partition id; the "
            "participation schema assigns clients to groups by it"
        )
    return partition % separation


@dataclass(frozen=True)
class Plan:
    """The run's schema, factorization and sensitivity, fixed at the first round."""

    schema: str
    separation: int  # b: groups, and the least gap between a client's rounds
    participations: int  # k = ceil(n / b)
    sensitivity: float  # of C for k participations (cyclic); max column norm (amplified)
    method: str  # how the sensitivity was obtained
    group_size: int  # the smallest group (amplified: the Poisson population)
    bands: int = 0  # banded MF
    coefs: tuple[float, ...] = ()
    workload: str = "prefix-sum"
    choice: str = "given"  # how b was set (correlated.choose-separation)
    sweep: tuple[tuple[int, float, float, float], ...] = ()  # least-error: (b, q, z, error)

    def cohort(
        self,
        server_round: int,
        nodes: list[int],
        partitions: PartitionMap,
        m: int,
        rng: np.random.Generator,
        mechanism: str,
    ) -> list[int]:
        """Round ``server_round``'s cohort from the connected ``nodes`` (partition
        order): the first m of group (t - 1) mod b (cyclic), or Poisson sampling with
        q = m / (smallest group) within it (amplified, the secret ``rng``)."""
        group = (server_round - 1) % self.separation
        members = [
            n for n in nodes if group_of(partitions, n, self.separation, mechanism) == group
        ]
        if self.schema == "amplified":
            return poisson_sample(members, m / self.group_size, rng, partitions)
        if len(members) < m:
            raise StopTraining(
                f"round {server_round}: group {group} has {len(members)} connected "
                f"clients, the cyclic cohort needs 'dp.num-sampled-clients' = {m}"
            )
        return members[:m]

    def releases(
        self, mechanism: str, z: float, server_round: int, m: int, charged: bool
    ) -> list[Release]:
        """What aggregating round ``server_round`` charges (``charged``: an earlier
        round was): the whole run at the first round (cyclic), one Poisson-sampled
        Gaussian at each block's start (amplified)."""
        if self.schema == "cyclic":
            return [] if charged else [self._whole_run(mechanism, z, server_round)]
        if (server_round - 1) % self.separation or charged:
            return []
        return [self._block(z, server_round, m)]

    def planned(self, mechanism: str, z: float, m: int) -> list[Release]:
        """The whole planned run with multiplier z (calibration)."""
        if self.schema == "cyclic":
            return [self._whole_run(mechanism, z, 1)]
        return [self._block(z, 1, m, count=self.participations)]

    def calibration_record(self, mechanism: str, m: int) -> dict[str, object]:
        """What the calibration record states about the plan."""
        return {
            "mechanism": mechanism,
            "schema": self.schema,
            "min-separation": self.separation,
            "participations": self.participations,
            "sensitivity": self.sensitivity,
            "sensitivity-method": self.method,
            "bands": self.bands,
            "workload": self.workload,
            "expected-clients": m,
            "separation-choice": self.choice,
            # least-error: every candidate b's (b, q, z, mean sq. error / C^2)
            "separation-sweep": [list(row) for row in self.sweep],
        }

    def _whole_run(self, mechanism: str, z: float, server_round: int) -> Release:
        return Release(
            server_round=server_round,
            kind="model-updates (whole run, correlated noise)",
            mechanism="gaussian",
            noise_multiplier=z / self.sensitivity,
            sampling="none",
            sample_size=1,
            population=1,
            note=(
                f"{mechanism}, schema cyclic: every client at most k = "
                f"{self.participations} times, >= {self.separation} rounds apart, no "
                f"amplification; sensitivity {self.sensitivity:.6g} ({self.method}) of the "
                f"strategy matrix for k participations; z = {z:.6g}; the whole run charged "
                "at its first round"
            ),
        )

    def _block(self, z: float, server_round: int, m: int, count: int = 1) -> Release:
        return Release(
            server_round=server_round,
            kind="model-updates (block of b rounds, correlated noise)",
            mechanism="gaussian",
            noise_multiplier=z / self.sensitivity,
            sampling="poisson",
            sample_size=m,
            population=self.group_size,
            count=count,
            note=(
                f"banded-mf, schema amplified: b = {self.separation} groups "
                f"({'the least-error b' if self.choice == 'least-error' else 'given'}), Poisson "
                f"sampling within the round's group (q = {m}/{self.group_size}); a "
                "client's rounds are one per block of b, whose columns share no row "
                f"(bands {self.bands} <= b); max column norm {self.sensitivity:.6g}; "
                f"z = {z:.6g}"
            ),
        )


def make_plan(
    mechanism: str,
    schema: str,
    nodes: list[int],
    partitions: PartitionMap,
    *,
    rounds: int,
    m: int,
    min_separation: int = 0,
    bands: int = 0,
    restart_every: int | None = None,
    momentum: float = 0.0,
    choose: str = "given",
    target_epsilon: float | None = None,
    delta: float = 1e-5,
) -> Plan:
    """The plan for the connected ``nodes``, or StopTraining with the one-line reason
    the federation cannot provide the schema. ``choose`` "least-error" (amplified banded
    MF): b is the least-error one at ``target_epsilon`` (:func:`choose_separation`)."""
    population = len(nodes)
    sweep: tuple = ()
    if choose == "least-error":
        b, sweep = choose_separation(
            nodes, partitions, rounds=rounds, m=m, bands=bands, momentum=momentum,
            target_epsilon=target_epsilon, delta=delta, mechanism=mechanism,
        )  # fmt: skip
    else:
        b = min_separation or population // m
    if b < 1 or population < m * b:
        raise StopTraining(
            f"'correlated.schema' = {schema!r} needs {m} clients in each of "
            f"b = {max(b, 1)} groups ('dp.num-sampled-clients' x "
            f"'correlated.min-separation' = {m * max(b, 1)} nodes), only {population} "
            "connected"
        )
    sizes = [0] * b
    for node in nodes:
        sizes[group_of(partitions, node, b, mechanism)] += 1
    smallest = min(sizes)
    if smallest < m:
        raise StopTraining(
            f"'correlated.schema' = {schema!r}: the smallest of the b = {b} groups "
            f"(partition id mod {b}) has {smallest} clients, fewer than "
            f"'dp.num-sampled-clients' = {m}"
        )
    k = math.ceil(rounds / b)
    if mechanism == "dp-ftrl":
        sens = correlated.tree_sensitivity(
            rounds, participations=k, min_separation=b, restart_every=restart_every
        )
        return Plan(schema, b, k, sens, "tree-bound", smallest)
    bands = min(bands or b, rounds)
    if choose == "least-error":  # correlated.bands caps the chosen b's bands
        bands = min(bands, b)
    if bands > b:
        raise StopTraining(
            f"'correlated.bands' = {bands} exceeds the separation b = {b}: valid values 1..{b}"
        )
    factorization = correlated.optimize_banded(rounds, bands, momentum=momentum)
    strategy = factorization.strategy()
    if schema == "amplified":  # k Poisson-sampled Gaussians, one per block
        sens, method = float(np.max(np.linalg.norm(strategy, axis=0))), "max-column-norm"
    else:
        found = correlated.sensitivity(strategy, participations=k, min_separation=b)
        sens, method = found.value, found.method
    return Plan(
        schema, b, k, sens, method, smallest, bands, factorization.coefs,
        factorization.workload, choose, sweep,
    )  # fmt: skip


def choose_separation(
    nodes: list[int],
    partitions: PartitionMap,
    *,
    rounds: int,
    m: int,
    bands: int,
    momentum: float,
    target_epsilon: float | None,
    delta: float,
    mechanism: str,
) -> tuple[int, tuple[tuple[int, float, float, float], ...]]:
    """The amplified schema's least-error b among 1..N // m for the connected ``nodes``
    (each b's smallest group by partition id mod b), and the sweep; StopTraining in one
    line when no b is valid. Public inputs only: it costs no privacy."""
    key = "'correlated.choose-separation' = 'least-error'"
    if not target_epsilon:
        raise StopTraining(f"{key} needs 'dp.target-epsilon' (> 0)")
    sizes = {}
    for b in range(1, len(nodes) // m + 1):
        counts = [0] * b
        for node in nodes:
            counts[group_of(partitions, node, b, mechanism)] += 1
        sizes[b] = min(counts)
    try:
        chosen = correlated.least_error_separation(
            rounds=rounds, cohort=m, group_sizes=sizes, target_epsilon=target_epsilon,
            delta=delta, momentum=momentum, bands=bands,
        )  # fmt: skip
    except (correlated.FactorizationError, AccountingError) as err:
        raise StopTraining(
            f"{key}: no valid b for {len(nodes)} connected clients, "
            f"'dp.num-sampled-clients' = {m}, {rounds} rounds: {err}"
        ) from None
    return chosen.separation, chosen.sweep
