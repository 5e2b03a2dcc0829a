"""Correlated noise against the honest baselines on the peer workload, and its cost.

Digits MLP (the peer workload of ``bench/peer_digits.py``), N = 1 000 clients, 50 a
round, 300 rounds, delta 1e-5, fixed clip 0.5, server momentum 0.5, z calibrated to the
whole run's epsilon. Arms (studies/correlated-noise/README.md): a DP-FedAvg on cyclic cohorts,
b DP-FedAvg with secret Poisson sampling, c banded MF, d amplified banded MF (b chosen
by least mechanism-alone error), e DP-FTRL's honest tree, f pfl-research 0.6's banded
MF in its own environment (bench/peers/pfl_banded_mf.py). Each run is ``python -m
lab.run --engine inprocess`` in its own process.

    python bench/correlated.py --eps 2 8 --seeds 0 --out /tmp/correlated-bench \
        --pfl-python .pfl-venv/bin/python
    python bench/correlated.py --cost   # the mechanism's cost per round at 1e7 weights
    python bench/correlated.py --error  # the mechanisms alone: z and prefix-sum error
    python bench/correlated.py replica --bands 1 5 20  # no engine (`theory`: its noise)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import peer_digits  # noqa: E402  (this directory is on sys.path when run as a script)

N, COHORT, ROUNDS = 1000, 50, 300
# The shared peer workload (bench/peer_digits.py), with this benchmark's own keys.
WORKLOAD = {
    **{k: v for k, v in peer_digits.WORKLOAD.items() if k != "num-server-rounds"},
    "strategy": "fedavg",
    "round-timeout": 600.0,
    "dp.clip-norm": 0.5,
    "dp.num-sampled-clients": COHORT,
    "dp.target-delta": 1e-5,
    "server.optimizer": "momentum",
    "server.lr": 1.0,
    "server.momentum": 0.5,
}
ARMS = {
    "dp-fedavg-cyclic": {"privacy": "banded-mf", "correlated.bands": 1},
    "dp-fedavg-poisson": {"privacy": "dp-fedavg-fixed", "dp.sampling": "poisson"},
    "banded-mf": {"privacy": "banded-mf"},
    # b = 10 groups of 100: q = 50/100 (with b = 20, groups of 50 give q = 1: no sampling)
    "banded-mf-amp": {
        "privacy": "banded-mf",
        "correlated.schema": "amplified",
    },
    "dp-ftrl": {"privacy": "dp-ftrl"},
    "pfl-banded-mf": {},  # the peer, in its own environment (``peer``)
}
PEER_SCRIPT = REPO / "bench" / "peers" / "pfl_banded_mf.py"


def one(
    arm: str,
    epsilon: float,
    seed: int,
    rounds: int,
    out: Path,
    clients=N,
    cohort=COHORT,
    amp_groups: int = 0,
    bands: int = 0,
    cooldown: float = 0.0,
) -> dict:
    """One run; its final accuracy, ε (the ledger's), z and warm round."""
    root = out / f"{arm}-eps{epsilon:g}-seed{seed}"
    root.mkdir(parents=True, exist_ok=True)
    config = {**WORKLOAD, **ARMS[arm], "seed": seed, "num-server-rounds": rounds}
    if arm == "banded-mf-amp" and amp_groups:
        config["correlated.min-separation"] = amp_groups
    elif arm == "banded-mf-amp":  # the run's own least-error b (its workload, its groups)
        config["correlated.choose-separation"] = "least-error"
    if cooldown:  # every arm's server learning rate (post-processing)
        config["server.cooldown"] = cooldown
    if arm == "banded-mf" and bands:  # arm c's bands (0: b, the least prefix-sum error)
        config["correlated.bands"] = bands
    config |= {"dp.target-epsilon": epsilon, "output-dir": str(root)}
    config |= {"min-available-nodes": clients, "min-train-nodes": cohort}
    config["dp.num-sampled-clients"] = cohort
    run_config = " ".join(f"{k}={peer_digits.toml_value(v)}" for k, v in config.items())
    seconds, cpu, metrics, timing = peer_digits.run_engine(run_config, clients, root)
    train = timing[(timing["scope"] == "train") & (timing["round"] >= 2)]
    central = metrics[metrics["scope"] == "central-eval"].sort_values("round")
    released = metrics[metrics["scope"] == "train"].sort_values("round")
    (ledger,) = root.glob("*/ledger.json")
    calibration = json.loads(ledger.read_text()).get("calibration") or {}
    return {
        "arm": arm,
        "epsilon": epsilon,
        "seed": seed,
        "ledger epsilon": float(released["dp-epsilon"].iloc[-1]),
        "accuracy": float(central["eval-accuracy"].iloc[-1]),
        "warm round s": statistics.median(train["round-seconds"]),
        "process s": round(seconds, 1),
        "process CPU s": round(cpu, 1),
        "groups": calibration.get("min-separation", 0),  # b as the ledger records it
        "bands": calibration.get("bands", 0),
        "cooldown": cooldown,
    }


def peer(
    python: str,
    epsilon: float,
    seed: int,
    rounds: int,
    out: Path,
    clients=N,
    cohort=COHORT,
    cooldown: float = 0.0,
    fair: bool = False,
) -> dict:
    """Arm f: pfl-research's banded MF (bench/peers/pfl_banded_mf.py) in its own
    environment; beside pfl's own ε, the ε of what ran: pfl's noise on the sensitivity
    of its C for k participations >= N // m apart (privacy.correlated.sensitivity).
    ``fair``: pfl's noise raised so that what runs is ε (``--noise-for-what-runs``)."""
    from privacy import correlated as cr

    name = "pfl-banded-mf" + ("-what-runs" if fair else "")
    root = out / f"{name}-eps{epsilon:g}-seed{seed}"
    root.mkdir(parents=True, exist_ok=True)
    result, strategy = root / "result.json", root / "strategy.npy"
    cmd = [
        python, str(PEER_SCRIPT), "--clients", str(clients), "--cohort", str(cohort),
        "--rounds", str(rounds), "--epsilon", str(epsilon), "--seed", str(seed),
        "--out", str(result), "--save-strategy", str(strategy), "--cooldown", str(cooldown),
    ]  # fmt: skip
    cmd += ["--noise-for-what-runs"] if fair else []
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    got = json.loads(result.read_text())
    found = cr.sensitivity(
        np.load(strategy),
        participations=got["participations"],
        min_separation=got["min_separation"],
    )
    ran = cr.epsilon(noise_multiplier=got["noise_parameter"], sensitivity=found.value, delta=1e-5)
    return {
        "arm": name,
        "epsilon": epsilon,
        "seed": seed,
        "ledger epsilon": ran,  # what ran: pfl states `epsilon` for sensitivity sqrt(k)
        "accuracy": got["accuracy"],
        "warm round s": got["warm_round_s"],
        "process s": round(seconds, 1),
        "groups": got["min_separation"],
        "pfl sensitivity": found.value,
        "pfl assumed sensitivity": math.sqrt(got["participations"]),
        "pfl noise scale": got.get("noise_scale", 1.0),
        "cooldown": cooldown,
    }


def table(rows: list[dict]) -> str:
    """Markdown: accuracy mean ± std over seeds and the median warm round per arm × ε."""
    frame = pd.DataFrame(rows)
    lines = [
        "| arm | ε | ledger ε | accuracy | seeds | warm round (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (arm, eps), group in frame.groupby(["arm", "epsilon"], sort=False):
        acc = group["accuracy"]
        std = f" ± {acc.std(ddof=1):.3f}" if len(acc) > 1 else ""
        lines.append(
            f"| {arm} | {eps:g} | {group['ledger epsilon'].max():.3f} | {acc.mean():.3f}{std} "
            f"| {len(acc)} | {group['warm round s'].median():.3f} |"
        )
    return "\n".join(lines)


def _timed(step, repeat: int = 1) -> tuple[float, float]:
    """(wall s, CPU s of this process) per call of ``step``, over ``repeat`` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeat):
        step()
    return (time.perf_counter() - wall) / repeat, (time.process_time() - cpu) / repeat


def cost(dim: int = 10_000_000, rounds: int = 5, bands: int = 20) -> dict[str, float]:
    """Seconds per round of the mechanism at ``dim`` weights: the stream's increment
    (noise drawn, the factorization applied, added to the sum) for banded MF (b bands),
    the tree, and DP-FedAvg's independent draw, beside the server's clip-and-sum of the
    cohort's updates; wall and CPU seconds (the shares use CPU seconds of this process,
    which other processes on a shared machine do not inflate); the L-BFGS time of the
    strategy for 2 000 rounds, b = 64 (uncached)."""
    import tempfile

    from privacy import correlated as cr
    from privacy.mechanisms import GaussianMechanism

    out = {}
    coefs = cr.optimize_banded(ROUNDS, bands, use_cache=False).coefs
    rng = np.random.default_rng()
    # The server's own aggregate of one round at this size: m clipped float32 updates
    # summed in float64 (DP-FedAvg's clip and sum; the floor of a round, before
    # training and messages).
    mech = GaussianMechanism(clip_norm=1.0, noise_multiplier=1.0)
    update = [rng.normal(0.0, 1.0, dim).astype(np.float32)]
    total = np.zeros(dim)

    def clip_and_sum():
        total[:] = 0.0
        for _ in range(COHORT):
            total.__iadd__(mech.clip(update).arrays[0])

    wall, cpu = _timed(clip_and_sum)
    out[f"clip and sum of {COHORT} updates s"], out[f"clip and sum of {COHORT} CPU s"] = wall, cpu
    # float32 weights: the stream runs in float32 and is added to the float64 sum in
    # place, as CorrelatedNoiseDP._private_mean does.
    streams = {
        "banded-mf": cr.BandedNoise(
            coefs, dim=dim, std=1.0, generator=np.random.default_rng(), dtype=np.float32
        ),
        "dp-ftrl": cr.TreeNoise(dim=dim, std=1.0, generator=np.random.default_rng()),
    }
    for name, stream in streams.items():
        for _ in range(bands):  # fill the band
            stream.add_to(total)
        wall, cpu = _timed(lambda s=stream: s.add_to(total), rounds)
        out[f"{name} s/round"], out[f"{name} CPU s/round"] = wall, cpu
    del streams
    wall, cpu = _timed(lambda: total.__iadd__(rng.normal(0.0, 1.0, dim)), rounds)
    out["independent draw s/round"], out["independent draw CPU s/round"] = wall, cpu
    for name in ("banded-mf", "dp-ftrl", "independent draw"):
        out[f"{name} share of the aggregate (CPU)"] = (
            out[f"{name} CPU s/round"] / out[f"clip and sum of {COHORT} CPU s"]
        )
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        cr.optimize_banded(2000, 64, cache=Path(tmp))
        out["strategy n=2000 b=64 s"] = time.perf_counter() - started
        started = time.perf_counter()
        cr.optimize_banded(2000, 64, cache=Path(tmp))
        out["cached s"] = time.perf_counter() - started
    return out


def _poisson_z(eps: float, delta: float, cohort: int, population: int, count: int) -> float:
    """z of ``count`` Poisson-sampled Gaussians (q = cohort / population) at (ε, δ), PLD."""
    from dataclasses import replace

    from privacy.accounting import Release
    from privacy.calibration import calibrate_parameter

    release = Release(
        server_round=1,
        kind="model-update",
        mechanism="gaussian",
        noise_multiplier=1.0,
        sampling="poisson",
        sample_size=cohort,
        population=population,
        count=count,
    )
    return calibrate_parameter(
        lambda p: [replace(release, noise_multiplier=p)],
        target_epsilon=eps,
        target_delta=delta,
        accountant="pld",
        neighboring="add-or-remove-one",
    )


def amplified_error(
    eps: float, groups: int, *, rounds=ROUNDS, clients=N, cohort=COHORT, delta=1e-5
) -> tuple[float, float]:
    """Amplified banded MF with b = ``groups`` (b bands, groups of N // b, q = m / (N //
    b), k = ceil(n / b) Poisson-sampled Gaussians at max column norm 1): (z, mean sq.
    prefix-sum error / C²). b = 1 is DP-FedAvg with Poisson sampling (C = I)."""
    from privacy import correlated as cr

    population = clients // groups
    if population < cohort:
        raise ValueError(f"groups={groups}: groups of {population} < cohort {cohort}")
    z = _poisson_z(eps, delta, cohort, population, math.ceil(rounds / groups))
    decoder = cr.optimize_banded(rounds, groups).decoder()
    return z, cr.prefix_sum_error(decoder, noise_std=z)


def best_amplified_groups(eps: float, *, rounds=ROUNDS, clients=N, cohort=COHORT, delta=1e-5):
    """The b (1 .. N // m) with the least mechanism-alone error at ε, and every b's
    (z, error): the choice is data-independent (n, N, m, ε, δ are public), so it costs
    no privacy (Choquette-Choo, McMahan et al. 2023 choose the bands the same way)."""
    errors = {
        b: amplified_error(eps, b, rounds=rounds, clients=clients, cohort=cohort, delta=delta)
        for b in range(1, clients // cohort + 1)
    }
    return min(errors, key=lambda b: errors[b][1]), errors


def error_table(
    epsilons=(2.0, 8.0), delta: float = 1e-5, *, rounds=ROUNDS, clients=N, cohort=COHORT
) -> str:
    """The mechanisms alone at the benchmark's size (N, m, n): z calibrated to each ε
    and the mean squared error of the released prefix sums per coordinate, in units
    of C² (the noise the model's trajectory carries; no training); then amplified
    banded MF for every b, the least-error b marked."""
    from privacy import correlated as cr

    n, b = rounds, clients // cohort
    k = math.ceil(n / b)
    identity = n * (n + 1) / 2 / n  # ||A||_F^2 / n

    banded = cr.optimize_banded(n, b)
    sens = cr.sensitivity(banded.strategy(), participations=k, min_separation=b).value
    tree = cr.tree_sensitivity(n, participations=k, min_separation=b)
    lines = [
        "| arm | ε | z | sensitivity | mean sq. prefix-sum error / C² | RMSE / C |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    sweep = [
        "",
        "| ε | b (groups, bands) | q | k | z | mean sq. prefix-sum error / C² |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for eps in epsilons:
        rows = []
        z = cr.calibrate(target_epsilon=eps, sensitivity=math.sqrt(k), delta=delta)
        rows.append(("a dp-fedavg-cyclic", z, math.sqrt(k), z**2 * identity))
        z = _poisson_z(eps, delta, cohort, clients, n)
        rows.append(("b dp-fedavg-poisson", z, 1.0, z**2 * identity))
        z = cr.calibrate(target_epsilon=eps, sensitivity=sens, delta=delta)
        rows.append(("c banded-mf", z, sens, cr.prefix_sum_error(banded.decoder(), noise_std=z)))
        best, errors = best_amplified_groups(
            eps, rounds=n, clients=clients, cohort=cohort, delta=delta
        )
        z, error = errors[best]
        rows.append((f"d banded-mf-amp (b = {best})", z, 1.0, error))
        z = cr.calibrate(target_epsilon=eps, sensitivity=tree, delta=delta)
        rows.append(("e dp-ftrl", z, tree, cr.prefix_sum_error(cr.tree_decoder(n), noise_std=z)))
        for name, z, s, err in rows:
            lines.append(
                f"| {name} | {eps:g} | {z:.3f} | {s:.3f} | {err:.4g} | {math.sqrt(err):.2f} |"
            )
        for g, (z, err) in errors.items():
            q = cohort / (clients // g)
            mark = " **(chosen)**" if g == best else ""
            sweep.append(
                f"| {eps:g} | {g}{mark} | {q:.3g} | {math.ceil(n / g)} | {z:.3f} | {err:.4g} |"
            )
    return "\n".join(lines + sweep)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eps", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--arms", nargs="+", default=None, choices=list(ARMS))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--clients", type=int, default=N)
    parser.add_argument("--cohort", type=int, default=COHORT)
    parser.add_argument("--out", type=Path, default=Path("/tmp/correlated-bench"))
    parser.add_argument("--cost", action="store_true", help="only the mechanism's cost")
    parser.add_argument("--error", action="store_true", help="only the mechanisms' error")
    parser.add_argument(
        "--pfl-python", default=None, help="arm f: the Python of pfl-research's environment"
    )
    parser.add_argument(
        "--amp-groups", type=int, default=0, help="arm d's b (0: the run's least-error b)"
    )
    parser.add_argument(
        "--bands", type=int, default=0, help="arm c's bands (0: b; see the study on b)"
    )
    parser.add_argument("--cooldown", type=float, default=0.0, help="server.cooldown")
    parser.add_argument(
        "--pfl-what-runs",
        action="store_true",
        help="arm f also with pfl's noise raised so that what runs is the target ε",
    )
    parser.add_argument(
        "--pfl-what-runs-only",
        action="store_true",
        help="arm f only with pfl's noise raised (not also as pfl states it)",
    )
    args = parser.parse_args(argv)
    if args.cost:
        for key, value in cost().items():
            print(f"{key}: {value:.4f}")
        return 0
    if args.error:
        print(error_table(args.eps, rounds=args.rounds, clients=args.clients, cohort=args.cohort))
        return 0
    if args.arms is None:  # all of them; the peer when its environment is given
        args.arms = [a for a in ARMS if a != "pfl-banded-mf" or args.pfl_python]
    rows = []
    for seed in args.seeds:
        for epsilon in args.eps:
            for arm in args.arms:
                if arm == "pfl-banded-mf":
                    if not args.pfl_python:
                        parser.error("arm 'pfl-banded-mf' needs --pfl-python PATH")
                    sizes = (args.rounds, args.out, args.clients, args.cohort, args.cooldown)
                    fair = args.pfl_what_runs or args.pfl_what_runs_only
                    if args.pfl_what_runs and not args.pfl_what_runs_only:  # as pfl states
                        rows.append(peer(args.pfl_python, epsilon, seed, *sizes))
                        print(rows[-1], flush=True)
                    rows.append(peer(args.pfl_python, epsilon, seed, *sizes, fair=fair))
                else:
                    sizes = (args.rounds, args.out, args.clients, args.cohort, args.amp_groups)
                    rows.append(
                        one(arm, epsilon, seed, *sizes, bands=args.bands, cooldown=args.cooldown)
                    )
                print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.out / "results.csv", index=False)
    print(table(rows))
    return 0


# --- `replica` and `theory`: why banded MF gains less in training than its error says ---
# The scaled-down trained benchmark above (digits, N = 200, 10 a round, 60 rounds, b = 20
# cyclic groups, k = 3, clip 0.5, server momentum 0.5) without the engine: the same data
# order, model and client step (one SGD step of lr 0.1 per client: a shard of 7 examples
# is one batch of 16), the same noise (``privacy.correlated``'s strategy, sensitivity,
# calibration and ``BandedNoise`` stream) and Flower's FedAvgM update, in a loop of a few
# CPU seconds a run, so that many seeds can be afforded. Written by hand (not the
# engine) for that speed; ``--bands 1`` is DP-FedAvg on the same cohorts (C = I).
# Results: studies/correlated-noise/README.md ("Why banded MF lost in training").


def _replica_plan(rounds: int, bands: int, separation: int, momentum: float, eps: float):
    """(factorization, z) of the b-banded strategy for the run's workload, calibrated to ε."""
    from privacy import correlated as cr

    factorization = cr.optimize_banded(rounds, bands, momentum=momentum)
    k = math.ceil(rounds / separation)
    sens = cr.sensitivity(factorization.strategy(), participations=k, min_separation=separation)
    return factorization, cr.calibrate(target_epsilon=eps, sensitivity=sens.value, delta=1e-5)


def theory(rounds=60, separation=20, momentum=0.5, eps=2.0, bands=(1, 2, 5, 10, 20)) -> str:
    """Per bands: the noise of one round's mean update, and of the released models (B =
    A C^-1, A the momentum workload) per coordinate in units of C / m: its level (root
    mean over rounds, and at the last round), its change from one round to the next, and
    the correlation of a model's noise with the noise 1, 5 and 20 rounds later."""
    from privacy import correlated as cr

    lines = [
        "| bands | z | round's noise sd | model noise rms | at round n | change a round "
        "| corr lag 1 | lag 5 | lag 20 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    workload = cr.momentum_workload(rounds, momentum) if momentum else None
    for b in bands:
        factorization, z = _replica_plan(rounds, b, separation, momentum, eps)
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


def replica_run(bands: int, seed: int, *, model="mlp", rounds=60, clients=200, cohort=10,
                separation=20, momentum=0.5, eps=2.0, clip=0.5, lr=0.1,
                cooldown=0.0) -> float:  # fmt: skip
    """Final central accuracy of one replica run (FedAvgM: v_t = beta v_(t-1) + g_t, x +=
    lr_t v_t; lr_t = 1 but in ``server.cooldown``'s last rounds, ServerOptimizerSettings.lr_at)."""
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from privacy import correlated as cr
    from strategies.algorithms.server_optimizer import ServerOptimizerSettings

    server = ServerOptimizerSettings("momentum", 1.0, momentum, cooldown=cooldown)
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
    factorization, z = _replica_plan(rounds, bands, separation, momentum, eps)
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


def theory_main(argv: list[str]) -> int:
    """``theory``: the noise in the models, per bands (a table)."""
    parser = argparse.ArgumentParser(
        prog="correlated.py theory", description="The noise in the replica's models."
    )
    parser.add_argument("--eps", type=float, default=2.0)
    parser.add_argument("--momentum", type=float, default=0.5)
    args = parser.parse_args(argv)
    print(theory(momentum=args.momentum, eps=args.eps))
    return 0


def replica_main(argv: list[str]) -> int:
    """``replica``: the final accuracy, mean ± std over seeds 0 .. n - 1, per bands."""
    parser = argparse.ArgumentParser(
        prog="correlated.py replica", description="The trained benchmark without the engine."
    )
    parser.add_argument("--bands", type=int, nargs="+", default=[1, 20])
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0 .. n - 1 (n >= 2)")
    parser.add_argument("--eps", type=float, default=2.0)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--model", choices=["mlp", "linear"], default="mlp")
    parser.add_argument("--cooldown", type=float, default=0.0, help="server.cooldown")
    args = parser.parse_args(argv)
    if args.seeds < 2:
        parser.error(f"--seeds {args.seeds}: the spread needs at least 2 seeds")
    print("| bands | model | ε | momentum | cooldown | accuracy mean ± std | seeds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b in args.bands:
        runs = [
            replica_run(
                b, s, model=args.model, eps=args.eps, momentum=args.momentum,
                cooldown=args.cooldown,
            )
            for s in range(args.seeds)
        ]  # fmt: skip
        print(
            f"| {b} | {args.model} | {args.eps:g} | {args.momentum:g} | {args.cooldown:g} "
            f"| {statistics.mean(runs):.3f} ± {statistics.stdev(runs):.3f} | {args.seeds} |",
            flush=True,
        )
    return 0


COMMANDS = {"replica": replica_main, "theory": theory_main}


def cli(argv: list[str] | None = None) -> object:
    """``replica`` or ``theory`` with their arguments, else the benchmark's (``main``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return COMMANDS[args[0]](args[1:])
    return main(args)


if __name__ == "__main__":
    sys.exit(cli())
