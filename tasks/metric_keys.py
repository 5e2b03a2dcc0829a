"""Metric keys every task reports (kebab-case, stable across tasks), in a module of their
own so that reading a run's tables (a notebook, ``lab.figures``) imports no torch."""

NUM_EXAMPLES = "num-examples"
TRAIN_LOSS = "train-loss"
TRAIN_ACCURACY = "train-accuracy"
EVAL_LOSS = "eval-loss"
EVAL_ACCURACY = "eval-accuracy"
TRAIN_REWARD = "train-reward"  # RL tasks: mean return of the episodes played in training
EVAL_REWARD = "eval-reward"  # RL tasks: mean return of the evaluation episodes
# Wall-clock seconds of a client's own training work in a round, where its task reports
# them (lunar-lander: SB3's PPO.learn); differs between identical runs.
TRAIN_SECONDS = "train-seconds"
