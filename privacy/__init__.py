"""Privacy mechanisms and accounting (no Flower imports).

* ``privacy.mechanisms``: clipping (L2/L1), Gaussian and Laplace noise, the two-phase
  ``GaussianMechanism`` and ``LaplaceMechanism``, explicit generators.
* ``privacy.accounting``: the run's ``PrivacyLedger`` over dp-accounting.
* ``privacy.calibration``: noise multiplier for a target ε, ε for a multiplier.
* ``python -m privacy.budget``: the same from the command line.
"""

from __future__ import annotations

import importlib

# The names below, by the submodule that defines them. They are imported on first use
# (PEP 562), not with the package, so importing one submodule does not import the
# others. dp-accounting itself is imported by the functions that build its events or
# accountants (privacy.events), so neither app imports it at start-up
# (tests/test_layers.py; bench/BENCHMARKS.md).
_EXPORTS = {
    "privacy.accounting": (
        "AccountingError",
        "BudgetExceededError",
        "LocalGuarantee",
        "PrivacyLedger",
        "Release",
        "UnaccountedRelease",
        "l1_sensitivity_factor",
        "l2_sensitivity_factor",
        "to_dp_event",
    ),
    "privacy.calibration": (
        "accounted_noise_multiplier",
        "calibrate_noise_multiplier",
        "epsilon_for",
    ),
    "privacy.mechanisms": (
        "ClipResult",
        "GaussianMechanism",
        "LaplaceMechanism",
        "NonFiniteUpdateError",
        "add_noise",
        "clip_by_l1_norm",
        "clip_by_l2_norm",
        "gaussian_noise_like",
        "global_l1_norm",
        "global_l2_norm",
        "laplace_noise_like",
        "make_generator",
        "noise_generator",
        "secret_seed",
        "secure_generator",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'privacy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
