"""protocol.keys: the names both sides of a message agree on."""

from __future__ import annotations

import inspect

import flwr.server.strategy.dpfedavg_adaptive as flower_adaptive
import flwr.server.strategy.dpfedavg_fixed as flower_fixed

from protocol import keys

NAMES = {name: value for name, value in vars(keys).items() if name.isupper()}


def test_every_key_is_a_string_and_no_two_names_share_one():
    # One name, one meaning: a key reused under two names would let one side read what
    # the other wrote for another purpose.
    assert all(isinstance(value, str) and value for value in NAMES.values())
    by_value: dict[str, list[str]] = {}
    for name, value in NAMES.items():
        by_value.setdefault(value, []).append(name)
    assert {v: n for v, n in by_value.items() if len(n) > 1} == {}


def test_the_dp_config_keys_are_flowers_own():
    """The DP-FedAvg config keys are the exact strings of Flower's original wrappers."""
    fixed, adaptive = inspect.getsource(flower_fixed), inspect.getsource(flower_adaptive)
    assert f'"{keys.DP_CLIP_NORM}"' in fixed
    assert f'"{keys.DP_NOISE_STDDEV}"' in fixed
    assert f'"{keys.DP_ADAPTIVE}"' in adaptive


def test_cluster_keys_name_model_k():
    assert [keys.cluster_model_key(k) for k in range(3)] == [
        "cluster-model-0", "cluster-model-1", "cluster-model-2",
    ]  # fmt: skip
    assert keys.cluster_score_key(12) == "cluster-score-12"
    assert keys.cluster_model_key(1) != keys.cluster_score_key(1)


def test_group_metric_templates_take_the_group_name():
    assert keys.GROUP_ACCURACY.format("low") == "eval-accuracy-low"
    assert keys.GROUP_NUM_EXAMPLES.format("high") == "num-examples-high"
    # A group's example count is not the reply's weight.
    assert keys.GROUP_NUM_EXAMPLES.format("low") != keys.NUM_EXAMPLES


def test_the_query_actions_are_distinct_message_types():
    actions = [keys.CLUSTER_QUERY, keys.PARTITION_QUERY, keys.HIER_QUERY]
    assert len(set(actions)) == len(actions)
    assert all("." not in action for action in actions)  # "query.<action>" parses back
