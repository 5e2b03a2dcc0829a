"""Noise given, or calibrated to ``dp.target-epsilon`` once the population is known.

A privacy wrapper that mixes :class:`CalibratedNoise` in states its whole planned run
as releases of one noise parameter p (larger: more private: a noise multiplier, or
1/ε of a Laplace round) in :meth:`CalibratedNoise.planned_releases`; at its first
round, with N known, :meth:`CalibratedNoise.calibrated` finds the smallest p whose run
stays within the target under the run's accountant
(:func:`privacy.calibration.calibrate_parameter`, dp-accounting's calibration), and
:meth:`CalibratedNoise.record_calibration` logs it and keeps the record the app writes
to ``ledger.json``. The ledger's budget (``dp.max-epsilon``, else the target) then
refuses a round beyond it, e.g. when the population shrinks.
"""

from __future__ import annotations

from logging import INFO

from flwr.common.logger import log

from privacy.accounting import AccountingError, PrivacyLedger, Release
from privacy.calibration import calibrate_parameter
from strategies.errors import StopTraining


class CalibratedNoise:
    """Mixin of a privacy wrapper with ``ledger``, ``target_epsilon`` (None: the noise
    was given) and ``planned_rounds`` (see the module docstring); the wrapper calls
    :meth:`calibrate` at round start (``PrivacyWrapper.nodes_for_round``)."""

    ledger: PrivacyLedger
    target_epsilon: float | None
    planned_rounds: int
    calibration: dict[str, float | str | None] | None = None

    def calibrate(self, population: int) -> None:
        """Set the noise for ``population`` clients unless it is set (the wrapper's)."""
        raise NotImplementedError

    def planned_releases(self, parameter: float, population: int) -> list[Release]:
        """The releases of the whole planned run with noise parameter ``parameter``."""
        raise NotImplementedError

    def calibrated(self, population: int) -> float:
        """The smallest noise parameter that keeps the planned run within the target.

        Raises
        ------
        StopTraining
            If the target cannot be met (nothing has been sent).
        """
        assert self.target_epsilon is not None
        try:
            return calibrate_parameter(
                lambda p: self.planned_releases(p, population),
                target_epsilon=self.target_epsilon,
                target_delta=self.ledger.target_delta,
                accountant=self.ledger.accountant,
                neighboring=self.ledger.neighboring,
            )
        except AccountingError as err:
            raise StopTraining(f"'dp.target-epsilon' = {self.target_epsilon:g}: {err}") from None

    def restore_plan(self) -> None:
        """Declare the calibrated run's plan to the ledger again (after a resume)."""
        if self.calibration:
            value, population = self.calibration["value"], self.calibration["population"]
            assert isinstance(value, float) and isinstance(population, int)
            self.ledger.plan(self.planned_releases(value, population))

    def record_calibration(self, key: str, value: float, population: int, **details) -> None:
        """Keep and log the calibrated ``value`` of the run-config key ``key``."""
        self.ledger.plan(self.planned_releases(value, population))  # ε exact at the end
        self.calibration = {
            "parameter": key,
            "value": value,
            "target-epsilon": self.target_epsilon,
            "target-delta": self.ledger.target_delta,
            "rounds": self.planned_rounds,
            "population": population,
            "sampling": self.ledger.sampling,
            "accountant": self.ledger.accountant,
            **details,
        }
        shown = (
            "noise multiplier z" if key == "dp.noise-multiplier" else "Laplace epsilon per round"
        )
        log(
            INFO,
            "DP calibration: %s = %.4f meets epsilon %g at delta %g over %d rounds (N = %d, "
            "sampling %s, accountant %s)",
            shown,
            value,
            self.target_epsilon,
            self.ledger.target_delta,
            self.planned_rounds,
            population,
            self.ledger.sampling,
            self.ledger.accountant,
        )
