"""The array-built subsampled-Gaussian PLD is dp-accounting's own, bit for bit."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution

from privacy.fast_pld import from_subsampled_gaussian


@pytest.mark.parametrize(
    ("z", "q", "interval"),
    [
        (1.19, 0.05, 1e-3),
        (0.6, 0.1, 4e-3),
        (3.0, 0.01, 1e-4),
        (0.3, 0.5, 2e-3),
        # -log(1 - q) = 0.05 on the grid: the points next to the subsampling boundary.
        (1.0, -math.expm1(-0.05), 1e-3),
    ],
)
def test_equal_to_from_gaussian_mechanism(z, q, interval):
    expected = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=z,
        value_discretization_interval=interval,
        sampling_prob=q,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )
    built = from_subsampled_gaussian(z, q, interval)
    for want, got in (
        (expected._pmf_remove, built._pmf_remove),
        (expected._pmf_add, built._pmf_add),
    ):
        assert got._lower_loss == want._lower_loss
        assert got._infinity_mass == want._infinity_mass
        assert np.array_equal(got._probs, want._probs)
    assert built.self_compose(20).get_epsilon_for_delta(1e-5) == expected.self_compose(
        20
    ).get_epsilon_for_delta(1e-5)


def test_sampling_probability_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="sampling_prob"):
        from_subsampled_gaussian(1.0, 1.0, 1e-4)
