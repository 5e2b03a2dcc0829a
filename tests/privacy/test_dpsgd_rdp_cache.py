"""DP-SGD's epsilon from a history, with the per-step RDP cached per (z, q): the same
float as Opacus' RDPAccountant, on the first call and on the calls that reuse it."""

from __future__ import annotations

import pytest
from opacus.accountants import RDPAccountant

from privacy.dpsgd import _rdp_per_step, epsilon_from_history

HISTORIES = [
    [(1.0, 0.05, 10)],
    [(1.0, 0.05, 40)],  # the same (z, q), more steps: a cache hit
    [(1.0, 0.05, 40), (0.7, 0.2, 3)],  # two entries, one of them cached
    [(2.0, 1.0, 5)],  # no subsampling
]


def opacus_epsilon(history, delta, orders=None) -> float:
    accountant = RDPAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta=delta, alphas=orders))


@pytest.mark.filterwarnings("ignore:Optimal order")
@pytest.mark.parametrize("orders", [None, [1.5, 2.0, 4.0, 8.0, 32.0]])
def test_cached_rdp_gives_opacus_epsilon_bit_for_bit(orders):
    _rdp_per_step.cache_clear()
    for history in HISTORIES:
        assert epsilon_from_history(history, 1e-5, orders) == opacus_epsilon(history, 1e-5, orders)
    info = _rdp_per_step.cache_info()
    assert (info.misses, info.hits) == (3, 2)  # (1.0, 0.05) three times, computed once


def test_the_cached_rdp_cannot_be_changed_by_a_caller():
    rdp = _rdp_per_step(1.0, 0.05, (2.0, 4.0))
    with pytest.raises(ValueError, match="read-only"):
        rdp[0] = 0.0
