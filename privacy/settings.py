"""The settings of the privacy mechanisms and of the audit (``dp.*``, ``audit.*``).

Declared here, without Flower, because both halves read them: the server's wrappers
and checks (``strategies/``, ``server_app/``) and the ClientApp (its DP seed, the
audit's canaries), which reads them with ``Settings.from_run_config``
(``config.settings``) without importing the server's strategies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from config.settings import Choice, Settings, SettingsError, listed, setting
from privacy.mechanisms import FRONT_LOADED_MODES

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
    """The privacy mechanisms' shared run-config keys (``dp.*``; adaptive clipping's own
    are ``AdaptiveClipSettings``, same prefix, beside its wrapper)."""

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
        "gradient, the parameters or the clipped delta (frontloaded-dp-hfl's --sigma).",
        low=0.0,
    )
    per_example: bool = setting(
        False,
        "CG-NG: clip per example (Opacus) and noise every step, then accounted as "
        "sample-level DP; false: frontloaded-dp-hfl's per-batch clipping, no formal guarantee.",
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


# What the audit's canaries fit: one global model that averages uploads, released under
# a client-level mechanism (or none). DP-SGD is sample-level (a canary client would
# exceed its epsilon by design); the hierarchical modes, clusters and SmartFedProx's
# selection are not one average of sampled uploads.
AUDIT_STRATEGIES = ("fedavg", "fedprox")
AUDIT_PRIVACY = ("none", "dp-fedavg-fixed", "dp-fedavg-adaptive", "laplace", "subspace-dp")


@dataclass(frozen=True)
class AuditSettings(Settings):
    """The empirical privacy audit's run-config keys (``audit.*``)."""

    PREFIX: ClassVar[str] = "audit"
    OFF: ClassVar[dict] = {"canaries": 0}
    canaries: int = setting(
        0,
        "Empirical privacy audit: k canary clients, the federation's last k partition"
        " ids (simulation: num-supernodes = N + k); each is inserted with probability"
        " 1/2, the rest are held out. 0: no audit.",
        low=0,
    )
    canary_rate: float = setting(
        1.0,
        "Audit: probability that a sampled inserted canary uploads its direction in a"
        " round (1: it is sampled and uploads exactly like a real client).",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    every: int = setting(
        0,
        "Audit also the global model of every this many rounds (its delta from the "
        "initial model; audit.json 'history'); 0: only the final model.",
        low=0,
    )
    confidence: float = setting(
        0.95,
        "Audit: confidence of the one-run epsilon lower bound (Steinke et al. 2023).",
        low=0.5,
        high=1.0,
        high_open=True,
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """Enough canaries, in a run whose release the audit's method fits."""
        k = choice.part(AuditSettings).canaries
        if not k:
            return
        if k < 4:
            raise SettingsError(
                f"'audit.canaries' = {k} is too few: the estimate fits a Gaussian to the "
                "inserted and to the held-out canaries (each about k/2); valid values: 0 "
                "(off) or >= 4"
            )
        if choice.strategy not in AUDIT_STRATEGIES:
            raise SettingsError(
                f"'audit.canaries' = {k} is not available with 'strategy' = "
                f"{choice.strategy!r}; valid strategies: " + listed(AUDIT_STRATEGIES)
            )
        if choice.privacy not in AUDIT_PRIVACY:
            raise SettingsError(
                f"'audit.canaries' = {k} is not available with 'privacy' = "
                f"{choice.privacy!r} (the audit tests a client-level guarantee of one "
                "released model); valid values: " + listed(AUDIT_PRIVACY)
            )
