"""DP-FedAvg's secure noise site is given to it when the registry builds it (composition),
not set from outside by the SecAgg+ wrapper."""

from __future__ import annotations

import pytest

from server_app import config
from strategies import registry
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.runtime.capabilities import layers
from strategies.secure.distributed_dp import SecureNoise
from strategies.secure.secure_aggregation import SecureAggregation

DP = {
    "privacy": "dp-fedavg-fixed",
    "dp.noise-multiplier": 1.0,
    "dp.sampling": "fixed",
    "dp.num-sampled-clients": 4,
}


def _build(**overrides):
    cfg = config.load({**config.defaults(), **DP, **overrides})
    strategy = registry.build(cfg.privacy, cfg.strategy_settings())
    (dp,) = [layer for layer in layers(strategy) if isinstance(layer, DPFedAvgFixed)]
    return strategy, dp


@pytest.mark.parametrize("site", ["server", "client"])
def test_the_registry_gives_dp_fedavg_its_secure_noise_site(site):
    strategy, dp = _build(**{"secagg.enabled": True, "dp.noise-site": site})
    assert isinstance(strategy, SecureAggregation)
    assert isinstance(dp.secure, SecureNoise)
    assert dp.secure.distributed is (site == "client")
    assert dp.local_view is None  # the server never sees an upload


def test_without_secagg_there_is_no_secure_site():
    _, dp = _build(**{"dp.noise-site": "client"})
    assert dp.secure is None and dp.local_view is not None


def test_secagg_refuses_a_dp_wrapper_built_without_its_noise_site():
    _, dp = _build()
    settings = config.load({**config.defaults(), **DP, "secagg.enabled": True})
    with pytest.raises(ValueError, match="noise site given when it is built"):
        SecureAggregation(dp, registry.secagg_settings(settings))
