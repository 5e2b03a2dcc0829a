"""Sample-level DP-SGD (Abadi et al., 2016) for any torch model, on Opacus' pieces.

Each step Poisson-samples a batch (rate ``q = B / n``), clips each example's gradient
to ``C``, sums, adds ``N(0, (z C)^2)``; Opacus' RDP accountant keeps the history
``[(z, q, steps), ...]`` across rounds in the client's state. A task calls
``train_private`` with its model, optimizer, data loader and epochs (its hooks); the
mechanism runs the private training. Why the pieces are built here rather than by
``make_private``, and why the proximal term bypasses the loss: docs/privacy.md.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache, partial
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

if TYPE_CHECKING:
    from opacus.accountants import RDPAccountant
    from opacus.data_loader import DPDataLoader
    from opacus.grad_sample import GradSampleHooks
    from opacus.optimizers import DPOptimizer

_OPACUS_LOG_FORMAT = "%(asctime)s:%(levelname)s:%(message)s"
LOCAL_EPSILON = "local-epsilon"  # the metric: a DP-SGD client's sample-level epsilon


@dataclass(frozen=True)
class DPSGD:
    """One client's DP-SGD settings.

    ``noise_multiplier`` z (noise std / ``max_grad_norm``, the per-example clip);
    ``delta`` of the reported epsilon; with ``target_epsilon`` > 0 the smallest z that
    keeps the client within it after ``planned_rounds`` rounds (worst case: it trains
    in every round); with ``max_epsilon`` > 0 a round that would exceed it is refused
    before training (``BudgetExceeded``).
    """

    noise_multiplier: float
    max_grad_norm: float
    delta: float
    target_epsilon: float = 0.0
    planned_rounds: int = 0
    max_epsilon: float = 0.0


class PrivateRound(Protocol):
    """What DP-SGD reads of a task's local training (``tasks.base.LocalTraining``)."""

    dp_sgd: DPSGD | None
    proximal_mu: float
    dp_seed: int
    state: dict[str, Any]


@cache
def opacus_names() -> SimpleNamespace:
    """The Opacus names used here, imported on first use: importing Opacus costs
    ~0.8 s per process (it pulls in torch._dynamo), which every ClientApp process would
    pay at start-up although only DP-SGD runs need it (bench/vs_flower.py orchestration)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.utils import get_noise_multiplier
    from opacus.data_loader import DPDataLoader
    from opacus.grad_sample import GradSampleHooks
    from opacus.optimizers import DPOptimizer
    from opacus.validators import ModuleValidator
    from opacus.validators.errors import UnsupportedModuleError

    # opacus/utils/module_utils.py calls logging.basicConfig() when imported, which puts
    # a handler on the root logger and prints every Flower log line a second time.
    # Remove that handler (recognised by Opacus' format) and nothing else.
    for handler in list(logging.root.handlers):
        if getattr(handler.formatter, "_fmt", None) == _OPACUS_LOG_FORMAT:
            logging.root.removeHandler(handler)
    return SimpleNamespace(
        RDPAccountant=RDPAccountant,
        get_noise_multiplier=get_noise_multiplier,
        DPDataLoader=DPDataLoader,
        GradSampleHooks=GradSampleHooks,
        DPOptimizer=DPOptimizer,
        ModuleValidator=ModuleValidator,
        UnsupportedModuleError=UnsupportedModuleError,
    )


HISTORY_KEY = "dpsgd-history"  # key of the accountant history in the client's state
CALIBRATED_KEY = "dpsgd-calibrated-noise-multiplier"  # in the client's state
ROUNDS_KEY = "dpsgd-rounds"  # in the client's state: trainings the history covers
# What a DP-SGD client reports besides local-epsilon (protocol/keys.py has the same
# names; a test checks they agree): trainings its accountant covers, and this round's
# steps, from which the server re-derives the client's epsilon.
ROUNDS = "dpsgd-rounds"
ROUND_NOISE = "dpsgd-round-noise-multiplier"
ROUND_SAMPLE_RATE = "dpsgd-round-sample-rate"
ROUND_STEPS = "dpsgd-round-steps"
BUDGET_REFUSAL = "dp.max-epsilon reached"  # in the error of a refused round
# Attributes Opacus leaves on parameters (DPOptimizer) and layers (activation capture)
# after GradSampleHooks.cleanup().
LEFTOVER_PARAM_ATTRS = ("summed_grad",)
LEFTOVER_MODULE_ATTRS = ("activations", "max_batch_len")

HistoryEntry = tuple[float, float, int]  # (noise_multiplier, sample_rate, steps)


class PrivacySpent(NamedTuple):
    """The accountant's history after training and the epsilon it amounts to."""

    history: list[list[float | int]]
    """JSON-serialisable ``[[noise_multiplier, sample_rate, steps], ...]``."""
    epsilon: float
    """Cumulative epsilon at the ``delta`` of the DP-SGD settings."""


# --- accounting ---------------------------------------------------------------------


def poisson_sample_rate(batch_size: int, num_examples: int) -> float:
    """Sample rate ``q = B / n`` giving expected batch size ``B`` (at most 1)."""
    if num_examples < 1:
        raise ValueError("DP-SGD needs at least one training example")
    return min(1.0, batch_size / num_examples)


def steps_per_epoch(sample_rate: float) -> int:
    """Poisson-sampled steps in one epoch: ``int(1 / q)``, Opacus' sampler default."""
    return max(1, int(1 / sample_rate))


def history_from_state(raw: Sequence[Sequence[Any]] | None) -> list[HistoryEntry]:
    """Validate a stored history ``[[z, q, steps], ...]`` and return it as tuples.

    Raises
    ------
    ValueError
        If an entry is not ``[noise_multiplier >= 0, 0 < sample_rate <= 1, steps >= 1]``.
    """
    history: list[HistoryEntry] = []
    for entry in raw or []:
        if len(entry) != 3:
            raise ValueError(f"DP-SGD history entry {entry!r} is not [z, q, steps]")
        z, q, steps = float(entry[0]), float(entry[1]), int(entry[2])
        if z < 0 or not 0 < q <= 1 or steps < 1 or steps != entry[2]:
            raise ValueError(f"invalid DP-SGD history entry {entry!r}")
        history.append((z, q, steps))
    return history


def history_to_state(history: Sequence[Sequence[Any]]) -> list[list[float | int]]:
    """The accountant history as JSON-serialisable lists."""
    return [[float(z), float(q), int(steps)] for z, q, steps in history]


def epsilon_from_history(
    history: Sequence[Sequence[Any]], delta: float, orders: Sequence[float] | None = None
) -> float:
    """Epsilon at ``delta`` of a DP-SGD history, by Opacus' RDP accountant.

    Parameters
    ----------
    history : sequence of (noise_multiplier, sample_rate, steps)
        The composed sampled Gaussian mechanisms (``RDPAccountant.history``).
    delta : float
        Target delta.
    orders : sequence of float, optional
        RDP orders to optimise the conversion over; default
        ``RDPAccountant.DEFAULT_ALPHAS`` (what Opacus and the reported metric use).

    Returns
    -------
    float
        Epsilon (0.0 for an empty history).
    """
    names = opacus_names()  # before any Opacus import here: it undoes Opacus' log handler
    from opacus.accountants.analysis.rdp import get_privacy_spent

    entries = history_from_state(history)
    if not entries:
        return 0.0
    alphas = tuple(names.RDPAccountant.DEFAULT_ALPHAS if orders is None else orders)
    # Opacus' RDPAccountant.get_privacy_spent, the per-step RDP of each (z, q) computed
    # once per process: each round asks again with more steps, the same numbers.
    rdp = sum([_rdp_per_step(z, q, alphas) * steps for z, q, steps in entries])
    epsilon, _ = get_privacy_spent(orders=list(alphas), rdp=rdp, delta=delta)
    return float(epsilon)


@lru_cache(maxsize=64)
def _rdp_per_step(z: float, q: float, orders: tuple[float, ...]) -> np.ndarray:
    """RDP at ``orders`` of one sampled Gaussian step (Opacus' ``compute_rdp``)."""
    from opacus.accountants.analysis.rdp import compute_rdp

    rdp = np.asarray(compute_rdp(q=q, noise_multiplier=z, steps=1, orders=list(orders)))
    rdp.setflags(write=False)
    return rdp


def calibrate_noise_multiplier(
    *, target_epsilon: float, delta: float, sample_rate: float, epochs: int
) -> float:
    """Smallest noise multiplier (within 0.01 in epsilon) reaching ``target_epsilon``.

    The number of steps is ``epochs * steps_per_epoch(sample_rate)``, the steps that
    DP-SGD training over ``epochs`` takes here (Opacus' ``get_noise_multiplier``
    would use ``int(epochs / sample_rate)``).
    """
    with warnings.catch_warnings():
        # The bisection's first guesses (large z) are optimal at the largest order.
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        z = opacus_names().get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=epochs * steps_per_epoch(sample_rate),
            accountant="rdp",
        )
    return float(z)


def calibrated_settings(local: PrivateRound, *, sample_rate: float, epochs: int) -> DPSGD:
    """``local.dp_sgd`` with the noise multiplier for its target epsilon, if any.

    Calibrated once per client (cached in ``local.state`` under ``CALIBRATED_KEY``)
    for the worst case of training ``epochs`` local epochs in every one of the planned
    rounds, at ``sample_rate`` (capped at 1).
    """
    dp = local.dp_sgd
    assert dp is not None
    if dp.target_epsilon <= 0:
        return dp
    if CALIBRATED_KEY not in local.state:
        local.state[CALIBRATED_KEY] = calibrate_noise_multiplier(
            target_epsilon=dp.target_epsilon, delta=dp.delta,
            sample_rate=min(1.0, sample_rate), epochs=dp.planned_rounds * epochs,
        )  # fmt: skip
    return replace(dp, noise_multiplier=float(local.state[CALIBRATED_KEY]))


class BudgetExceeded(ValueError):
    """The round would take the client's sample-level epsilon above its budget."""


def check_budget(
    history: Sequence[Sequence[Any]] | None,
    planned: HistoryEntry,
    *,
    delta: float,
    max_epsilon: float,
) -> None:
    """Raise ``BudgetExceeded`` if ``history`` plus the ``planned`` steps
    ``(z, q, steps)`` exceed ``max_epsilon`` at ``delta`` (0: no budget); before training."""
    if max_epsilon <= 0:
        return
    projected = epsilon_from_history([*history_from_state(history), planned], delta)
    if projected > max_epsilon:
        raise BudgetExceeded(
            f"{BUDGET_REFUSAL}: this round would take the client's sample-level epsilon to "
            f"{projected:.4f} > {max_epsilon:g}; not trained"
        )


def round_report(
    before: Sequence[Sequence[Any]], after: Sequence[Sequence[Any]], state: dict[str, Any]
) -> dict[str, float]:
    """Count one more DP-SGD training in ``state`` and describe this round's steps (the
    entries ``after`` adds to ``before``, one noise multiplier and sample rate)."""
    old, new = history_from_state(before), history_from_state(after)
    steps = sum(e[2] for e in new) - sum(e[2] for e in old)
    z, q, _ = new[-1]
    state[ROUNDS_KEY] = int(state.get(ROUNDS_KEY, 0)) + 1
    return {
        ROUNDS: float(state[ROUNDS_KEY]),
        ROUND_NOISE: float(z),
        ROUND_SAMPLE_RATE: float(q),
        ROUND_STEPS: float(steps),
    }


# --- training -----------------------------------------------------------------------


def check_compatible(model: nn.Module, model_name: str) -> None:
    """Raise ValueError naming ``model_name`` if Opacus cannot privatise ``model``.

    Puts ``model`` in training mode (the validator requires it).
    """
    model.train()
    opacus = opacus_names()
    try:
        opacus.ModuleValidator.validate(model, strict=True)
        opacus.GradSampleHooks.validate(model, strict=True)  # no trainable layer with buffers
    except (opacus.UnsupportedModuleError, NotImplementedError) as err:
        raise ValueError(
            f"vision.model = {model_name!r} is not compatible with DP-SGD (Opacus): {err}. "
            "Use a model without BatchNorm, e.g. with GroupNorm instead "
            "(opacus.validators.ModuleValidator.fix replaces it)."
        ) from err


def seeded_generators(seed: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """Independent (sampling, noise) generators derived from ``seed`` (SeedSequence).

    The sampling generator is on the CPU (Opacus' sampler draws there), the noise
    generator on ``device`` (the noise is drawn where the gradients are).
    """
    sampling_seed, noise_seed = np.random.SeedSequence(seed).generate_state(2)
    sampling = torch.Generator().manual_seed(int(sampling_seed))
    noise = torch.Generator(device=device).manual_seed(int(noise_seed))
    return sampling, noise


def add_proximal_gradient(
    model: nn.Module, global_params: Sequence[torch.Tensor], mu: float
) -> None:
    """Add ``mu * (w - w_global)``, the gradient of the FedProx term, to ``p.grad``."""
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for w, g in zip(params, global_params, strict=True):
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            w.grad.add_(w - g, alpha=mu)


@dataclass
class PrivateTraining:
    """The Opacus objects of one DP-SGD training run on a plain module.

    Train with ``loader`` and ``optimizer`` as usual (zero_grad, forward, mean loss,
    backward, step), inside ``with``; leaving the block (or ``finish``) removes
    every hook and attribute Opacus put on ``model``.
    """

    model: nn.Module
    hooks: GradSampleHooks
    optimizer: DPOptimizer
    loader: DPDataLoader
    accountant: RDPAccountant
    dp: DPSGD
    sample_rate: float
    _warnings: Any = field(default=None, repr=False)

    def __enter__(self) -> PrivateTraining:
        # The first layer's input needs no gradient; torch warns on every backward.
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()
        if self._warnings is not None:
            self._warnings.__exit__(*exc)
            self._warnings = None

    def detach(self) -> None:
        """Remove Opacus' hooks and attributes from ``model`` (idempotent)."""
        self.hooks.cleanup()
        for p in self.model.parameters():
            for attr in LEFTOVER_PARAM_ATTRS:
                if hasattr(p, attr):
                    delattr(p, attr)
        for module in self.model.modules():
            for attr in LEFTOVER_MODULE_ATTRS:
                if attr in module.__dict__:
                    delattr(module, attr)

    def finish(self) -> PrivacySpent:
        """Detach from the model; return the history and the cumulative epsilon."""
        self.detach()
        history = history_to_state(self.accountant.history)
        return PrivacySpent(history, epsilon_from_history(history, self.dp.delta))


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    *,
    dp: DPSGD,
    generator_seed: int,
    history: Sequence[Sequence[Any]] = (),
    public_gradient: Callable[[], None] | None = None,
    model_name: str | None = None,
) -> PrivateTraining:
    """Make ``model``, ``optimizer`` and ``loader`` train with DP-SGD.

    Hooks go on ``model`` itself (no wrapper); ``optimizer`` becomes a ``DPOptimizer``;
    ``loader``'s dataset is Poisson-sampled at ``q = batch_size / len(dataset)``. ``dp``
    gives z, the clip norm and delta; ``generator_seed`` seeds the sampling and noise
    generators (``seeded_generators``); ``history`` is the accountant history to
    continue; ``public_gradient`` adds data-independent terms to ``p.grad`` after the
    noise (``add_proximal_gradient``); ``model_name`` names the model in the
    incompatibility error. Use the result as a context manager and train with its
    ``loader`` and ``optimizer``.
    """
    check_compatible(model, model_name or type(model).__name__)
    device = next(model.parameters()).device
    sampling, noise = seeded_generators(generator_seed, device)
    # torch's stubs give Dataset no __len__; a map-style dataset (all ours) has one
    batch_size, num_examples = int(loader.batch_size or 1), len(loader.dataset)  # type: ignore[arg-type]
    sample_rate = poisson_sample_rate(batch_size, num_examples)
    accountant = opacus_names().RDPAccountant()
    accountant.history = history_from_state(history)
    dp_optimizer = opacus_names().DPOptimizer(
        optimizer,
        noise_multiplier=dp.noise_multiplier,
        max_grad_norm=dp.max_grad_norm,
        expected_batch_size=min(batch_size, num_examples),  # q * n
        loss_reduction="mean",
        generator=noise,
    )
    dp_optimizer.attach_step_hook(
        account_then_add(accountant.get_optimizer_hook_fn(sample_rate), public_gradient)
    )
    dp_loader = opacus_names().DPDataLoader(
        loader.dataset, sample_rate=sample_rate, collate_fn=loader.collate_fn, generator=sampling
    )
    # Hooks last: nothing after them can fail and leave them on the model.
    hooks = opacus_names().GradSampleHooks(
        model, batch_first=True, loss_reduction="mean", strict=True
    )
    hooks.forbid_grad_accumulation()
    return PrivateTraining(model, hooks, dp_optimizer, dp_loader, accountant, dp, sample_rate)


def account_then_add(
    account: Callable[[DPOptimizer], None], public_gradient: Callable[[], None] | None
) -> Callable[[DPOptimizer], None]:
    """The DPOptimizer step hook: record the step, then add the public gradient."""

    def hook(optimizer: DPOptimizer) -> None:
        account(optimizer)
        if public_gradient is not None:
            public_gradient()

    return hook


def train_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    local: PrivateRound,
    *,
    epochs: int,
    global_params: Sequence[torch.Tensor],
    run_epochs: Callable[[DPDataLoader, DPOptimizer], dict[str, float]],
    model_name: str | None = None,
) -> dict[str, float]:
    """One client's DP-SGD training round; extends the accountant history in ``local.state``.

    The task's hooks: ``model``, ``optimizer``, ``loader`` (its batch size is the
    expected batch size) and ``run_epochs(private_loader, private_optimizer)``, which
    trains ``epochs`` epochs without the proximal term and returns the task's metrics.
    The noise multiplier is ``local.dp_sgd``'s or the one calibrated to its target
    epsilon (``calibrated_settings``); a round that would exceed ``max_epsilon`` is
    refused before training (``check_budget``). The proximal gradient
    ``mu (w - global_params)`` is data-independent and added to the noisy clipped
    gradient (Opacus would drop it from the loss). ``model_name`` names the model in
    ``make_private``'s incompatibility error. Returns ``run_epochs``' metrics, the
    cumulative ``local-epsilon`` and this round's steps (``round_report``).
    """
    # torch's stubs give Dataset no __len__; a map-style dataset (all ours) has one
    num_examples, batch_size = len(loader.dataset), int(loader.batch_size or 1)  # type: ignore[arg-type]
    dp = calibrated_settings(local, sample_rate=batch_size / num_examples, epochs=epochs)
    mu = local.proximal_mu
    public = partial(add_proximal_gradient, model, global_params, mu) if mu > 0 else None
    history = local.state.get(HISTORY_KEY, [])
    q = poisson_sample_rate(batch_size, num_examples)
    planned = (dp.noise_multiplier, q, epochs * steps_per_epoch(q))
    check_budget(history, planned, delta=dp.delta, max_epsilon=dp.max_epsilon)
    private = make_private(
        model, optimizer, loader, dp=dp, generator_seed=local.dp_seed,
        history=history, public_gradient=public, model_name=model_name,
    )  # fmt: skip
    with private:
        metrics = run_epochs(private.loader, private.optimizer)
    spent = private.finish()
    local.state[HISTORY_KEY] = spent.history
    report = round_report(history, spent.history, local.state)
    return {**metrics, LOCAL_EPSILON: spent.epsilon, **report}
