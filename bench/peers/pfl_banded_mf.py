#!/usr/bin/env python
"""Peer arm (f) of bench/correlated.py: pfl-research 0.6's banded matrix factorization
mechanism on the correlated-noise benchmark's workload, run in pfl's own environment.

Workload as bench/correlated.py's arms (bench/peers/README.md): digits MLP 64-64-10, IID
clients, local SGD lr 0.1, server SGD lr 1.0 with momentum 0.5, clip 0.5, delta 1e-5.
pfl's pieces as pfl documents them: ``BandedMatrixFactorizationMechanism`` (b = N // m,
its ``FTRLMatrixFactorizer``), ``PLDPrivacyAccountant`` over k = ceil(n / b)
compositions without amplification, ``minimize_reuse`` cohorts (the cyclic schema).

    .pfl-venv/bin/python bench/peers/pfl_banded_mf.py --clients 1000 --cohort 50 \
        --rounds 300 --epsilon 2 --seed 0 --out /tmp/pfl.json

``--cooldown F`` decays pfl's central learning rate linearly to 0 over the last F of
the rounds (the engine's ``server.cooldown``); ``--noise-for-what-runs`` raises pfl's
noise multiplier by its C's sensitivity over the sqrt(k) its accountant assumes, so that
what runs is the ε pfl states. Prints and writes one JSON object (accuracy, noise, the
median round time).
"""

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

DELTA = 1e-5
CLIP = 0.5
LOCAL_LR, LOCAL_BATCH, LOCAL_EPOCHS = 0.1, 16, 1
SERVER_LR, SERVER_MOMENTUM = 1.0, 0.5


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--cohort", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--epsilon", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--save-strategy", default=None, help=".npy path for pfl's C")
    parser.add_argument("--cooldown", type=float, default=0.0, help="central LR cooldown")
    parser.add_argument(
        "--noise-for-what-runs",
        action="store_true",
        help="scale pfl's noise to its C's sensitivity (the stated ε is what runs)",
    )
    a = parser.parse_args()
    started = time.perf_counter()
    os.environ.setdefault("PFL_PYTORCH_DEVICE", "cpu")
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, PLDPrivacyAccountant
    from pfl.privacy.ftrl_mechanism import BandedMatrixFactorizationMechanism
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    np.random.seed(a.seed)  # pfl draws its internal seeds (the noise's) from this
    torch.manual_seed(a.seed)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    parts = np.array_split(np.random.default_rng(0).permutation(len(xtr)), a.clients)
    data = {cid: (xtr[idx], ytr[idx]) for cid, idx in enumerate(parts)}
    sampler = get_user_sampler("minimize_reuse", list(data))
    train = FederatedDataset.from_slices(data, sampler)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
            )

        def forward(self, inputs):
            return self.net(inputs)

        def loss(self, inputs, targets):
            self.train()
            return torch.nn.functional.cross_entropy(self(inputs), targets.long())

        @torch.no_grad()
        def metrics(self, inputs, targets):
            self.eval()
            logits = self(inputs)
            n = len(targets)
            loss = torch.nn.functional.cross_entropy(logits, targets.long(), reduction="sum")
            correct = (logits.argmax(1) == targets.long()).sum().item()
            return {"loss": Weighted(loss.item(), n), "accuracy": Weighted(correct, n)}

    net = MLP()
    central = torch.optim.SGD(net.parameters(), lr=SERVER_LR, momentum=SERVER_MOMENTUM)
    schedule = None
    if a.cooldown:  # round t (1-based) at lr * min(1, (n - t + 1) / (F n)), as the engine
        schedule = torch.optim.lr_scheduler.LambdaLR(
            central, lambda i: min(1.0, (a.rounds - i) / (a.cooldown * a.rounds))
        )
    model = PyTorchModel(
        model=net,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=central,
        central_learning_rate_scheduler=schedule,
    )
    separation = a.clients // a.cohort
    participations = math.ceil(a.rounds / separation)
    accountants = []

    def make_accountant(num_compositions):
        accountant = PLDPrivacyAccountant(
            num_compositions=num_compositions,
            sampling_probability=1.0,
            mechanism="gaussian",
            epsilon=a.epsilon,
            delta=DELTA,
        )
        accountants.append(accountant)
        return accountant

    calibration_started = time.perf_counter()
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # pfl saves the optimised C under the working directory
        try:
            mechanism = BandedMatrixFactorizationMechanism(
                clipping_bound=CLIP,
                num_iterations=a.rounds,
                min_separation=separation,
                make_privacy_accountant=make_accountant,
            )
        finally:
            os.chdir(cwd)
    factorization_s = time.perf_counter() - calibration_started
    c = mechanism.query_matrix
    pfl_noise = float(accountants[0].cohort_noise_parameter)
    scale = 1.0
    if a.noise_for_what_runs:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from privacy.correlated import sensitivity  # numpy only: no Flower, no dp-accounting

        found = sensitivity(c, participations=participations, min_separation=separation)
        scale = found.value / math.sqrt(participations)
        # pfl has no public setter: its GaussianMechanism keeps the multiplier here and
        # add_noise reads it each round.
        mechanism._relative_noise_stddev = pfl_noise * scale
    backend = SimulatedBackend(
        training_data=train,
        val_data=None,
        postprocessors=[CentrallyAppliedPrivacyMechanism(mechanism)],
    )

    class Timer(TrainingProcessCallback):
        def __init__(self):
            self.laps = []

        def on_train_begin(self, *, model):
            self._t = time.perf_counter()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            now = time.perf_counter()
            self.laps.append(now - self._t)
            self._t = now
            return False, Metrics()

    timer = Timer()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=a.rounds,
            evaluation_frequency=10**9,
            train_cohort_size=a.cohort,
            val_cohort_size=None,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=LOCAL_LR,
            local_num_epochs=LOCAL_EPOCHS,
            local_batch_size=LOCAL_BATCH,
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=[timer],
    )
    with torch.no_grad():
        accuracy = float((net(torch.as_tensor(xte)).argmax(1).numpy() == yte).mean())
    out = {
        "arm": "pfl-banded-mf",
        "epsilon": a.epsilon,
        "seed": a.seed,
        "clients": a.clients,
        "cohort": a.cohort,
        "rounds": a.rounds,
        "min_separation": separation,
        "participations": participations,
        "bands": int(max(np.count_nonzero(c[:, j]) for j in range(c.shape[1]))),
        "max_column_norm": float(np.linalg.norm(c, axis=0).max()),
        "noise_parameter": pfl_noise * scale,  # what ran
        "pfl_noise_parameter": pfl_noise,  # pfl's, for sensitivity sqrt(k)
        "noise_scale": scale,
        "cooldown": a.cooldown,
        "accuracy": accuracy,
        "rounds_completed": len(timer.laps),
        "warm_round_s": statistics.median(timer.laps[1:] or timer.laps),
        "factorization_s": factorization_s,
        "process_s": time.perf_counter() - started,
        "pfl": __import__("pfl").__version__,
    }
    print(json.dumps(out))
    if a.save_strategy:
        np.save(a.save_strategy, c)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
