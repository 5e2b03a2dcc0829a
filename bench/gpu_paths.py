"""The app's GPU paths, run on a GPU: do they work, do they agree with the CPU, and what
does DP cost there.

Design notes: ``docs/notes.md``, ``bench.gpu_paths``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from timing import machine_info, median_ms  # bench/timing.py

from privacy.mechanisms import GaussianMechanism, make_generator
from tasks.base import DPSGD, LocalTraining
from tasks.finance import FinanceTask
from tasks.lunar_lander import LunarLanderTask
from tasks.vision.data import ClientPartition, TensorSplit
from tasks.vision.task import CIFAR10Task, DigitsTask

CLIENTS = 10  # the default experiment's clients: m updates per aggregate
CIFAR_TRAIN = 4000  # the largest iid client's train split of CIFAR-10 (privacy_cost.py)
DP = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
FINANCE = {"finance.synthetic-rows": 3000, "finance.local-epochs": 2}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def max_weight_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest absolute difference over every state-dict entry (floats only)."""
    return max(
        float((x.double() - y.double()).abs().max())
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
        if x.is_floating_point()
    )


def train_on(task_cls, config: dict, device: str, dp_sgd: DPSGD | None = None, partition=None):
    """(model, metrics, seconds) of one ``Task.train`` on ``device`` from seed-0 weights."""
    task = task_cls({**config, device_key(task_cls): device})
    model = task.build_model(0)
    part = task.load_partition(0, task.num_partitions() or 4) if partition is None else partition
    local = LocalTraining(server_round=1, seed=7, dp_sgd=dp_sgd, dp_seed=11)
    sync()
    start = time.perf_counter()
    metrics = task.train(model, part, local)
    sync()
    return model, metrics, time.perf_counter() - start


def device_key(task_cls) -> str:
    return {FinanceTask: "finance.device", LunarLanderTask: "ppo.device"}.get(
        task_cls, "vision.device"
    )


def section_agree(gpu: str = "cuda") -> list[dict]:
    """Train loss on the CPU and on ``gpu``, the weights' largest difference, DP-SGD's
    epsilon."""
    cases = [
        ("digits lenet", DigitsTask, {"vision.local-epochs": 2}, None),
        ("digits lenet DP-SGD", DigitsTask, {"vision.local-epochs": 2}, DP),
        ("finance mlp", FinanceTask, FINANCE, None),
        ("finance mlp DP-SGD", FinanceTask, {**FINANCE, "finance.norm": "layer"}, DP),
    ]
    rows = []
    for name, cls, config, dp in cases:
        cpu_model, cpu, cpu_s = train_on(cls, config, "cpu", dp)
        gpu_model, on_gpu, gpu_s = train_on(cls, config, gpu, dp)
        row = {
            "case": name,
            "loss cpu": cpu["train-loss"],
            "loss cuda": on_gpu["train-loss"],
            "max |w cpu - w cuda|": max_weight_difference(cpu_model, gpu_model),
            "s cpu": cpu_s,
            "s cuda": gpu_s,
        }
        if dp is not None:
            row["epsilon cpu"] = cpu["local-epsilon"]
            row["epsilon cuda"] = on_gpu["local-epsilon"]
        rows.append(row)
    return rows


def random_cifar_partition(examples: int) -> ClientPartition:
    """``examples`` random normalised 3x32x32 images with random labels (10 classes)."""
    gen = torch.Generator().manual_seed(examples)
    split = TensorSplit(
        torch.randn(examples, 3, 32, 32, generator=gen),
        torch.randint(0, 10, (examples,), generator=gen),
    )
    return ClientPartition(0, CLIENTS, split, split)


def aggregate_ms(model: torch.nn.Module, repeats: int) -> float:
    """The server's DP aggregate of m = 10 updates of ``model``'s shapes (float32,
    norm 10 C, so each is clipped), as bench/privacy_cost.py times it."""
    from privacy_cost import ServerStandIn, private_mean, random_update  # bench/

    rng = make_generator(0, 1)
    mech = GaussianMechanism(clip_norm=1.0, noise_multiplier=1.0)
    server = ServerStandIn(mech, rng, CLIENTS)
    deltas = [random_update(model, 10.0, rng) for _ in range(CLIENTS)]
    return median_ms(lambda: private_mean(server, deltas), repeats)


def section_epochs(
    models: list[str],
    cpu_models: list[str],
    repeats: int,
    gpu: str = "cuda",
    examples: int = CIFAR_TRAIN,
) -> list[dict]:
    """One local epoch per model, device and DP setting; the aggregate beside it."""
    partition, warm_up = random_cifar_partition(examples), random_cifar_partition(256)
    rows = []
    for name in models:
        config = {"vision.model": name, "vision.local-epochs": 1}
        agg = aggregate_ms(CIFAR10Task(config).build_model(0), repeats)
        for device in [gpu, "cpu"] if name in cpu_models else [gpu]:
            for dp in (None, DP):
                try:
                    train_on(CIFAR10Task, config, device, dp, warm_up)  # cuDNN, allocator
                    model, metrics, seconds = train_on(CIFAR10Task, config, device, dp, partition)
                except RuntimeError as err:  # recorded; the other rows still run
                    rows.append({"model": name, "device": device, "error": str(err)[:300]})
                    print(f"  {name} {device}: {err}", file=sys.stderr)
                    continue
                rows.append(
                    {
                        "model": name,
                        "device": device,
                        "training": "DP-SGD" if dp else "SGD",
                        "d": sum(p.numel() for p in model.state_dict().values()),
                        "epoch s": seconds,
                        "examples/s": examples / seconds,
                        f"aggregate m={CLIENTS} ms": agg,
                        "agg/round %": 100 * agg / (CLIENTS * seconds * 1e3),
                        "train-loss": metrics["train-loss"],
                    }
                )
                print(
                    f"  {name} {device} {rows[-1]['training']}: {seconds:.2f} s", file=sys.stderr
                )
    return rows


def section_ppo(steps: int, gpu: str = "cuda") -> list[dict]:
    """Env steps per second of one client's local PPO on the CPU and on ``gpu``, with
    the PPO settings of the lunar-lands study's lunar-fl-lands-fedavg preset (4 envs x 512
    steps a rollout, batch 64, 10 epochs)."""
    config = {
        "ppo.derived-per-base": 0, "ppo.local-steps": steps, "ppo.n-envs": 4,
        "ppo.n-steps": 512, "ppo.batch-size": 64, "ppo.n-epochs": 10, "ppo.check-freq": steps,
    }  # fmt: skip
    rows = []
    for device in ("cpu", gpu):
        train_on(LunarLanderTask, {**config, "ppo.local-steps": 2048}, device)  # warm-up
        _, metrics, seconds = train_on(LunarLanderTask, config, device)
        taken = int(metrics["num-examples"])  # SB3 finishes the rollout it is in
        rows.append(
            {"device": device, "env steps": taken, "s": seconds, "steps/s": taken / seconds}
        )
    return rows


def markdown(rows: list[dict]) -> str:
    """``rows`` as a markdown table over every key any row has ("" where one lacks it)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[r.get(k, "") for k in keys] for r in rows]
    cells = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in c] for c in cells]
    lines = ["| " + " | ".join(keys) + " |", "|" + " ---: |" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "mobilenet_v2", "resnet18"])
    parser.add_argument(
        "--cpu-models", nargs="*", default=["cnn", "mobilenet_v2"], help="also timed on the CPU"
    )
    parser.add_argument("--ppo-steps", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", nargs="+", default=["agree", "ppo", "epochs"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_paths.py needs a CUDA GPU: torch.cuda.is_available() is False")
    logging.getLogger("absl").setLevel(logging.ERROR)
    print("# GPU paths\n\n" + machine_info("opacus"))
    results: dict[str, list[dict]] = {}
    sections = {
        "agree": section_agree,
        "epochs": lambda: section_epochs(args.models, args.cpu_models, args.repeats),
        "ppo": lambda: section_ppo(args.ppo_steps),
    }
    for name in args.sections:
        start = time.perf_counter()
        results[name] = sections[name]()
        print(f"\n## {name} ({time.perf_counter() - start:.0f} s)\n\n{markdown(results[name])}")
        if args.out is not None:  # after each section: a later one may run out of time
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "gpu_paths.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
