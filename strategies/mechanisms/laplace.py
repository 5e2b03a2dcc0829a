"""The Laplace mechanism on client updates (local DP), and its client mod.

Each sampled client clips its update to L1 norm S and adds Laplace(0, S/ε) noise to
every coordinate from a generator only it knows (``laplace_mod``); the server averages
the noisy uploads (a failed client counts as a zero update whose noise the server
draws) and charges each round to the ledger under the zero-out relation, and each
client's own uploads to its local view (against the server). The sampling, the
neighbouring relation and the client contract are in docs/privacy.md ("The mechanisms'
server and client halves").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.accounting import PrivacyLedger, Release
from privacy.local_view import LocalViewLedger
from privacy.mechanisms import LaplaceMechanism, is_released
from protocol import keys
from protocol.records import InvalidReply, arrays_of, as_float, to_record
from protocol.replies import check_reply
from strategies.base import add_to_config
from strategies.errors import BudgetExhausted
from strategies.mechanisms.base import PrivacyWrapper, client_mod
from strategies.mechanisms.calibrated import CalibratedNoise
from strategies.runtime.aggregation import weighted_metrics
from strategies.runtime.checkpoint import ledger_state, load_ledger
from strategies.runtime.partitions import grid_view, poisson_sample


class LaplaceDP(CalibratedNoise, PrivacyWrapper):
    """Local Laplace noise on every client's clipped update, averaged over the sample.

    Parameters
    ----------
    strategy : Strategy
        The wrapped strategy (it samples the clients unless ``expected_clients``).
    sensitivity : float
        S, the L1 clip norm.
    epsilon : float or None
        The per-round ε (noise scale S/ε); None: calibrated to ``target_epsilon`` over
        ``planned_rounds`` at the first round.
    ledger : PrivacyLedger
        The run's ledger (zero-out, sampling "none": no amplification, see above).
    rng : numpy.random.Generator
        The secret DP generator: Poisson sampling and the noise of clients counted as
        zero updates.
    expected_clients : int, optional
        m under Poisson sampling (the wrapper samples with q = m/N and divides by m).
    min_available_nodes, connect_timeout :
        Nodes to wait for, and how long, before a Poisson round samples.
    **kwargs
        ``client_metrics`` and ``noise_from_seed`` (:class:`PrivacyWrapper`).
    """

    RELEASED_METRICS = (*PrivacyWrapper.RELEASED_METRICS, keys.DP_EPSILON_LOCAL)

    def __init__(
        self,
        strategy: Strategy,
        *,
        sensitivity: float,
        epsilon: float | None,
        ledger: PrivacyLedger,
        rng: np.random.Generator,
        target_epsilon: float | None = None,
        planned_rounds: int = 1,
        expected_clients: int | None = None,
        min_available_nodes: int = 1,
        connect_timeout: float = 300.0,
        **kwargs,
    ) -> None:
        super().__init__(strategy, **kwargs)
        if (epsilon is None) == (target_epsilon is None):
            raise ValueError("give exactly one of epsilon and target_epsilon")
        if ledger.sampling != "none":
            raise ValueError(
                f"Laplace is charged without amplification: the ledger's sampling must be "
                f"'none', got {ledger.sampling!r} (module docstring)"
            )
        LaplaceMechanism(sensitivity=sensitivity, epsilon=epsilon or 1.0)  # validates S
        self.sensitivity, self.epsilon = sensitivity, epsilon
        self.target_epsilon, self.planned_rounds = target_epsilon, planned_rounds
        self.expected_clients = expected_clients
        self.min_available_nodes, self.connect_timeout = min_available_nodes, connect_timeout
        self.ledger = ledger
        self.rng = rng
        self.local_view = LocalViewLedger(
            accountant=ledger.accountant,
            target_delta=ledger.target_delta,
            neighboring=ledger.neighboring,
            mechanisms=("laplace",),
            max_epsilon=ledger.max_epsilon,
        )
        self._round_state: tuple[ArrayRecord, list[int], int] | None = None

    @property
    def mechanism(self) -> LaplaceMechanism:
        """The mechanism with the per-round ε (given or calibrated)."""
        assert self.epsilon is not None, "not calibrated yet"
        return LaplaceMechanism(sensitivity=self.sensitivity, epsilon=self.epsilon)

    def releases_with(
        self, epsilon: float, server_round: int, clients: int, population: int, count: int = 1
    ) -> list[Release]:
        """``count`` rounds' releases with per-round ε (worst case: a client in every
        round; no amplification, see the module docstring)."""
        return [
            Release(
                server_round=server_round,
                kind="model-update",
                mechanism="laplace",
                noise_multiplier=None,
                laplace_epsilon=epsilon,
                sampling=self.ledger.sampling,
                sample_size=self.expected_clients or clients,
                population=population,
                count=count,
                note="local Laplace noise on each client's L1-clipped update; epsilon for "
                "zeroing out one client's update (it still takes part; 2x for replacing it "
                "by another client's)",
            )
        ]

    def release(self, server_round: int, clients: int, population: int) -> list[Release]:
        """One round's release."""
        assert self.epsilon is not None
        return self.releases_with(self.epsilon, server_round, clients, population)

    def local_release(self, server_round: int) -> Release:
        """One client's noisy upload as the server sees it (no amplification)."""
        assert self.epsilon is not None
        return Release(
            server_round=server_round,
            kind="noisy-upload",
            mechanism="laplace",
            laplace_epsilon=self.epsilon,
            sampling="none",
            sample_size=1,
            population=1,
            note="one client's upload",
        )

    def planned_releases(self, parameter: float, population: int) -> list[Release]:
        """The planned run's releases with noise 1/ε per round = ``parameter``."""
        return self.releases_with(1.0 / parameter, 1, 1, population, count=self.planned_rounds)

    def calibrate(self, population: int) -> None:
        """Set the per-round ε so that the planned rounds meet ``target_epsilon``: the
        larger of what the accountant allows and what basic composition allows (T·ε;
        the ledger reports the smaller of the two bounds)."""
        if self.epsilon is not None:
            return
        assert self.target_epsilon is not None
        accountant = 1.0 / self.calibrated(population)
        self.epsilon = max(accountant, self.target_epsilon / self.planned_rounds)
        self.record_calibration("dp.epsilon", self.epsilon, population)

    def _sample(self, server_round, arrays, config, grid) -> tuple[list[Message], int]:
        """(The round's train messages, the population N): the wrapped strategy's
        sample, or a Poisson sample with the secret generator."""
        if self.expected_clients is None:
            population = len(list(grid.get_node_ids()))
            self.calibrate(population)
            self._refuse_over_budget(server_round, population)
            return list(self.strategy.configure_train(server_round, arrays, config, grid)), (
                population
            )
        nodes = self.nodes_for_round(
            server_round, grid, self.expected_clients, self.min_available_nodes
        )
        rate = self.expected_clients / len(nodes)
        chosen = poisson_sample(nodes, rate, self.rng, self.partitions)
        if not chosen:  # an empty cohort: the round releases the noise alone
            return [], len(nodes)
        view = grid_view(grid, chosen)
        return list(self.strategy.configure_train(server_round, arrays, config, view)), len(nodes)

    def _refuse_over_budget(self, server_round: int, population: int) -> None:
        if self.ledger.would_exceed(self.release(server_round, 1, population)) or (
            self.local_view.would_exceed(self.local_release(server_round))
        ):
            raise BudgetExhausted(
                f"round {server_round} would exceed 'dp.max-epsilon' = "
                f"{self.ledger.max_epsilon} (epsilon so far {self.ledger.epsilon():.4f}, "
                f"against the server {self.local_view.bound():.4f} for a client asked in "
                "every round); "
                "nothing was sent"
            )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The round's sample, plus the clip bound and noise scale."""
        messages, population = self._sample(server_round, arrays, config, grid)
        extra = {
            keys.LAPLACE_SENSITIVITY: self.sensitivity,
            keys.LAPLACE_SCALE: self.mechanism.scale,
            **self.report_config(),
        }
        messages = add_to_config(messages, extra)
        sent = self.partitions.order(m.metadata.dst_node_id for m in messages)
        clients = [self.partitions.client_name(n) for n in sent]
        self.local_view.charge(clients, self.local_release(server_round))
        self._round_state = (arrays, sent, population)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The mean of the noisy deltas (a failed client: a noised zero) over m (Poisson)
        or the clients asked."""
        if self._round_state is None:
            return None, None
        current, sent, population = self._round_state
        self._round_state = None
        valid, failed = self._screen(replies, sent, current)
        self.ledger.charge(self.release(server_round, max(len(sent), 1), population))
        if getattr(self.strategy, "AGGREGATES_UPLOADS", False):
            uploads = [message for message, _ in valid]
            new_arrays, metrics = self.strategy.aggregate_train(server_round, uploads)
            return new_arrays, self._metrics(metrics or MetricRecord({}), failed)
        reference = arrays_of(current)
        total = [np.zeros(a.shape) for a in reference]
        for _, received in valid:
            for t, r, c in zip(total, received, reference, strict=True):
                t += np.asarray(r, dtype=np.float64) - c
        scale = self.mechanism.scale
        for _ in failed:  # their noise, drawn here: the mean is as if they sent a zero
            for t in total:
                t += self.rng.laplace(0.0, scale, size=t.shape)
        count = self.expected_clients or max(len(sent), 1)
        new_arrays = to_record(  # integer arrays keep the server's value (not released)
            current,
            [
                c + t / count if is_released(c) else c
                for c, t in zip(reference, total, strict=True)
            ],
        )
        records = [
            MetricRecord({**cast(MetricRecord, m.content[keys.METRICS]), keys.NUM_EXAMPLES: 1})
            for m, _ in valid
        ]
        return new_arrays, self._metrics(weighted_metrics(records), failed)

    def _screen(
        self, replies: Iterable[Message], sent: list[int], current: ArrayRecord
    ) -> tuple[list[tuple[Message, list[np.ndarray]]], list[int]]:
        """(the valid replies of the nodes asked with their arrays, in partition order;
        the other nodes asked)."""
        by_node: dict[int, Message] = {}
        for message in replies:
            by_node.setdefault(message.metadata.src_node_id, message)
        valid, failed = [], []
        for node in sent:
            try:
                if node not in by_node:
                    raise InvalidReply("no reply")
                received, _ = check_reply(by_node[node], current)
                valid.append((by_node[node], received))
            except InvalidReply as err:
                failed.append(node)
                log(WARNING, "Laplace: node %d counts as a zero update: %s", node, err)
        return valid, failed

    def _metrics(self, metrics: MetricRecord, failed: list[int]) -> MetricRecord:
        out = dict(metrics)
        out[keys.DP_FAILED_CLIENTS] = float(len(failed))
        out[keys.DP_EPSILON] = self.ledger.epsilon()
        out[keys.DP_EPSILON_LOCAL] = self.local_view.bound()  # published: sample-independent
        out[keys.DP_EPSILON_LOCAL_WORST] = self.local_view.worst()[1]  # curator
        return MetricRecord(self.mark(out))

    def on_resume(self) -> None:
        """Every client may have uploaded in the round under way when the server stopped."""
        if self.epsilon is not None:
            self.local_view.charge_all(self.local_release(0))
            log(INFO, "resume: one noisy upload charged to every client against the server")

    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The secret generator, the per-round epsilon, the calibration and the ledgers."""
        return {
            "rng": self.rng.bit_generator.state,
            "epsilon": self.epsilon,
            "calibration": self.calibration,
            "ledger": ledger_state(self.ledger),
            "local-view": ledger_state(self.local_view),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the generator and the ledgers in place)."""
        self.rng.bit_generator.state = state["rng"]
        self.epsilon, self.calibration = state["epsilon"], state["calibration"]
        load_ledger(self.ledger, state["ledger"])
        load_ledger(self.local_view, state["local-view"])
        self.restore_plan()  # a resumed run reports its exact ε at the last round

    def summary(self) -> None:
        """Log the mechanism, then the wrapped strategy's summary."""
        log(
            INFO,
            "\t├──> Laplace: L1 clip S = %g, epsilon per round %s, sampling %s (no "
            "amplification charged), zero-out relation; the same epsilon per upload "
            "against the server",
            self.sensitivity,
            f"{self.epsilon:g}" if self.epsilon else f"calibrated to {self.target_epsilon:g}",
            "poisson" if self.expected_clients else "the strategy's",
        )
        self.strategy.summary()


# -- the client half ----------------------------------------------------------------
def privatise_update(
    config: ConfigRecord, delta: list[np.ndarray], metrics: MetricRecord, rng: np.random.Generator
) -> list[np.ndarray]:
    """Clip Δ to L1 norm S and add Laplace noise of scale b to every coordinate."""
    sensitivity = as_float(config[keys.LAPLACE_SENSITIVITY])
    scale = as_float(config[keys.LAPLACE_SCALE])
    mechanism = LaplaceMechanism(sensitivity=sensitivity, epsilon=sensitivity / scale)
    return mechanism.noise(mechanism.clip(delta).arrays, rng=rng)


# The Laplace mechanism's client mod: every client noises its own upload.
laplace_mod = client_mod(
    privatise_update,
    applies=lambda config: keys.LAPLACE_SENSITIVITY in config,
    client_noised=lambda config: keys.LAPLACE_SENSITIVITY in config,
    name="laplace_mod",
)
