"""Front-loaded DP client modes for hierarchical FL: CG-NG, CG-NP, CP-NP.

Ratnayake, Chen & Ding (2025), "Privacy-Preserving Hierarchical Federated Learning
with Front-Loaded Differential Privacy Mechanism". CG-NG and CG-NP clip each batch's
(or, ``per_example``, each example's) gradient and take one optimizer step per epoch
on their average, with Gaussian noise on the final step's gradient (CG-NG; every step
per-example) or on the final parameters (CG-NP); CP-NP clips and noises the update
(``clip_and_noise_delta``). All noise comes from an explicit ``torch.Generator``.
A task calls ``train_clipped_gradients`` with its model, loader, optimizer and loss.
What each mode guarantees, and against whom: docs/privacy.md.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch import nn

from privacy.dpsgd import (
    HISTORY_KEY,
    LEFTOVER_MODULE_ATTRS,
    LEFTOVER_PARAM_ATTRS,
    LOCAL_EPSILON,
    check_budget,
    check_compatible,
    epsilon_from_history,
    history_from_state,
    history_to_state,
    opacus_names,
)
from privacy.mechanisms import FRONT_LOADED_MODES as MODES

if TYPE_CHECKING:
    from opacus.grad_sample import GradSampleHooks

CLIP_EPSILON = 1e-6  # the paper's code: min(1, C / (||g|| + 1e-6))

# The task metrics it reports (tasks.base names them too; a test checks they agree).
NUM_EXAMPLES = "num-examples"
TRAIN_LOSS = "train-loss"
# Metric keys (kebab-case) besides num-examples, train-loss and local-epsilon.
NOISE_STD = "noise-std"
CLIP_FRACTION = "clip-fraction"
OPTIMIZER_STEPS = "optimizer-steps"
UPDATE_NORM = "update-norm"
CLIPPED = "clipped"


class ConfigError(ValueError):
    """A front-loaded DP setting is out of range (the message names its run-config key)."""


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ArrayT = TypeVar("ArrayT", torch.Tensor, np.ndarray)


@dataclass(frozen=True)
class FrontLoadedDP:
    """One client's front-loaded DP settings.

    Attributes
    ----------
    mode : str
        ``privacy``: one of ``MODES``.
    clip : float
        ``dp.clip-norm``: the L2 clipping bound C.
    sigma : float
        ``dp.noise-std``: std of the Gaussian noise, in the units of what it is added
        to (averaged gradient, parameters or clipped update).
    per_example : bool
        ``dp.per-example``: clip each example's gradient (CG-NG only).
    delta : float
        ``dp.target-delta``: delta of the reported per-example epsilon.
    """

    mode: str
    clip: float
    sigma: float
    per_example: bool = False
    delta: float = 1e-5
    max_epsilon: float = 0.0
    """Per-example CG-NG: refuse (before training) a round that would take the
    client's sample-level epsilon above this (0: no budget)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"'privacy' = {self.mode!r} is not a front-loaded mode; "
                              f"valid values: {', '.join(repr(m) for m in MODES)}")  # fmt: skip
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise ConfigError(f"'dp.clip-norm' = {self.clip!r}; valid values: finite > 0")
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ConfigError(f"'dp.noise-std' = {self.sigma!r}; valid values: finite >= 0")
        if not 0 < self.delta < 1:
            raise ConfigError(f"'dp.target-delta' = {self.delta!r}; valid range: (0, 1)")
        if self.per_example and self.mode == "cg-np":
            raise ConfigError(
                "'dp.per-example' = true with 'privacy' = 'cg-np': noise added only to the "
                "final parameters, after noiseless steps, has no per-example bound beyond "
                "the client-level one. Use 'privacy' = 'cg-ng' with 'dp.per-example' = "
                "true (noise in every step) or 'privacy' = 'dp-sgd'."
            )
        if self.per_example and self.mode == "cp-np":
            raise ConfigError(
                "'dp.per-example' = true applies only to 'privacy' = 'cg-ng'; CP-NP is "
                "client-level DP. Valid values with 'cp-np': false"
            )


# --- mechanisms -----------------------------------------------------------------------


def gaussian_noise(like: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """I.i.d. ``N(0, sigma^2)`` shaped like ``like``, drawn on ``generator``'s device and
    returned on ``like``'s device and dtype (the paper code's ``gaussian_noise``)."""
    noise = torch.randn(like.shape, generator=generator, device=generator.device)
    return noise.mul_(sigma).to(device=like.device, dtype=like.dtype)


def global_l2_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``tensors`` concatenated (0-d, at least float32 precision)."""
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return torch.zeros(())
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors], torch.float32)
    device = tensors[0].device
    norms = [torch.linalg.vector_norm(t.to(dtype)).to(device) for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_factor(norm: torch.Tensor, clip: float) -> torch.Tensor:
    """``min(1, C / (norm + 1e-6))``, elementwise."""
    return (clip / (norm + CLIP_EPSILON)).clamp(max=1.0)


def clip_and_noise_delta(
    delta: Sequence[torch.Tensor], *, clip: float, sigma: float, generator: torch.Generator
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """CP-NP: clip the update ``dw`` to global L2 norm ``clip``, add ``N(0, sigma^2)``.

    Parameters
    ----------
    delta : sequence of Tensor
        ``w_after - w_before`` (floating tensors); not modified.
    clip, sigma : float
        The clipping bound C and the noise std.
    generator : torch.Generator
        Source of the noise.

    Returns
    -------
    list of Tensor, dict
        The noisy clipped update; metrics ``update-norm`` (before clipping),
        ``clipped`` (1.0 if scaled down) and ``noise-std``.
    """
    FrontLoadedDP("cp-np", clip, sigma)  # validates clip and sigma
    for i, d in enumerate(delta):
        if not d.is_floating_point():
            raise ValueError(f"CP-NP delta tensor {i} has dtype {d.dtype}; need floating")
    norm = global_l2_norm(delta)
    factor = clip_factor(norm, clip)
    noisy = []
    for d in delta:
        clipped = d.detach() * factor.to(device=d.device, dtype=d.dtype)
        noisy.append(clipped + gaussian_noise(d, sigma, generator) if sigma > 0 else clipped)
    metrics = {UPDATE_NORM: float(norm), CLIPPED: float(factor < 1), NOISE_STD: float(sigma)}
    return noisy, metrics


# --- local training (CG-NG, CG-NP) ------------------------------------------------------


@dataclass
class _EpochSums:
    """What one epoch's pass accumulates."""

    grads: list[torch.Tensor]  # sum of clipped batch (or per-example) gradients
    units: int = 0  # batches (per-batch clipping) or examples (per-example)
    clipped: int = 0
    examples: int = 0
    loss_sum: float = 0.0  # sum of per-batch mean loss x batch size


def train_clipped_gradients(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    dp: FrontLoadedDP,
    local_epochs: int,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    generator: torch.Generator,
    device: torch.device | str,
    state: dict[str, Any] | None = None,
) -> dict[str, float]:
    """CG-NG / CG-NP local training, in place: one optimizer step per local epoch.

    The task's hooks: ``model`` (on ``device``; ``optimizer`` updates its trainable
    parameters), ``loader`` of (inputs, targets), re-iterated once per epoch, and
    ``loss_fn(outputs, targets)``, the batch's MEAN loss. ``dp`` gives the mode
    (``cg-ng`` or ``cg-np``), C, sigma and per-example clipping; all noise comes from
    ``generator``. ``state``, the client's persistent state, is required with
    ``dp.per_example`` (its accountant history under ``privacy.dpsgd.HISTORY_KEY`` is
    extended). Returns ``num-examples`` (per epoch), ``train-loss`` (last epoch),
    ``noise-std``, ``clip-fraction``, ``optimizer-steps``, and ``local-epsilon`` with
    per-example clipping.
    """
    _check_training_args(dp, local_epochs, state)
    if dp.per_example and dp.max_epsilon > 0:  # full batch: n examples per step, q = 1
        n = len(loader.dataset)  # type: ignore[attr-defined]
        assert state is not None  # _check_training_args: required with per_example
        planned = (n * dp.sigma / dp.clip, 1.0, local_epochs)
        check_budget(state.get(HISTORY_KEY), planned, delta=dp.delta, max_epsilon=dp.max_epsilon)
    params = [p for p in model.parameters() if p.requires_grad]
    clipped = units = 0
    sample_level: list[tuple[float, float, int]] = []  # (z, q=1, 1 step) per epoch
    with per_example_hooks(model) if dp.per_example else nullcontext():
        model.train()
        for epoch in range(local_epochs):
            sums = _clipped_epoch(model, params, loader, loss_fn, dp.clip, device, dp.per_example)
            clipped, units = clipped + sums.clipped, units + sums.units
            noisy = dp.mode == "cg-ng" and (dp.per_example or epoch == local_epochs - 1)
            _step_on_average(params, sums, optimizer, dp.sigma if noisy else 0.0, generator)
            sample_level.append((sums.examples * dp.sigma / dp.clip, 1.0, 1))
    if dp.mode == "cg-np" and dp.sigma > 0:
        with torch.no_grad():
            for p in params:
                p.add_(gaussian_noise(p, dp.sigma, generator))
    metrics = {
        NUM_EXAMPLES: float(sums.examples),
        TRAIN_LOSS: sums.loss_sum / sums.examples,
        NOISE_STD: float(dp.sigma),
        CLIP_FRACTION: clipped / units,
        OPTIMIZER_STEPS: float(local_epochs),
    }
    if dp.per_example:
        assert state is not None  # _check_training_args: required with per_example
        metrics[LOCAL_EPSILON] = record_full_batch_steps(state, sample_level, dp.delta)
    return metrics


def _check_training_args(dp: FrontLoadedDP, local_epochs: int, state: dict | None) -> None:
    if dp.mode not in ("cg-ng", "cg-np"):
        raise ValueError(f"'privacy' = {dp.mode!r} does not clip gradients; valid values "
                         "here: 'cg-ng', 'cg-np' (CP-NP: clip_and_noise_delta)")  # fmt: skip
    if local_epochs < 1:
        raise ValueError(f"local epochs = {local_epochs}; valid values: >= 1")
    if dp.per_example and state is None:
        raise ValueError("per-example CG-NG needs the client's state for its accountant")


def _clipped_epoch(
    model: nn.Module, params: Sequence[torch.Tensor], loader: Iterable, loss_fn: LossFn,
    clip: float, device: torch.device | str, per_example: bool,
) -> _EpochSums:  # fmt: skip
    """One pass; the sum of the batch (or per-example) gradients, each clipped to
    global L2 norm ``clip``."""
    sums = _EpochSums([torch.zeros_like(p) for p in params])
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        if len(targets) == 0:
            continue
        for p in params:
            p.grad = None
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if per_example:
            samples = [_take_grad_sample(p, len(targets)) for p in params]
        else:  # the batch gradient as a batch of one
            samples = [torch.zeros_like(p)[None] if p.grad is None else p.grad[None]
                       for p in params]  # fmt: skip
        norms = torch.stack([s.flatten(1).norm(dim=1) for s in samples], dim=1).norm(dim=1)
        factors = clip_factor(norms, clip)
        for acc, s in zip(sums.grads, samples, strict=True):
            acc.add_(torch.einsum("i,i...->...", factors.to(s.dtype), s))
        sums.units += len(factors)
        sums.clipped += int((factors < 1).sum())
        sums.examples += len(targets)
        sums.loss_sum += loss.item() * len(targets)
    return sums


def _take_grad_sample(p: torch.Tensor, batch: int) -> torch.Tensor:
    """``p``'s per-example gradients of the last backward pass (zeros if unused);
    clears ``p.grad_sample`` and ``p.grad``."""
    sample = getattr(p, "grad_sample", None)
    # grad_sample is Opacus's attribute, set on the tensor at run time (not in torch's stubs)
    p.grad_sample, p.grad = None, None  # type: ignore[attr-defined]
    if sample is None:
        return torch.zeros((batch, *p.shape), device=p.device, dtype=p.dtype)
    return torch.cat(sample) if isinstance(sample, list) else sample


def _step_on_average(
    params: Sequence[torch.Tensor], sums: _EpochSums, optimizer: torch.optim.Optimizer,
    sigma: float, generator: torch.Generator,
) -> None:  # fmt: skip
    """Set ``.grad`` to the mean clipped gradient (+ ``N(0, sigma^2)``); one step."""
    if sums.units == 0:
        raise ValueError("front-loaded DP training needs at least one training example")
    for p, acc in zip(params, sums.grads, strict=True):
        p.grad = acc / sums.units
        if sigma > 0:
            p.grad.add_(gaussian_noise(p, sigma, generator))
    optimizer.step()
    for p in params:
        p.grad = None


@contextmanager
def per_example_hooks(model: nn.Module) -> Iterator[GradSampleHooks]:
    """Attach Opacus' per-sample gradient hooks to ``model``; remove every hook and
    attribute they leave on leaving the block."""
    check_compatible(model, type(model).__name__)
    hooks = opacus_names().GradSampleHooks(
        model, batch_first=True, loss_reduction="mean", strict=True
    )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield hooks
    finally:
        hooks.cleanup()
        for p in model.parameters():
            for attr in LEFTOVER_PARAM_ATTRS:
                if hasattr(p, attr):
                    delattr(p, attr)
        for module in model.modules():
            for attr in LEFTOVER_MODULE_ATTRS:
                if attr in module.__dict__:
                    delattr(module, attr)


def record_full_batch_steps(
    state: dict[str, Any], steps: Sequence[tuple[float, float, int]], delta: float
) -> float:
    """Append Gaussian steps ``(noise_multiplier, sample_rate, count)`` to the accountant
    history in ``state`` (merging runs of equal settings, as Opacus' accountant does);
    return the cumulative epsilon at ``delta``."""
    history = history_from_state(state.get(HISTORY_KEY))
    for z, q, count in history_from_state(steps):
        if history and history[-1][:2] == (z, q):
            history[-1] = (z, q, history[-1][2] + count)
        else:
            history.append((z, q, count))
    state[HISTORY_KEY] = history_to_state(history)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the")
        return epsilon_from_history(history, delta)
