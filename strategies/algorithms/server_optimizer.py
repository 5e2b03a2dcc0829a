"""Server optimizers on the aggregate (Reddi et al. 2021, "Adaptive Federated
Optimization"; Hsu et al. 2019, FedAvgM), for every strategy with one global model.

The wrapped strategy's aggregate x̃ (under DP: the released, noised model) gives the
pseudo-gradient Δ = x̃ − x of the round; the optimizer turns it into the new global
model. Each rule is Flower's own Message-API strategy, used only for its update: ``sgd``
and ``momentum`` are :class:`flwr.serverapp.strategy.FedAvgM`'s (``server.lr``,
``server.momentum``; written out bit-identically), ``adam``, ``yogi`` and ``adagrad`` are
``FedAdam``, ``FedYogi`` and ``FedAdagrad`` (``server.lr`` = their η, ``server.tau``;
``server.beta1`` and ``server.beta2`` for adam and yogi). The wrapper hands the rule the
round's global arrays and the aggregate as the single reply of weight 1 (FedAvg's
average of one reply is that reply), and takes the rule's new arrays; non-floating
arrays (counters) keep the aggregate's values.

Design notes: ``docs/notes.md``, ``strategies.algorithms.server_optimizer``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import INFO
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvgM, FedYogi, Strategy
from flwr.serverapp.strategy.fedopt import FedOpt

from config.settings import Choice, Settings, SettingsError, listed, setting
from protocol import keys
from protocol.records import arrays_of, to_record
from strategies.base import TrainingWrapper

OPTIMIZERS = ("sgd", "momentum", "adam", "yogi", "adagrad")
# Strategies that keep one global model, which a server optimizer can move.
ONE_GLOBAL_MODEL = ("fedavg", "fedprox", "smart-fedprox", "hierarchical")


@dataclass(frozen=True)
class ServerOptimizerSettings(Settings):
    """The server optimizer's run-config keys (``server.*``)."""

    PREFIX: ClassVar[str] = "server"
    OFF: ClassVar[dict] = {"optimizer": "sgd", "lr": 1.0, "cooldown": 0.0}  # the aggregate
    optimizer: str = setting(
        "sgd",
        "Server optimizer on the round's aggregate (strategies with one global model;"
        " under DP post-processing of the released aggregate): `sgd` and `momentum` "
        "(Flower's FedAvgM), `adam`, `yogi`, `adagrad` (FedAdam, FedYogi, FedAdagrad;"
        " Reddi et al. 2021).",
        choices=OPTIMIZERS,
    )
    lr: float = setting(
        1.0,
        "Server learning rate (sgd/momentum) or eta (adam/yogi/adagrad); sgd with 1.0"
        " is plain FedAvg.",
        low=0.0,
        low_open=True,
    )
    momentum: float = setting(
        0.9,
        "Server momentum of `server.optimizer = momentum`.",
        low=0.0,
        high=1.0,
        high_open=True,
    )
    beta1: float = setting(
        0.9,
        "First-moment decay of adam and yogi.",
        low=0.0,
        high=1.0,
        high_open=True,
    )
    beta2: float = setting(
        0.99,
        "Second-moment decay of adam and yogi.",
        low=0.0,
        high=1.0,
        high_open=True,
    )
    tau: float = setting(
        0.001,
        "Adaptivity tau of adam, yogi and adagrad (added to the root of the second moment).",
        low=0.0,
        low_open=True,
    )

    cooldown: float = setting(
        0.0,
        "Fraction of the run's last rounds over which the server learning rate (or eta)"
        " decays linearly towards 0 (a learning-rate cooldown: the noise of correlated-"
        "noise mechanisms cancels in the model but not in its last steps); 0: constant.",
        low=0.0,
        high=1.0,
        high_open=True,
    )

    def lr_at(self, server_round: int, rounds: int) -> float:
        """The learning rate of round ``server_round`` of ``rounds``: ``lr``, times
        (rounds - t + 1) / (cooldown * rounds) in the last cooldown * rounds rounds."""
        if not self.cooldown:
            return self.lr
        return self.lr * min(1.0, (rounds - server_round + 1) / (self.cooldown * rounds))

    @property
    def name(self) -> str:
        """The optimizer's name (``server.optimizer``)."""
        return self.optimizer

    @staticmethod
    def check(choice: Choice) -> None:
        """A server optimizer moves one global model."""
        optimizer = ServerOptimizerSettings.from_options(choice.options)
        if not optimizer.is_identity and choice.strategy not in ONE_GLOBAL_MODEL:
            raise SettingsError(
                f"'server.optimizer' = {optimizer.name!r} (lr {optimizer.lr:g}) needs a "
                f"strategy with one global model, not 'strategy' = {choice.strategy!r}; "
                "valid strategies: " + listed(ONE_GLOBAL_MODEL)
            )

    @property
    def is_identity(self) -> bool:
        """Plain SGD with learning rate 1: the aggregate is the new model."""
        return all(getattr(self, name) == off for name, off in self.OFF.items())

    def rule(self) -> FedAvgM | FedOpt:
        """Flower's strategy whose update rule this optimizer is."""
        if self.name in ("sgd", "momentum"):
            momentum = self.momentum if self.name == "momentum" else 0.0
            return FedAvgM(server_learning_rate=self.lr, server_momentum=momentum)
        if self.name == "adagrad":  # Flower's FedAdagrad: no moment decay (m = Δ)
            return FedAdagrad(eta=self.lr, tau=self.tau)
        cls = FedAdam if self.name == "adam" else FedYogi
        return cls(eta=self.lr, tau=self.tau, beta_1=self.beta1, beta_2=self.beta2)


# The state each Flower rule carries between rounds (restored on resume).
_RULE_STATE = {FedAvgM: ("momentum_vector",), FedAdam: ("m_t", "v_t")}
_RULE_STATE |= {FedYogi: ("m_t", "v_t"), FedAdagrad: ("m_t", "v_t")}


def _floating(reference: ArrayRecord) -> list[bool]:
    return [np.issubdtype(np.dtype(reference[k].dtype), np.floating) for k in reference]


class ServerOptimizer(TrainingWrapper):
    """Apply a server optimizer to the wrapped strategy's aggregate (module docstring).

    Attributes the wrapped strategy has (the ledger, the privacy views, its summary)
    are read through this wrapper.
    """

    def __init__(
        self, strategy: Strategy, settings: ServerOptimizerSettings, rounds: int = 0
    ) -> None:
        super().__init__(strategy)
        if settings.cooldown and rounds < 1:
            raise ValueError("'server.cooldown' needs the run's number of rounds")
        self.settings, self.rounds = settings, rounds
        self.rule = settings.rule()
        self._current: ArrayRecord | None = None
        ledger = getattr(strategy, "ledger", None)
        if ledger is not None:
            ledger.post_processing.append(
                f"server optimizer {settings.name} (lr {settings.lr:g}, cooldown "
                f"{settings.cooldown:g}) on the released aggregate"
            )

    def __getattr__(self, name: str):
        # Only reached for attributes this wrapper lacks: the wrapped strategy's.
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    @property
    def rule_state(self) -> dict[str, Any]:
        """The rule's moments (plain data, for the checkpoint)."""
        return {name: getattr(self.rule, name) for name in _RULE_STATE[type(self.rule)]}

    @rule_state.setter
    def rule_state(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            if name not in _RULE_STATE[type(self.rule)]:
                raise ValueError(f"unexpected server optimizer state {name!r}")
            setattr(self.rule, name, value)

    def step(self, server_round: int, current: ArrayRecord, aggregate: ArrayRecord) -> ArrayRecord:
        """The rule's new global arrays from ``current`` and the round's ``aggregate``."""
        lr = self.settings.lr_at(server_round, self.rounds) if self.rounds else self.settings.lr
        averaged = arrays_of(aggregate)
        if isinstance(self.rule, FedAvgM):
            moved = self._fedavgm_update(lr, arrays_of(current), averaged)
        else:
            self.rule.eta = lr
            self.rule.current_arrays = dict(zip(current.keys(), arrays_of(current), strict=True))
            sent = Message(RecordDict(), dst_node_id=0, message_type="train")
            content: dict[str, ArrayRecord | MetricRecord | ConfigRecord] = {
                keys.ARRAYS: aggregate,
                keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 1}),
            }
            reply = Message(RecordDict(content), reply_to=sent)
            record, _ = self.rule.aggregate_train(server_round, [reply])
            assert record is not None
            moved = arrays_of(record)
        triples = zip(moved, averaged, _floating(current), strict=True)
        return to_record(current, [new if floating else old for new, old, floating in triples])

    def _fedavgm_update(
        self, lr: float, current: list[np.ndarray], averaged: list[np.ndarray]
    ) -> list[np.ndarray]:
        """What ``FedAvgM.aggregate_train`` computes given ``averaged`` as its one reply
        of weight 1, on the decoded arrays, with the rule's own fields and momentum
        (why it is written out, and the test that holds it to Flower's: docs/notes.md)."""
        rule = self.rule
        assert isinstance(rule, FedAvgM)
        rule.server_learning_rate = lr
        # Flower's FedAvgM skips its update when lr = 1 without momentum at init.
        rule.server_opt = rule.server_opt or bool(self.settings.cooldown)
        new = [a * 1.0 for a in averaged]  # FedAvg's weighted average of one reply
        if not rule.server_opt:
            return new
        pseudo_gradient = [old - n for n, old in zip(new, current, strict=True)]
        if rule.server_momentum > 0.0:
            if rule.momentum_vector is None:
                rule.momentum_vector = pseudo_gradient
            else:
                rule.momentum_vector = [
                    rule.server_momentum * mv + pg
                    for mv, pg in zip(rule.momentum_vector, pseudo_gradient, strict=True)
                ]
            pseudo_gradient = rule.momentum_vector
        steps = zip(current, pseudo_gradient, strict=True)
        return [np.asarray(old - lr * pg) for old, pg in steps]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's round; the global arrays are kept for the step."""
        self._current = arrays
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The wrapped strategy's aggregate, moved by the optimizer."""
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        current, self._current = self._current, None
        if arrays is None or current is None:
            return arrays, metrics
        return self.step(server_round, current, arrays), metrics

    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The rule's moments."""
        return {"rule": self.rule_state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.rule_state = state["rule"]

    def summary(self) -> None:
        """Log the optimizer, then the wrapped strategy's summary."""
        s = self.settings
        log(
            INFO,
            "\t├──> Server optimizer %s: lr %g, momentum %g, beta1 %g, beta2 %g, tau %g "
            "(Flower's %s; post-processing of the aggregate)",
            s.name,
            s.lr,
            s.momentum,
            s.beta1,
            s.beta2,
            s.tau,
            type(self.rule).__name__,
        )
        self.strategy.summary()
