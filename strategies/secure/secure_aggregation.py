"""Secure aggregation around a strategy: each train round runs as SecAgg+
(:mod:`strategies.secure.secagg_plus`), so the server obtains only the sum of the sampled
clients' encoded updates (``secagg.enabled = true``).

Design notes: ``docs/notes.md``, ``strategies.secure.secure_aggregation``.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO
from typing import Any, Protocol, cast

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.app.typing import MetricRecordValues
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.skellam import SecureSumEncoding
from privacy.subspace import unflatten
from protocol import keys
from protocol.records import arrays_of, as_int, to_record
from strategies.base import TrainingWrapper, add_to_config
from strategies.errors import StopTraining
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.mechanisms.dp_fedavg_adaptive import DPFedAvgAdaptive
from strategies.runtime.partitions import partition_map
from strategies.secure.distributed_dp import DROPPED, SURVIVORS, SecureNoise
from strategies.secure.secagg_plus import SecAggSettings, SecureSum, secure_sum


class SecureExchange(Protocol):
    """A strategy whose train round is a protocol of several exchanges, not one."""

    def exchange_train(self, grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
        """Run the round's exchanges; the replies that stand for the clients' answers."""


class SecureAggregation(TrainingWrapper):
    """Run each train round of ``strategy`` as SecAgg+ (see the module docstring).

    Parameters
    ----------
    strategy : Strategy
        FedAvg or FedProx (plain secure aggregation), or a DP-FedAvg wrapper.
    settings : SecAggSettings
        The protocol's parameters.
    """

    def __init__(self, strategy: Strategy, settings: SecAggSettings) -> None:
        super().__init__(strategy)
        self.settings = settings
        self.dp = strategy if isinstance(strategy, DPFedAvgFixed) else None
        if self.dp is not None:
            if self.dp.ledger.sampling == "poisson":
                raise ValueError(
                    "secure aggregation needs fixed-size sampling: a Poisson cohort's size "
                    "depends on who was sampled, and a round too small to unmask is "
                    "abandoned, which the subsampled Gaussian's bound does not cover"
                )
            distributed = self.dp.noise_site == "client"
            if distributed and isinstance(self.dp, DPFedAvgAdaptive):
                raise ValueError(
                    "distributed DP under secure aggregation supports fixed clipping only: "
                    "the count of norm bits would need its own distributed mechanism"
                )
            if self.dp.secure is None or self.dp.secure.distributed != distributed:
                raise ValueError(
                    "DP-FedAvg under secure aggregation needs the secure sum's noise site "
                    "given when it is built (strategies.registry: secure_noise_site)"
                )
        self._current: ArrayRecord | None = None
        self._result: SecureSum | None = None
        self._length = 0

    @property
    def _secure(self) -> SecureNoise | None:
        """The DP wrapper's noise site, the SecureNoise this wrapper set."""
        return cast(SecureNoise | None, self.dp.secure) if self.dp is not None else None

    def __getattr__(self, name: str):
        # Only reached for attributes this wrapper lacks: the wrapped strategy's.
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    @property
    def secure_counts(self) -> dict[str, int]:
        secure = self._secure if self.dp is not None else None
        return {"interrupted": secure.interrupted, "charged": secure.charged} if secure else {}

    @secure_counts.setter
    def secure_counts(self, counts: dict[str, int]) -> None:
        if self.dp is not None and self._secure is not None and counts:
            self._secure.interrupted = int(counts["interrupted"])
            self._secure.charged = int(counts["charged"])

    @property
    def participations(self) -> dict[int, int]:
        secure = self._secure if self.dp is not None else None
        return secure.participations if secure is not None else {}

    @participations.setter
    def participations(self, counts: dict[int, int]) -> None:
        if self.dp is not None and self._secure is not None:
            self._secure.participations = {int(n): int(c) for n, c in counts.items()}

    def on_resume(self) -> None:
        """What the wrapped strategy charges on resume, and distributed DP's own."""
        if self.dp is not None and self._secure is not None:
            self._secure.on_resume()
        if hasattr(self.strategy, "on_resume"):
            self.strategy.on_resume()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        """The wrapped strategy's train messages, with the encoding the clients use."""
        dim = sum(a.size for a in arrays_of(arrays))
        self._current, self._result = arrays, None
        if self.dp is not None:
            assert self._secure is not None
            self._secure.dim = dim
            self._secure.catch_up(self.dp)  # a resumed run's interrupted round
            self._length = dim + (1 if isinstance(self.dp, DPFedAvgAdaptive) else 0)
            messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
            encoding = self._secure.encoding(self.dp)
        else:
            self._length = dim + 1  # the weighted update and the weight
            messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
            messages, encoding = (
                add_to_config(messages, self._plain_config()),
                self._plain_encoding(),
            )
        if not encoding.fits(len(messages), self._length):
            raise StopTraining(
                f"round {server_round}: the sum of {len(messages)} encoded updates could wrap "
                f"around modulo 'secagg.modulus-range' = {self.settings.modulus_range}; raise it "
                "or lower 'secagg.quantization-range' (nothing was sent)"
            )
        return messages

    def _plain_config(self) -> dict:
        s = self.settings
        return {
            keys.SECAGG_CLIP_NORM: 0.0,
            keys.SECAGG_COORDINATE_RANGE: s.clipping_range,
            keys.SECAGG_SCALE: s.scale,
            keys.SECAGG_MODULUS_BITS: s.modulus_range.bit_length() - 1,
            keys.SECAGG_MAX_WEIGHT: s.max_weight,
        }

    def _plain_encoding(self) -> SecureSumEncoding:
        s = self.settings
        return SecureSumEncoding(
            clip_norm=0.0,
            scale=s.scale,
            modulus=s.modulus_range,
            coordinate_range=s.clipping_range,
        )

    def exchange_train(self, grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
        """The SecAgg+ round; the collect stage's replies (masked vectors only)."""
        server_round = (
            as_int(messages[0].content[keys.CONFIG].get(keys.SERVER_ROUND, 0)) if messages else 0
        )
        needed = (
            self._secure.survivors_needed(self.dp)
            if self.dp is not None and self._secure is not None
            else 2
        )
        self._result = secure_sum(
            grid,
            messages,
            self.settings,
            length=self._length,
            server_round=server_round,
            timeout=timeout,
            survivors_needed=needed,
        )
        return self._result.replies

    def aggregate_train(
        self, server_round: int, replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The aggregate from the secure sum (the replies carry nothing else)."""
        result, self._result = self._result, None
        if result is None:  # nothing was sampled: the wrapped strategy's empty round
            return self.strategy.aggregate_train(server_round, [])
        partitions = partition_map(self.strategy)
        for node, why in result.reasons.items():  # the participation record's reasons
            partitions.note(node, why)
        if self.dp is not None:
            assert self._secure is not None
            return self._secure.aggregate(self.dp, server_round, result)
        extra: dict[str, MetricRecordValues] = {
            SURVIVORS: float(len(result.survivors)),
            DROPPED: float(len(result.dropped)),
        }
        if result.vector is None:
            return None, MetricRecord(extra)
        current = self._current
        assert current is not None
        flat = self._plain_encoding().decode(result.vector)
        weight = flat[-1]
        if not weight > 0:
            return None, MetricRecord(extra)
        reference = arrays_of(current)
        mean = unflatten(flat[:-1] / weight, reference)
        new = to_record(current, [r + d for r, d in zip(reference, mean, strict=True)])
        extra[keys.NUM_EXAMPLES] = float(weight * self.settings.max_weight)
        return new, MetricRecord(extra)

    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Distributed DP's count of released sums."""
        return {"secure-counts": self.secure_counts}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.secure_counts = state["secure-counts"]

    def client_state_dict(self) -> dict[str, dict[int, Any]]:
        """Distributed DP's participation counts, by node id."""
        return {"participations": self.participations}

    def load_client_state_dict(self, state: Mapping[str, dict[int, Any]]) -> None:
        """Restore :meth:`client_state_dict` (keyed by this run's node ids)."""
        self.participations = state["participations"]

    def summary(self) -> None:
        """Log the protocol's parameters, then the wrapped strategy's summary."""
        s = self.settings
        log(
            INFO,
            "\t├──> SecAgg+ (server sees only the sum): shares %g, threshold %g, "
            "scale %g per unit, modulus 2^%d, min survivors %s",
            s.num_shares,
            s.reconstruction_threshold,
            s.scale,
            s.modulus_range.bit_length() - 1,
            s.min_survivors or "the threshold",
        )
        self.strategy.summary()
