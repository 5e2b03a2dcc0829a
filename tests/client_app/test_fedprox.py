"""Client side of SmartFedProx: effective mu, divergence report, EMA, FedBN layers."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, RecordDict

from client_app.halves import fedbn, fedprox
from protocol import keys

SMART = {
    keys.PROXIMAL_MU: 0.1,
    keys.SMART_ADAPTIVE_MU: True,
    keys.SMART_CLIENT_DIVERGENCE: 3.0,
    keys.SMART_GLOBAL_DIVERGENCE: 2.0,
    keys.SMART_LOCAL_EPOCHS: 3,
    keys.SMART_MU_MIN: 0.0,
    keys.SMART_MU_MAX: 1.0,
    keys.SMART_EMA_ALPHA: 0.3,
}


def test_plain_fedprox_trains_with_the_servers_mu():
    config = ConfigRecord({keys.PROXIMAL_MU: 0.25})
    assert fedprox.effective_mu(config, RecordDict()) == 0.25
    assert fedprox.effective_mu(ConfigRecord({}), RecordDict()) == 0.0


def test_adaptive_mu_starts_from_the_servers_copy_of_the_history():
    # h = 3, g = 2: factor 1 + 0.5 (1.5 - 1) = 1.25; 3 epochs: 1.2 -> 0.1 * 1.25 * 1.2
    mu = fedprox.effective_mu(ConfigRecord(SMART), RecordDict())

    assert mu == pytest.approx(0.15)


def test_adaptive_mu_prefers_the_clients_own_history():
    state = RecordDict({fedprox.SMART_STATE: ConfigRecord({fedprox.HISTORY: 1.0})})
    # h = 1, g = 2: factor 1 + 0.5 (0.5 - 1) = 0.75 -> 0.1 * 0.75 * 1.2
    assert fedprox.effective_mu(ConfigRecord(SMART), state) == pytest.approx(0.09)


def test_divergence_report_updates_the_clients_ema():
    model = torch.nn.Linear(2, 1, bias=False)
    received = fedprox.parameters(model)
    with torch.no_grad():
        model.weight.add_(torch.tensor([[3.0, 4.0]]))  # moved by distance 5
    state = RecordDict()

    metrics = fedprox.divergence_metrics(model, received, 0.15, ConfigRecord(SMART), state)

    # EMA from the server's 3.0: 0.3 * 5 + 0.7 * 3 = 3.6
    assert metrics == pytest.approx(
        {keys.DIVERGENCE: 5.0, keys.EFFECTIVE_MU: 0.15, keys.HISTORICAL_DIVERGENCE: 3.6}
    )
    assert float(state[fedprox.SMART_STATE][fedprox.HISTORY]) == pytest.approx(3.6)


def test_divergence_is_reported_without_smart_fedprox_too():
    model = torch.nn.Linear(1, 1)
    state = RecordDict()

    metrics = fedprox.divergence_metrics(
        model, fedprox.parameters(model), 0.0, ConfigRecord({}), state
    )

    assert metrics == {keys.DIVERGENCE: 0.0, keys.EFFECTIVE_MU: 0.0}
    assert fedprox.SMART_STATE not in state


def test_local_layers_survive_loading_the_global_model():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    names = ("1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked")
    state = RecordDict()
    with torch.no_grad():
        model[1].weight.fill_(7.0)
        model[1].running_mean.fill_(-2.0)
    fedbn.keep_local_layers(model, names, state)
    global_model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model.load_state_dict(global_model.state_dict())

    fedbn.restore_local_layers(model, names, state)

    assert torch.equal(model[1].weight, torch.full((2,), 7.0))
    assert torch.equal(model[1].running_mean, torch.full((2,), -2.0))
    assert torch.equal(model[0].weight, global_model[0].weight)  # the rest is global
