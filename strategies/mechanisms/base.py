"""What every privacy wrapper shares: what it releases, what clients may report, and
what it does on resume.

Under a privacy mechanism the run directory separates what the ε covers from what it
does not (``curator/``, :mod:`server_app.results`): a wrapper names the metric keys it
releases (``RELEASED_METRICS``, computed from released quantities only: ε, clip norms
moved by noised counts, gates on noised sketches); every other key of its train metrics
(aggregated client reports, raw diagnostics such as clipping fractions) is curator-only.

Clients send only what the mechanism and the wrapped strategy need (``report-metrics``
in the train config, applied by each mechanism's client mod) unless the run sets
``dp.client-metrics = true``. Federated evaluation (each client's accuracy on its own
test split) is a release no mechanism covers: under DP it runs only when the user asks
for per-client metrics, and its results then go to ``curator/``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO
from typing import ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from config.settings import Choice, Settings, SettingsError, listed, setting
from privacy.mechanisms import FRONT_LOADED_MODES, noise_generator
from protocol import keys
from strategies.base import TrainingWrapper


class PrivacyWrapper(TrainingWrapper):
    """A privacy mechanism around ``self.strategy`` (see the module docstring).

    Parameters
    ----------
    strategy : Strategy
        The wrapped strategy.
    client_metrics : bool
        ``dp.client-metrics``: clients report all their metrics and take part in
        federated evaluation (everything goes to ``curator/``).
    noise_from_seed : bool
        ``dp.reproducible-noise``: the DP randomness derives from the run seed; the
        wrapper marks its rows (``dp-noise-from-seed`` = 1).
    """

    # Metric keys (exact, or prefixes ending in "-") of train metrics that are released.
    RELEASED_METRICS: tuple[str, ...] = (keys.DP_EPSILON, keys.DP_NOISE_FROM_SEED)
    # Keys a client reports under this mechanism besides those the strategy needs.
    CLIENT_REPORTS: tuple[str, ...] = ()

    def __init__(
        self, strategy: Strategy, *, client_metrics: bool = False, noise_from_seed: bool = False
    ) -> None:
        super().__init__(strategy)
        self.client_metrics = client_metrics
        self.noise_from_seed = noise_from_seed
        self._said_no_evaluation = False

    # -- what is released ------------------------------------------------------------
    def releases_metric(self, key: str) -> bool:
        """Whether the train metric ``key`` is computed from released quantities only."""
        return any(
            key == name or (name.endswith("-") and key.startswith(name))
            for name in self.RELEASED_METRICS
        )

    def mark(self, metrics: dict) -> dict:
        """``metrics`` with ``dp-noise-from-seed`` (1 under dp.reproducible-noise)."""
        metrics[keys.DP_NOISE_FROM_SEED] = 1.0 if self.noise_from_seed else 0.0
        return metrics

    # -- what clients send -------------------------------------------------------------
    def reported_metrics(self) -> list[str]:
        """The metric keys a client keeps in its train reply: this mechanism's, and
        those the wrapped strategy declares it needs (``REPORTED_METRICS``)."""
        needed = getattr(self.strategy, "REPORTED_METRICS", ())
        return sorted({*self.CLIENT_REPORTS, *needed})

    def report_config(self) -> dict:
        """The train-config entry restricting what clients report (none when
        ``dp.client-metrics`` is on)."""
        if self.client_metrics:
            return {}
        return {keys.REPORT_METRICS: self.reported_metrics()}

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's federated evaluation, only with ``dp.client-metrics``."""
        if self.client_metrics:
            return self.strategy.configure_evaluate(server_round, arrays, config, grid)
        if not self._said_no_evaluation:
            self._said_no_evaluation = True
            log(
                INFO,
                "Federated evaluation is off under DP: each client's metrics on its own "
                "test split are a release no epsilon covers. Set dp.client-metrics = true to "
                "collect them (written under curator/); central evaluation is unaffected.",
            )
        return []

    # -- resume --------------------------------------------------------------------------
    def on_resume(self) -> None:
        """Charge what the round under way when the server stopped may have released.

        The server releases a round only after its checkpoint commits it, so nothing the
        trusted server releases is lost; what clients sent in that round (client-side
        noise, seen by the server) is charged here by the wrappers that have a local
        view. Called once when a run resumes, before its first round."""


# Strategies that pick clients from what the clients report (no uniform sampling,
# so DP wrappers claim no amplification by subsampling for them).
DATA_DEPENDENT_SELECTION: frozenset[str] = frozenset({"smart-fedprox"})

# ``dp.clip-norm = 0``: adaptive clipping starts at 0.1, as Andrew et al. (2021), TFF's
# and Flower's adaptive-clipping aggregators do (a model's first updates are often far
# above the quantile it converges to, and the noise scales with C until it gets there);
# a fixed clip, DP-SGD's per-example clip and the hierarchical modes start at 1.
ADAPTIVE_INITIAL_CLIP = 0.1
DEFAULT_CLIP = 1.0

# Each mechanism's noise parameter: give it, or dp.target-epsilon to calibrate it.
NOISE_PARAMETER = {
    "dp-fedavg-fixed": "dp.noise-multiplier",
    "dp-fedavg-adaptive": "dp.noise-multiplier",
    "subspace-dp": "dp.noise-multiplier",
    "dp-sgd": "dp.noise-multiplier",
    "laplace": "dp.epsilon",
}


@dataclass(frozen=True)
class DPSettings(Settings):
    """The privacy mechanisms' run-config keys (``dp.*``)."""

    PREFIX: ClassVar[str] = "dp"
    clip_norm: float = setting(
        0.0,
        "L2 clip norm C: of each client update (DP-FedAvg; the initial C when "
        "adaptive), of each example's gradient (DP-SGD). 0: the mechanism's default, "
        f"{ADAPTIVE_INITIAL_CLIP:g} for dp-fedavg-adaptive (Andrew et al. 2021), "
        f"{DEFAULT_CLIP:g} otherwise.",
        low=0.0,
    )
    noise_multiplier: float = setting(
        0.0,
        "z: noise std / C (DP-FedAvg, subspace-dp: on the sum of the round's updates; "
        "DP-SGD: on each batch's gradient sum). 0: calibrated from dp.target-epsilon; "
        "give one of the two.",
        low=0.0,
    )
    num_sampled_clients: int = setting(
        5,
        "m: clients per DP round (dp.sampling = poisson: the expected number, each "
        "client taken with probability m/N; fixed: exactly m, without replacement). "
        "The mean divides by m either way.",
        low=1,
    )
    sampling: str = setting(
        "poisson",
        "How DP-FedAvg, subspace-dp and Laplace sample clients: `poisson` (each "
        "client independently, add-or-remove-one, PLD by default) or `fixed` (exactly"
        " m without replacement, replace-one, RDP; McMahan et al.'s DP-FedAvg). Laplace: "
        "`poisson` samples q = m/N, `fixed` is the strategy's `fraction-train`; "
        "neither is charged as amplified (local noise).",
        choices=("poisson", "fixed"),
    )
    noise_site: str = setting(
        "server",
        "Who adds the Gaussian noise.",
        choices=("server", "client"),
    )
    accountant: str = setting(
        "auto",
        "Privacy accountant (dp-accounting): `auto` is pld for Poisson sampling and "
        "rdp otherwise (dp-accounting's PLD has no sampling without replacement).",
        choices=("auto", "rdp", "pld"),
    )
    target_delta: float = setting(
        1e-05,
        "delta at which epsilon is reported.",
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
    )
    max_epsilon: float = setting(
        0.0,
        "Budget: a round that would exceed it is refused (0: no limit).",
        low=0.0,
    )
    reproducible_noise: bool = setting(
        False,
        "Debugging only: derive DP noise and DP sampling from `seed` (reproducible) "
        "instead of OS entropy. No epsilon then holds against anyone who knows the "
        "seed; the ledger, the summary and metrics.csv say so.",
    )
    client_metrics: bool = setting(
        False,
        "Under a privacy mechanism, clients also report their training metrics and "
        "run federated evaluation (no epsilon covers either; written under curator/)."
        " False: clients send only what the mechanism needs.",
    )
    target_quantile: float = setting(
        0.5,
        "Adaptive clipping: quantile of update norms that C tracks.",
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
    )
    clip_lr: float = setting(
        0.2,
        "Adaptive clipping: geometric learning rate of C.",
        low=0.0,
        low_open=True,
    )
    clip_count_stddev: float = setting(
        0.0,
        "Adaptive clipping: noise sigma_b of the clipped count (0: max(m/20, z)).",
        low=0.0,
    )
    sensitivity: float = setting(
        15.0,
        "Laplace: L1 clip norm S of each update.",
        low=0.0,
        low_open=True,
    )
    epsilon: float = setting(
        0.0,
        "Laplace: epsilon per round (noise scale S/epsilon). 0: calibrated from "
        "dp.target-epsilon; give one of the two.",
        low=0.0,
    )
    target_epsilon: float = setting(
        0.0,
        "The epsilon (at dp.target-delta) the whole run meets: the server calibrates "
        "z (DP-FedAvg, subspace-dp) or the Laplace scale once the nodes are known, "
        "and refuses a round beyond it; DP-SGD: each client calibrates its noise for "
        "this sample-level epsilon. 0: use dp.noise-multiplier / dp.epsilon.",
        low=0.0,
    )
    noise_std: float = setting(
        0.01,
        "CG-NG / CG-NP / CP-NP: std sigma of the Gaussian noise on the averaged "
        "gradient, the parameters or the clipped delta (the seed's --sigma).",
        low=0.0,
    )
    per_example: bool = setting(
        False,
        "CG-NG: clip per example (Opacus) and noise every step, then accounted as "
        "sample-level DP; false: the seed's per-batch clipping, no formal guarantee.",
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """Exactly one of a mechanism's noise parameter and dp.target-epsilon, a budget
        not below the target; client-side noise only with fixed-size sampling."""
        o, dp = choice.options, choice.part(DPSettings)
        target, budget = dp.target_epsilon, dp.max_epsilon
        if target and budget and budget < target:
            raise SettingsError(
                f"'dp.max-epsilon' = {budget:g} is below 'dp.target-epsilon' = {target:g}: "
                "the run could not reach its target; set 'dp.max-epsilon' >= "
                "'dp.target-epsilon' (or 0: the target is the budget)"
            )
        if choice.privacy in FRONT_LOADED_MODES and target:
            raise SettingsError(
                f"'dp.target-epsilon' = {target:g} is not available with 'privacy' = "
                f"{choice.privacy!r} (its noise is 'dp.noise-std'); valid values with a "
                "target: " + listed(tuple(NOISE_PARAMETER))
            )
        key = NOISE_PARAMETER.get(choice.privacy)
        if key is None:
            return
        given = float(o[key])
        if given and target:
            raise SettingsError(
                f"both {key!r} = {given:g} and 'dp.target-epsilon' = {target:g} are given; "
                f"give one: {key!r} sets the noise, 'dp.target-epsilon' calibrates it"
            )
        if not given and not target:
            raise SettingsError(
                f"'privacy' = {choice.privacy!r} needs its noise: set {key!r} > 0, or "
                "'dp.target-epsilon' > 0 to calibrate it for the whole run"
            )
        if (
            choice.privacy in ("dp-fedavg-fixed", "dp-fedavg-adaptive")
            and dp.noise_site == "client"
            and dp.sampling == "poisson"
            and choice.strategy not in DATA_DEPENDENT_SELECTION  # it samples nothing
        ):
            raise SettingsError(
                "'dp.noise-site' = 'client' needs 'dp.sampling' = 'fixed': with Poisson "
                "sampling the number of noise shares in the sum, and so whether a client "
                "took part, would show in the released mean (add-or-remove-one would not "
                "hold)"
            )


_SERVER_STREAM = 0x5E  # the server's generator: DP sampling and server-side noise


def dp_generator(s) -> np.random.Generator:
    """The generator of the randomness a guarantee rests on (noise, DP sampling) for the
    run settings ``s``: secret, from OS entropy, unless ``dp.reproducible-noise`` derives
    it from the run seed."""
    return noise_generator(
        seed=s.seed,
        streams=(_SERVER_STREAM,),
        reproducible=s.part(DPSettings).reproducible_noise,
    )
