"""Who adds DP-FedAvg's Gaussian noise: the server, each client, or the secure sum.

:class:`ServerNoise` draws N(0, (zC)²) once on the sum of the clipped deltas;
:class:`ClientNoise` asks each client for its share N(0, (zC)²/m) and draws only the
failed clients' shares; under secure aggregation a :class:`SecureNoiseSite`
(:class:`strategies.secure.distributed_dp.SecureNoise`) replaces both.

Design notes: ``docs/notes.md``, ``strategies.mechanisms.noise_site``.
"""

from __future__ import annotations

import math
from logging import INFO, WARNING
from typing import Protocol

import numpy as np
from flwr.common.logger import log

from privacy.accounting import PrivacyLedger, Release, l2_sensitivity_factor
from privacy.mechanisms import GaussianMechanism, NonFiniteUpdateError, clip_by_l2_norm
from protocol import keys
from protocol.records import InvalidReply

# z·√d/m above which the noise on the mean update drowns any client's signal.
NOISE_TO_SIGNAL_WARNING = 20.0


NO_AMPLIFICATION = (
    "clients selected by the wrapped strategy from their data: "
    "no amplification by subsampling claimed"
)


def sum_release(
    noise_multiplier: float,
    ledger: PrivacyLedger,
    sample_size: int,
    population: int,
    server_round: int,
    count: int = 1,
    uniform_sampling: bool = True,
) -> Release:
    """``count`` Gaussian releases of the clipped sum with noise std z·C, as the ledger
    accounts them (sensitivity of its neighbouring relation; amplification only when the
    sample is the DP generator's)."""
    return Release(
        server_round=server_round,
        kind="model-update",
        mechanism="gaussian",
        noise_multiplier=noise_multiplier / l2_sensitivity_factor(ledger.neighboring),
        laplace_epsilon=None,
        sampling=ledger.sampling,
        sample_size=sample_size,
        population=population,
        count=count,
        note="" if uniform_sampling else NO_AMPLIFICATION,
    )


class SecureNoiseSite(Protocol):
    """Where the noise is added when the round runs as a secure sum (given to the
    wrapper as ``secure`` when it is built, by the registry)."""

    distributed: bool

    def release(
        self, dp, noise_multiplier: float, server_round: int, population: int, count: int
    ) -> Release: ...
    def client_config(self, dp) -> dict: ...
    def eligible(self, dp, nodes: list[int]) -> list[int]: ...
    def planned_participations(self, dp, population: int) -> int: ...


class ServerNoise:
    """The server clips each delta and noises the sum once: in float64 NumPy, or with a
    ``device`` (the clients' training device) in float32 torch there
    (:func:`privacy.device_sum.noisy_sum_on_device`: the same draws, the same charge)."""

    name = "server"
    device: str | None = None

    def client_config(self, mech: GaussianMechanism, m: int) -> dict[str, float]:
        """Nothing for the clients to add."""
        return {}

    def noisy_sum(self, deltas, missing: int, mech: GaussianMechanism, m: int, rng, template):
        """Σ clip(Δ) + N(0, (zC)²), in float64 (one draw: 1/m of the clients' draws)."""
        if self.device is not None:
            from privacy.device_sum import noisy_sum_on_device  # torch, on use

            try:
                return noisy_sum_on_device(deltas, mech, rng, template, self.device)
            except NonFiniteUpdateError as err:  # checked already; defensive
                raise InvalidReply(str(err)) from err
        total = [np.zeros(a.shape) for a in template]
        for delta in deltas:
            try:
                delta = mech.clip(delta).arrays
            except NonFiniteUpdateError as err:  # checked already; defensive
                raise InvalidReply(str(err)) from err
            for t, d in zip(total, delta, strict=True):
                t += d
        return mech.noise_sum(total, rng=rng)


class ClientNoise:
    """Each client clips and adds its share; the server adds the failed clients'."""

    name = "client"

    def client_config(self, mech: GaussianMechanism, m: int) -> dict[str, float]:
        """The std of each client's noise share."""
        return {keys.DP_NOISE_STDDEV: mech.client_noise_std(m)}

    def noisy_sum(self, deltas, missing: int, mech: GaussianMechanism, m: int, rng, template):
        """Σ (Δ + ξ) plus the ``missing`` clients' shares, so the sum carries N(0, (zC)²)."""
        total = [np.zeros(a.shape) for a in template]
        for delta in deltas:
            for t, d in zip(total, within_client_bound(delta, mech, m), strict=True):
                t += d
        if missing:
            share = mech.client_noise_std(m) * math.sqrt(missing)
            total = [t + rng.normal(0.0, share, size=t.shape) for t in total]
        return total


def noise_site(name: str) -> ServerNoise | ClientNoise:
    """The site named ``name``; ValueError naming the valid ones otherwise."""
    sites: dict[str, type[ServerNoise | ClientNoise]] = {
        "server": ServerNoise,
        "client": ClientNoise,
    }
    if name not in sites:
        raise ValueError(f"noise_site must be 'server' or 'client', not {name!r}")
    return sites[name]()


def within_client_bound(delta: list[np.ndarray], mech: GaussianMechanism, m: int):
    """With client-side noise the server cannot check the clip, only the norm an honest
    noisy update has: ``‖Δ + ξ‖ <= C + σ(√d + 8)`` for ξ ~ N(0, σ²I), σ = zC/√m, except
    with probability e^(−32) (Gaussian norm concentration). A larger update, which no
    honest client sends, is scaled back to that radius and logged."""
    d = sum(a.size for a in delta)
    sigma = mech.noise_multiplier * mech.clip_norm / math.sqrt(m)
    radius = mech.clip_norm + sigma * (math.sqrt(d) + 8.0)
    result = clip_by_l2_norm(delta, clip_norm=radius)
    if result.clipped:
        log(
            WARNING,
            "DP-FedAvg: a client-noised update of norm %.4g exceeds the bound %.4g an "
            "honest client meets; scaled back to it",
            result.norm,
            radius,
        )
    return result.arrays


def report_noise_to_signal(noise_multiplier: float, dim: int, m: int) -> None:
    """Log the noise on the mean update (norm about z·C·√d/m) against the most any client
    can move it (C); above ``NOISE_TO_SIGNAL_WARNING`` a model learns little, so the
    run says so before it spends its budget (numbers: docs/notes.md)."""
    ratio = noise_multiplier * math.sqrt(dim) / m
    level = WARNING if ratio > NOISE_TO_SIGNAL_WARNING else INFO
    log(
        level,
        "DP-FedAvg: the noise on the mean update has norm about %.1f x C (z %.3f, "
        "d = %d released weights, m = %g clients per round) against at most C of "
        "signal%s",
        ratio,
        noise_multiplier,
        dim,
        m,
        (
            ": expect the model to learn little. The noise shrinks as sqrt(d)/m: more "
            "clients per round ('dp.num-sampled-clients' with more nodes), a smaller "
            "model ('vision.model' = 'mlp' for digits), or a larger epsilon; on digits, "
            "preset='digits-dp-eps8' on 100 SuperNodes learns (README)"
            if level == WARNING
            else ""
        ),
    )
