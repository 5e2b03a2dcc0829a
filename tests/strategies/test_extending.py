"""docs/extending.md stays true: its toy mechanism, run exactly as the page writes it,
is a working privacy mechanism of the app (client mod, server wrapper, ledger, registry)."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, RecordDict

from client_app.mods import privacy_mod
from privacy.events import RDP_ORDERS
from protocol import keys
from strategies import registry
from tests.fakes import FakeGrid, instruction, record, reply_from
from tests.strategies.runtime.test_aggregation import SETTINGS

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
RECEIVED = {"w": [1.0, 1.0, 1.0], "b": [0.0]}


@pytest.fixture
def guide(monkeypatch):
    """The namespace of the guide's code blocks, run in order, with the registry's dicts
    copied first so that what the guide registers leaves with the test."""
    monkeypatch.setattr(registry, "PRIVACY", dict(registry.PRIVACY))
    monkeypatch.setattr(registry, "CLIENT_MODS", dict(registry.CLIENT_MODS))
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) == 3, "the guide's three steps: client half, server half, registry"
    namespace: dict = {"__name__": "toy_gaussian"}
    exec(compile("\n".join(blocks), str(GUIDE), "exec"), namespace)
    return namespace


def _context(privacy: str) -> Context:
    run_config = {"seed": 7, "dp.reproducible-noise": True, "privacy": privacy}
    return Context(1, 1, {"partition-id": 0, "num-partitions": 2}, RecordDict(), run_config)


def _delta(reply) -> list[float]:
    arrays = reply.content[keys.ARRAYS]
    got = np.concatenate([arrays[k].numpy() for k in ("w", "b")])
    return list(got - np.concatenate([RECEIVED["w"], RECEIVED["b"]]))


def test_the_guides_client_mod_clips_and_the_registry_chooses_it(guide):
    config = {keys.SERVER_ROUND: 1, guide["TOY_CLIP"]: 1.0}

    def trained(msg, ctxt):  # Δ = (3, 4, 0 | 0), L2 norm 5 -> clipped to 1
        return reply_from(1, {"w": [4.0, 5.0, 1.0], "b": [0.0]}, {"num-examples": 10})

    reply = privacy_mod(instruction(RECEIVED, config), _context("toy-gaussian"), trained)
    np.testing.assert_allclose(_delta(reply), [0.6, 0.8, 0.0, 0.0], atol=1e-12)
    direct = guide["toy_mod"](instruction(RECEIVED, config), _context("none"), trained)
    np.testing.assert_allclose(_delta(direct), [0.6, 0.8, 0.0, 0.0], atol=1e-12)


def test_the_guides_server_half_releases_a_noised_mean_and_charges_it(guide):
    options = {**SETTINGS.options, "dp.clip-norm": 1.0, "dp.noise-multiplier": 1e-4}
    strategy = registry.build("toy-gaussian", replace(SETTINGS, options=options))
    assert isinstance(strategy, guide["ToyGaussian"])
    arrays = record(RECEIVED)
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid([11, 22])))
    assert {m.content[keys.CONFIG][guide["TOY_CLIP"]] for m in messages} == {1.0}
    replies = [  # node 11 moved (3, 4, 0 | 0): clipped to (0.6, 0.8); node 22 (0, 0, 0.5 | 0)
        reply_from(11, {"w": [4.0, 5.0, 1.0], "b": [0.0]}, {"num-examples": 10}),
        reply_from(22, {"w": [1.0, 1.0, 1.5], "b": [0.0]}, {"num-examples": 10}),
    ]
    new, metrics = strategy.aggregate_train(1, replies)
    got = np.concatenate([new["w"].numpy(), new["b"].numpy()])
    # mean over m = 2: (0.3, 0.4, 0.25 | 0), noise std z·C/m = 5e-5
    np.testing.assert_allclose(got, [1.3, 1.4, 1.25, 0.0], atol=5e-4)
    # One Gaussian release of multiplier z, no amplification, as dp-accounting gives it.
    accountant = dp_accounting.rdp.RdpAccountant(RDP_ORDERS)
    accountant.compose(dp_accounting.GaussianDpEvent(1e-4))
    expected = accountant.get_epsilon(float(options["dp.target-delta"]))
    assert metrics[keys.DP_EPSILON] == pytest.approx(expected, rel=1e-9)
    assert math.isfinite(metrics[keys.DP_EPSILON])


def test_every_privacy_wrapper_has_its_client_mods_beside_it():
    assert set(registry.CLIENT_MODS) == set(registry.PRIVACY)
    assert registry.client_mods("none") == ()
    assert [m.__name__ for m in registry.client_mods("laplace")] == ["laplace_mod"]
    assert [m.__name__ for m in registry.client_mods("cp-np")] == ["front_loaded_mod"]
