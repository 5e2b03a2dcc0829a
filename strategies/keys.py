"""Message keys shared by strategies and client code (one place, no string drift)."""

# Records inside a message's RecordDict.
ARRAYS = "arrays"
METRICS = "metrics"
CONFIG = "config"

# ConfigRecord keys sent to clients.
SERVER_ROUND = "server-round"  # injected by Flower's FedAvg.configure_train
PROXIMAL_MU = "proximal-mu"  # injected by Flower's FedProx.configure_train
LOCAL_ONLY = "local-only"  # strategy=local: train/evaluate the client's own model

# MetricRecord keys every train/evaluate reply carries.
NUM_EXAMPLES = "num-examples"

# Keys in a client's context.state.
LOCAL_MODEL = "local-model"
