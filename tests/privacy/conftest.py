"""Fixtures of the privacy tests."""

from __future__ import annotations

import functools

import pytest
from dp_accounting.rdp import rdp_privacy_accountant

# dp-accounting's log-moment of the Gaussian subsampled without replacement at one
# integer order: a pure function, O(order²) in Python (about 1 s of CPU per (q, σ) over
# the app's RDP orders). The same (q, σ) recurs within a test (a calibration's search
# and its check, the app's ledger and the reference accountant), so it is memoised for
# this process; the values are the library's, bit for bit.
_wor_log_a = functools.lru_cache(maxsize=None)(
    rdp_privacy_accountant._compute_rdp_sample_wor_gaussian_int
)


@pytest.fixture(autouse=True, scope="module")
def memoised_without_replacement_rdp():
    """The memo above in place of dp-accounting's function, per module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rdp_privacy_accountant, "_compute_rdp_sample_wor_gaussian_int", _wor_log_a)
        yield
