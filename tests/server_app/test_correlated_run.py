"""A banded-MF run as `flwr run` makes it, in this process: the server keeps the cyclic
schema, ledger.json records it and the trusted-server ε is dp-accounting's."""

from __future__ import annotations

import json

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from privacy import correlated as cr
from privacy.accounting import PrivacyLedger
from server_app.results import load_metrics
from tests.inprocess import run_like_flwr

pytestmark = pytest.mark.usefixtures("learning_curve_not_rendered")


@pytest.mark.slow
def test_banded_mf_run_records_schema_sensitivity_and_epsilon(tmp_path, monkeypatch):
    monkeypatch.setenv(cr.CACHE_ENV, str(tmp_path / "cache"))
    # 4 SuperNodes, 2 a round, b = 2 groups: each client trains in 2 of the 4 rounds.
    result = run_like_flwr(
        "num-server-rounds=4 vision.local-epochs=1 vision.momentum=0.0 "
        "run.divergence-factor=0.0 privacy='banded-mf' dp.num-sampled-clients=2 "
        f"dp.noise-multiplier=1.5 dp.clip-norm=0.5 output-dir='{tmp_path}'"
    )
    assert result.returncode == 0 and result.run_dir is not None, result.output
    doc = json.loads((result.run_dir / "ledger.json").read_text())
    (release,) = doc["state"]["releases"]  # the whole run, charged at round 1
    assert release["server_round"] == 1
    assert "schema cyclic" in release["note"] and "k = 2" in release["note"]
    f = cr.optimize_banded(4, 2)
    sens = cr.sensitivity(f.strategy(), participations=2, min_separation=2).value
    assert release["noise_multiplier"] == pytest.approx(1.5 / sens, rel=1e-12)
    direct = (
        pld_privacy_accountant.PLDAccountant(
            dp_accounting.NeighboringRelation.REPLACE_SPECIAL, 1e-4
        )
        .compose(dp_accounting.GaussianDpEvent(1.5 / sens))
        .get_epsilon(1e-5)
    )
    ledger = PrivacyLedger.from_state_dict(doc["state"])
    assert ledger.epsilon() == pytest.approx(direct, rel=1e-9)
    trusted = {e["threat-model"]: e for e in doc["threat-models"]}["trusted-server"]
    assert trusted["holds"] and trusted["epsilon"] == pytest.approx(direct, rel=1e-9)
    assert "schema" in trusted["basis"]
    train = load_metrics(result.run_dir)
    train = train[train["scope"] == "train"]
    assert list(train["round"]) == [1, 2, 3, 4]
    assert train["dp-epsilon"].tolist() == pytest.approx([direct] * 4, rel=1e-9)
