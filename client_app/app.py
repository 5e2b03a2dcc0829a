"""ClientApp: load this node's partition, train or evaluate the received model, reply.

The task, its data partition and the model object are built once per process and
reused across messages (only the weights change per message).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

import tasks
from client_app import canary, hierarchy, proximal_client, state
from client_app.mods import privacy_mod
from client_app.preset_mod import preset_mod
from client_app.secagg_mod import secagg_mod
from privacy.mechanisms import secret_seed
from protocol import keys
from protocol.records import to_numpy, to_record
from tasks.base import DPSGD, EVAL_LOSS, EVAL_REWARD, SEED, LocalTraining, Task, local_seed

# preset_mod first: every later step reads the preset's keys; secagg_mod answers
# SecAgg+ stages
app = ClientApp(mods=[preset_mod, secagg_mod, privacy_mod])
_DP_STREAM = 0xD5  # dp.reproducible-noise: the DP seed's stream beside the local seed


@lru_cache(maxsize=4)
def _task(frozen_run_config: tuple[tuple[str, Any], ...]) -> Task:
    return tasks.build(dict(frozen_run_config))


@lru_cache(maxsize=4)
def _model(task: Task, seed: int) -> torch.nn.Module:
    return task.build_model(seed)


def _node_partition(node_config: Mapping[str, Any]) -> tuple[int, int]:
    """Return (partition-id, num-partitions) from the node config, validated."""
    try:
        pid, num = int(node_config["partition-id"]), int(node_config["num-partitions"])
    except KeyError as err:
        raise ValueError(
            f"node config lacks {err}; start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<n>"'
        ) from None
    if not 0 <= pid < num:
        raise ValueError(f"partition-id {pid} is not in [0, num-partitions={num})")
    return pid, num


def _setup(context: Context) -> tuple[Task, torch.nn.Module, Any, int]:
    """Return (task, this process's model object, partition, partition id).

    With ``audit.canaries`` = k the real clients split the data N = num-partitions - k
    ways, and a canary gets the partition it shadows (:mod:`client_app.canary`)."""
    run_config = context.run_config
    task = _task(tuple(sorted(run_config.items())))
    pid, num = _node_partition(context.node_config)
    partition = task.partition_from_node_config(context.node_config)
    if partition is None:
        real = canary.real_partitions(run_config, num)
        index = canary.canary_index(run_config, pid, num)
        shadow = pid if index is None else canary.shadow_partition(index, real)
        partition = task.load_partition(shadow, real)
    return task, _model(task, int(run_config.get(SEED.key, SEED.default))), partition, pid


def _canary(context: Context) -> int | None:
    """This node's canary index, or None for a real client."""
    pid, num = _node_partition(context.node_config)
    return canary.canary_index(context.run_config, pid, num)


def _prepare(msg: Message, context: Context) -> tuple[Task, torch.nn.Module, Any, int]:
    """Return (task, model loaded with the weights to use, partition, partition id).

    A fresh context (a resumed run, a restarted SuperNode) first gets the state this
    client saved (:mod:`client_app.state`)."""
    task, model, partition, pid = _setup(context)
    config = msg.content[keys.CONFIG]
    if keys.SERVER_ROUND in config:
        artifacts = _artifacts_dir(config, context.node_config)
        evaluate = msg.metadata.message_type == MessageType.EVALUATE
        state.restore(context, artifacts, pid, int(config[keys.SERVER_ROUND]), evaluate=evaluate)
    arrays = msg.content[keys.ARRAYS]
    if config.get(keys.LOCAL_ONLY) and keys.LOCAL_MODEL in context.state:
        arrays = context.state[keys.LOCAL_MODEL]
    model.load_state_dict(_state_dict(arrays), strict=True)
    proximal_client.restore_local_layers(model, task.local_state_keys(), context.state)
    return task, model, partition, pid


def _state_dict(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """``arrays.to_torch_state_dict()``, each array decoded without ``np.load``'s header
    parsing (:func:`protocol.records.to_numpy`): a client message's largest fixed cost
    after training on small models."""
    return {key: torch.from_numpy(to_numpy(arrays[key])) for key in arrays}


def _reply(msg: Message, metrics: dict[str, float], model: torch.nn.Module | None) -> Message:
    content = RecordDict({keys.METRICS: MetricRecord(metrics)})
    if model is not None:
        content[keys.ARRAYS] = ArrayRecord(model.state_dict())
    return Message(content=content, reply_to=msg)


def _dp_sgd(config, run_config) -> DPSGD | None:
    if keys.DPSGD_NOISE_MULTIPLIER not in config:
        return None
    return DPSGD(
        noise_multiplier=float(config[keys.DPSGD_NOISE_MULTIPLIER]),
        max_grad_norm=float(config[keys.DPSGD_MAX_GRAD_NORM]),
        delta=float(config[keys.DPSGD_DELTA]),
        target_epsilon=float(config.get(keys.DPSGD_TARGET_EPSILON, 0.0)),
        planned_rounds=int(run_config.get("num-server-rounds", 0)),
        max_epsilon=float(config.get(keys.DPSGD_MAX_EPSILON, 0.0)),
    )


def _dp_seed(reproducible_seed: int, run_config) -> int:
    """The seed of this training's DP randomness: OS entropy, never sent anywhere;
    ``reproducible_seed`` (from the run seed) only under ``dp.reproducible-noise``."""
    if bool(run_config.get("dp.reproducible-noise", False)):
        return int(np.random.SeedSequence([reproducible_seed, _DP_STREAM]).generate_state(1)[0])
    return secret_seed()


def _task_state(context: Context) -> dict[str, Any]:
    record = context.state.get(keys.TASK_STATE)
    return json.loads(str(record["json"])) if record is not None else {}


def _task_tensors(context: Context) -> dict[str, torch.Tensor]:
    record = context.state.get(keys.TASK_TENSORS)
    return _state_dict(record) if record is not None else {}


def _keep_task_state(context: Context, local: LocalTraining) -> None:
    """The task's state into ``context.state``; none at all when the task keeps none, so
    that a client without state writes no state file (:func:`client_app.state.save`)."""
    if local.state:
        context.state[keys.TASK_STATE] = ConfigRecord({"json": json.dumps(local.state)})
    elif keys.TASK_STATE in context.state:
        del context.state[keys.TASK_STATE]
    if local.state_tensors:
        context.state[keys.TASK_TENSORS] = ArrayRecord(local.state_tensors)
    elif keys.TASK_TENSORS in context.state:
        del context.state[keys.TASK_TENSORS]


def _artifacts_dir(config, node_config: Mapping[str, Any]) -> str | None:
    """The SuperNode's own ``artifacts-dir`` if it sets one, else the server's."""
    chosen = node_config.get(keys.ARTIFACTS_DIR, config.get(keys.ARTIFACTS_DIR))
    return str(chosen) if chosen else None


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received (or, under strategy=local, the client's own) model; a canary
    replies its own update (:mod:`client_app.canary`)."""
    index, config = _canary(context), msg.content[keys.CONFIG]
    if index is not None and canary.reports_nothing_trained(config):
        return _canary_reply(msg, context, index, {keys.NUM_EXAMPLES: 1})
    task, model, partition, pid = _prepare(msg, context)
    server_round = int(config[keys.SERVER_ROUND])
    received = proximal_client.parameters(model)
    mu = proximal_client.effective_mu(config, context.state)
    seed = local_seed(
        int(context.run_config.get(SEED.key, SEED.default)),
        server_round,
        pid,
        *([int(config[keys.EDGE_ROUND])] if keys.EDGE_ROUND in config else []),
    )
    local = LocalTraining(
        server_round=server_round,
        seed=seed,
        dp_seed=_dp_seed(seed, context.run_config),
        proximal_mu=mu,
        dp_sgd=_dp_sgd(config, context.run_config),
        state=_task_state(context),
        state_tensors=_task_tensors(context),
        partition_id=pid,
        artifacts_dir=_artifacts_dir(config, context.node_config),
        local_updates=int(config[keys.LOCAL_UPDATES]) if keys.LOCAL_UPDATES in config else None,
        front_loaded=hierarchy.front_loaded(config),
    )
    metrics = task.train(model, partition, local)
    metrics |= proximal_client.divergence_metrics(model, received, mu, config, context.state)
    proximal_client.keep_local_layers(model, task.local_state_keys(), context.state)
    _keep_task_state(context, local)
    if config.get(keys.LOCAL_ONLY):
        context.state[keys.LOCAL_MODEL] = ArrayRecord(model.state_dict())
    state.save(context, local.artifacts_dir, pid, server_round)
    if local.front_loaded is not None and local.front_loaded.mode == "cp-np":
        delta, extra = hierarchy.cp_np_reply(
            model, msg.content[keys.ARRAYS], local.front_loaded, local.dp_seed
        )
        # Only the noisy delta leaves (the seed): no loss, divergence or update norm,
        # which no mechanism protects; the example count weights the edge average.
        kept = {keys.NUM_EXAMPLES: metrics[keys.NUM_EXAMPLES], "noise-std": extra["noise-std"]}
        content = RecordDict({keys.ARRAYS: delta, keys.METRICS: MetricRecord(kept)})
        return Message(content=content, reply_to=msg)
    if index is not None:  # the canary's update replaces the one it trained
        return _canary_reply(msg, context, index, metrics)
    return _reply(msg, metrics, model)


def _canary_reply(msg: Message, context: Context, index: int, metrics: dict) -> Message:
    """Canary ``index``'s train reply: the received model plus its update (a held-out
    canary that must be absent: an error reply, :func:`canary.absent_when_held_out`)."""
    received, config = msg.content[keys.ARRAYS], msg.content[keys.CONFIG]
    arrays, inserted = canary.update(received, config, context.run_config, index)
    if not inserted and canary.absent_when_held_out(config, context.run_config):
        error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=canary.HELD_OUT)
        return Message(error, reply_to=msg)
    content = RecordDict({keys.ARRAYS: to_record(received, arrays)})
    content[keys.METRICS] = MetricRecord(metrics)
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received (or the client's own) model on the local test split (a
    canary: on the split it shadows, with weight 0)."""
    task, model, partition, _ = _prepare(msg, context)
    metrics = task.evaluate(model, partition)
    if _canary(context) is not None:
        metrics[keys.NUM_EXAMPLES] = 0
    return _reply(msg, metrics, None)


@app.evaluate(keys.CLUSTER_QUERY)
def cluster_scores(msg: Message, context: Context) -> Message:
    """Clustered FedAvg with ``cluster.assign = "loss"`` (IFCA): evaluate each of the K
    global models on the local test split and reply ``cluster-score-<k>``, lower is
    better: the evaluation loss, or the negative mean reward for RL tasks."""
    task, model, partition, _ = _setup(context)
    scores = {}
    for k in range(int(msg.content[keys.CONFIG][keys.CLUSTER_K])):
        arrays = msg.content[keys.cluster_model_key(k)]
        model.load_state_dict(_state_dict(arrays), strict=True)
        metrics = task.evaluate(model, partition)
        score = metrics[EVAL_LOSS] if EVAL_LOSS in metrics else -metrics[EVAL_REWARD]
        scores[keys.cluster_score_key(k)] = float(score)
    return Message(content=RecordDict({keys.METRICS: MetricRecord(scores)}), reply_to=msg)


@app.query(keys.PARTITION_QUERY)
def partition(msg: Message, context: Context) -> Message:
    """Tell the server this node's partition id (it orders nodes by it: reproducible
    sampling and summation whatever node ids Flower assigned) and, where the task's
    ``num-examples`` counts data, its training-set size (the most its replies weigh)."""
    pid, num = _node_partition(context.node_config)
    metrics = {keys.PARTITION_ID: pid}
    task, _, data, _ = _setup(context)
    if task.partition_from_node_config(context.node_config) is None:
        # Its data is partition pid of num (not named by the node config, e.g. a planet):
        # the server checks num against the task and the other nodes.
        metrics[keys.NUM_PARTITIONS] = num
    bound = task.weight_bound(data)
    if bound is not None:
        metrics[keys.NUM_EXAMPLES] = int(bound)
    return Message(content=RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)


@app.query(keys.HIER_QUERY)
def edge(msg: Message, context: Context) -> Message:
    """Hierarchical FL: tell the server this node's edge, partition and training size."""
    task, _, partition, pid = _setup(context)
    _, num = _node_partition(context.node_config)
    num_edges = int(msg.content[keys.CONFIG][keys.NUM_EDGES])
    metrics = {
        keys.EDGE_ID: hierarchy.edge_id(context.node_config, pid, num, num_edges),
        keys.PARTITION_ID: pid,
        keys.NUM_EXAMPLES: task.train_size(partition),
    }
    return Message(content=RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)
