"""Correlated noise across rounds: banded matrix factorization and DP-FTRL (tree).

Design notes: ``docs/notes.md``, ``strategies.mechanisms.correlated_noise``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from config.settings import Choice, Settings, SettingsError, setting
from privacy import correlated
from privacy.accounting import PrivacyLedger, Release
from privacy.mechanisms import NonFiniteUpdateError
from protocol.records import InvalidReply
from strategies.base import add_to_config
from strategies.errors import StopTraining
from strategies.mechanisms.base import DATA_DEPENDENT_SELECTION, DPSettings, dp_generator
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.runtime.nodes import grid_view, poisson_sample, wait_for_nodes
from strategies.secure.secagg_plus import SecAggSettings

MECHANISMS = ("banded-mf", "dp-ftrl")
SCHEMAS = ("cyclic", "amplified")


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
        bands, separation = corr.bands, corr.min_separation
        if bands and separation and bands > separation:
            raise SettingsError(
                f"'correlated.bands' = {bands} exceeds 'correlated.min-separation' = "
                f"{separation}: valid values 1..{separation} (or 0: the separation)"
            )


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


class CorrelatedNoiseDP(DPFedAvgFixed):
    """Banded-MF or DP-FTRL tree noise under an enforced participation schema.

    DP-FedAvg (fixed clip C, server-side noise) with its sampling replaced by the
    schema's cohorts and its independent noise by the stream's increments; the other
    parameters are :class:`DPFedAvgFixed`'s. ``rng`` is the secret generator of the
    noise (and of the amplified schema's sampling).

    Parameters
    ----------
    mechanism : {"banded-mf", "dp-ftrl"}
    schema : {"cyclic", "amplified"}
    min_separation : int
        b (0: N // m at the first round).
    bands : int
        Bands of C (banded-mf; 0: b, capped at the rounds).
    restart_every : int
        dp-ftrl: a fresh tree every r rounds (0: one tree).
    momentum : float
        The server's heavy-ball momentum: C is optimised for that workload (banded-mf).
    """

    LOCAL_VIEW = False

    def __init__(
        self,
        strategy: Strategy,
        *,
        mechanism: str,
        schema: str = "cyclic",
        min_separation: int = 0,
        bands: int = 0,
        restart_every: int = 0,
        momentum: float = 0.0,
        **kwargs,
    ) -> None:
        super().__init__(strategy, noise_site="server", **kwargs)
        if mechanism not in MECHANISMS or schema not in SCHEMAS:
            raise ValueError(f"mechanism must be in {MECHANISMS}, schema in {SCHEMAS}")
        if mechanism == "dp-ftrl" and schema != "cyclic":
            raise ValueError("dp-ftrl takes the cyclic schema only")
        wanted = "poisson" if schema == "amplified" else "none"
        if self.ledger.sampling != wanted:
            raise ValueError(f"schema {schema!r} needs a ledger with sampling {wanted!r}")
        self.mechanism, self.schema = mechanism, schema
        self.min_separation, self.bands = min_separation, bands
        self.restart_every = restart_every or None
        self.momentum = momentum
        self.plan: Plan | None = None
        self.stream: correlated.BandedNoise | correlated.TreeNoise | None = None
        self._stream_state: dict | None = None  # loaded before the stream exists
        self._charged_rounds: set[int] = set()

    # -- the schema and the factorization (first round) -------------------------------
    def _group_sizes(self, nodes: list[int], separation: int) -> list[int]:
        sizes = [0] * separation
        for node in nodes:
            sizes[self._partition(node) % separation] += 1
        return sizes

    def _partition(self, node: int) -> int:
        partition = self.partitions.partition_of(node)
        if partition is None:
            raise StopTraining(
                f"'privacy' = {self.mechanism!r}: node {node} reported no partition id; the "
                "participation schema assigns clients to groups by it"
            )
        return partition

    def _make_plan(self, nodes: list[int]) -> Plan:
        """The plan for the connected ``nodes``, or StopTraining with the one-line reason
        the federation cannot provide the schema."""
        n, m = self.planned_rounds, self.num_sampled_clients
        population = len(nodes)
        b = self.min_separation or population // m
        if b < 1 or population < m * b:
            raise StopTraining(
                f"'correlated.schema' = {self.schema!r} needs {m} clients in each of "
                f"b = {max(b, 1)} groups ('dp.num-sampled-clients' x "
                f"'correlated.min-separation' = {m * max(b, 1)} nodes), only {population} "
                "connected"
            )
        smallest = min(self._group_sizes(nodes, b))
        if smallest < m:
            raise StopTraining(
                f"'correlated.schema' = {self.schema!r}: the smallest of the b = {b} groups "
                f"(partition id mod {b}) has {smallest} clients, fewer than "
                f"'dp.num-sampled-clients' = {m}"
            )
        k = math.ceil(n / b)
        if self.mechanism == "dp-ftrl":
            sens = correlated.tree_sensitivity(
                n, participations=k, min_separation=b, restart_every=self.restart_every
            )
            return Plan(self.schema, b, k, sens, "tree-bound", smallest)
        bands = min(self.bands or b, n)
        if bands > b:
            raise StopTraining(
                f"'correlated.bands' = {bands} exceeds the separation b = {b}: valid values 1..{b}"
            )
        factorization = correlated.optimize_banded(n, bands, momentum=self.momentum)
        strategy = factorization.strategy()
        if self.schema == "amplified":  # k Poisson-sampled Gaussians, one per block
            sens = float(np.max(np.linalg.norm(strategy, axis=0)))
            method = "max-column-norm"
        else:
            found = correlated.sensitivity(strategy, participations=k, min_separation=b)
            sens, method = found.value, found.method
        return Plan(
            self.schema,
            b,
            k,
            sens,
            method,
            smallest,
            bands,
            factorization.coefs,
            factorization.workload,
        )

    # -- what is released and charged ------------------------------------------------
    def _whole_run(self, noise_multiplier: float, server_round: int) -> Release:
        plan = self.plan
        assert plan is not None
        return Release(
            server_round=server_round,
            kind="model-updates (whole run, correlated noise)",
            mechanism="gaussian",
            noise_multiplier=noise_multiplier / plan.sensitivity,
            sampling="none",
            sample_size=1,
            population=1,
            note=(
                f"{self.mechanism}, schema cyclic: every client at most k = "
                f"{plan.participations} times, >= {plan.separation} rounds apart, no "
                f"amplification; sensitivity {plan.sensitivity:.6g} ({plan.method}) of the "
                f"strategy matrix for k participations; z = {noise_multiplier:.6g}; the "
                "whole run charged at its first round"
            ),
        )

    def _block(self, noise_multiplier: float, server_round: int, count: int = 1) -> Release:
        plan = self.plan
        assert plan is not None
        return Release(
            server_round=server_round,
            kind="model-updates (block of b rounds, correlated noise)",
            mechanism="gaussian",
            noise_multiplier=noise_multiplier / plan.sensitivity,
            sampling="poisson",
            sample_size=self.num_sampled_clients,
            population=plan.group_size,
            count=count,
            note=(
                f"banded-mf, schema amplified: b = {plan.separation} groups, Poisson "
                f"sampling within the round's group (q = {self.num_sampled_clients}/"
                f"{plan.group_size}); a client's rounds are one per block of b, whose "
                f"columns share no row (bands {plan.bands} <= b); max column norm "
                f"{plan.sensitivity:.6g}; z = {noise_multiplier:.6g}"
            ),
        )

    def releases_with(
        self, noise_multiplier: float, server_round: int, population: int, count: int = 1
    ) -> list[Release]:
        """What aggregating round ``server_round`` charges: the whole run at the first
        round (cyclic), one Poisson-sampled Gaussian at each block's start (amplified)."""
        plan = self.plan
        assert plan is not None
        if plan.schema == "cyclic":
            if self._charged_rounds:
                return []
            return [self._whole_run(noise_multiplier, server_round)]
        if (server_round - 1) % plan.separation or server_round in self._charged_rounds:
            return []
        return [self._block(noise_multiplier, server_round)]

    def planned_releases(self, noise_multiplier: float, population: int) -> list[Release]:
        """The whole planned run with multiplier z (calibration)."""
        plan = self.plan
        assert plan is not None
        if plan.schema == "cyclic":
            return [self._whole_run(noise_multiplier, 1)]
        return [self._block(noise_multiplier, 1, count=plan.participations)]

    def calibrate(self, population: int) -> None:
        """z for ``dp.target-epsilon`` over the plan, unless given (once)."""
        if self.noise_multiplier is not None:
            return
        self.noise_multiplier = self.calibrated(population)
        plan = self.plan
        assert plan is not None
        self.record_calibration(
            "dp.noise-multiplier",
            self.noise_multiplier,
            population,
            mechanism=self.mechanism,
            schema=plan.schema,
            **{
                "min-separation": plan.separation,
                "participations": plan.participations,
                "sensitivity": plan.sensitivity,
                "sensitivity-method": plan.method,
                "bands": plan.bands,
                "workload": plan.workload,
                "expected-clients": self.num_sampled_clients,
            },
        )

    def nodes_for_round(
        self, server_round: int, grid, expected_clients: int, min_available_nodes: int
    ) -> list[int]:
        """DP-FedAvg's (calibration, budget), with the plan fixed from the first
        round's nodes before (the schema's refusal comes first)."""
        if self.plan is None:
            needed = max(expected_clients, min_available_nodes)
            nodes = wait_for_nodes(grid, needed, self.partitions, timeout=self.connect_timeout)
            self.plan = self._make_plan(nodes)
            log(INFO, "%s: %s", self.mechanism, self.plan)
        return super().nodes_for_round(server_round, grid, expected_clients, min_available_nodes)

    # -- the round ----------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ):
        """The round's cohort under the schema; the wrapped strategy configures it."""
        m = self.num_sampled_clients
        if server_round > self.planned_rounds:
            raise StopTraining(
                f"round {server_round}: the {self.mechanism} noise is built for "
                f"'num-server-rounds' = {self.planned_rounds} rounds"
            )
        all_nodes = self.nodes_for_round(server_round, grid, m, self.min_available_nodes)
        plan = self.plan
        assert plan is not None
        group = (server_round - 1) % plan.separation
        ordered = self.partitions.order(all_nodes)
        members = [n for n in ordered if self._partition(n) % plan.separation == group]
        if plan.schema == "cyclic":
            if len(members) < m:
                raise StopTraining(
                    f"round {server_round}: group {group} has {len(members)} connected "
                    f"clients, the cyclic cohort needs 'dp.num-sampled-clients' = {m}"
                )
            cohort = members[:m]
        else:
            cohort = poisson_sample(members, m / plan.group_size, self.rng, self.partitions)
        view = grid_view(grid, cohort)
        messages = (
            list(self.strategy.configure_train(server_round, arrays, config, view))
            if cohort
            else []  # an empty Poisson cohort: the round releases the noise alone
        )
        if len(messages) != len(cohort):
            raise StopTraining(
                f"the wrapped strategy configured {len(messages)} clients, the schema "
                f"chose {len(cohort)}"
            )
        self._fix_released(arrays)
        messages = add_to_config(messages, self.client_config())
        sent = self.partitions.order(msg.metadata.dst_node_id for msg in messages)
        self._round_state = (arrays, sent, len(all_nodes))
        return messages

    def aggregate_train(self, server_round: int, replies):
        """DP-FedAvg's aggregate with the stream's noise; marks the round charged."""
        result = super().aggregate_train(server_round, replies)
        if result[0] is not None:
            self._charged_rounds.add(server_round)
        return result

    def _noise_stream(self, dim: int, dtype=np.float64):
        """The round's noise stream (std z C), created at the first aggregate; banded
        noise in ``dtype``, the released weights' (float32 when all of them are)."""
        if self.stream is None:
            std = self.update_noise_multiplier() * self.clip_norm
            if self.mechanism == "dp-ftrl":
                self.stream = correlated.TreeNoise(
                    dim=dim, std=std, generator=self.rng, restart_every=self.restart_every
                )
            else:
                assert self.plan is not None
                self.stream = correlated.BandedNoise(
                    self.plan.coefs, dim=dim, std=std, generator=self.rng, dtype=dtype
                )
            if self._stream_state is not None:
                self.stream.load_state_dict(self._stream_state)
                self._stream_state = None
        return self.stream

    def _private_mean(self, deltas, missing, template):
        """The mean over m of the clipped deltas plus the stream's increment for this
        round (one draw of dim = the released weights, in their dtype when all are
        float32; the sum kept in float64 until the end)."""
        mech, m = self._mechanism(), self.num_sampled_clients
        total = np.zeros(sum(a.size for a in template))
        for delta in deltas:
            try:
                clipped = mech.clip(delta).arrays
            except NonFiniteUpdateError as err:  # checked already; defensive
                raise InvalidReply(str(err)) from err
            total += np.concatenate([np.ravel(d) for d in clipped])
        single = all(np.asarray(a).dtype == np.float32 for a in template)
        self._noise_stream(total.size, np.float32 if single else np.float64).add_to(total)
        out, offset = [], 0
        for a in template:
            part = total[offset : offset + a.size].reshape(a.shape) / m
            out.append(part.astype(a.dtype, copy=False))
            offset += a.size
        return out

    # -- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """DP-FedAvg's state, the plan and the noise stream (secret: past noise)."""
        state = super().state_dict()
        stream = self.stream.state_dict() if self.stream is not None else self._stream_state
        state["correlated"] = {
            "plan": None if self.plan is None else self.plan.__dict__,
            "stream": stream,
            "charged-rounds": sorted(self._charged_rounds),
        }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`: the stream continues where it stopped."""
        super().load_state_dict(state)
        saved = state["correlated"]
        plan = saved["plan"]
        self.plan = None if plan is None else Plan(**{**plan, "coefs": tuple(plan["coefs"])})
        self._charged_rounds = set(saved["charged-rounds"])
        self.stream, self._stream_state = None, saved["stream"]

    def on_resume(self) -> None:
        """Nothing the server released is lost (its checkpoint commits a round first)."""

    def summary(self) -> None:
        """Log the mechanism and schema, then the wrapped strategy's summary."""
        log(
            INFO,
            "\t├──> %s (correlated noise), schema %s, clip norm C = %g, z = %s",
            self.mechanism,
            self.schema,
            self.clip_norm,
            f"{self.noise_multiplier:g}"
            if self.noise_multiplier is not None
            else f"calibrated in round 1 to epsilon {self.target_epsilon:g}",
        )
        self.strategy.summary()


def _ledger(dp: DPSettings, amplified: bool) -> PrivacyLedger:
    """The run's ledger: unsampled under zero-out (cyclic: a client keeps its cohort
    place, its data replaced by none) or Poisson-sampled (amplified); ``auto`` is PLD
    (one Gaussian, or Poisson-sampled Gaussians: PLD is the tighter accountant)."""
    ledger = PrivacyLedger(
        accountant="pld" if dp.accountant == "auto" else dp.accountant,
        target_delta=float(dp.target_delta),
        max_epsilon=float(dp.max_epsilon) or None,
        sampling="poisson" if amplified else "none",
        neighboring=None if amplified else "zero-out",
        mechanisms=("gaussian",),
    )
    ledger.noise_from_seed = bool(dp.reproducible_noise)
    return ledger


def _factory(mechanism: str):
    def build(base: Strategy, s) -> Strategy:
        from strategies.algorithms.server_optimizer import ServerOptimizerSettings

        dp, corr = s.part(DPSettings), s.part(CorrelatedSettings)
        optimizer = s.part(ServerOptimizerSettings)
        return CorrelatedNoiseDP(
            base,
            mechanism=mechanism,
            schema=corr.schema,
            min_separation=corr.min_separation,
            bands=corr.bands,
            restart_every=corr.restart_every,
            momentum=optimizer.momentum if optimizer.optimizer == "momentum" else 0.0,
            clip_norm=float(dp.clip_norm),
            noise_multiplier=float(dp.noise_multiplier) or None,
            target_epsilon=float(dp.target_epsilon) or None,
            planned_rounds=s.num_rounds,
            num_sampled_clients=int(dp.num_sampled_clients),
            ledger=_ledger(dp, corr.schema == "amplified"),
            rng=dp_generator(s),
            min_available_nodes=s.min_available_nodes,
            connect_timeout=s.round_timeout,
            released_keys=s.released_keys,
            client_metrics=bool(dp.client_metrics),
            noise_from_seed=bool(dp.reproducible_noise),
        )

    return build


# The registration (strategies.registry.PRIVACY): privacy name -> factory.
CORRELATED_PRIVACY = {mechanism: _factory(mechanism) for mechanism in MECHANISMS}
