"""Why banded MF gains less in training than its prefix-sum error says: a cheap replica.

The scaled-down trained benchmark (bench/correlated.py: digits, N = 200, 10 a round, 60
rounds, b = 20 cyclic groups, k = 3, clip 0.5, server momentum 0.5) without the engine:
the same data order, model and client step (one SGD step of lr 0.1 per client: a shard
of 7 examples is one batch of 16), the same noise (``privacy.correlated``'s strategy,
sensitivity, calibration and ``BandedNoise`` stream), Flower's FedAvgM update, in a
loop of a few CPU seconds a run, so that many seeds can be afforded.

    python bench/correlated_dynamics.py --theory          # the noise in the models
    python bench/correlated_dynamics.py --bands 1 5 20 --seeds 10
    python bench/correlated_dynamics.py --bands 1 20 --model linear --seeds 8

``--bands 1`` is DP-FedAvg on the same cohorts (C = I). Results: the study
studies/correlated-noise/README.md ("Why banded MF lost in training").
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from privacy import correlated as cr


def _plan(rounds: int, bands: int, separation: int, momentum: float, eps: float):
    """(coefs, z) of the b-banded strategy for the run's workload, calibrated to ε."""
    factorization = cr.optimize_banded(rounds, bands, momentum=momentum)
    k = math.ceil(rounds / separation)
    sens = cr.sensitivity(factorization.strategy(), participations=k, min_separation=separation)
    return factorization, cr.calibrate(target_epsilon=eps, sensitivity=sens.value, delta=1e-5)


def theory(rounds=60, separation=20, momentum=0.5, eps=2.0, bands=(1, 2, 5, 10, 20)) -> str:
    """Per bands: the noise of one round's mean update, and of the released models (B =
    A C^-1, A the momentum workload) per coordinate in units of C / m: its level (root
    mean over rounds, and at the last round), its change from one round to the next, and
    the correlation of a model's noise with the noise 1, 5 and 20 rounds later."""
    lines = [
        "| bands | z | round's noise sd | model noise rms | at round n | change a round "
        "| corr lag 1 | lag 5 | lag 20 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    workload = cr.momentum_workload(rounds, momentum) if momentum else None
    for b in bands:
        factorization, z = _plan(rounds, b, separation, momentum, eps)
        inverse = np.linalg.inv(factorization.strategy())
        decoder = (workload if workload is not None else np.tril(np.ones((rounds,) * 2))) @ inverse
        cov = z**2 * decoder @ decoder.T
        sd = np.sqrt(np.diag(cov))
        corr = cov / np.outer(sd, sd)
        change = np.diag(cov)[1:] + np.diag(cov)[:-1] - 2 * np.diag(cov, 1)
        late = range(separation - 1, rounds)  # after the first window of b rounds

        def lag(d: int, late=late, corr=corr) -> float:
            return float(np.mean([corr[t, t + d] for t in late if t + d < rounds]))

        lines.append(
            f"| {b} | {z:.3f} | {z * math.sqrt(np.mean(np.sum(inverse**2, axis=1))):.2f} "
            f"| {math.sqrt(np.mean(sd**2)):.1f} | {sd[-1]:.1f} "
            f"| {math.sqrt(np.mean(change[separation - 1 :])):.2f} | {lag(1):.3f} "
            f"| {lag(5):.3f} | {lag(20):.3f} |"
        )
    return "\n".join(lines)


def train(bands: int, seed: int, *, model="mlp", rounds=60, clients=200, cohort=10,
          separation=20, momentum=0.5, eps=2.0, clip=0.5, lr=0.1,
          cooldown=0.0) -> float:  # fmt: skip
    """Final central accuracy of one run (FedAvgM: v_t = beta v_(t-1) + g_t, x += lr_t
    v_t; lr_t = 1 but in ``server.cooldown``'s last rounds, ServerOptimizerSettings.lr_at)."""
    from strategies.algorithms.server_optimizer import ServerOptimizerSettings

    server = ServerOptimizerSettings("momentum", 1.0, momentum, cooldown=cooldown)
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    ids = np.arange(len(y))
    pool, central = train_test_split(ids, test_size=0.2, stratify=y, random_state=0)
    pool = pool[np.random.default_rng(0).permutation(len(pool))]  # the peer workload's order
    data = torch.tensor(x / 16.0, dtype=torch.float32)
    labels = torch.tensor(y)
    shards = np.array_split(pool, clients)
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)]
    net = torch.nn.Sequential(*(layers if model == "mlp" else [torch.nn.Linear(64, 10)]))
    params = list(net.parameters())
    dim = sum(p.numel() for p in params)
    factorization, z = _plan(rounds, bands, separation, momentum, eps)
    stream = cr.BandedNoise(
        factorization.coefs, dim=dim, std=z * clip, generator=np.random.default_rng(seed)
    )
    weights = torch.nn.utils.parameters_to_vector(params).detach().double()
    velocity = torch.zeros_like(weights)
    for t in range(rounds):
        members = [i for i in range(clients) if i % separation == t % separation][:cohort]
        total = np.zeros(dim)
        for i in members:
            torch.nn.utils.vector_to_parameters(weights.float(), params)
            loss = torch.nn.functional.cross_entropy(net(data[shards[i]]), labels[shards[i]])
            grads = torch.autograd.grad(loss, params)
            delta = -lr * torch.cat([g.flatten() for g in grads]).double().numpy()
            total += delta * min(1.0, clip / max(float(np.linalg.norm(delta)), 1e-12))
        stream.add_to(total)
        velocity = momentum * velocity + torch.from_numpy(total / cohort)
        weights = weights + server.lr_at(t + 1, rounds) * velocity
    torch.nn.utils.vector_to_parameters(weights.float(), params)
    with torch.no_grad():
        predicted = net(data[central]).argmax(1)
    return float((predicted == labels[central]).float().mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--theory", action="store_true", help="only the models' noise")
    parser.add_argument("--bands", type=int, nargs="+", default=[1, 20])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--eps", type=float, default=2.0)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--model", choices=["mlp", "linear"], default="mlp")
    parser.add_argument("--cooldown", type=float, default=0.0, help="server.cooldown")
    args = parser.parse_args(argv)
    if args.theory:
        print(theory(momentum=args.momentum, eps=args.eps))
        return 0
    print("| bands | model | ε | momentum | cooldown | accuracy mean ± std | seeds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b in args.bands:
        runs = [
            train(
                b,
                s,
                model=args.model,
                eps=args.eps,
                momentum=args.momentum,
                cooldown=args.cooldown,
            )
            for s in range(args.seeds)
        ]
        print(
            f"| {b} | {args.model} | {args.eps:g} | {args.momentum:g} | {args.cooldown:g} "
            f"| {statistics.mean(runs):.3f} ± {statistics.stdev(runs):.3f} | {args.seeds} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
