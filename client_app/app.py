"""ClientApp: load this node's partition, train or evaluate the received model, reply.

Each algorithm's client half (:mod:`client_app.halves`) hooks into train and evaluate
when its predicate holds for the message and this node (:data:`HALVES`, one table
lookup; a half's module is imported on first use); privacy and SecAgg+ are client mods.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app import canary, node, state
from client_app.halves.base import ClientHalf
from client_app.mods import mechanism, preset_mod, privacy_mod, secure_mod
from privacy.mechanisms import FRONT_LOADED_MODES
from protocol import keys
from tasks.base import EVAL_LOSS, EVAL_REWARD, LocalTraining, local_seed

# preset_mod first: every later step reads the preset's keys; secure_mod answers
# SecAgg+ stages
app = ClientApp(mods=[preset_mod, secure_mod, privacy_mod])

Runs = Callable[[ConfigRecord, Context], bool]


def _fedprox(config: ConfigRecord, context: Context) -> bool:
    # FedProx's mu or SmartFedProx's state, or a reply that may carry the divergence
    # (every reply does unless a privacy mechanism restricts it to other keys).
    allowed = config.get(keys.REPORT_METRICS)
    return (
        keys.PROXIMAL_MU in config
        or keys.SMART_EMA_ALPHA in config
        or allowed is None
        or keys.DIVERGENCE in allowed
    )


def _dpsgd(config: ConfigRecord, context: Context) -> bool:
    # This client's own run-config decides too: a server that leaves the settings out
    # cannot make a DP-SGD client train without it (the half then refuses to train).
    return keys.DPSGD_NOISE_MULTIPLIER in config or mechanism(context) == "dp-sgd"


def _front_loaded(config: ConfigRecord, context: Context) -> bool:
    return keys.FRONT_LOADED_MODE in config or mechanism(context) in FRONT_LOADED_MODES


def _canary(config: ConfigRecord, context: Context) -> bool:
    pid, num = node.node_partition(context.node_config)
    return canary.canary_index(context.run_config, pid, num) is not None


# Every client half, in the order its hooks run (the first reply it gives is sent):
# name -> (whether this message and node run it, "module:Class").
HALVES: dict[str, tuple[Runs, str]] = {
    "local": (lambda c, _: bool(c.get(keys.LOCAL_ONLY)), "client_app.halves.local:LocalHalf"),
    "fedbn": (lambda c, _: True, "client_app.halves.fedbn:FedBNHalf"),
    "fedprox": (_fedprox, "client_app.halves.fedprox:FedProxHalf"),
    "dpsgd": (_dpsgd, "client_app.halves.dpsgd:DPSGDHalf"),
    "hierarchical": (
        lambda c, _: keys.EDGE_ROUND in c or keys.LOCAL_UPDATES in c,
        "client_app.halves.hierarchical:HierarchicalHalf",
    ),
    "frontloaded": (_front_loaded, "client_app.halves.frontloaded:FrontLoadedHalf"),
    "canary": (_canary, "client_app.halves.canary:CanaryHalf"),
}


@cache
def half(path: str) -> ClientHalf:
    """The client half ``"module:Class"``, its module imported on first use."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)()


def active_halves(config: ConfigRecord, context: Context) -> list[ClientHalf]:
    """The halves this message runs on this node, in table order."""
    return [half(path) for runs, path in HALVES.values() if runs(config, context)]


def _active(msg: Message, context: Context) -> list[ClientHalf]:
    return active_halves(msg.content[keys.CONFIG], context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model with the task's own training, under the active halves."""
    halves = _active(msg, context)
    for half in halves:
        if (early := half.without_training(msg, context)) is not None:
            return early
    r = node.prepare(msg, context, halves)
    server_round = int(r.config[keys.SERVER_ROUND])
    more = [e for half in halves for e in half.seed_entropy(r.config)]
    seed = local_seed(node.run_seed(context), server_round, r.pid, *more)
    fields = {k: v for half in halves for k, v in half.training(r).items()}
    local = LocalTraining(
        server_round=server_round, seed=seed, dp_seed=node.dp_seed(seed, context.run_config),
        state=node.task_state(context), state_tensors=node.task_tensors(context),
        partition_id=r.pid, artifacts_dir=node.artifacts_dir(r.config, context.node_config),
        **fields,
    )  # fmt: skip
    metrics = r.task.train(r.model, r.partition, local)
    for half in halves:
        metrics |= half.trained(r, metrics)
    node.keep_task_state(context, local)
    state.save(context, local.artifacts_dir, r.pid, server_round)
    for half in halves:
        if (own := half.reply(r, metrics, local)) is not None:
            return own
    return node.reply(msg, metrics, r.model)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the model to use on the local test split."""
    halves = _active(msg, context)
    r = node.prepare(msg, context, halves)
    metrics = r.task.evaluate(r.model, r.partition)
    for half in halves:
        half.evaluated(r, metrics)
    return node.reply(msg, metrics, None)


@app.evaluate(keys.CLUSTER_QUERY)
def cluster_scores(msg: Message, context: Context) -> Message:
    """Clustered FedAvg, ``cluster.assign = "loss"`` (IFCA): each of the K models'
    ``cluster-score-<k>`` on the local test split (loss, or -mean reward), lower better."""
    task, model, partition, _ = node.setup(context)
    scores = {}
    for k in range(int(msg.content[keys.CONFIG][keys.CLUSTER_K])):
        model.load_state_dict(node.state_dict(msg.content[keys.cluster_model_key(k)]))
        metrics = task.evaluate(model, partition)
        score = metrics[EVAL_LOSS] if EVAL_LOSS in metrics else -metrics[EVAL_REWARD]
        scores[keys.cluster_score_key(k)] = float(score)
    return Message(content=RecordDict({keys.METRICS: MetricRecord(scores)}), reply_to=msg)


@app.query(keys.PARTITION_QUERY)
def partition(msg: Message, context: Context) -> Message:
    """This node's partition id (the server orders nodes by it), the number of
    partitions when the node config does not name its data, and, where the task's
    ``num-examples`` counts data, its training-set size (the most its replies weigh)."""
    pid, num = node.node_partition(context.node_config)
    metrics = {keys.PARTITION_ID: pid}
    task = node.task_of(context)
    if task.partition_from_node_config(context.node_config) is None:
        metrics[keys.NUM_PARTITIONS] = num
    try:
        _, _, data, _ = node.setup(context)
    except ValueError:  # data this node cannot hold: the server's start-up checks name it
        data = None
    bound = None if data is None else task.weight_bound(data)
    if bound is not None:
        metrics[keys.NUM_EXAMPLES] = int(bound)
    return Message(content=RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)


@app.query(keys.HIER_QUERY)
def edge(msg: Message, context: Context) -> Message:
    """Hierarchical FL: this node's edge, partition and training size."""
    from client_app.halves.hierarchical import edge_reply

    return edge_reply(msg, context)
