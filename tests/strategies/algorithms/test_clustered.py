"""Clustered FedAvg (the PPO study section 5, IFCA) on hand-built uploads with three
well-separated groups, against hand-computed means, assignments and counts."""

import json
import logging
import math

import numpy as np
import pytest
from flwr.app import ConfigRecord

from protocol import keys
from strategies import StopTraining
from strategies.algorithms.clustered import (
    ClusteredFedAvg,
    match_by_members,
    model_seeds,
    unit_rows,
)
from strategies.runtime.partitions import QUERY_TYPE as PARTITION_QUERY
from tests.fakes import FakeGrid, error_from, partition_reply, record, reply_from

# Three groups of uploads: w near (0, 0), (10, 10), (-10, 5); b = the node id.
UPLOADS = {
    1: [0.3, 0.0],
    2: [-0.3, 0.3],
    3: [0.0, 0.6],  # group A: mean w (0, 0.3), mean b 2
    4: [10.2, 10.0],
    5: [9.8, 10.1],
    6: [10.0, 9.6],  # group B: mean w (10, 9.9), mean b 5
    7: [-10.1, 5.1],
    8: [-9.9, 5.1],
    9: [-10.0, 4.8],  # group C: mean w (-10, 5.0), mean b 8
}
GROUPS = {"A": (1, 2, 3), "B": (4, 5, 6), "C": (7, 8, 9)}
MEANS = {"A": ([0.0, 0.3], [2.0]), "B": ([10.0, 9.9], [5.0]), "C": ([-10.0, 5.0], [8.0])}
INITIAL = {"w": [0.0, 0.0], "b": [0.0]}
# Distinct global models, each closest to one group: C -> 0, A -> 1, B -> 2.
DISTINCT = [
    {"w": [-9.0, 4.0], "b": [8.0]},
    {"w": [1.0, 1.0], "b": [2.0]},
    {"w": [9.0, 9.0], "b": [5.0]},
]
INDEX = {"C": 0, "A": 1, "B": 2}


class QueryGrid(FakeGrid):
    """A FakeGrid that answers the cluster query with ``answers[node]`` (None: silent)."""

    def __init__(self, node_ids, answers=None):
        super().__init__(node_ids)
        self.answers = answers or {}
        self.sent = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == PARTITION_QUERY:
            return [partition_reply(m, m.metadata.dst_node_id) for m in messages]
        self.sent.extend(messages)
        replies = [self.answers.get(m.metadata.dst_node_id) for m in messages]
        return [r for r in replies if r is not None]


def _strategy(k=3, assign="l2", seed=7, **overrides):
    settings = {
        "fraction_train": 1.0,
        "fraction_evaluate": 1.0,
        "min_train_nodes": 1,
        "min_evaluate_nodes": 1,
        "min_available_nodes": 1,
        "query_timeout": 0.0,
    } | overrides
    return ClusteredFedAvg(k=k, assign=assign, seed=seed, **settings)


def _upload(node, shift=0.0, loss=None):
    arrays = {"w": np.add(UPLOADS[node], shift), "b": [node + shift]}
    return reply_from(node, arrays, {"num-examples": node, "train-loss": loss or float(node)})


def _configure(strategy, server_round=1, nodes=range(1, 10), grid=None):
    grid = grid or FakeGrid(nodes)
    messages = strategy.configure_train(
        server_round, record(INITIAL), ConfigRecord({"artifacts-dir": "x"}), grid
    )
    return {m.metadata.dst_node_id: m for m in messages}


def _sent_ids(messages):
    return {n: m.content[keys.CONFIG][keys.CLUSTER_ID] for n, m in messages.items()}


def _model(record_):
    return {key: record_[key].numpy().tolist() for key in record_}


def _assert_model(record_, w, b):
    np.testing.assert_allclose(record_["w"].numpy(), w, atol=1e-12)
    np.testing.assert_allclose(record_["b"].numpy(), b, atol=1e-12)


def _group_of(node):
    return next(g for g, members in GROUPS.items() if node in members)


def test_round_one_averages_each_group_and_reports_sizes():
    strategy = _strategy()
    sent = _configure(strategy)
    assert len(sent) == 9 and len(strategy.models) == 3
    assert all(_model(m) == {"w": [0.0, 0.0], "b": [0.0]} for m in strategy.models)
    config = sent[4].content[keys.CONFIG]
    assert config[keys.SERVER_ROUND] == 1 and config["artifacts-dir"] == "x"
    strategy.models = [record(m) for m in DISTINCT]  # matching is now hand-computable

    arrays, metrics = strategy.aggregate_train(1, [_upload(n) for n in range(1, 10)])

    for group, (w, b) in MEANS.items():
        _assert_model(strategy.models[INDEX[group]], w, b)
    _assert_model(arrays, *MEANS["C"])  # sizes 3/3/3: the lowest index wins
    assert [metrics[f"cluster-{k}-size"] for k in range(3)] == [3, 3, 3]
    ids = _sent_ids(sent)
    assert [metrics[f"assigned-{k}"] for k in range(3)] == [
        sum(v == k for v in ids.values()) for k in range(3)
    ]
    changed = sum(ids[n] != INDEX[_group_of(n)] for n in ids)
    assert metrics["clusters-changed"] == changed
    assert metrics["train-loss"] == pytest.approx(285 / 45)  # sum(i*i) / sum(i)
    assert "num-examples" not in metrics
    assert [(r["round"], r["node-id"]) for r in strategy.history] == [(1, n) for n in range(1, 10)]
    for row in strategy.history:
        assert row["assigned"] == ids[row["node-id"]]
        assert row["cluster"] == INDEX[_group_of(row["node-id"])]
        assert row["how"] == "random" and math.isnan(row["score"])
    assert strategy.largest_cluster() == 0


def test_round_two_l2_sends_every_node_its_groups_model():
    strategy = _strategy()
    _configure(strategy, nodes=range(1, 11))
    strategy.models = [record(m) for m in DISTINCT]
    strategy.aggregate_train(1, [_upload(n) for n in range(1, 10)] + [error_from(10)])

    sent = _configure(strategy, server_round=2, nodes=range(1, 11))

    for node in range(1, 10):
        group = _group_of(node)
        assert sent[node].content[keys.CONFIG][keys.CLUSTER_ID] == INDEX[group]
        assert sent[node].content[keys.CONFIG][keys.SERVER_ROUND] == 2
        _assert_model(sent[node].content[keys.ARRAYS], *MEANS[group])
    strategy.aggregate_train(2, [_upload(n) for n in range(1, 10)] + [error_from(10)])
    rows = {r["node-id"]: r for r in strategy.history if r["round"] == 2}
    assert rows[1]["how"] == "l2"
    # node 1 uploaded w (0.3, 0), b 1; model A is w (0, 0.3), b 2
    assert rows[1]["score"] == pytest.approx(math.sqrt(0.09 + 0.09 + 1.0))
    assert rows[10]["how"] == "random"  # its round-1 reply was an error: never seen
    round_one = {r["node-id"]: r["cluster"] for r in strategy.history if r["round"] == 1}
    assert round_one[10] == -1


def test_model_indices_stay_stable_over_two_rounds():
    strategy = _strategy()
    _configure(strategy)
    strategy.aggregate_train(1, [_upload(n) for n in range(1, 10)])
    first = {g: strategy.history[members[0] - 1]["cluster"] for g, members in GROUPS.items()}
    assert sorted(first.values()) == [0, 1, 2]
    for group, members in GROUPS.items():
        assert {strategy.history[n - 1]["cluster"] for n in members} == {first[group]}
        _assert_model(strategy.models[first[group]], *MEANS[group])

    sent = _configure(strategy, server_round=2)
    _, metrics = strategy.aggregate_train(2, [_upload(n, shift=0.5) for n in range(1, 10)])

    assert _sent_ids(sent) == {n: first[_group_of(n)] for n in range(1, 10)}
    second = {r["node-id"]: r["cluster"] for r in strategy.history if r["round"] == 2}
    assert second == {n: first[_group_of(n)] for n in range(1, 10)}
    for group, (w, b) in MEANS.items():
        _assert_model(strategy.models[first[group]], np.add(w, 0.5), np.add(b, 0.5))
    assert metrics["clusters-changed"] == 0
    assert [metrics[f"assigned-{k}"] for k in range(3)] == [3, 3, 3]


def test_round_one_ties_are_random_but_reproducible_for_a_seed():
    def first_round(seed):
        return _sent_ids(_configure(_strategy(seed=seed)))

    assert first_round(7) == first_round(7)
    assert len(set(first_round(7).values())) > 1  # not all on one model
    assert any(first_round(seed) != first_round(7) for seed in (8, 9, 10))


def test_loss_assignment_takes_each_nodes_argmin_and_randomises_bad_replies(caplog):
    def scores(node, values):
        metrics = {f"cluster-score-{k}": v for k, v in enumerate(values)}
        return reply_from(node, None, metrics, kind="evaluate.cluster")

    strategy = _strategy(assign="loss")
    grid = QueryGrid(range(1, 8))
    _configure(strategy, grid=grid)
    assert grid.sent == []  # round 1: all K models equal, nothing to ask
    strategy.aggregate_train(1, [])
    strategy.models = [record(m) for m in DISTINCT]
    grid.answers = {
        1: scores(1, [3.0, 1.0, 2.0]),
        2: scores(2, [0.5, 0.7, -1.0]),
        3: error_from(3, "no env"),
        4: scores(4, [0.1, 0.2]),  # cluster-score-2 missing
        5: scores(5, [0.1, float("nan"), 0.3]),
        # 6 does not answer
        7: scores(7, [1.0, 1.0, 5.0]),  # tie between 0 and 1
    }

    with caplog.at_level(logging.WARNING):
        sent = _configure(strategy, server_round=2, grid=grid)

    assert sorted(m.metadata.dst_node_id for m in grid.sent) == list(range(1, 8))
    for query in grid.sent:
        assert query.metadata.message_type == "evaluate.cluster"
        assert dict(query.content[keys.CONFIG]) == {"server-round": 2, "cluster-k": 3}
        for k in range(3):
            assert _model(query.content[f"cluster-model-{k}"]) == DISTINCT[k]
    assert _sent_ids(sent)[1] == 1 and _sent_ids(sent)[2] == 2
    _assert_model(sent[2].content[keys.ARRAYS], [9.0, 9.0], [5.0])
    assert _sent_ids(sent)[7] in (0, 1)
    for node in (3, 4, 5, 6):
        assert any(f"node {node} gets a random model" in r.getMessage() for r in caplog.records)
    strategy.aggregate_train(2, [error_from(n) for n in range(1, 8)])
    rows = {r["node-id"]: r for r in strategy.history if r["round"] == 2}
    assert (rows[1]["how"], rows[1]["score"]) == ("loss", 1.0)
    assert (rows[2]["how"], rows[2]["score"]) == ("loss", -1.0)
    assert all(rows[n]["how"] == "random" for n in (3, 4, 5, 6, 7))
    assert all(r["cluster"] == -1 for r in rows.values())
    assert [_model(m) for m in strategy.models] == DISTINCT  # no valid reply: unchanged


def test_invalid_train_replies_never_enter_an_aggregate(caplog):
    strategy = _strategy(k=2)
    _configure(strategy, nodes=range(1, 9))
    strategy.models = [record({"w": [0.0, 1.0], "b": [0.0]}), record({"w": [10, 11], "b": [0.0]})]
    metrics = {"num-examples": 1, "train-loss": 1000.0}
    replies = [
        reply_from(1, {"w": [0.0, 0.0], "b": [1.0]}, {"num-examples": 1, "train-loss": 1.0}),
        reply_from(2, {"w": [1.0, 0.0], "b": [3.0]}, {"num-examples": 3, "train-loss": 5.0}),
        reply_from(3, {"w": [10.0, 10.0], "b": [0.0]}, {"num-examples": 0, "train-loss": 9.0}),
        reply_from(4, {"w": [11.0, 10.0], "b": [0.0]}, {"num-examples": 0, "train-loss": 9.0}),
        error_from(5),
        reply_from(6, {"w": [np.nan, 0.0], "b": [0.0]}, metrics),
        reply_from(7, {"w": [0.0, 0.0, 0.0], "b": [0.0]}, metrics),  # wrong shape
        reply_from(8, {"w": [0.0, 0.0], "b": [0.0]}, {"train-loss": 1000.0}),  # no weight
        reply_from(99, {"w": [0.0, 0.0], "b": [0.0]}, metrics),  # was not sent a model
    ]

    with caplog.at_level(logging.WARNING):
        arrays, aggregated = strategy.aggregate_train(1, replies)

    _assert_model(strategy.models[0], [0.5, 0.0], [2.0])  # unweighted mean of 1 and 2
    _assert_model(strategy.models[1], [10.5, 10.0], [0.0])
    _assert_model(arrays, [0.5, 0.0], [2.0])  # sizes 2/2: the lowest index
    assert aggregated["train-loss"] == pytest.approx(0.25 * 1.0 + 0.75 * 5.0)
    assert (aggregated["cluster-0-size"], aggregated["cluster-1-size"]) == (2, 2)
    clusters = {r["node-id"]: r["cluster"] for r in strategy.history}
    assert clusters == {1: 0, 2: 0, 3: 1, 4: 1, 5: -1, 6: -1, 7: -1, 8: -1}
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 5 and any("node 99" in m for m in skipped)


def test_fewer_valid_replies_than_k_leave_unmatched_models_unchanged():
    strategy = _strategy()
    _configure(strategy)
    strategy.models = [record(m) for m in DISTINCT]

    arrays, metrics = strategy.aggregate_train(1, [_upload(1), _upload(4)])

    _assert_model(strategy.models[0], [-9.0, 4.0], [8.0])  # unmatched: unchanged
    _assert_model(strategy.models[1], [0.3, 0.0], [1.0])
    _assert_model(strategy.models[2], [10.2, 10.0], [4.0])
    assert [metrics[f"cluster-{k}-size"] for k in range(3)] == [0, 1, 1]
    assert strategy.largest_cluster() == 1
    _assert_model(arrays, [0.3, 0.0], [1.0])


def test_sampling_follows_fraction_and_minimum_and_is_reproducible():
    nodes = range(1, 11)
    assert len(_configure(_strategy(fraction_train=0.35, min_train_nodes=2), nodes=nodes)) == 3
    assert len(_configure(_strategy(fraction_train=0.35, min_train_nodes=5), nodes=nodes)) == 5
    runs = []
    for _ in range(2):
        strategy = _strategy(fraction_train=0.5, seed=3)
        runs.append([sorted(_configure(strategy, r, nodes)) for r in (1, 2)])
    assert runs[0] == runs[1] and len(runs[0][0]) == 5
    assert _configure(_strategy(fraction_train=0.0), nodes=nodes) == {}
    # Fewer than min-available after the timeout: the round goes on with those there;
    # fewer than the sample needs: the run ends.
    everyone = _strategy(min_available_nodes=20, fraction_train=1.0)
    assert len(_configure(everyone, nodes=nodes)) == 10
    with pytest.raises(StopTraining):
        _configure(_strategy(min_train_nodes=20), nodes=nodes)


def test_evaluation_sends_each_node_its_clusters_model_and_weights_metrics():
    strategy = _strategy(fraction_evaluate=1.0)
    _configure(strategy)
    strategy.models = [record(m) for m in DISTINCT]
    strategy.aggregate_train(1, [_upload(n) for n in range(1, 10)])

    messages = strategy.configure_evaluate(
        1, record(INITIAL), ConfigRecord(), FakeGrid(range(1, 11))
    )

    sent = {m.metadata.dst_node_id: m for m in messages}
    assert len(sent) == 10 and all(m.metadata.message_type == "evaluate" for m in messages)
    for node in range(1, 10):
        assert sent[node].content[keys.CONFIG][keys.CLUSTER_ID] == INDEX[_group_of(node)]
        _assert_model(sent[node].content[keys.ARRAYS], *MEANS[_group_of(node)])
    assert sent[10].content[keys.CONFIG][keys.CLUSTER_ID] == 0  # never clustered: largest
    replies = [
        reply_from(1, None, {"num-examples": 1, "eval-loss": 2.0}, kind="evaluate"),
        reply_from(2, None, {"num-examples": 3, "eval-loss": 6.0}, kind="evaluate"),
        error_from(3),
    ]
    assert strategy.aggregate_evaluate(1, replies)["eval-loss"] == pytest.approx(5.0)
    assert strategy.aggregate_evaluate(1, [error_from(3)]) is None


def test_state_is_json_and_summary_names_k_and_rule(caplog):
    strategy = _strategy(assign="loss")
    _configure(strategy)
    strategy.models = [record(m) for m in DISTINCT]
    strategy.aggregate_train(1, [_upload(n) for n in range(1, 10)])

    state = json.loads(json.dumps(strategy.state(), allow_nan=False))

    assert state["round"] == 1 and state["cluster-sizes"] == [3, 3, 3]
    assert state["node-clusters"] == {str(n): INDEX[_group_of(n)] for n in range(1, 10)}
    assert len(state["history"]) == 9 and state["history"][0]["score"] is None
    with caplog.at_level(logging.INFO):
        strategy.summary()
    assert "K = 3" in caplog.text and "IFCA" in caplog.text


def test_rejects_bad_k_and_rule():
    with pytest.raises(ValueError, match="k = 0"):
        _strategy(k=0)
    with pytest.raises(ValueError, match="assign"):
        _strategy(assign="nearest")


def test_tables_name_the_assignment_history():
    strategy = _strategy()

    assert strategy.tables() == {"clusters.csv": strategy.history}


# Two groups that move in two directions, one client of the first four times as far:
# the uploads from a model at 0 (k-means on weights splits node 2 off, SSE 1.49 against
# 4.52 for the groups), their unit directions (1, 0, 0) twice and (0, 1, 0) twice.
UNEVEN = {1: [1.0, 0.0], 2: [4.0, 0.0], 3: [0.0, 1.0], 4: [0.0, 1.2]}


def _uneven_round(space):
    strategy = _strategy(k=2, space=space)
    sent = _sent_ids(_configure(strategy, nodes=range(1, 5)))
    replies = [reply_from(n, {"w": w, "b": [0.0]}, {"num-examples": 1}) for n, w in UNEVEN.items()]
    strategy.aggregate_train(1, replies)
    return strategy, sent, {r["node-id"]: r["cluster"] for r in strategy.history}


def test_directions_keep_a_client_that_moved_farther_with_its_group():
    strategy, sent, clusters = _uneven_round("directions")

    assert clusters[1] == clusters[2] != clusters[3] == clusters[4]
    _assert_model(strategy.models[clusters[1]], [2.5, 0.0], [0.0])
    _assert_model(strategy.models[clusters[3]], [0.0, 1.1], [0.0])
    # Each cluster went to the model most of its members trained from: of the two
    # matchings, the one that keeps more nodes on the model they were sent.
    kept = sum(sent[n] == clusters[n] for n in UNEVEN)
    swapped = sum(sent[n] == 1 - clusters[n] for n in UNEVEN)
    assert kept >= swapped

    weights, _, split = _uneven_round("weights")
    assert split[1] == split[3] == split[4] != split[2]  # the PPO study's rule: by distance
    _assert_model(weights.models[split[2]], [4.0, 0.0], [0.0])
    _assert_model(weights.models[split[1]], [1 / 3, 2.2 / 3], [0.0])


def test_directions_are_taken_from_the_model_each_client_trained_from():
    strategy = _strategy(k=2, space="directions")
    models = [{"w": [0.0, 0.0], "b": [0.0]}, {"w": [10.0, 10.0], "b": [0.0]}]
    _configure(strategy, nodes=range(1, 5))
    strategy.models = [record(m) for m in models]
    strategy._pending = {
        1: (0, "l2", 0.0),
        2: (0, "l2", 0.0),
        3: (1, "l2", 0.0),
        4: (1, "l2", 0.0),
    }
    # 1 and 3 move along +w0 (from different models), 2 and 4 along +w1: by direction the
    # clusters are {1, 3} and {2, 4}, though by weights {1, 2} and {3, 4} lie together.
    uploads = {1: [1.0, 0.0], 2: [0.0, 3.0], 3: [12.0, 10.0], 4: [10.0, 10.5]}
    replies = [
        reply_from(n, {"w": w, "b": [0.0]}, {"num-examples": 1}) for n, w in uploads.items()
    ]

    _, metrics = strategy.aggregate_train(1, replies)

    clusters = {r["node-id"]: r["cluster"] for r in strategy.history}
    assert clusters[1] == clusters[3] != clusters[2] == clusters[4]
    assert metrics["clusters-changed"] == 2  # one of each pair left the model it was sent
    _assert_model(strategy.models[clusters[1]], [6.5, 5.0], [0.0])
    _assert_model(strategy.models[clusters[2]], [5.0, 6.75], [0.0])


def test_match_by_members_maximises_the_nodes_that_keep_their_model():
    labels = np.array([0, 0, 0, 1, 1, 2])
    assigned = np.array([2, 2, 0, 2, 1, 1])
    # counts (cluster x model): [[1, 0, 2], [0, 1, 1], [0, 1, 0]]: 0 -> 2, 1 -> 1 would
    # leave 2 nowhere; the best total (2 + 1 + 0 or 2 + 0 + 1) keeps three.
    matched = match_by_members(labels, assigned, 3)
    to_model = dict(zip(labels.tolist(), matched.tolist(), strict=True))
    assert sorted(to_model.values()) == [0, 1, 2] and to_model[0] == 2
    assert sum(matched == assigned) == 3
    # Fewer clusters than models: the unused model is left out.
    assert match_by_members(np.array([1, 1, 0]), np.array([2, 2, 0]), 3).tolist() == [2, 2, 0]


def test_unit_rows_scale_to_length_one_and_leave_a_zero_row_at_zero():
    rows = unit_rows(np.array([[3.0, 4.0], [0.0, 0.0], [-2.0, 0.0]]))
    np.testing.assert_allclose(rows, [[0.6, 0.8], [0.0, 0.0], [-1.0, 0.0]])


def test_rejects_an_unknown_space():
    with pytest.raises(
        ValueError, match="space = 'cosine'; valid values: \\('weights', 'directions'\\)"
    ):
        _strategy(space="cosine")


def test_assignment_update_averages_each_models_assignees_without_kmeans():
    # IFCA's update: node 1 (group A) and node 4 (group B) were sent model 0, nodes 2 and
    # 3 (group A) model 1, node 5 model 1 but its reply is an error. k-means would split
    # by group; by assignment model 0 averages 1 and 4 across the groups.
    strategy = _strategy(update="assignment")
    _configure(strategy, nodes=range(1, 6))
    strategy.models = [record(m) for m in DISTINCT]
    strategy._pending = {
        1: (0, "loss", -3.0),
        4: (0, "loss", -2.0),
        2: (1, "loss", -1.0),
        3: (1, "loss", -1.5),
        5: (1, "loss", -4.0),
    }

    arrays, metrics = strategy.aggregate_train(
        1, [_upload(1), _upload(4), _upload(2), _upload(3), error_from(5)]
    )

    _assert_model(strategy.models[0], [5.25, 5.0], [2.5])  # (0.3 + 10.2) / 2, ...
    _assert_model(strategy.models[1], [-0.15, 0.45], [2.5])
    _assert_model(strategy.models[2], *DISTINCT[2].values())  # no assignee: unchanged
    _assert_model(arrays, [5.25, 5.0], [2.5])  # sizes 2/2/0: the lowest index
    assert [metrics[f"cluster-{k}-size"] for k in range(3)] == [2, 2, 0]
    assert [metrics[f"assigned-{k}"] for k in range(3)] == [2, 3, 0]  # node 5 too
    assert metrics["clusters-changed"] == 0
    clusters = {r["node-id"]: r["cluster"] for r in strategy.history}
    assert clusters == {1: 0, 2: 1, 3: 1, 4: 0, 5: -1}
    assert strategy.state()["update"] == "assignment"


def test_assignment_update_keeps_a_loss_assigned_group_on_its_own_model():
    # IFCA's round: every node scores its group's model lowest, trains it, and each
    # model becomes the mean of its group's uploads.
    strategy = _strategy(assign="loss", update="assignment")
    _configure(strategy)
    strategy.models = [record(m) for m in DISTINCT]
    answers = {}
    for n in range(1, 10):
        scores = {f"cluster-score-{k}": float(k != INDEX[_group_of(n)]) for k in range(3)}
        answers[n] = reply_from(n, None, scores, kind="evaluate.cluster")
    grid = QueryGrid(range(1, 10), answers)
    sent = _sent_ids(_configure(strategy, server_round=2, grid=grid))
    assert sent == {n: INDEX[_group_of(n)] for n in range(1, 10)}

    strategy.aggregate_train(2, [_upload(n) for n in range(1, 10)])

    for group, (w, b) in MEANS.items():
        _assert_model(strategy.models[INDEX[group]], w, b)


def test_rejects_an_unknown_update_and_a_space_it_ignores():
    with pytest.raises(
        ValueError, match="update = 'ifca'; valid values: \\('kmeans', 'assignment'\\)"
    ):
        _strategy(update="ifca")
    with pytest.raises(ValueError, match="space = 'directions' has no effect with update"):
        _strategy(update="assignment", space="directions")


def test_distinct_init_queries_in_round_one_and_sends_each_node_its_pick():
    def scores(node, values):
        metrics = {f"cluster-score-{k}": v for k, v in enumerate(values)}
        return reply_from(node, None, metrics, kind="evaluate.cluster")

    strategy = _strategy(assign="loss", init="distinct")
    strategy.set_distinct_models([record(DISTINCT[1]), record(DISTINCT[2])])
    grid = QueryGrid(range(1, 4))
    grid.answers = {
        1: scores(1, [0.0, 1.0, 2.0]),
        2: scores(2, [5.0, -3.0, 2.0]),
        3: scores(3, [5.0, 4.0, 1.5]),
    }

    sent = _configure(strategy, nodes=range(1, 4), grid=grid)

    # Model 0 is the model the round was given; models 1 and 2 the distinct ones
    assert [_model(m) for m in strategy.models] == [INITIAL, DISTINCT[1], DISTINCT[2]]
    assert len(grid.sent) == 3  # round 1 asks: the models differ
    for query in grid.sent:
        assert [_model(query.content[f"cluster-model-{k}"]) for k in range(3)] == [
            INITIAL,
            DISTINCT[1],
            DISTINCT[2],
        ]
    assert _sent_ids(sent) == {1: 0, 2: 1, 3: 2}
    _assert_model(sent[1].content[keys.ARRAYS], [0.0, 0.0], [0.0])
    _assert_model(sent[3].content[keys.ARRAYS], [9.0, 9.0], [5.0])
    strategy.aggregate_train(1, [_upload(n) for n in range(1, 4)])
    rows = {r["node-id"]: (r["how"], r["score"]) for r in strategy.history}
    assert rows == {1: ("loss", 0.0), 2: ("loss", -3.0), 3: ("loss", 1.5)}
    assert strategy.state()["init"] == "distinct"


def test_distinct_models_are_copies_and_the_shared_init_ignores_none():
    given = [record(DISTINCT[1]), record(DISTINCT[2])]
    strategy = _strategy(update="assignment", init="distinct")
    strategy.set_distinct_models(given)
    given[0]["w"] = record({"w": [7.0, 7.0]})["w"]  # the caller's record, changed after
    _configure(strategy, nodes=range(1, 4))
    assert _model(strategy.models[1]) == DISTINCT[1]
    shared = _strategy()
    _configure(shared, nodes=range(1, 4))
    assert all(_model(m) == INITIAL for m in shared.models)


def test_distinct_init_refuses_missing_wrong_and_unasked_models():
    with pytest.raises(ValueError, match=r"init = 'random'; valid values: \('shared', 'di"):
        _strategy(init="random")
    with pytest.raises(ValueError, match="need init = 'distinct', not 'shared'"):
        _strategy().set_distinct_models([record(DISTINCT[1]), record(DISTINCT[2])])
    with pytest.raises(ValueError, match="K = 3 needs 2 distinct models, got 1"):
        _strategy(init="distinct").set_distinct_models([record(DISTINCT[1])])
    with pytest.raises(ValueError, match=r"needs models 1\.\.K-1 before round 1"):
        _configure(_strategy(init="distinct"), nodes=range(1, 4))
    strategy = _strategy(init="distinct")
    strategy.set_distinct_models([record(DISTINCT[1]), record({"w": [1.0, 2.0, 3.0], "b": [0.0]})])
    with pytest.raises(ValueError, match="distinct initial model 2: array 'w' has shape"):
        _configure(strategy, nodes=range(1, 4))
    strategy = _strategy(init="distinct")
    strategy.set_distinct_models([record(DISTINCT[1]), record({"w": [np.nan, 0.0], "b": [0.0]})])
    with pytest.raises(ValueError, match="distinct initial model 2: array 'w' contains NaN"):
        _configure(strategy, nodes=range(1, 4))


def test_model_seeds_are_reproducible_distinct_and_per_run_seed():
    assert model_seeds(0, 3) == model_seeds(0, 3)
    assert len(model_seeds(0, 3)) == 2 and len(set(model_seeds(0, 5))) == 4
    assert model_seeds(0, 3) != model_seeds(1, 3)
    assert model_seeds(0, 3) == model_seeds(0, 4)[:2]  # K does not reseed the first ones
    assert model_seeds(0, 1) == []
