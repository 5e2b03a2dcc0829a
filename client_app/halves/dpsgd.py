"""Sample-level DP-SGD, client half: the settings the task trains under.

The training itself is :mod:`privacy.dpsgd`'s, run by the task on its own model,
loss and data loader; the task reports the client's ``local-epsilon``.
"""

from __future__ import annotations

from flwr.app import ConfigRecord

from client_app.halves import ClientHalf, Round
from config.app import NUM_SERVER_ROUNDS
from privacy.dpsgd import DPSGD
from protocol import keys


def dp_sgd(config: ConfigRecord, run_config) -> DPSGD:
    """The DP-SGD settings the server sent (the planned rounds from the run-config)."""
    return DPSGD(
        noise_multiplier=float(config[keys.DPSGD_NOISE_MULTIPLIER]),
        max_grad_norm=float(config[keys.DPSGD_MAX_GRAD_NORM]),
        delta=float(config[keys.DPSGD_DELTA]),
        target_epsilon=float(config.get(keys.DPSGD_TARGET_EPSILON, 0.0)),
        planned_rounds=int(NUM_SERVER_ROUNDS.read(run_config)),
        max_epsilon=float(config.get(keys.DPSGD_MAX_EPSILON, 0.0)),
    )


class DPSGDHalf(ClientHalf):
    """Trains with DP-SGD when the server sends its settings."""

    def training(self, r: Round) -> dict:
        if keys.DPSGD_NOISE_MULTIPLIER not in r.config:
            raise ValueError(
                "privacy = 'dp-sgd' in this client's run-config, but the server sent no "
                f"'{keys.DPSGD_NOISE_MULTIPLIER}': the client does not train without DP-SGD"
            )
        return {"dp_sgd": dp_sgd(r.config, r.context.run_config)}
