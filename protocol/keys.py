"""The names both sides of a message agree on: record and config keys, metric keys, and
the client-state directory (one place, no string drift).

The ServerApp's strategies write and read them, the ClientApp reads and writes them;
neither side owns this module (:mod:`protocol`)."""

# Records inside a message's RecordDict.
ARRAYS = "arrays"
METRICS = "metrics"
CONFIG = "config"

# ConfigRecord keys sent to clients.
SERVER_ROUND = "server-round"  # injected by Flower's FedAvg.configure_train
PROXIMAL_MU = "proximal-mu"  # injected by Flower's FedProx.configure_train
LOCAL_ONLY = "local-only"  # strategy=local: train/evaluate the client's own model

# DP-FedAvg (the exact names of Flower's original wrappers).
DP_CLIP_NORM = "dpfedavg_clip_norm"
DP_NOISE_STDDEV = "dpfedavg_noise_stddev"
DP_ADAPTIVE = "dpfedavg_adaptive_clip_enabled"
DP_NORM_BIT = "dpfedavg-norm-bit"  # MetricRecord: 1.0 if ||update|| <= clip norm

# What a client may report under a privacy mechanism (train and query configs): the
# MetricRecord keys it keeps; ``num-examples``, when not among them, is sent as 1 (every
# client weighs one in the unweighted aggregates of client-level DP). Absent: everything.
REPORT_METRICS = "report-metrics"

# Per-round metrics of the privacy wrappers (metrics.csv train rows).
DP_EPSILON = "dp-epsilon"  # client-level epsilon against observers of the released model
# Every client's epsilon against the server itself is at most this: the epsilon of a
# client asked in every round so far (independent of who was sampled, so published).
DP_EPSILON_LOCAL = "dp-epsilon-local"
# The epsilon of the client actually asked most: depends on who was sampled (curator).
DP_EPSILON_LOCAL_WORST = "dp-epsilon-local-worst"
DP_NOISE_FROM_SEED = "dp-noise-from-seed"  # 1: dp.reproducible-noise, no epsilon vs seed holders
DP_FAILED_CLIENTS = "dp-failed-clients"  # sampled clients counted as a zero update (curator)

# Laplace mechanism (the PPO study): client clips the L1 norm and adds Laplace noise.
LAPLACE_SENSITIVITY = "laplace-sensitivity"
LAPLACE_SCALE = "laplace-scale"

# DP-SGD (sample-level, Opacus) on the clients.
DPSGD_NOISE_MULTIPLIER = "dpsgd-noise-multiplier"
DPSGD_MAX_GRAD_NORM = "dpsgd-max-grad-norm"
DPSGD_TARGET_EPSILON = "dpsgd-target-epsilon"  # 0: use the noise multiplier as given
DPSGD_DELTA = "dpsgd-delta"
LOCAL_EPSILON = "local-epsilon"  # MetricRecord: the client's cumulative sample-level epsilon
DPSGD_MAX_EPSILON = "dpsgd-max-epsilon"  # the client refuses a round that would exceed it
# MetricRecord keys of a DP-SGD reply besides local-epsilon: how many trainings its
# accountant covers and this round's steps, from which the server re-derives its epsilon.
DPSGD_ROUNDS = "dpsgd-rounds"
DPSGD_ROUND_NOISE = "dpsgd-round-noise-multiplier"
DPSGD_ROUND_SAMPLE_RATE = "dpsgd-round-sample-rate"
DPSGD_ROUND_STEPS = "dpsgd-round-steps"
DPSGD_BUDGET_REFUSAL = "dp.max-epsilon reached"  # error-reason marker of a refused round

# MetricRecord keys every train/evaluate reply carries.
NUM_EXAMPLES = "num-examples"

# Keys in a client's context.state.
LOCAL_MODEL = "local-model"
TASK_STATE = "task-state"  # ConfigRecord {"json": ...}: the task's persistent state
TASK_TENSORS = "task-tensors"  # ArrayRecord: the task's persistent tensors (e.g. Adam moments)

# Where clients write their own diagnostics (e.g. PPO episode logs), sent by the
# ServerApp in every train config; a SuperNode's node_config "artifacts-dir" wins.
ARTIFACTS_DIR = "artifacts-dir"
# Inside it, each client keeps its context.state per round (client_app.state); a
# resumed server deletes the files of rounds it did not commit (server_app.results).
STATE_DIR = "client-state"

# Clustered FedAvg (the PPO study section 5; IFCA for cluster.assign = "loss").
CLUSTER_ID = "cluster-id"  # train/evaluate config: index k of the global model sent
CLUSTER_K = "cluster-k"  # query config: the number K of global models
CLUSTER_QUERY = "cluster"  # query action: message_type "evaluate.cluster"
CLUSTER_MODEL = "cluster-model"  # query ArrayRecords "cluster-model-<k>", k = 0..K-1
CLUSTER_SCORE = "cluster-score"  # query reply metrics "cluster-score-<k>" (lower is better)


def cluster_model_key(k: int) -> str:
    """The query's ArrayRecord key of global model ``k``: ``cluster-model-<k>``."""
    return f"{CLUSTER_MODEL}-{k}"


def cluster_score_key(k: int) -> str:
    """The query reply's metric key of global model ``k``: ``cluster-score-<k>``."""
    return f"{CLUSTER_SCORE}-{k}"


# SmartFedProx (the SmartFedProx study): the adaptive-mu inputs the server sends each client (one
# ConfigRecord per node) and the metrics every SmartFedProx train reply carries.
SMART_ADAPTIVE_MU = "smart-adaptive-mu"  # bool: compute the effective mu adaptively
SMART_CLIENT_DIVERGENCE = "smart-client-divergence"  # server's EMA of this node (0.0 unseen)
SMART_GLOBAL_DIVERGENCE = "smart-global-divergence"  # mean EMA over reporting nodes (or 0.0)
SMART_LOCAL_EPOCHS = "smart-local-epochs"  # epochs entering the epoch factor
SMART_MU_MIN = "smart-mu-min"  # lower clamp of the effective mu
SMART_MU_MAX = "smart-mu-max"  # upper clamp of the effective mu
SMART_EMA_ALPHA = "smart-ema-alpha"  # EMA smoothing of the historical divergence
DIVERGENCE = "divergence"  # MetricRecord: ||w_local - w_global|| after training
EFFECTIVE_MU = "effective-mu"  # MetricRecord: the mu the client trained with
HISTORICAL_DIVERGENCE = "historical-divergence"  # MetricRecord: the client's EMA after it
TRAIN_LOSS = "train-loss"  # MetricRecord: mean local training loss (tasks.base.TRAIN_LOSS)
# Under client-level DP the divergence is released: clipped to [0, bound], noised.
DIVERGENCE_CLIP = "divergence-clip"  # train config: the public bound of the report
DIVERGENCE_NOISE_STDDEV = "divergence-noise-stddev"  # train config: std of its noise

# Label-group evaluation metrics (tasks.vision.data): per group, and the gap between them.
GROUP_ACCURACY = "eval-accuracy-{}"  # MetricRecord: accuracy on one label group
GROUP_NUM_EXAMPLES = "num-examples-{}"  # MetricRecord: that group's evaluated examples
FAIRNESS_GAP = "fairness-gap"  # MetricRecord: best minus worst group accuracy

# Reproducibility: every strategy orders nodes by the partition id they report.
PARTITION_QUERY = "partition"  # query action: message_type "query.partition"

# Hierarchical FedAvg (HierFAVG: client -> edge -> cloud).
HIER_QUERY = "edge"  # query action: message_type "query.edge" (learn a node's edge)
NUM_EDGES = "num-edges"  # query config: the number of edges E (edge ids 0..E-1)
EDGE_ID = "edge-id"  # query reply metric (the node's edge) and train config
PARTITION_ID = "partition-id"  # query reply metric: the node's data partition
NUM_PARTITIONS = "num-partitions"  # query reply metric: the partitions its node config names
EDGE_ROUND = "edge-round"  # train config: edge aggregation k = 1..tau_2 of the cloud round
LOCAL_UPDATES = "local-updates"  # train config: tau_1, local updates per edge aggregation

# Front-loaded DP of hierarchical FL (frontloaded-dp-hfl): train config of the client modes.
FRONT_LOADED_MODE = "fl-mode"  # "cg-ng" | "cg-np" | "cp-np" (absent: baseline)
FRONT_LOADED_CLIP = "fl-clip"  # C: per-batch (per-example) gradient clip, or delta clip
FRONT_LOADED_SIGMA = "fl-sigma"  # sigma: std of the Gaussian noise
FRONT_LOADED_PER_EXAMPLE = "fl-per-example"  # CG-NG: clip per example, noise every step

# Secure aggregation (SecAgg+: strategies/secure/secagg_plus.py, protocol/masking.py):
# train config of the collect stage.
SECAGG_CLIP_NORM = "secagg-clip-norm"  # C (L2, DP) or 0: coordinates clipped to the range
SECAGG_COORDINATE_RANGE = "secagg-coordinate-range"  # without DP: each coordinate in ±range
SECAGG_SCALE = "secagg-scale"  # integers per unit of an update coordinate
SECAGG_MODULUS_BITS = "secagg-modulus-bits"  # log2 M (M = 2^64 does not fit a config int)
SECAGG_VARIANCE = "secagg-client-variance"  # each client's Skellam share (integer units)
SECAGG_MAX_WEIGHT = "secagg-max-weight"  # without DP: weight = min(n, max)/max, summed too
SECAGG_NORM_BIT = "secagg-norm-bit"  # adaptive clipping: the bit is one more summed integer
