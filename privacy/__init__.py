"""Privacy mechanisms and accounting (no Flower imports).

* :mod:`privacy.mechanisms`: clipping (L2/L1), Gaussian and Laplace noise, the two-phase
  :class:`GaussianMechanism` and :class:`LaplaceMechanism`, explicit generators.
* :mod:`privacy.accounting`: the run's :class:`PrivacyLedger` over dp-accounting.
* :mod:`privacy.calibration`: noise multiplier for a target ε, ε for a multiplier.
* ``python -m privacy.budget``: the same from the command line.
"""

from privacy.accounting import (
    AccountingError,
    BudgetExceededError,
    LocalGuarantee,
    PrivacyLedger,
    Release,
    UnaccountedRelease,
    l1_sensitivity_factor,
    l2_sensitivity_factor,
    to_dp_event,
)
from privacy.calibration import (
    accounted_noise_multiplier,
    calibrate_noise_multiplier,
    epsilon_for,
)
from privacy.mechanisms import (
    ClipResult,
    GaussianMechanism,
    LaplaceMechanism,
    NonFiniteUpdateError,
    add_noise,
    clip_by_l1_norm,
    clip_by_l2_norm,
    gaussian_noise_like,
    global_l1_norm,
    global_l2_norm,
    laplace_noise_like,
    make_generator,
    noise_generator,
    secret_seed,
    secure_generator,
)

__all__ = [
    "AccountingError",
    "BudgetExceededError",
    "ClipResult",
    "GaussianMechanism",
    "LaplaceMechanism",
    "LocalGuarantee",
    "NonFiniteUpdateError",
    "PrivacyLedger",
    "Release",
    "UnaccountedRelease",
    "accounted_noise_multiplier",
    "add_noise",
    "calibrate_noise_multiplier",
    "clip_by_l1_norm",
    "clip_by_l2_norm",
    "epsilon_for",
    "gaussian_noise_like",
    "global_l1_norm",
    "global_l2_norm",
    "l1_sensitivity_factor",
    "l2_sensitivity_factor",
    "laplace_noise_like",
    "make_generator",
    "noise_generator",
    "secret_seed",
    "secure_generator",
    "to_dp_event",
]
