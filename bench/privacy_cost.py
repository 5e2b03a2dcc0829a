"""Cost of the app's differential privacy against local training, and of its ledger.

Reproduce from the repository root (the first is the full run, the second a short check)::

    .venv/bin/python bench/privacy_cost.py --ledger-budget-s 60
    .venv/bin/python bench/privacy_cost.py --dims 1e4 1e5 1e6 --repeats 3 --rounds 300
    .venv/bin/python bench/privacy_cost.py --sections models --repeats 5
    .venv/bin/python bench/privacy_cost.py --sections subspace --dims 1e4 1e5 1e6 1e7
    .venv/bin/python bench/privacy_cost.py --sections planned --rounds 30

Section ``update``, for models of d parameters (``--dims``): an MLP 64 -> h -> 10 (ReLU)
with h = round((d - 10) / 75), i.e. 75 h + 10 ≈ d parameters. An update is that model's
arrays as float32 numpy arrays of global L2 norm 10 C (so clipping scales it; ``clip in
C`` times an update of norm C/2, which is only checked and copied). C = z = 1.

Design notes: ``docs/notes.md``, ``bench.privacy_cost``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord
from timing import (  # bench/timing.py (scripts here run with bench/ on sys.path)
    machine_info,
    median_ms,
)

from privacy.accounting import SPARSE_CHECKPOINTS, PrivacyLedger, Release, l2_sensitivity_factor
from privacy.mechanisms import (
    GaussianMechanism,
    clip_by_l2_norm,
    gaussian_noise_like,
    make_generator,
)
from privacy.subspace import EllipticalGaussianMechanism, SubspaceMetric, uniform_allocation
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.mechanisms.noise_site import ServerNoise
from tasks.vision.data import CIFAR10, DIGITS, DatasetSpec
from tasks.vision.models import MODEL_NAMES, build_model
from tasks.vision.settings import VISION_OPTIONS
from tasks.vision.steps import train_batch

CLIP_NORM, NOISE_MULTIPLIER, DELTA, MAX_EPSILON = 1.0, 1.0, 1e-5, 1e9
EXAMPLES, FEATURES, CLASSES, BATCH = 144, 64, 10, 32
GOAL_ROUND_FRACTION, GOAL_LEDGER_MS = 0.05, 50.0
LEDGER_CASES = (  # accountant, sampling, event
    ("rdp", "without-replacement", "same"),
    ("rdp", "poisson", "same"),
    ("pld", "poisson", "same"),
    ("rdp", "without-replacement", "varying"),
    ("rdp", "poisson", "varying"),
    ("pld", "poisson", "varying"),
)


# -- helpers ----------------------------------------------------------------------
def markdown(rows: list[dict[str, object]]) -> str:
    """``rows`` as a markdown table (floats to 3 significant digits)."""
    cells = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows]
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + " ---: |" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])


# -- section "update": clipping and noise against local training -------------------
def make_mlp(dim: int) -> torch.nn.Sequential:
    """MLP 64 -> h -> 10 with 75 h + 10 ≈ ``dim`` parameters."""
    hidden = max(1, round((dim - CLASSES) / (FEATURES + 1 + CLASSES)))
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES)
    )


def local_round(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> ArrayRecord:
    """One epoch of SGD over (x, y), then the client's export of the weights."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    model.train()
    for start in range(0, len(x), BATCH):
        batch = order[start : start + BATCH]
        optimizer.zero_grad()
        loss_fn(model(x[batch]), y[batch]).backward()
        optimizer.step()
    return ArrayRecord(model.state_dict())


def random_update(model: torch.nn.Module, norm: float, rng: np.random.Generator) -> list:
    """Float32 arrays shaped like the model's, of global L2 norm ``norm``."""
    shapes = [tuple(v.shape) for v in model.state_dict().values()]
    arrays = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    total = float(np.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays)))
    return [a * np.float32(norm / total) for a in arrays]


@dataclass
class ServerStandIn:
    """What ``DPFedAvgFixed._private_mean`` reads from ``self`` (server-side noise)."""

    mechanism: GaussianMechanism
    rng: np.random.Generator
    num_sampled_clients: int
    noise_site: str = "server"
    site: ServerNoise = field(default_factory=ServerNoise)

    def _mechanism(self) -> GaussianMechanism:
        return self.mechanism


def private_mean(server: ServerStandIn, deltas: list[list[np.ndarray]]) -> list[np.ndarray]:
    """``DPFedAvgFixed._private_mean`` of ``deltas`` (every client replied), as the app
    calls it: the global model's arrays (here the first delta's) give shapes and dtypes."""
    return DPFedAvgFixed._private_mean(server, deltas, 0, deltas[0])


def noise_sum_once(deltas: list[list[np.ndarray]], server: ServerStandIn) -> list:
    """Clip m updates, sum, one ``noise_sum``, divide by m (not the app's order)."""
    mech = server.mechanism
    clipped = [mech.clip(d).arrays for d in deltas]
    total = [sum(parts[1:], parts[0]) for parts in zip(*clipped, strict=True)]
    return [t / len(deltas) for t in mech.noise_sum(total, rng=server.rng)]


def measure_update(dim: int, clients: int, repeats: int) -> dict[str, object]:
    """One row of the ``update`` table (see the module docstring)."""
    model, rng = make_mlp(dim), make_generator(0, dim)
    gen = torch.Generator().manual_seed(dim)
    x, y = torch.randn(EXAMPLES, FEATURES, generator=gen), torch.randint(0, CLASSES, (EXAMPLES,))
    mech = GaussianMechanism(clip_norm=CLIP_NORM, noise_multiplier=NOISE_MULTIPLIER)
    server = ServerStandIn(mech, rng, clients)
    deltas = [random_update(model, 10 * CLIP_NORM, rng) for _ in range(clients)]
    small = random_update(model, CLIP_NORM / 2, rng)
    clipped = mech.clip(deltas[0]).arrays
    train = median_ms(lambda: local_round(model, x, y), repeats)
    export = median_ms(lambda: ArrayRecord(model.state_dict()), repeats)
    clip = median_ms(lambda: clip_by_l2_norm(deltas[0], clip_norm=CLIP_NORM), repeats)
    noise = median_ms(lambda: mech.noise_client(clipped, num_clients=clients, rng=rng), repeats)
    agg = median_ms(lambda: private_mean(server, deltas), repeats)
    return {
        "d": sum(a.size for a in small),
        "train+export ms": train,
        "export ms": export,
        "clip ms": clip,
        "clip in C ms": median_ms(lambda: clip_by_l2_norm(small, clip_norm=CLIP_NORM), repeats),
        "noise ms": noise,
        f"aggregate m={clients} ms": agg,
        "agg noise_sum once ms": median_ms(lambda: noise_sum_once(deltas, server), repeats),
        "update/train": (clip + noise) / train,
        "agg/train": agg / train,
        "agg/round": agg / (clients * train),
        "goal <= 5 %": "yes" if agg / (clients * train) <= GOAL_ROUND_FRACTION else "NO",
    }


def noise_generators(dim: int) -> dict[str, Callable[[], object]]:
    """Ways to draw ``dim`` N(0, std²) values; the first is the app's."""
    std, rng = 0.3, make_generator(1, dim)
    like = [np.empty(dim, dtype=np.float32)]
    cpu = torch.Generator().manual_seed(dim)
    out: dict[str, Callable[[], object]] = {
        "numpy normal f64 (app)": lambda: gaussian_noise_like(like, std=std, rng=rng),
        "numpy standard_normal f32": lambda: rng.standard_normal(dim, dtype=np.float32) * std,
        "torch cpu f32": lambda: torch.randn(dim, generator=cpu).mul_(std),
        "torch cpu f64": lambda: torch.randn(dim, generator=cpu, dtype=torch.float64).mul_(std),
    }
    if torch.cuda.is_available():
        out |= cuda_generators(dim, std)
    return out


def cuda_generators(dim: int, std: float) -> dict[str, Callable[[], object]]:
    """``torch.randn`` on the GPU: generation only (synchronised), and copied to numpy."""
    gen = torch.Generator(device="cuda").manual_seed(dim)

    def draw(dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(dim, generator=gen, device="cuda", dtype=dtype).mul_(std)

    out: dict[str, Callable[[], object]] = {}
    for name, dtype in (("f32", torch.float32), ("f64", torch.float64)):
        out[f"cuda {name}"] = lambda t=dtype: (draw(t), torch.cuda.synchronize())
        out[f"cuda {name} + to host"] = lambda t=dtype: draw(t).cpu().numpy()
    return out


def measure_noise(dim: int, repeats: int) -> list[dict[str, object]]:
    """Rows of the ``noise`` table for one d."""
    times = {name: median_ms(fn, repeats) for name, fn in noise_generators(dim).items()}
    app = next(iter(times.values()))
    return [{"d": dim, "generator": k, "ms": t, "x app": t / app} for k, t in times.items()]


def section_update(args: argparse.Namespace) -> None:
    """Print the ``update`` and ``noise`` tables."""
    dims = [int(d) for d in args.dims]
    print(f"\n## Per update and per aggregate (m = {args.clients}) vs local training\n")
    print(markdown([measure_update(d, args.clients, args.repeats) for d in dims]))
    print("\n## Noise generation (d values, scaled by the std)\n")
    if not torch.cuda.is_available():
        print("no GPU on this machine (torch.cuda.is_available() is False): CPU only\n")
    print(markdown([row for d in dims for row in measure_noise(d, args.repeats)]))


# -- section "models": the app's vision models as the reference -----------------------
MODEL_DATASETS = {"lenet": DIGITS}  # everything else on CIFAR-10 (see the docstring)
DEFAULT_MODELS = ("lenet", "cnn", "mobilenet_v2", "resnet18")
DEFAULT_CLIENTS = 10  # the default experiment's clients (the split of the data)
WARM_UP_STEPS, MIN_TIMED_STEPS = 2, 5
OPTION_DEFAULTS = {option.key: option.default for option in VISION_OPTIONS}


def pool_size(spec: DatasetSpec) -> int:
    """Examples partitioned among the clients (see the docstring)."""
    if spec is DIGITS:  # scikit-learn's train_test_split rounds the test share up
        total = 1797
        return total - math.ceil(OPTION_DEFAULTS["vision.central-test-fraction"] * total)
    if spec is CIFAR10:  # its own "test" split is the central test set
        return 50_000
    raise ValueError(f"no pool size for {spec.name}")


def epoch_steps(spec: DatasetSpec) -> tuple[int, int]:
    """(local train examples, SGD steps) of one epoch of the largest iid client."""
    n = math.ceil(pool_size(spec) / DEFAULT_CLIENTS)
    train = n - round(OPTION_DEFAULTS["vision.test-fraction"] * n)
    return train, math.ceil(train / OPTION_DEFAULTS["vision.batch-size"])


def step_ms(model: torch.nn.Module, spec: DatasetSpec, steps: int) -> float:
    """Median ms of ``steps`` app SGD steps on random inputs, after the warm-up steps."""
    batch = OPTION_DEFAULTS["vision.batch-size"]
    gen = torch.Generator().manual_seed(0)
    shape = (batch, spec.in_channels, spec.image_size, spec.image_size)
    x = torch.randn(shape, generator=gen)
    y = torch.randint(0, spec.num_classes, (batch,), generator=gen)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=OPTION_DEFAULTS["vision.lr"],
        momentum=OPTION_DEFAULTS["vision.momentum"],
        weight_decay=OPTION_DEFAULTS["vision.weight-decay"],
    )
    model.train()
    times = []
    for step in range(WARM_UP_STEPS + steps):
        start = time.perf_counter()
        train_batch(model, x, y, optimizer, [], 0.0)
        if step >= WARM_UP_STEPS:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_model(name: str, clients: int, repeats: int) -> dict[str, object]:
    """One row of the ``models`` table (see the module docstring)."""
    spec = MODEL_DATASETS.get(name, CIFAR10)
    model = build_model(name, spec.in_channels, spec.num_classes, spec.image_size, seed=0)
    train, steps = epoch_steps(spec)
    step = step_ms(model, spec, max(MIN_TIMED_STEPS, repeats))
    epoch = step * steps
    rng = make_generator(0, len(name))
    mech = GaussianMechanism(clip_norm=CLIP_NORM, noise_multiplier=NOISE_MULTIPLIER)
    server = ServerStandIn(mech, rng, clients)
    deltas = [random_update(model, 10 * CLIP_NORM, rng) for _ in range(clients)]
    clipped = mech.clip(deltas[0]).arrays
    clip = median_ms(lambda: clip_by_l2_norm(deltas[0], clip_norm=CLIP_NORM), repeats)
    noise = median_ms(lambda: mech.noise_client(clipped, num_clients=clients, rng=rng), repeats)
    agg = median_ms(lambda: private_mean(server, deltas), repeats)
    return {
        "model": name,
        "data": f"{spec.name} {spec.in_channels}x{spec.image_size}x{spec.image_size}",
        "d": sum(a.size for a in deltas[0]),
        "step ms": step,
        "train ex": train,
        "steps": steps,
        "epoch ms (extrap.)": epoch,
        "clip ms": clip,
        "noise ms": noise,
        f"aggregate m={clients} ms": agg,
        "update/epoch %": 100 * (clip + noise) / epoch,
        "agg/round %": 100 * agg / (clients * epoch),
        "goal <= 5 %": "yes" if agg / (clients * epoch) <= GOAL_ROUND_FRACTION else "NO",
    }


def section_models(args: argparse.Namespace) -> None:
    """Print the ``models`` table."""
    print(
        f"\n## DP cost vs the app's vision models (m = {args.clients}; epoch time "
        "extrapolated from per-step times)\n"
    )
    rows = []
    for name in args.models:
        start = time.perf_counter()
        rows.append(measure_model(name, args.clients, args.repeats))
        print(f"  model {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    print(markdown(rows))


# -- section "ledger": time per round after many rounds ----------------------------
class OverBudget(BaseException):
    """Raised by the alarm of :func:`budget` (a BaseException: no library swallows it)."""


@contextmanager
def budget(seconds: float) -> Iterator[None]:
    """Raise :class:`OverBudget` in the block after ``seconds`` of wall time."""

    def ring(signum: int, frame: object) -> None:
        raise OverBudget

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def release(server_round: int, sampling: str, event: str, clients: int) -> Release:
    """DPFedAvgFixed.release's release for ``server_round`` (q = 0.1)."""
    neighboring = "replace-one" if sampling == "without-replacement" else "add-or-remove-one"
    z = NOISE_MULTIPLIER * (1 + 1e-4 * server_round if event == "varying" else 1.0)
    return Release(
        server_round=server_round,
        kind="model-update",
        mechanism="gaussian",
        noise_multiplier=z / l2_sensitivity_factor(neighboring),
        sampling=sampling,
        sample_size=clients,
        population=10 * clients,
    )


def app_round(ledger: PrivacyLedger, rel: Release) -> tuple[float, float, float]:
    """The app's ledger calls for one round: (accounting ms, record ms, ε)."""
    start = time.perf_counter()
    if ledger.would_exceed(rel):
        raise RuntimeError("budget exceeded: raise MAX_EPSILON")
    ledger.charge(rel)
    epsilon = ledger.epsilon()
    middle = time.perf_counter()
    ledger.state_dict()
    json.dumps({"summary": ledger.summary(), "state": ledger.state_dict()}, indent=2)
    return (middle - start) * 1e3, (time.perf_counter() - middle) * 1e3, epsilon


def fast_forward(ledger: PrivacyLedger, releases: list[Release]) -> None:
    """Put ``ledger`` where a run is after charging ``releases`` (see the docstring)."""
    state = ledger.state_dict()
    ledger.load_state_dict({**state, "releases": [asdict(r) for r in releases]})
    ledger.epsilon()


def time_window(
    case: tuple[str, str, str], first: int, last: int, args: argparse.Namespace
) -> dict[str, object]:
    """Median ms per round of rounds ``first``..``last`` of one ledger case."""
    accountant, sampling, event = case
    ledger = PrivacyLedger(
        accountant=accountant, target_delta=DELTA, max_epsilon=MAX_EPSILON, sampling=sampling
    )
    ledger.checkpoints = SPARSE_CHECKPOINTS  # as the app's (strategies.registry.make_ledger)
    row: dict[str, object] = {"accountant": accountant, "sampling": sampling, "event": event}
    row["rounds"] = f"{first}-{last}"
    try:
        with budget(args.ledger_budget_s):
            fast_forward(
                ledger, [release(r, sampling, event, args.clients) for r in range(1, first)]
            )
    except OverBudget:
        return row | {"timed": 0, "note": f"fast-forward > {args.ledger_budget_s:g} s"}
    times: list[tuple[float, float, float]] = []
    try:
        with budget(args.ledger_budget_s):
            for r in range(first, last + 1):
                times.append(app_round(ledger, release(r, sampling, event, args.clients)))
    except OverBudget:
        pass
    return row | window_stats(times, args.ledger_budget_s)


def window_stats(times: list[tuple[float, float, float]], limit: float) -> dict[str, object]:
    """Medians of a window's (accounting, record) times, last ε, the goal check."""
    if not times:
        return {"timed": 0, "note": f"one round > {limit:g} s"}
    totals = [a + r for a, r, _ in times]
    total = statistics.median(totals)
    return {
        "timed": len(times),
        "accounting ms": statistics.median(a for a, _, _ in times),
        "record ms": statistics.median(r for _, r, _ in times),
        "total ms": total,
        "mean ms": statistics.fmean(totals),  # amortised: checkpoint rounds included
        "max ms": max(totals),
        "epsilon": times[-1][2],
        "note": "" if total <= GOAL_LEDGER_MS else f"> {GOAL_LEDGER_MS:g} ms goal",
    }


def windows(rounds: int) -> list[tuple[int, int]]:
    """Rounds 1-10, the 10 ending at rounds/2 and the last 10 (distinct, >= 1)."""
    ends = sorted({min(10, rounds), rounds // 2, rounds})
    return [(max(1, end - 9), end) for end in ends if end >= 1]


def section_ledger(args: argparse.Namespace) -> None:
    """Print the ledger table; a case whose window was cut skips its later windows."""
    print(f"\n## Ledger ms per round (goal <= {GOAL_LEDGER_MS:g} ms), {args.rounds} rounds\n")
    rows = []
    for case in (c for c in LEDGER_CASES if "/".join(c) in args.ledger_cases):
        warm_up_ledger(*case[:2], args.clients)
        for first, last in windows(args.rounds):
            rows.append(time_window(case, first, last, args))
            progress = {k: v for k, v in rows[-1].items() if k in ("rounds", "timed", "total ms")}
            print(f"  ledger {'/'.join(case)}: {progress}", file=sys.stderr, flush=True)
            if rows[-1]["timed"] < last - first + 1:
                break  # later rounds cost at least as much: not affordable either
    print(markdown([{k: r.get(k, "") for k in rows_keys(rows)} for r in rows]))
    print(
        f"\ntimed < window: the fast-forward or the window ran out of --ledger-budget-s = "
        f"{args.ledger_budget_s:g} s; that case's later windows (which cost at least as "
        "much) are skipped."
    )


def warm_up_ledger(accountant: str, sampling: str, clients: int) -> None:
    """One round of a throwaway ledger with an event no case uses (z = 3)."""
    rel = asdict(release(1, sampling, "same", clients)) | {"noise_multiplier": 3.0}
    ledger = PrivacyLedger(accountant=accountant, target_delta=DELTA, sampling=sampling)
    app_round(ledger, Release(**rel))


def rows_keys(rows: list[dict[str, object]]) -> list[str]:
    """All keys of ``rows`` in first-seen order."""
    return list(dict.fromkeys(k for r in rows for k in r))


def orthonormal_basis(dim: int, rank: int, rng: np.random.Generator) -> np.ndarray:
    """A random d×k orthonormal basis (reduced QR, column by column in float64)."""
    q, _ = np.linalg.qr(rng.standard_normal((dim, rank)))
    return q


def subspace_row(dim: int, rank: int, repeats: int) -> dict[str, float]:
    """Isotropic against elliptical clip + noise of one update of ``dim`` values."""
    rng = make_generator(0, dim)
    update = [rng.standard_normal(dim).astype(np.float32) * 10.0]
    iso = GaussianMechanism(clip_norm=1.0, noise_multiplier=1.0)
    metric = SubspaceMetric(
        basis=orthonormal_basis(dim, rank, rng), lam=uniform_allocation(rank, 25.0), tau=0.8
    )
    ell = EllipticalGaussianMechanism(metric, clip_norm=1.0, noise_multiplier=1.0)
    row = {"d": dim, "k": rank}
    row["iso clip ms"] = median_ms(lambda: iso.clip(update), repeats)
    row["ell clip ms"] = median_ms(lambda: ell.clip(update), repeats)
    row["iso noise ms"] = median_ms(lambda: iso.noise_sum(update, rng=rng), repeats)
    row["ell noise ms"] = median_ms(lambda: ell.noise_sum(update, rng=rng), repeats)
    iso_total = row["iso clip ms"] + row["iso noise ms"]
    ell_total = row["ell clip ms"] + row["ell noise ms"]
    row["ell/iso"] = ell_total / iso_total
    row["ell ns/coord"] = ell_total * 1e6 / dim
    row["iso ns/coord"] = iso_total * 1e6 / dim
    return row


def section_planned(args: argparse.Namespace) -> list[dict[str, object]]:
    """The ledger of a calibrated PLD run of ``--rounds`` rounds (its plan declared, its
    budget the planned ε): CPU ms a round, composing every round against the app's
    checkpoints."""
    print(f"\n## Ledger CPU ms per round, a planned {args.rounds}-round PLD run\n")
    planned = release(1, "poisson", "same", args.clients)
    probe = PrivacyLedger(accountant="pld", target_delta=DELTA, sampling="poisson")
    probe.charge(Release(**(asdict(planned) | {"count": args.rounds})))
    target = probe.epsilon()  # also builds the release's PLD once, for both rows
    rows = []
    for name, schedule in (("every round", None), ("app's checkpoints", SPARSE_CHECKPOINTS)):
        ledger = PrivacyLedger(
            accountant="pld", target_delta=DELTA, max_epsilon=target, sampling="poisson"
        )
        ledger.checkpoints = schedule
        ledger.plan(Release(**(asdict(planned) | {"count": args.rounds})))
        times = []
        for r in range(1, args.rounds + 1):
            start = time.process_time()
            app_round(ledger, release(r, "poisson", "same", args.clients))
            times.append((time.process_time() - start) * 1e3)
        rows.append(
            {
                "composed": name,
                "total CPU s": sum(times) / 1e3,
                "mean ms": statistics.fmean(times),
                "median ms": statistics.median(times),
                "max ms": max(times),
                "last epsilon": ledger.epsilon(),
                "planned epsilon": target,
            }
        )
    print(markdown(rows))
    return rows


def section_subspace(args: argparse.Namespace) -> None:
    """Geometry-aligned DP (P-norm clip, N(0, z²C² P⁻¹), rank-k U) against isotropic DP
    as d grows; the metric's QR (once per PMU adoption) is not timed. About 4 GB at
    d = 1e7, k = 32."""
    rows = [subspace_row(int(dim), args.rank, args.repeats) for dim in args.dims]
    print("\n## Subspace DP against isotropic DP\n")
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + " ---: |" * len(cols))
    for row in rows:
        print("| " + " | ".join(f"{row[c]:.3g}" for c in cols) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=float, nargs="+", default=[1e4, 1e5, 1e6, 1e7])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, default=10, help="m, updates per aggregate")
    parser.add_argument("--rounds", type=int, default=1000, help="ledger rounds")
    parser.add_argument(
        "--ledger-budget-s",
        type=float,
        default=10.0,
        help="wall-time cap of each ledger fast-forward and of each window",
    )
    parser.add_argument(
        "--ledger-cases",
        nargs="+",
        choices=["/".join(c) for c in LEDGER_CASES],
        default=["/".join(c) for c in LEDGER_CASES],
        help="ledger cases to time (accountant/sampling/event)",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODEL_NAMES,
        default=list(DEFAULT_MODELS),
        help="section models: lenet on digits, the others on CIFAR-10",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=("update", "models", "ledger", "planned", "subspace"),
        default=["update", "models", "ledger"],
    )
    parser.add_argument("--rank", type=int, default=32, help="section subspace: k of U")
    args = parser.parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's order warnings
    print("# Privacy cost benchmark\n\n" + machine_info("dp-accounting"))
    if "update" in args.sections:
        section_update(args)
    if "models" in args.sections:
        section_models(args)
    if "ledger" in args.sections:
        section_ledger(args)
    if "planned" in args.sections:
        section_planned(args)
    if "subspace" in args.sections:
        section_subspace(args)


if __name__ == "__main__":
    main()
