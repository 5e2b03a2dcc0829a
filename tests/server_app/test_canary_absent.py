"""A held-out audit canary is what the ledger's neighbouring relation calls "out".

Under Poisson sampling (add-or-remove-one) "out" is "absent": under adaptive clipping a
held-out canary's zero update would still send its norm bit, which adds ½ to the
centred count an absent client does not add to. It now answers with an error reply,
which the server counts like a client that is not there (zero update, nothing in the
count). Under fixed-size sampling (replace-one) it stays a zero-update client.
"""

from __future__ import annotations

import pytest

from client_app import canary
from privacy import audit
from protocol import keys
from tests.server_app.test_audit_run import REAL, K, _run


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_a_held_out_canary_sends_what_the_relation_allows(tmp_path, sampling):
    path, grid = _run(
        tmp_path,
        privacy="dp-fedavg-adaptive",
        # q = m / N = 1 under Poisson: every node is asked every round.
        **{"dp.sampling": sampling, "dp.num-sampled-clients": REAL + K, "dp.clip-norm": 0.5},
    )
    truth = audit.inclusion(grid.run_config["seed"], K)
    assert 0 < truth.sum() < K  # both kinds of canary take part
    held_out = inserted = 0
    for sent, reply in grid.exchanges:
        if sent.metadata.message_type != "train":
            continue
        pid = grid.contexts[sent.metadata.dst_node_id].node_config["partition-id"]
        index = canary.canary_index(grid.run_config, pid, REAL + K)
        if index is None:
            assert not reply.has_error()
            continue
        if truth[index]:  # in: its clipped direction and the bit of a clipped update
            inserted += 1
            assert reply.content[keys.METRICS][keys.DP_NORM_BIT] == 0.0
        elif sampling == "poisson":  # out = absent: nothing at all
            held_out += 1
            assert reply.has_error() and reply.error.reason == canary.HELD_OUT
        else:  # out = a zero update, a client like any other under replace-one
            held_out += 1
            assert reply.content[keys.METRICS][keys.DP_NORM_BIT] == 1.0
    assert held_out == 2 * (K - truth.sum()) and inserted == 2 * truth.sum()
    assert (path / "audit.json").is_file()


def test_only_adaptive_clipping_under_poisson_sampling_makes_a_canary_absent():
    adaptive = {keys.DP_ADAPTIVE: True}
    assert canary.absent_when_held_out(adaptive, {"dp.sampling": "poisson"})
    assert not canary.absent_when_held_out(adaptive, {"dp.sampling": "fixed"})
    assert not canary.absent_when_held_out({}, {"dp.sampling": "poisson"})
