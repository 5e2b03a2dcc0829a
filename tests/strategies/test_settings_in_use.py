"""A run checks the settings of what it uses: its strategy, its mechanism, and the
parts it turns on (``Settings.OFF``), not every part's."""

from __future__ import annotations

from config.settings import Choice
from server_app import config
from server_app.audit import AuditSettings
from strategies import registry
from strategies.algorithms.clustered import ClusterSettings
from strategies.algorithms.hierarchical_fedavg import HierSettings
from strategies.algorithms.server_optimizer import ServerOptimizerSettings
from strategies.algorithms.smart_fedprox.private import DivergenceSettings
from strategies.algorithms.smart_fedprox.strategy import SmartSettings
from strategies.mechanisms.base import DPSettings
from strategies.mechanisms.correlated_noise import CorrelatedSettings
from strategies.mechanisms.dp_fedavg_adaptive import AdaptiveClipSettings
from strategies.mechanisms.subspace_dp import SubspaceSettings
from strategies.secure.secagg_plus import SecAggSettings

OPTIONAL = {
    ClusterSettings, SmartSettings, HierSettings, SubspaceSettings, CorrelatedSettings,
    SecAggSettings, ServerOptimizerSettings, AuditSettings, DivergenceSettings,
    AdaptiveClipSettings,
}  # fmt: skip


def _checked(strategy: str = "fedavg", privacy: str = "none", **options) -> set[type]:
    parsed = {**config.load(config.defaults()).options, **options}
    run = Choice(strategy=strategy, privacy=privacy, task="digits", num_rounds=1, options=parsed)
    return set(registry.settings_to_check(config.PARTS, strategy, privacy, run))


def test_a_dp_fedavg_run_checks_only_the_app_wide_settings():
    checked = _checked(privacy="dp-fedavg-fixed")
    assert DPSettings in checked
    assert not checked & OPTIONAL


def test_the_chosen_strategy_mechanism_and_switched_on_parts_are_checked():
    checked = _checked(strategy="clustered", **{"secagg.enabled": True})
    assert checked & OPTIONAL == {ClusterSettings, SecAggSettings}
    assert _checked(privacy="cg-ng", strategy="hierarchical") & OPTIONAL == {HierSettings}
    assert _checked(privacy="dp-fedavg-adaptive") & OPTIONAL == {AdaptiveClipSettings}
    smart = {SmartSettings, DivergenceSettings}  # the divergence release is SmartFedProx's
    assert _checked(strategy="smart-fedprox", privacy="dp-fedavg-fixed") & OPTIONAL == smart
    assert _checked(**{"server.lr": 0.5}) & OPTIONAL == {ServerOptimizerSettings}
    assert _checked(**{"server.optimizer": "adam"}) & OPTIONAL == {ServerOptimizerSettings}


def test_a_part_is_off_only_at_all_of_its_off_values():
    run = config.load(config.defaults())
    assert not SecAggSettings.on_in(run) and not ServerOptimizerSettings.on_in(run)
    assert ServerOptimizerSettings().is_identity
    assert DPSettings.on_in(run)  # no OFF: on whenever chosen
