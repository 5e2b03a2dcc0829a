"""Correlated noise across rounds: banded matrix factorization and DP-FTRL (tree).

Design notes: ``docs/notes.md``, ``strategies.mechanisms.correlated_noise``.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy import correlated
from privacy.accounting import PrivacyLedger, Release
from privacy.mechanisms import NonFiniteUpdateError
from protocol.records import InvalidReply
from strategies.base import add_to_config
from strategies.errors import StopTraining
from strategies.mechanisms.base import DPSettings, dp_generator
from strategies.mechanisms.correlated_schema import (
    MECHANISMS,
    SCHEMAS,
    CorrelatedSettings,
    Plan,
    make_plan,
)
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.runtime.partitions import grid_view, wait_for_nodes

__all__ = ["CORRELATED_PRIVACY", "CorrelatedNoiseDP", "CorrelatedSettings", "Plan"]


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
    choose_separation : {"given", "least-error"}
        least-error: b is the amplified schema's least-error b at ``target_epsilon``.
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
        choose_separation: str = "given",
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
        self.choose_separation = choose_separation
        self.plan: Plan | None = None
        self.stream: correlated.BandedNoise | correlated.TreeNoise | None = None
        self._stream_state: dict | None = None  # loaded before the stream exists
        self._charged_rounds: set[int] = set()

    # -- what is released and charged ------------------------------------------------
    def releases_with(
        self, noise_multiplier: float, server_round: int, population: int, count: int = 1
    ) -> list[Release]:
        """What aggregating round ``server_round`` charges (:meth:`Plan.releases`)."""
        assert self.plan is not None
        charged = bool(self._charged_rounds)
        if self.plan.schema == "amplified":
            charged = server_round in self._charged_rounds
        return self.plan.releases(
            self.mechanism, noise_multiplier, server_round, self.num_sampled_clients, charged
        )

    def planned_releases(self, noise_multiplier: float, population: int) -> list[Release]:
        """The whole planned run with multiplier z (calibration)."""
        assert self.plan is not None
        return self.plan.planned(self.mechanism, noise_multiplier, self.num_sampled_clients)

    def calibrate(self, population: int) -> None:
        """z for ``dp.target-epsilon`` over the plan, unless given (once)."""
        if self.noise_multiplier is not None:
            return
        self.noise_multiplier = self.calibrated(population)
        assert self.plan is not None
        record = self.plan.calibration_record(self.mechanism, self.num_sampled_clients)
        self.record_calibration("dp.noise-multiplier", self.noise_multiplier, population, **record)

    def nodes_for_round(
        self, server_round: int, grid, expected_clients: int, min_available_nodes: int
    ) -> list[int]:
        """DP-FedAvg's (calibration, budget), with the plan fixed from the first
        round's nodes before (the schema's refusal comes first)."""
        if self.plan is None:
            needed = max(expected_clients, min_available_nodes)
            nodes = wait_for_nodes(grid, needed, self.partitions, timeout=self.connect_timeout)
            self.plan = make_plan(
                self.mechanism, self.schema, nodes, self.partitions,
                rounds=self.planned_rounds, m=self.num_sampled_clients,
                min_separation=self.min_separation, bands=self.bands,
                restart_every=self.restart_every, momentum=self.momentum,
                choose=self.choose_separation, target_epsilon=self.target_epsilon,
                delta=self.ledger.target_delta,
            )  # fmt: skip
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
        assert self.plan is not None
        ordered = self.partitions.order(all_nodes)
        cohort = self.plan.cohort(
            server_round, ordered, self.partitions, m, self.rng, self.mechanism
        )
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
        """DP-FedAvg's aggregate with the stream's noise; marks the round charged.
        Round t must add row t of the factorization (the sensitivity is computed for
        the schema's rounds as C's columns): a stream at another row is refused."""
        saved = self._stream_state or {}
        row = self.stream.round if self.stream is not None else saved.get("round", 0)
        if self._round_state is not None and row != server_round - 1:
            raise StopTraining(
                f"round {server_round}: the {self.mechanism} noise stream is at round "
                f"{row + 1}; its rows must follow the rounds (nothing released)"
            )
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
        """Restore :meth:`state_dict`: the stream continues where it stopped. The plan
        first: DP-FedAvg's restore declares the calibrated run's releases from it."""
        saved = state["correlated"]
        plan = saved["plan"]
        if plan is not None:
            sweep = tuple(tuple(row) for row in plan.get("sweep", ()))
            plan = Plan(**{**plan, "coefs": tuple(plan["coefs"]), "sweep": sweep})
        self.plan = plan
        super().load_state_dict(state)
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
            choose_separation=corr.choose_separation,
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
