"""SmartFedProx under DP-FedAvg: each sampled client releases its divergence clipped
and noised (the scale the ledger charges), every round charges that release beside the
model update, and selection and mu read only the released values."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from scipy.optimize import brentq
from scipy.stats import norm

from config.settings import RunOptions
from privacy.accounting import PrivacyLedger
from privacy.mechanisms import BoundedScalarRelease, NonFiniteUpdateError
from protocol import keys
from server_app import config as app_config
from strategies import registry
from strategies.algorithms.smart_fedprox.strategy import SmartFedProx
from strategies.mechanisms.dp_fedavg import DivergenceRelease, DPFedAvgFixed, dp_fedavg_mod
from strategies.mechanisms.dp_fedavg_adaptive import DPFedAvgAdaptive
from strategies.mechanisms.threat_models import run_report
from tests.fakes import FakeGrid, instruction, record
from tests.inprocess import run_config

GLOBAL = {"w": [0.0, 0.0]}
NODES = range(1, 9)


def _smart(**overrides) -> SmartFedProx:
    settings = {
        "selection": "hybrid",
        "adaptive_mu": True,
        "cold_start_rounds": 1,
        "exploration_rate": 0.0,
        "mu_min": 0.0,
        "mu_max": 1.0,
        "local_epochs": 1,
        "seed": 3,
        "sample_size": 4,
        "connect_timeout": 0.0,
    } | overrides
    return SmartFedProx(1.0, 1.0, 1, 1, 1, **settings)


def _wrapper(cls=DPFedAvgFixed, *, z=1.0, clip=1.0, report=None, accountant="rdp", **kw):
    ledger = PrivacyLedger(accountant=accountant, target_delta=1e-5, sampling="none")
    return cls(
        _smart(),
        clip_norm=clip,
        noise_multiplier=z,
        num_sampled_clients=4,
        noise_site=kw.pop("site", "server"),
        ledger=ledger,
        rng=np.random.default_rng(0),
        uniform_sampling=False,
        divergence=report or DivergenceRelease(),
        **kw,
    )


def _context(node: int) -> Context:
    """Node ``node``'s context; its noise derives from the seed so runs compare."""
    return Context(
        run_id=1,
        node_id=node,
        node_config={"partition-id": node, "num-partitions": 9},
        state=RecordDict(),
        run_config={"seed": 7, "dp.reproducible-noise": True},
    )


def _client(raw_divergence: float, delta=(0.1, 0.0)):
    """A ClientApp that trains to GLOBAL + delta and reports ``raw_divergence``."""

    def call_next(msg: Message, ctxt: Context) -> Message:
        arrays = record({"w": np.add(GLOBAL["w"], delta)})
        metrics = MetricRecord({"num-examples": 10, keys.DIVERGENCE: raw_divergence})
        return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)

    return call_next


def _round(strategy, server_round: int, raw: dict[int, float]) -> list[Message]:
    """One round: configure, each selected node's reply through dp_fedavg_mod, aggregate.
    Returns the replies as the server received them."""
    messages = strategy.configure_train(
        server_round, record(GLOBAL), ConfigRecord({}), FakeGrid(NODES)
    )
    replies = []
    for message in messages:
        node = message.metadata.dst_node_id
        reply = dp_fedavg_mod(message, _context(node), _client(raw[node]))
        replies.append(reply)
    strategy.aggregate_train(server_round, replies)
    return replies


# -- the release itself ------------------------------------------------------------
def test_bounded_scalar_release_clips_then_adds_noise_of_std_z_bound():
    release = BoundedScalarRelease(bound=2.0, noise_multiplier=0.5)
    rng = np.random.default_rng(1)
    for raw, clipped in ((7.0, 2.0), (1.25, 1.25), (-3.0, 0.0)):
        draws = np.array([release.release(raw, rng=rng) for _ in range(4000)])
        assert draws.mean() == pytest.approx(clipped, abs=4 * 1.0 / math.sqrt(4000))
        assert draws.std() == pytest.approx(1.0, rel=0.05)  # z * bound
    with pytest.raises(NonFiniteUpdateError):
        release.release(math.nan, rng=rng)
    assert release.dp_event() == dp_accounting.GaussianDpEvent(0.5)


def test_client_releases_its_divergence_with_the_scale_the_ledger_charges():
    strategy = _wrapper(z=0.8, clip=1.5, report=DivergenceRelease(bound=3.0))
    (message, *_) = strategy.configure_train(1, record(GLOBAL), ConfigRecord({}), FakeGrid(NODES))
    config = message.content[keys.CONFIG]
    assert config[keys.DIVERGENCE_CLIP] == 3.0
    assert config[keys.DIVERGENCE_NOISE_STDDEV] == pytest.approx(0.8 * 3.0)  # z_d = z
    released = []
    for rnd in range(1, 2001):
        config = ConfigRecord({**config, keys.SERVER_ROUND: rnd})
        msg = instruction(GLOBAL, dict(config))
        reply = dp_fedavg_mod(msg, _context(2), _client(10.0))  # raw 10 is clipped to 3
        released.append(reply.content[keys.METRICS][keys.DIVERGENCE])
    (_, charged) = strategy.release(1, 8)
    assert charged.kind == "divergence-report" and charged.sampling == "none"
    assert np.mean(released) == pytest.approx(3.0, abs=4 * 2.4 / math.sqrt(2000))
    assert np.std(released) == pytest.approx(charged.noise_multiplier * 3.0, rel=0.05)


def test_a_failed_client_reports_zero_plus_noise():
    config = {
        keys.SERVER_ROUND: 1,
        keys.DP_CLIP_NORM: 1.0,
        keys.DP_NOISE_STDDEV: 0.1,
        keys.DIVERGENCE_CLIP: 1.0,
        keys.DIVERGENCE_NOISE_STDDEV: 1e-9,
    }
    msg = instruction(GLOBAL, config)

    def failing(msg, ctxt):
        raise RuntimeError("diverged")

    reply = dp_fedavg_mod(msg, _context(1), failing)
    assert reply.content[keys.METRICS][keys.DIVERGENCE] == pytest.approx(0.0, abs=1e-6)


# -- the ledger ------------------------------------------------------------------
def _gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact ε of mu-GDP at δ (Balle & Wang 2018, Thm 8), by root finding."""

    def gap(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(gap, 0.0, 500.0)


@pytest.mark.parametrize("cls", [DPFedAvgFixed, DPFedAvgAdaptive])
def test_every_round_charges_the_update_and_the_divergence_once(cls):
    # 3 rounds: each round's ε builds unsampled Gaussian PLDs afresh (~0.3 s each).
    z, z_d, rounds = 2.0, 3.0, 3
    kw = (
        {"target_quantile": 0.5, "clip_lr": 0.2, "clip_count_stddev": 4.0}
        if cls is DPFedAvgAdaptive
        else {}
    )
    strategy = _wrapper(
        cls, z=z, report=DivergenceRelease(noise_multiplier=z_d), accountant="pld", **kw
    )
    raw = dict.fromkeys(NODES, 0.5)
    for rnd in range(1, rounds + 1):
        _round(strategy, rnd, raw)
    kinds = [r.kind for r in strategy.ledger.releases]
    assert kinds.count("divergence-report") == rounds and len(kinds) == 2 * rounds
    assert all(r.sampling == "none" for r in strategy.ledger.releases)
    # Independent golden values: dp-accounting's PLD of the composed events, and the
    # exact mu-GDP curve of T Gaussians (z) and T Gaussians (z_d).
    # (Composition commutes: T of each, self-composed, as two PLDs rather than 2T.)
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), rounds),
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z_d), rounds),
        ]
    )
    pld = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(1e-5)
    exact = _gaussian_epsilon(math.sqrt(rounds * (z**-2 + z_d**-2)), 1e-5)
    assert strategy.ledger.epsilon() == pytest.approx(pld, rel=2e-3)
    assert strategy.ledger.epsilon() == pytest.approx(exact, rel=2e-3)
    assert strategy.ledger.epsilon() >= exact * (1 - 1e-9)  # an upper bound


def test_calibration_accounts_for_the_divergence_release():
    ledger = PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="none")
    strategy = DPFedAvgFixed(
        _smart(),
        clip_norm=1.0,
        noise_multiplier=None,
        target_epsilon=4.0,
        planned_rounds=6,
        num_sampled_clients=4,
        noise_site="server",
        ledger=ledger,
        rng=np.random.default_rng(0),
        uniform_sampling=False,
        divergence=DivergenceRelease(),
    )
    for rnd in range(1, 7):
        _round(strategy, rnd, dict.fromkeys(NODES, 0.3))
    assert strategy.ledger.epsilon() <= 4.0 + 1e-9
    assert strategy.ledger.epsilon() > 3.9  # calibrated for both releases, not one


def test_local_view_charges_each_client_its_divergence_with_client_noise():
    strategy = _wrapper(site="client", z=2.0, report=DivergenceRelease(noise_multiplier=3.0))
    _round(strategy, 1, dict.fromkeys(NODES, 0.3))
    _, worst = strategy.local_view.worst()
    z_upload = 2.0 / math.sqrt(4)  # the client's own share
    expected = _gaussian_epsilon(math.sqrt(z_upload**-2 + 3.0**-2), 1e-5)
    assert worst == pytest.approx(expected, rel=1e-6)


# -- selection reads only released values -------------------------------------------
def _history(raw_of_node_3: float) -> tuple[list, dict]:
    strategy = _wrapper(z=0.5, report=DivergenceRelease(bound=1.0))
    raw = {n: 0.1 * n for n in NODES} | {3: raw_of_node_3}
    for rnd in range(1, 7):
        _round(strategy, rnd, raw)
    smart = strategy.strategy
    rows = [(r["round"], r["node-id"], r["mode"], r["group"]) for r in smart.history]
    return rows, smart.divergences


def test_selection_does_not_change_when_a_raw_divergence_changes_but_its_release_does_not():
    # Node 3's raw divergence 5 or 500: both clip to the bound 1, the released values
    # (same secret-noise stand-in: the seed) are identical, so is every selection.
    rows_a, seen_a = _history(5.0)
    rows_b, seen_b = _history(500.0)
    assert rows_a == rows_b and seen_a == seen_b
    assert any(mode == "hybrid" for _, _, mode, _ in rows_a)
    # The server holds the released values, never the raw ones.
    assert all(v != 5.0 and v != 500.0 for v in seen_a.get(3, []))
    # A raw change that does change the release reaches the selection's inputs.
    _, seen_c = _history(0.05)
    assert seen_c.get(3) != seen_a.get(3)


def test_selection_reads_the_reply_not_the_client():
    strategy = _wrapper(z=0.5, report=DivergenceRelease(bound=1.0))
    raw = {n: 0.1 * n for n in NODES}
    replies = _round(strategy, 1, raw)
    released = {r.metadata.src_node_id: r.content[keys.METRICS][keys.DIVERGENCE] for r in replies}
    for node, value in released.items():  # the client's raw value changes afterwards
        raw[node] = 123.0
        assert strategy.strategy.divergences[node] == [value]
        assert strategy.strategy.historical[node] == pytest.approx(0.3 * value)


def test_the_ledger_report_says_no_amplification_is_claimed():
    strategy = _wrapper(z=1.0)
    _round(strategy, 1, dict.fromkeys(NODES, 0.3))
    run = RunOptions({"dp.noise-site": "server"})
    central = run_report("dp-fedavg-fixed", run, strategy)[0]
    assert central["holds"] and "no amplification claimed" in central["basis"]
    assert "divergence" in strategy.ledger.releases[1].note


def test_the_app_builds_a_zero_out_ledger_without_sampling_and_m_selected_clients():
    cfg = app_config.load(
        run_config(strategy="smart-fedprox", privacy="dp-fedavg-adaptive", task="finance")
    )
    strategy = registry.build(cfg.privacy, cfg.strategy_settings())
    assert strategy.ledger.sampling == "none"  # whatever dp.sampling says
    assert strategy.ledger.neighboring == "zero-out"  # removal would change the selection
    assert strategy.strategy.sample_size == cfg.options["dp.num-sampled-clients"]
    assert strategy.divergence == DivergenceRelease()
