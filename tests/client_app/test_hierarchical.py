"""Client side of hierarchical FL: its edge, its mode, and CP-NP's delta-only reply."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from client_app.halves import frontloaded, hierarchical
from protocol import keys


def test_edge_comes_from_node_config_or_the_partition_block():
    assert hierarchical.edge_id({}, partition_id=3, num_partitions=4, num_edges=2) == 1
    assert hierarchical.edge_id({"edge-id": 0}, partition_id=3, num_partitions=4, num_edges=2) == 0
    with pytest.raises(ValueError, match="'edge-id' = 5 is not in"):
        hierarchical.edge_id({"edge-id": 5}, partition_id=3, num_partitions=4, num_edges=2)


def test_baseline_has_no_mode():
    assert frontloaded.front_loaded(ConfigRecord({})) is None
    mode = frontloaded.front_loaded(
        ConfigRecord(
            {
                keys.FRONT_LOADED_MODE: "cp-np",
                keys.FRONT_LOADED_CLIP: 2.0,
                keys.FRONT_LOADED_SIGMA: 0.5,
            }
        )
    )
    assert (mode.mode, mode.clip, mode.sigma, mode.per_example) == ("cp-np", 2.0, 0.5, False)


def test_cp_np_replies_the_clipped_delta_only():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    received = ArrayRecord(model.state_dict())
    with torch.no_grad():
        model[0].weight.add_(10.0)  # a large update: ||delta|| = sqrt(6) * 10
    dp = frontloaded.FrontLoadedDP(mode="cp-np", clip=1.0, sigma=0.0)

    reply, metrics = frontloaded.cp_np_reply(model, received, dp, seed=0)

    delta = reply.to_torch_state_dict()
    assert list(delta) == list(model.state_dict())  # the model's keys, nothing else
    norm = torch.sqrt(sum((t.float() ** 2).sum() for t in delta.values()))
    assert norm == pytest.approx(1.0, rel=1e-5)  # clipped to C; no noise (sigma 0)
    assert torch.allclose(delta["0.weight"], torch.full((2, 3), 1 / 6**0.5), rtol=1e-5)
    assert delta["1.num_batches_tracked"].item() == 0  # counters: a zero delta
    assert metrics["update-norm"] == pytest.approx(10 * 6**0.5, rel=1e-5)


def test_cp_np_noise_differs_between_edge_aggregations():
    model = torch.nn.Linear(50, 50)
    received = ArrayRecord(model.state_dict())
    dp = frontloaded.FrontLoadedDP(mode="cp-np", clip=1.0, sigma=1.0)

    first, _ = frontloaded.cp_np_reply(model, received, dp, seed=1)
    second, _ = frontloaded.cp_np_reply(model, received, dp, seed=2)
    again, _ = frontloaded.cp_np_reply(model, received, dp, seed=1)

    a, b, c = (r.to_torch_state_dict()["weight"] for r in (first, second, again))
    assert not torch.equal(a, b) and torch.equal(a, c)
    assert a.std().item() == pytest.approx(1.0, rel=0.05)
