"""The pieces DP-FedAvg and HierFAVG compose exist only when their feature is on, and
do what the code they came from did (hand-computed values)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import FedAvg

from privacy.accounting import PrivacyLedger
from protocol import keys
from strategies import StopTraining
from strategies.algorithms.edge_membership import EdgeMembership, Registration
from strategies.mechanisms.base import ReleasedArrays
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.mechanisms.head_only import HeadOnlyArrays
from strategies.mechanisms.upload_view import UploadView
from strategies.runtime.partitions import PartitionMap

# body: 2x3 floats, steps: an integer counter, head: 4 floats.
MODEL = ArrayRecord(
    {
        "body": Array(np.ones((2, 3))),
        "steps": Array(np.array([7], dtype=np.int64)),
        "head": Array(np.zeros(4)),
    }
)


def _dp(site: str = "server", released_keys=None) -> DPFedAvgFixed:
    ledger = PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="without-replacement")
    return DPFedAvgFixed(
        FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1),
        clip_norm=1.0,
        noise_multiplier=1.0,
        num_sampled_clients=4,
        noise_site=site,
        ledger=ledger,
        rng=np.random.default_rng(0),
        released_keys=released_keys,
    )


def test_a_plain_dp_fedavg_composes_neither_head_only_nor_an_upload_view():
    dp = _dp()
    assert type(dp.head) is ReleasedArrays
    assert dp.uploads is None and dp.local_view is None


def test_client_noise_composes_the_upload_view_over_the_local_ledger():
    dp = _dp(site="client")
    assert isinstance(dp.uploads, UploadView) and dp.local_view is dp.uploads.ledger
    # z / sqrt(m) / 2 (replace-one) = 1 / 2 / 2: one client's own share, no amplification.
    (upload,) = dp.uploads.releases(dp, server_round=3)
    assert upload.noise_multiplier == 0.25 and upload.sampling == "none"
    dp.uploads.charge(dp, ["a", "b"], server_round=3)
    assert dp.local_view.participations("a") == 1
    assert dp.local_view.participations("c") == 0
    published = dp.uploads.metrics()
    assert published[keys.DP_EPSILON_LOCAL] == pytest.approx(dp.local_view.bound())
    assert published[keys.DP_EPSILON_LOCAL_WORST] == pytest.approx(dp.local_view.worst()[1])


def test_every_floating_array_is_released_without_head_only():
    released = ReleasedArrays()
    assert released.fix(MODEL) and not released.fix(MODEL)
    assert released.mask == [True, False, True] and released.dim == 6 + 4
    delta = [np.full((2, 3), 2.0), np.array([5]), np.full(4, 3.0)]
    assert [a.shape for a in released.select(delta)] == [(2, 3), (4,)]


def test_head_only_releases_the_heads_floating_arrays_and_zeroes_the_rest():
    head = _dp(released_keys=("head", "steps")).head
    assert isinstance(head, HeadOnlyArrays)
    head.fix(MODEL)
    assert head.mask == [False, False, True] and head.dim == 4
    reference = [np.ones((2, 3)), np.array([7]), np.zeros(4)]
    merged = head.merge([np.full(4, 0.5)], reference)
    assert merged[0].tolist() == np.zeros((2, 3)).tolist() and merged[1].tolist() == [0]
    assert merged[2].tolist() == [0.5] * 4
    with pytest.raises(StopTraining, match=r"head-only arrays \['fc'\] are not in the global"):
        HeadOnlyArrays(("fc",)).fix(MODEL)


def test_edge_membership_lists_every_edge_and_its_registered_nodes():
    edges = EdgeMembership(3, PartitionMap(), timeout=1.0)
    edges.registrations.update({5: Registration(2, 1, 10), 3: Registration(0, 0, 4)})
    assert edges.members() == {0: [3], 1: [], 2: [5]}
    assert edges.table() == [
        {"node-id": 3, "edge-id": 0, "partition-id": 0, "num-examples": 4},
        {"node-id": 5, "edge-id": 2, "partition-id": 1, "num-examples": 10},
    ]
