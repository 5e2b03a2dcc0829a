"""ClientApp: load this node's partition, train or evaluate the received model, reply.

Each algorithm's client half (:mod:`client_app.halves`) hooks into train and evaluate
when the message activates it (the table and the order of hooks live there; a half's
module is imported on first use); privacy and SecAgg+ are client mods.
"""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app import node, state
from client_app.halves import Halves
from client_app.mods import preset_mod, privacy_mod, secure_mod
from protocol import keys
from protocol.records import to_state_dict
from tasks.base import EVAL_LOSS, EVAL_REWARD

# preset_mod first: every later step reads the preset's keys; secure_mod answers
# SecAgg+ stages
app = ClientApp(mods=[preset_mod, secure_mod, privacy_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model with the task's own training, under the active halves."""
    halves = Halves.of(msg, context)
    if (early := halves.without_training(msg, context)) is not None:
        return early
    r = halves.prepare(msg, context)
    local = halves.local_training(r)
    metrics = halves.trained(r, r.task.train(r.model, r.partition, local))
    node.keep_task_state(context, local)
    state.save(context, local.artifacts_dir, r.pid, local.server_round)
    own = halves.reply(r, metrics, local)
    return own if own is not None else node.reply(msg, metrics, r.model)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the model to use on the local test split."""
    halves = Halves.of(msg, context)
    r = halves.prepare(msg, context)
    metrics = r.task.evaluate(r.model, r.partition)
    halves.evaluated(r, metrics)
    return node.reply(msg, metrics, None)


@app.evaluate(keys.CLUSTER_QUERY)
def cluster_scores(msg: Message, context: Context) -> Message:
    """Clustered FedAvg, ``cluster.assign = "loss"`` (IFCA): each of the K models'
    ``cluster-score-<k>`` on the local test split (loss, or -mean reward), lower better."""
    task, model, partition, _ = node.setup(context)
    scores = {}
    for k in range(int(msg.content[keys.CONFIG][keys.CLUSTER_K])):
        model.load_state_dict(to_state_dict(msg.content[keys.cluster_model_key(k)]))
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
