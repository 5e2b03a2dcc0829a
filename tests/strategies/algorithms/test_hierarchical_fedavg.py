"""HierarchicalFedAvg (HierFAVG) against a scripted grid of clients: edge and
cloud aggregates, delta mode and sampling checked against hand-computed values."""

import logging
import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from protocol import keys
from strategies import StopTraining
from strategies.algorithms.hierarchical_fedavg import (
    QUERY_TYPE,
    TABLE_COLUMNS,
    HierarchicalFedAvg,
    apply_deltas,
    sample_edges,
    weighted_average,
)
from tests.fakes import FakeGrid, error_from, reply_from

# Two edges; the scripted clients' num-examples: edge 0 = {1: 1, 2: 3}, edge 1 = {3: 3, 4: 3}.
EDGES = {1: 0, 2: 0, 3: 1, 4: 1}
EXAMPLES = {1: 1, 2: 3, 3: 3, 4: 3}
LOSSES = {1: 4.0, 2: 8.0, 3: 1.0, 4: 3.0}


def _record(arrays: dict) -> ArrayRecord:
    """An ArrayRecord keeping each array's dtype (lists become float64)."""
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})


def _model(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: record[key].numpy() for key in record}


def _reply(node: int, arrays: dict, num_examples: float | None = None) -> Message:
    metrics = {"num-examples": num_examples or EXAMPLES[node], "train-loss": LOSSES.get(node, 0.0)}
    content = RecordDict({keys.METRICS: MetricRecord(metrics), keys.ARRAYS: _record(arrays)})
    sent = Message(content=RecordDict(), dst_node_id=node, message_type="train")
    return Message(content, reply_to=sent)


def fixed(uploads: dict):
    """Clients that upload ``uploads[node]`` whatever they were sent."""
    return lambda node, model: _reply(node, uploads[node])


def shifted(offsets: dict):
    """Clients that upload the model they were sent plus ``offsets[node]``."""
    return lambda node, model: _reply(node, {"w": model["w"] + np.asarray(offsets[node])})


class HierGrid(FakeGrid):
    """Answers the edge query from ``edges`` (an int, a MetricRecord dict, "error" or
    None: silent) and every train message with ``train(node, model)`` (None: silent)."""

    def __init__(self, train, edges=None):
        self.edges = dict(EDGES if edges is None else edges)
        super().__init__(sorted(self.edges))
        self.train = train
        self.batches: list[list[Message]] = []

    def send_and_receive(self, messages, *, timeout=None):
        self.batches.append(list(messages))
        replies = [self.answer(m) for m in self.batches[-1]]
        return [r for r in replies if r is not None]

    def answer(self, message: Message) -> Message | None:
        node = message.metadata.dst_node_id
        if message.metadata.message_type != QUERY_TYPE:
            return self.train(node, _model(message.content[keys.ARRAYS]))
        answer = self.edges[node]
        if answer == "error":
            return error_from(node, "no partition")
        if isinstance(answer, int):
            answer = {"edge-id": answer, "partition-id": node + 100, "num-examples": 7}
        return None if answer is None else reply_from(node, None, answer, kind=QUERY_TYPE)


def _strategy(**overrides) -> HierarchicalFedAvg:
    settings = dict(num_edges=2, edge_rounds=1, local_updates=6, client_fraction=1.0)
    settings |= dict(seed=1, timeout=0.0, min_available_nodes=1, min_evaluate_nodes=1)
    return HierarchicalFedAvg(**(settings | overrides))


def _round(strategy, grid, server_round=1, arrays=None):
    """One cloud round as server_app.rounds drives it: configure, send, aggregate."""
    arrays = arrays or _record({"w": [0.0, 0.0]})
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord({"x": 1}), grid))
    replies = grid.send_and_receive(messages)
    return messages, strategy.aggregate_train(server_round, replies)


def test_helpers_match_hand_values():
    arrays = [[np.array([0.0, 0.0])], [np.array([4.0, 8.0])]]
    np.testing.assert_allclose(weighted_average(arrays, [1, 3])[0], [3.0, 6.0])
    deltas = [[np.array([2.0, 0.0])], [np.array([0.0, 4.0])]]
    np.testing.assert_allclose(apply_deltas([np.ones(2)], deltas, [1, 3], 0.5)[0], [1.25, 2.5])
    rng = np.random.default_rng(0)
    assert len(sample_edges([0, 1, 2, 3, 4], 0.4, rng)) == 2
    assert len(sample_edges([0, 1, 2], 0.01, rng)) == 1 and sample_edges([], 1.0, rng) == []
    with pytest.raises(ValueError, match="positive"):
        weighted_average(arrays, [0, 0])


def test_edge_and_cloud_aggregates_are_weighted_by_num_examples():
    uploads = {1: {"w": [0.0, 0.0]}, 2: {"w": [4.0, 8.0]}, 3: {"w": [10.0, 10.0]}}
    uploads[4] = {"w": [2.0, 6.0]}
    strategy = _strategy(client_config={"mode": "cg-ng", "sigma": 0.5})
    grid = HierGrid(fixed(uploads))

    messages, (arrays, metrics) = _round(strategy, grid)

    query = grid.batches[0]
    assert sorted(m.metadata.dst_node_id for m in query) == [1, 2, 3, 4]
    assert {m.metadata.message_type for m in query} == {"query.edge"}
    assert dict(query[0].content[keys.CONFIG]) == {"server-round": 1, "num-edges": 2}
    assert strategy.membership() == {0: [1, 2], 1: [3, 4]}
    config = {m.metadata.dst_node_id: dict(m.content[keys.CONFIG]) for m in messages}
    assert config[3] == {
        "x": 1,
        "mode": "cg-ng",
        "sigma": 0.5,
        "server-round": 1,
        "edge-id": 1,
        "edge-round": 1,
        "local-updates": 6,
    }
    assert {m.metadata.message_type for m in messages} == {"train"}
    # edge 0: (1 * (0, 0) + 3 * (4, 8)) / 4; edge 1: (3 * (10, 10) + 3 * (2, 6)) / 6
    np.testing.assert_allclose(_model(strategy.models[0])["w"], [3.0, 6.0])
    np.testing.assert_allclose(_model(strategy.models[1])["w"], [6.0, 8.0])
    # cloud: (4 * (3, 6) + 6 * (6, 8)) / 10
    np.testing.assert_allclose(_model(arrays)["w"], [4.8, 7.2])
    assert metrics["train-loss"] == pytest.approx((4 + 24 + 3 + 9) / 10)
    assert metrics["edge-0-train-loss"] == pytest.approx(7.0)  # (4 + 24) / 4
    assert metrics["edge-1-train-loss"] == pytest.approx(2.0)
    assert (metrics["edge-0-clients"], metrics["edge-1-clients"]) == (2, 2)
    assert (metrics["edges"], metrics["failed-replies"], metrics["failed-queries"]) == (2, 0, 0)
    assert "num-examples" not in metrics


def test_second_edge_aggregation_starts_from_the_first_and_next_round_from_the_cloud():
    offsets = {1: [1.0, 0.0], 2: [0.0, 4.0], 3: [2.0, 2.0], 4: [-2.0, 0.0]}
    strategy = _strategy(edge_rounds=2)
    grid = HierGrid(shifted(offsets))

    messages, (arrays, metrics) = _round(strategy, grid)

    first = {m.metadata.dst_node_id: m for m in grid.batches[1]}
    assert all(_model(m.content[keys.ARRAYS])["w"].tolist() == [0, 0] for m in first.values())
    assert {m.content[keys.CONFIG]["edge-round"] for m in first.values()} == {1}
    second = {m.metadata.dst_node_id: m for m in messages}
    assert {m.content[keys.CONFIG]["edge-round"] for m in second.values()} == {2}
    # edge 0 moves by (1 * (1, 0) + 3 * (0, 4)) / 4 = (0.25, 3) per edge round, edge 1 by (0, 1)
    np.testing.assert_allclose(_model(second[2].content[keys.ARRAYS])["w"], [0.25, 3.0])
    np.testing.assert_allclose(_model(second[4].content[keys.ARRAYS])["w"], [0.0, 1.0])
    np.testing.assert_allclose(_model(strategy.models[0])["w"], [0.5, 6.0])
    np.testing.assert_allclose(_model(strategy.models[1])["w"], [0.0, 2.0])
    # cloud weights: the replies of both edge rounds, 8 and 12
    np.testing.assert_allclose(_model(arrays)["w"], [0.2, 3.6])
    assert metrics["edge-0-clients"] == 4

    grid.batches.clear()
    _round(strategy, grid, server_round=2, arrays=arrays)

    assert len(grid.batches) == 2  # every node registered: no second query
    for message in grid.batches[0]:  # edge round 1 of cloud round 2 starts from the cloud
        np.testing.assert_allclose(_model(message.content[keys.ARRAYS])["w"], [0.2, 3.6])


def test_delta_mode_adds_eta_times_the_weighted_mean_delta():
    deltas = {1: {"w": [2.0, 0.0]}, 2: {"w": [0.0, 4.0]}, 3: {"w": [4.0, 4.0]}}
    deltas[4] = {"w": [-2.0, 0.0]}
    strategy = _strategy(delta_updates=True, eta=0.5)

    _, (arrays, _) = _round(strategy, HierGrid(fixed(deltas)), arrays=_record({"w": [1.0, 1.0]}))

    # edge 0: (1, 1) + 0.5 * (0.5, 3); edge 1: (1, 1) + 0.5 * (1, 2)
    np.testing.assert_allclose(_model(strategy.models[0])["w"], [1.25, 2.5])
    np.testing.assert_allclose(_model(strategy.models[1])["w"], [1.5, 2.0])
    np.testing.assert_allclose(_model(arrays)["w"], [1.4, 2.2])  # (4 * e0 + 6 * e1) / 10


def _sampling_run(seed: int, rounds: int = 3) -> tuple[list, list]:
    """40 nodes on 4 edges (10 each), cfrac 0.3, efrac 0.5, tau_2 = 2."""
    calls = []
    edges = {n: (n - 1) // 10 for n in range(1, 41)}
    strategy = _strategy(
        num_edges=4,
        edge_rounds=2,
        client_fraction=0.3,
        edge_fraction=0.5,
        seed=seed,
        on_edge_aggregation=lambda *args: calls.append(args),
    )
    grid = HierGrid(lambda node, model: _reply(node, {"w": model["w"] + 1}, 2), edges)
    for server_round in range(1, rounds + 1):
        _round(strategy, grid, server_round)
    trains = [
        sorted(m.metadata.dst_node_id for m in batch)
        for batch in grid.batches
        if batch[0].metadata.message_type == "train"
    ]
    return trains, calls


def test_sampling_counts_follow_the_fractions_and_the_seed():
    trains, calls = _sampling_run(seed=3)

    assert len(trains) == 6 and all(len(nodes) == 6 for nodes in trains)  # 2 edges x 3
    assert [(c[0], c[1]) for c in calls] == [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)]
    assert all(len(c[2]) == 2 and set(c[2].values()) == {(3, 10)} for c in calls)
    for (_, _, sizes), nodes in zip(calls, trains, strict=True):  # the sampled nodes' edges
        assert sorted(sizes) == sorted({(n - 1) // 10 for n in nodes})
    assert len({tuple(nodes) for nodes in trains}) > 1  # a fresh sample every time
    assert _sampling_run(seed=3) == (trains, calls)
    assert any(_sampling_run(seed)[0] != trains for seed in (4, 5, 6))


def test_at_least_one_edge_and_one_client_take_part():
    calls = []
    strategy = _strategy(client_fraction=0.01, edge_fraction=0.01)
    strategy.on_edge_aggregation = lambda *args: calls.append(args)

    messages, _ = _round(strategy, HierGrid(shifted(dict.fromkeys(EDGES, (1.0, 0.0)))))

    assert len(messages) == 1
    assert calls == [(1, 1, {EDGES[messages[0].metadata.dst_node_id]: (1, 2)})]


def test_edge_hooks_run_once_per_edge_aggregation_with_sample_and_size():
    calls = []
    strategy = _strategy(
        edge_rounds=3,
        on_edge_aggregation=lambda *a: calls.append(("after", *a)),
        before_edge_aggregation=lambda *a: calls.append(("before", *a)),
    )
    grid = HierGrid(shifted(dict.fromkeys(EDGES, (1.0, 0.0))))
    arrays = _record({"w": [0.0, 0.0]})

    messages = strategy.configure_train(1, arrays, ConfigRecord(), grid)
    assert [c[:3] for c in calls] == [
        ("before", 1, 1),
        ("after", 1, 1),
        ("before", 1, 2),
        ("after", 1, 2),
        ("before", 1, 3),  # its "after" comes with aggregate_train
    ]
    strategy.aggregate_train(1, grid.send_and_receive(messages))

    sizes = {0: (2, 2), 1: (2, 2)}
    assert [c for c in calls if c[0] == "after"] == [("after", 1, k, sizes) for k in (1, 2, 3)]
    assert all(c[3] == sizes for c in calls)


def test_before_hook_may_stop_the_run_before_anything_is_sent():
    def refuse(server_round, k, sizes):
        if k == 2:
            raise StopTraining("budget")

    strategy = _strategy(edge_rounds=2, before_edge_aggregation=refuse)
    grid = HierGrid(shifted(dict.fromkeys(EDGES, (1.0, 0.0))))

    with pytest.raises(StopTraining, match="budget"):
        strategy.configure_train(1, _record({"w": [0.0, 0.0]}), ConfigRecord(), grid)

    assert [b[0].metadata.message_type for b in grid.batches] == ["query.edge", "train"]


def test_invalid_query_and_train_replies_are_skipped_and_counted(caplog):
    edges = EDGES | {5: {"edge-id": 7, "partition-id": 5, "num-examples": 1}, 6: "error"}
    edges |= {7: None, 8: {"edge-id": 1.5, "partition-id": 8, "num-examples": 1}}
    bad = {
        1: error_from(1, "out of memory"),
        2: _reply(2, {"w": [np.nan, 0.0]}),
        3: _reply(3, {"w": [1.0, 2.0, 3.0]}),  # wrong shape
        4: _reply(4, {"w": [5.0, 5.0]}),
    }
    strategy = _strategy()
    grid = HierGrid(lambda node, model: bad[node], edges)

    with caplog.at_level(logging.WARNING):
        _, (arrays, metrics) = _round(strategy, grid)

    assert strategy.membership() == {0: [1, 2], 1: [3, 4]}
    np.testing.assert_allclose(_model(strategy.models[0])["w"], [0.0, 0.0])  # kept
    np.testing.assert_allclose(_model(arrays)["w"], [5.0, 5.0])  # edge 1 alone: node 4
    assert (metrics["failed-replies"], metrics["failed-queries"]) == (3, 4)
    assert (metrics["edge-0-clients"], metrics["edge-1-clients"], metrics["edges"]) == (0, 1, 2)
    rows = {r["node-id"]: r for r in strategy.tables()["edges.csv"]}
    assert set(rows[1]) == set(TABLE_COLUMNS)
    assert "out of memory" in rows[1]["reason"] and "NaN" in rows[2]["reason"]
    assert "shape" in rows[3]["reason"] and not rows[3]["replied-ok"]
    assert (rows[4]["replied-ok"], rows[4]["num-examples"], rows[4]["partition-id"]) == (
        True,
        3.0,
        104,
    )
    assert rows[4]["train-loss"] == 3.0 and math.isnan(rows[1]["train-loss"])
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "node 5 not registered" in logged and "'edge-id' = 7" in logged
    assert all(f"node {n} not registered" in logged for n in (6, 7, 8))

    grid.batches.clear()
    grid.train = lambda node, model: error_from(node)
    _, result = _round(strategy, grid, server_round=2, arrays=arrays)

    assert sorted(m.metadata.dst_node_id for m in grid.batches[0]) == [5, 6, 7, 8]  # asked again
    assert result == (None, None)  # no valid edge aggregation: the cloud model stays


def test_integer_arrays_keep_their_dtype_and_round():
    def upload(node, model):
        w = model["w"] + np.float32(node)
        return _reply(node, {"w": w, "count": np.asarray([{1: 1, 2: 2, 3: 5, 4: 6}[node]])})

    strategy = _strategy()
    grid = HierGrid(upload)
    initial = {"w": np.zeros(2, np.float32), "count": np.zeros(1, np.int64)}

    _, (arrays, _) = _round(strategy, grid, arrays=_record(initial))

    counts = [_model(m)["count"] for m in strategy.models]
    assert [c.dtype for c in counts] == [np.int64, np.int64]
    assert [c.tolist() for c in counts] == [[2], [6]]  # rint(1.75), rint(5.5)
    assert _model(arrays)["count"].dtype == np.int64 and _model(arrays)["w"].dtype == np.float32
    assert _model(arrays)["count"].tolist() == [4]  # rint((4 * 2 + 6 * 6) / 10)
    np.testing.assert_allclose(_model(arrays)["w"], [2.8, 2.8], rtol=1e-6)  # 1.75 and 3.5

    _, (_, metrics) = _round(strategy, grid, server_round=2, arrays=arrays)
    assert metrics["failed-replies"] == 0  # the rounded int64 model validates again


def test_too_few_nodes_stop_training_and_no_members_send_nothing():
    with pytest.raises(StopTraining, match=r"0 node\(s\) connected .* needs at least 1"):
        _round(_strategy(min_available_nodes=5), HierGrid(fixed({}), edges={}))
    # Fewer than min-available after the timeout: the round goes on with those there.
    uploads = {node: {"w": [1.0, 1.0]} for node in EDGES}
    messages, _ = _round(_strategy(min_available_nodes=9), HierGrid(fixed(uploads)))
    assert sorted(m.metadata.dst_node_id for m in messages) == sorted(EDGES)
    strategy = _strategy()
    grid = HierGrid(fixed({}), edges=dict.fromkeys(EDGES, "error"))

    messages, result = _round(strategy, grid)

    assert messages == [] and result == (None, None)


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ({"num_edges": 0}, "hier.num-edges"),
        ({"edge_rounds": 0}, "hier.edge-rounds"),
        ({"local_updates": 0}, "hier.local-updates"),
        ({"client_fraction": 0.0}, "hier.client-fraction"),
        ({"edge_fraction": 1.5}, "hier.edge-fraction"),
        ({"eta": 0.0}, "hier.eta"),
    ],
)
def test_invalid_settings_name_the_run_config_key(setting, key):
    with pytest.raises(ValueError, match=key):
        _strategy(**setting)


def test_evaluation_samples_the_cloud_model_reproducibly():
    def evaluated(seed):
        strategy = _strategy(fraction_evaluate=0.5, seed=seed)
        messages = strategy.configure_evaluate(
            3, _record({"w": [1.0, 2.0]}), ConfigRecord(), FakeGrid(range(1, 11))
        )
        return sorted(m.metadata.dst_node_id for m in messages), messages

    nodes, messages = evaluated(seed=2)

    assert len(nodes) == 5 and evaluated(seed=2)[0] == nodes
    assert messages[0].metadata.message_type == "evaluate"
    assert messages[0].content[keys.CONFIG]["server-round"] == 3


def test_summary_logs_the_settings_tree(caplog):
    with caplog.at_level(logging.INFO):
        _strategy(delta_updates=True, eta=0.5, client_config={"mode": "cp-np"}).summary()

    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "Hierarchical FedAvg" in logged and "eta = 0.5" in logged and "cp-np" in logged


def test_membership_table_lists_every_registered_node():
    strategy = _strategy()
    grid = HierGrid(lambda node, model: _reply(node, {"w": [1.0, 1.0]}), EDGES)

    _round(strategy, grid)
    members = strategy.tables()["edge-membership.csv"]

    assert [(m["node-id"], m["edge-id"]) for m in members] == [(1, 0), (2, 0), (3, 1), (4, 1)]
    assert [m["partition-id"] for m in members] == [
        strategy.registrations[n].partition for n in (1, 2, 3, 4)
    ]


def test_apply_deltas_by_hand():
    # weights 1 and 3 -> mean dw = 0.25 [2, 4] + 0.75 [6, -4] = [5, -2].
    edge = [np.array([1.0, 2.0]), np.array([0.0])]
    deltas = [[np.array([2.0, 4.0]), np.array([4.0])], [np.array([6.0, -4.0]), np.array([0.0])]]

    result = apply_deltas(edge, deltas, weights=[1, 3], eta=0.5)

    assert [r.tolist() for r in result] == [[3.5, 1.0], [0.5]]  # w + 0.5 * mean
    assert edge[0].tolist() == [1.0, 2.0]  # inputs untouched


def test_apply_deltas_keeps_integer_arrays_as_the_seed_does():
    edge = [np.array([7]), np.array([1.0])]
    deltas = [[np.array([5]), np.array([2.0])]]

    result = apply_deltas(edge, deltas, weights=[4], eta=1.0)

    assert result[0].tolist() == [7] and result[0].dtype == np.int64
    assert result[1].tolist() == [3.0]


def test_apply_deltas_needs_a_positive_weight_sum():
    with pytest.raises(ValueError, match="must sum to a positive number"):
        apply_deltas([np.zeros(2)], [[np.ones(2)], [np.ones(2)]], [0.0, 0.0], 1.0)
