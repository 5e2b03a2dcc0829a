"""ClientApp: load this node's partition, train or evaluate the received model, reply.

Each algorithm's client half (:mod:`client_app.halves`) hooks into train and evaluate
when a message activates it (:data:`HALVES`); privacy and SecAgg+ are client mods.
"""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app import node, state
from client_app.halves.base import ClientHalf
from client_app.halves.canary import CanaryHalf
from client_app.halves.dpsgd import DPSGDHalf
from client_app.halves.fedbn import FedBNHalf
from client_app.halves.fedprox import FedProxHalf
from client_app.halves.frontloaded import FrontLoadedHalf
from client_app.halves.hierarchical import HierarchicalHalf, edge_reply
from client_app.halves.local import LocalHalf
from client_app.mods import privacy_mod
from client_app.preset_mod import preset_mod
from client_app.secagg_mod import secagg_mod
from protocol import keys
from tasks.base import EVAL_LOSS, EVAL_REWARD, LocalTraining, local_seed

# preset_mod first: every later step reads the preset's keys; secagg_mod answers
# SecAgg+ stages
app = ClientApp(mods=[preset_mod, secagg_mod, privacy_mod])

# Every client half, in the order its hooks run (the first reply it gives is sent).
HALVES: tuple[ClientHalf, ...] = (
    LocalHalf(), FedBNHalf(), FedProxHalf(), DPSGDHalf(), HierarchicalHalf(),
    FrontLoadedHalf(), CanaryHalf(),
)  # fmt: skip


def _active(msg: Message, context: Context) -> list[ClientHalf]:
    return [h for h in HALVES if h.active(msg.content[keys.CONFIG], context)]


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
    return edge_reply(msg, context)
