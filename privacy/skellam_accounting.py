"""The Skellam mechanism's dp-accounting event and the RDP accountant that composes it
(``privacy.skellam`` has the mechanism and its RDP curve, ``skellam_rdp``).

A module of its own because both subclass dp-accounting's types, so importing it imports
dp-accounting (~0.4 s of SciPy), which the encoding's users (every ClientApp) need not.
"""

from __future__ import annotations

import attr
import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant

from privacy.skellam import skellam_rdp

__all__ = ["SkellamDpEvent", "SkellamRdpAccountant"]


@attr.s(frozen=True, slots=True, auto_attribs=True)
class SkellamDpEvent(dp_accounting.DpEvent):
    """The Skellam mechanism: ``Sk(variance)`` added to each coordinate of an integer
    query with L2/L1 sensitivities ``l2_sensitivity``/``l1_sensitivity`` (integer units,
    under the ledger's neighbouring relation). Accounted by ``skellam_rdp``."""

    l2_sensitivity: float
    l1_sensitivity: float
    variance: float


class SkellamRdpAccountant(rdp_privacy_accountant.RdpAccountant):
    """dp-accounting's RDP accountant that also composes ``SkellamDpEvent`` (alone,
    self-composed or inside a composed event) by ``skellam_rdp``: what calibration
    and the ledger's checks compose with, so a Skellam release is accounted by the same
    conversion as every other. Extends the accountant's event traversal
    (``_maybe_compose``, dp-accounting 0.6) because dp-accounting has no hook for
    mechanisms it does not know."""

    def _maybe_compose(self, event, count, do_compose):
        if isinstance(event, SkellamDpEvent):
            if do_compose:
                self._rdp += count * skellam_rdp(
                    self._orders, event.l2_sensitivity, event.l1_sensitivity, event.variance
                )
            return None
        return super()._maybe_compose(event, count, do_compose)
