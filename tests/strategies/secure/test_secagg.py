"""SecAgg+ on the Message API: the server's view, the sum, and dropouts.

The clients are the real client mod (``client_app.secagg_mod.secagg_mod``, Flower's setup,
share-keys and unmask stages plus our collect stage) around a trainer that returns a
known update; the server is :func:`strategies.secure.secagg_plus.secure_sum` on a grid that records
every reply the server receives.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from client_app.secagg_mod import encoding_of, secagg_mod
from privacy.skellam import SecureSumEncoding
from protocol import keys
from protocol.masking import MASKED
from strategies.secure.secagg_plus import SecAggSettings, ring_neighbours, secure_sum

DIM = 600
SETTINGS = SecAggSettings()
PLAIN = {
    keys.SECAGG_CLIP_NORM: 0.0,
    keys.SECAGG_COORDINATE_RANGE: SETTINGS.clipping_range,
    keys.SECAGG_SCALE: SETTINGS.scale,
    keys.SECAGG_MODULUS_BITS: 32,
    keys.SECAGG_MAX_WEIGHT: SETTINGS.max_weight,
}


class ModGrid:
    """Nodes answering with ``secagg_mod`` around a trainer that adds ``updates[node]``
    to the received arrays; ``dies`` maps a node to the stage whose message kills it."""

    def __init__(self, updates: dict[int, np.ndarray], dies: dict[int, str] | None = None):
        self.updates = updates
        self.dies = dict(dies or {})
        self.dead: set[int] = set()
        self.contexts = {
            node: Context(
                run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={}
            )
            for node in updates
        }
        self.received: list[Message] = []  # every reply the server received

    def get_node_ids(self) -> list[int]:
        return [n for n in self.updates if n not in self.dead]

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            stage = message.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
            if self.dies.get(node) == stage:
                self.dead.add(node)
            if node in self.dead:
                continue
            reply = secagg_mod(message, self.contexts[node], self._train)
            self.received.append(reply)
            replies.append(reply)
        return replies

    def _train(self, msg: Message, _ctxt: Context) -> Message:
        received = msg.content[keys.ARRAYS]["w"].numpy()
        node = msg.metadata.dst_node_id
        trained = ArrayRecord({"w": _array(received + self.updates[node])})
        metrics = MetricRecord({keys.NUM_EXAMPLES: 100})
        return Message(RecordDict({keys.ARRAYS: trained, keys.METRICS: metrics}), reply_to=msg)


def _array(values: np.ndarray) -> Array:
    return Array(values.astype(np.float32))


def _train_messages(nodes, config=PLAIN) -> list[Message]:
    reference = ArrayRecord({"w": _array(np.zeros(DIM))})
    return [
        Message(
            RecordDict({keys.ARRAYS: reference, keys.CONFIG: ConfigRecord(dict(config))}),
            dst_node_id=node,
            message_type="train",
        )
        for node in nodes
    ]


def _updates(nodes, seed=0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0.0, 0.05, DIM).astype(np.float32).astype(np.float64) for n in nodes}


def _run(grid: ModGrid, settings=SETTINGS, needed=2):
    nodes = list(grid.updates)
    return secure_sum(
        grid,
        _train_messages(nodes),
        settings,
        length=DIM + 1,
        server_round=1,
        timeout=1.0,
        survivors_needed=needed,
    )


def _expected(updates: dict[int, np.ndarray], nodes) -> np.ndarray:
    """Σ w Δ and Σ w over ``nodes`` (w = 100 / max-weight)."""
    w = 100 / SETTINGS.max_weight
    return np.append(sum(w * updates[n] for n in nodes), w * len(nodes))


def _plain() -> SecureSumEncoding:
    return encoding_of(PLAIN)


def test_the_unmasked_sum_is_the_plain_sum_within_the_quantization_error():
    nodes = [11, 22, 33, 44, 55]
    grid = ModGrid(_updates(nodes))

    result = _run(grid)

    assert result.survivors == nodes and result.dropped == [] and result.reason == ""
    decoded = _plain().decode(result.vector)
    error = np.max(np.abs(decoded - _expected(grid.updates, nodes)))
    assert error <= _plain().max_error(len(nodes), DIM + 1)
    assert error > 0  # stochastic rounding did happen: the bound is not vacuous


def test_the_server_receives_no_single_update():
    nodes = [11, 22, 33, 44, 55]
    grid = ModGrid(_updates(nodes))

    result = _run(grid)

    encoding = _plain()
    masked = {}
    for reply in grid.received:
        # Only configs (keys, ciphertexts, shares) and masked integers, never a float array
        # or a metric.
        assert not reply.content.metric_records
        for name, record in reply.content.array_records.items():
            assert name == MASKED
            assert record[MASKED].numpy().dtype == np.uint32
            masked[reply.metadata.src_node_id] = record[MASKED].numpy().astype(np.uint64)
    assert sorted(masked) == nodes
    for node, vector in masked.items():
        truth = _expected(grid.updates, [node])
        # Alone, a masked vector decodes to noise of the modulus' size, not the update ...
        alone = encoding.decode(vector)
        assert np.median(np.abs(alone - truth)) > 1000.0
        assert abs(np.corrcoef(alone[:-1], truth[:-1])[0, 1]) < 0.2
        # ... and its values are uniform on Z_M (top bit set half the time).
        top = np.mean(vector >= 2**31)
        assert abs(top - 0.5) < 5 * np.sqrt(0.25 / vector.size)
    # Every strict subset of the masked vectors still carries masks.
    for left_out in nodes:
        subset = [n for n in nodes if n != left_out]
        partial = encoding.decode(sum(masked[n] for n in subset) & np.uint64(2**32 - 1))
        assert np.median(np.abs(partial - _expected(grid.updates, subset))) > 1000.0
    assert result.vector is not None


@pytest.mark.parametrize("stage", [Stage.COLLECT_MASKED_VECTORS, Stage.SHARE_KEYS])
def test_a_client_lost_after_setup_is_left_out_of_the_sum(stage):
    nodes = [11, 22, 33, 44, 55]
    grid = ModGrid(_updates(nodes), dies={33: stage})

    result = _run(grid)

    survivors = [11, 22, 44, 55]
    assert result.survivors == survivors and result.dropped == [33]
    error = np.max(np.abs(_plain().decode(result.vector) - _expected(grid.updates, survivors)))
    assert error <= _plain().max_error(len(survivors), DIM + 1)


def test_a_client_lost_while_unmasking_is_still_in_the_sum():
    nodes = [11, 22, 33, 44, 55]
    grid = ModGrid(_updates(nodes), dies={33: Stage.UNMASK})

    result = _run(grid)

    assert result.survivors == nodes
    error = np.max(np.abs(_plain().decode(result.vector) - _expected(grid.updates, nodes)))
    assert error <= _plain().max_error(len(nodes), DIM + 1)


def test_secagg_plus_ring_with_a_dropout_sums_the_survivors():
    nodes = [11, 22, 33, 44, 55, 66, 77]
    settings = SecAggSettings(num_shares=3, reconstruction_threshold=2)
    grid = ModGrid(_updates(nodes, seed=1), dies={44: Stage.COLLECT_MASKED_VECTORS})

    result = _run(grid, settings)

    survivors = [n for n in nodes if n != 44]
    assert result.survivors == survivors
    error = np.max(np.abs(_plain().decode(result.vector) - _expected(grid.updates, survivors)))
    assert error <= _plain().max_error(len(survivors), DIM + 1)


def test_too_few_survivors_abandon_the_round_before_unmasking():
    nodes = [11, 22, 33, 44]
    grid = ModGrid(_updates(nodes), dies={22: Stage.COLLECT_MASKED_VECTORS})

    result = _run(grid, needed=4)

    assert result.vector is None and result.survivors == [11, 33, 44]
    assert "3 of 4 vectors arrived, 4 needed" in result.reason
    # Nobody was asked for shares: the masked vectors stay masked.
    assert not [
        r
        for r in grid.received
        if Key.SHARE_LIST in r.content.config_records.get(RECORD_KEY_CONFIGS, {})
    ]


def test_ring_neighbours_are_symmetric_and_of_the_share_count():
    nodes = list(range(1, 12))

    graph = ring_neighbours(nodes, 5)

    assert all(len(graph[n]) == 5 and n in graph[n] for n in nodes)
    assert all(a in graph[b] for a in nodes for b in graph[a])


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"num_shares": 2}, "secagg.num-shares"),
        ({"reconstruction_threshold": 1.5}, "secagg.reconstruction-threshold"),
        ({"num_shares": 5, "reconstruction_threshold": 5}, "secagg.reconstruction-threshold"),
        ({"modulus_range": 3 * 2**20}, "secagg.modulus-range"),
        ({"quantization_range": 2**33}, "secagg.quantization-range"),
    ],
)
def test_invalid_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        SecAggSettings(**kwargs)


def test_shares_and_threshold_follow_flowers_rules():
    assert SecAggSettings().shares_and_threshold(10) == (10, 7)
    assert SecAggSettings(num_shares=0.5, reconstruction_threshold=0.5).shares_and_threshold(
        10
    ) == (5, 2)
    assert SecAggSettings(num_shares=5, reconstruction_threshold=3).shares_and_threshold(10) == (
        5,
        3,
    )
    assert SecAggSettings(min_survivors=8).survivors_needed(10) == 8
