"""Hostile or broken clients, property-based (hypothesis): whatever mix of valid and
malformed replies a round gets, the global model stays finite, nothing malformed enters
an aggregate, and a DP round counts a malformed reply as a zero update and is charged
like any other (no abort: whether a round aborts would be an uncharged release)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from hypothesis import given
from hypothesis import strategies as st

import strategies
from protocol import keys
from protocol.replies import MAX_NUM_EXAMPLES
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.mechanisms.dp_fedavg_adaptive import DPFedAvgAdaptive
from tests.fakes import FakeGrid, error_from, record, reply_from
from tests.strategies.mechanisms import test_dp_fedavg, test_laplace, test_subspace_dp
from tests.strategies.runtime.test_aggregation import SETTINGS

GLOBAL = {"w": np.array([1.0, -2.0, 0.5]), "b": np.array([0.25])}
MALFORMED = (
    "nan", "inf", "shape", "extra-key", "missing-key", "dtype", "no-metrics", "no-arrays",
    "negative-examples", "nan-examples", "huge-examples", "fractional-examples",
    "nan-metric", "string-examples", "error",
)  # fmt: skip
# The budget (max_examples, no deadline) is the Hypothesis profile's: tests/conftest.py.


def _valid(node, values, weight):
    arrays = {"w": GLOBAL["w"] + values[:3], "b": GLOBAL["b"] + values[3:]}
    # The indicator bit ‖Δ‖ <= C is what adaptive clipping asks of every client.
    bit = float(np.linalg.norm(values) <= 1.0)
    return reply_from(
        node, arrays, {"num-examples": weight, "train-loss": 1.0, keys.DP_NORM_BIT: bit}
    )


def _malformed(node, kind):
    arrays = {k: v + 0.1 for k, v in GLOBAL.items()}
    metrics = {"num-examples": 10, "train-loss": 1.0}
    if kind == "error":
        return error_from(node, "client crashed")
    if kind in ("nan", "inf"):
        arrays["w"] = np.array([0.0, np.nan if kind == "nan" else np.inf, 0.0])
    elif kind == "shape":
        arrays["w"] = np.zeros(4)
    elif kind == "extra-key":
        arrays["extra"] = np.zeros(2)
    elif kind == "missing-key":
        del arrays["b"]
    elif kind == "nan-metric":
        metrics["train-loss"] = float("nan")
    elif kind.endswith("examples"):
        metrics["num-examples"] = {
            "negative-examples": -5, "nan-examples": float("nan"),
            "huge-examples": 10 * MAX_NUM_EXAMPLES, "fractional-examples": 2.5,
            "string-examples": "many",
        }[kind]  # fmt: skip
    if kind == "string-examples":
        return _reply_with(node, record(arrays), ConfigRecord(metrics))  # wrong record type
    if kind == "dtype":
        return _reply_with(
            node,
            ArrayRecord({k: Array(v.astype(np.float32)) for k, v in arrays.items()}),
            metrics,
        )
    if kind == "no-metrics":
        return _reply_with(node, record(arrays), None)
    if kind == "no-arrays":
        return reply_from(node, None, metrics)
    return reply_from(node, arrays, metrics)


def _reply_with(node, arrays, metrics):
    content = RecordDict({keys.ARRAYS: arrays})
    if isinstance(metrics, dict):
        content[keys.METRICS] = MetricRecord(metrics)
    elif metrics is not None:
        content[keys.METRICS] = metrics
    sent = Message(content=RecordDict(), dst_node_id=node, message_type="train")
    return Message(content, reply_to=sent)


# One reply per node: ("ok", values, weight) or ("bad", kind).
REPLIES = st.lists(
    st.one_of(
        st.tuples(
            st.just("ok"),
            st.lists(st.floats(-1.0, 1.0), min_size=4, max_size=4).map(np.array),
            st.integers(1, 1000),
        ),
        st.tuples(st.just("bad"), st.sampled_from(MALFORMED)),
    ),
    min_size=1,
    max_size=5,
)


def _replies(spec):
    return [
        _valid(node, item[1], item[2]) if item[0] == "ok" else _malformed(node, item[1])
        for node, item in enumerate(spec, start=1)
    ]


def _run_round(strategy, spec):
    nodes = range(1, len(spec) + 1)
    list(strategy.configure_train(1, record(GLOBAL), ConfigRecord(), FakeGrid(nodes)))
    return strategy.aggregate_train(1, _replies(spec))


@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
@given(spec=REPLIES)
def test_fedavg_family_averages_exactly_the_valid_replies(name, spec):
    one = {"min_available_nodes": 1, "min_train_nodes": 1, "min_evaluate_nodes": 1}
    # Weights and updates unbounded: the exact weighted mean of whatever passed the checks;
    # tests/strategies/runtime/test_bounded_weights.py tests the bound.
    options = {
        **SETTINGS.options,
        "aggregation.max-weight-share": 1.0,
        "aggregation.max-update-norm": 0.0,
    }
    strategy = strategies.build("none", replace(SETTINGS, strategy=name, options=options, **one))
    arrays, _ = _run_round(strategy, spec)
    valid = [(item[1], item[2]) for item in spec if item[0] == "ok"]
    if not valid:
        assert arrays is None
        return
    weights = np.array([w for _, w in valid], dtype=float)
    mean = weights @ np.array([v for v, _ in valid]) / weights.sum()
    got = np.concatenate([arrays["w"].numpy(), arrays["b"].numpy()])
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, np.concatenate([GLOBAL["w"], GLOBAL["b"]]) + mean, atol=1e-12)


def _dp(kind, m):
    if kind == "subspace-dp":
        return test_subspace_dp._wrapper(m=m, z=0.5, clip=1.0, tau=1.0)
    cls = DPFedAvgAdaptive if kind == "adaptive" else DPFedAvgFixed
    extra = {"target_quantile": 0.5, "clip_lr": 0.2, "clip_count_stddev": 1.0}
    return test_dp_fedavg._wrapper(
        cls, m=m, z=0.5, site="client" if kind == "client" else "server",
        **(extra if kind == "adaptive" else {}),
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["server", "client", "adaptive", "subspace-dp"])
@given(spec=REPLIES)
def test_dp_round_counts_a_malformed_reply_as_zero_and_is_charged(kind, spec):
    strategy = _dp(kind, len(spec))
    arrays, metrics = _run_round(strategy, spec)
    assert len(strategy.ledger.releases) == 1
    assert all(np.all(np.isfinite(arrays[k].numpy())) for k in GLOBAL)
    bad = sum(item[0] == "bad" for item in spec)
    assert metrics[keys.DP_FAILED_CLIENTS] >= bad  # adaptive: a wrong bit fails too


@pytest.mark.parametrize("kind", ["server", "client"])
@given(scale=st.floats(1e3, 1e30), m=st.integers(1, 4))
def test_an_unclipped_update_cannot_move_the_model_beyond_the_bound(kind, scale, m):
    """A client that skips clipping (a huge but finite update) moves the mean by at most
    C/m (server clip) or the honest client-noise radius / m (client noise)."""
    strategy = _dp(kind, m)
    spec = [("ok", np.zeros(4), 1)] * (m - 1) + [("ok", np.full(4, scale), 1)]
    arrays, _ = _run_round(strategy, spec)
    moved = np.concatenate([arrays[k].numpy() - GLOBAL[k] for k in GLOBAL])
    sigma = 0.5 * 1.0 / np.sqrt(m)  # z C / √m, per client
    bound = 1.0 if kind == "server" else 1.0 + sigma * (2.0 + 8.0)  # √d = 2
    # Server: clipped sum (<= C) plus N(0, (zC)^2) noise; bound it at 12 std.
    noise = 12 * 0.5 * 1.0 * 2.0 if kind == "server" else 12 * sigma * 2.0 * np.sqrt(m)
    assert np.linalg.norm(moved) <= (bound + noise) / m + 1e-9


@given(spec=REPLIES)
def test_laplace_counts_malformed_replies_as_zero_and_is_charged(spec):
    strategy = test_laplace._wrapper(
        FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    )
    arrays, metrics = _run_round(strategy, spec)
    assert len(strategy.ledger.releases) == 1
    assert all(np.all(np.isfinite(arrays[k].numpy())) for k in GLOBAL)
    assert metrics[keys.DP_FAILED_CLIENTS] == sum(item[0] == "bad" for item in spec)
