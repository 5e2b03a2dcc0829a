"""Target-ε calibration of a whole run under PLD: before (dp-accounting's Brent search
on whole-run PLDs at the ledger's 1e-4) and after (``calibrate_noise_multiplier`` in
:mod:`privacy.calibration`: coarse grids, then one check on the ledger's).

    python bench/calibration.py              # after, the 8 peer workloads
    python bench/calibration.py --before 2   # and the old search on the first 2

Peer workloads: digits, Poisson sampling, δ = 1e-5, N = 100 with 10 per round and
N = 1 000 with 50 per round, 30 and 1 000 rounds, ε 2 and 8. Each row: the calibrated z,
its ε from dp-accounting's PLD accountant directly (must be <= target), the CPU seconds
of the whole calibration (the machine is shared: wall seconds vary), the seconds of
the search on coarse grids and of the check on the ledger's grid (the PLD the run's first
charge then reuses), and the old search's z and seconds. Each workload runs in a fresh
process (no cache shared between rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = [
    (population, sampled, rounds, eps)
    for population, sampled in ((100, 10), (1000, 50))
    for rounds in (30, 1000)
    for eps in (2.0, 8.0)
]
DELTA = 1e-5


def _direct_epsilon(z: float, q: float, rounds: int) -> float:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from privacy.events import PLD_DISCRETIZATION

    accountant = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, PLD_DISCRETIZATION
    )
    accountant.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds
    )
    return float(accountant.get_epsilon(DELTA))


def _before(population: int, sampled: int, rounds: int, eps: float) -> float:
    """The search as it was: bracket from 1, then dp-accounting's calibration (Brent) on
    whole-run PLDs at the ledger's discretisation, tolerance 1e-6."""
    import dp_accounting
    from dp_accounting import mechanism_calibration
    from dp_accounting.pld import pld_privacy_accountant

    from privacy.calibration import _bracket
    from privacy.events import PLD_DISCRETIZATION

    q = sampled / population
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE

    def fresh():
        return pld_privacy_accountant.PLDAccountant(relation, PLD_DISCRETIZATION)

    def event(z):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds
        )

    low, high = _bracket(lambda z: fresh().compose(event(z)).get_epsilon(DELTA), eps)
    interval = mechanism_calibration.ExplicitBracketInterval(low, high)
    return float(
        mechanism_calibration.calibrate_dp_mechanism(
            fresh, event, eps, DELTA, bracket_interval=interval, tol=1e-6
        )
    )


def one(population: int, sampled: int, rounds: int, eps: float, before: bool) -> dict:
    """One workload, in this process (fresh: nothing cached)."""
    import dp_accounting  # noqa: F401  (imports are not the calibration's time)

    import privacy.composition  # noqa: F401
    from privacy import calibration
    from privacy.events import PLD_DISCRETIZATION

    seconds: dict[str, float] = {}
    cached = calibration._pld_epsilon

    def timed(groups, neighboring, discretization, delta):
        started = time.perf_counter()
        try:
            return cached(groups, neighboring, discretization, delta)
        finally:
            key = "check" if discretization == PLD_DISCRETIZATION else "search"
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - started

    calibration._pld_epsilon = timed
    cpu = time.process_time()
    started = time.perf_counter()
    z = calibration.calibrate_noise_multiplier(
        target_epsilon=eps,
        target_delta=DELTA,
        rounds=rounds,
        sample_size=sampled,
        population=population,
        sampling="poisson",
        accountant="pld",
    )
    total = time.perf_counter() - started
    cpu = time.process_time() - cpu
    row = {
        "N": population,
        "per-round": sampled,
        "rounds": rounds,
        "target": eps,
        "z": z,
        "epsilon": _direct_epsilon(z, sampled / population, rounds),
        "seconds": total,
        "cpu-s": cpu,
        "search-s": seconds.get("search", 0.0),
        "check-s": seconds.get("check", 0.0),
    }
    if before:
        started = time.perf_counter()
        row["z-before"] = _before(population, sampled, rounds, eps)
        row["seconds-before"] = time.perf_counter() - started
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=int, default=0, help="old search on the first K")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a worker: one workload as JSON
    args = parser.parse_args(argv)
    if args.one:
        population, sampled, rounds, eps, before = json.loads(args.one)
        print(json.dumps(one(population, sampled, rounds, eps, before)))
        return 0
    print("| N | per round | rounds | target ε | z | ε (dp-accounting) | CPU s | s | search s "
          "| check s | z before | s before |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for index, workload in enumerate(WORKLOADS):
        spec = json.dumps([*workload, index < args.before])
        out = subprocess.run(
            [sys.executable, __file__, "--one", spec],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        assert r["epsilon"] <= r["target"], r
        before = f"{r['z-before']:.6f} | {r['seconds-before']:.2f}" if "z-before" in r else "- | -"
        print(
            f"| {r['N']} | {r['per-round']} | {r['rounds']} | {r['target']:g} | {r['z']:.6f} "
            f"| {r['epsilon']:.6f} | {r['cpu-s']:.2f} | {r['seconds']:.2f} | {r['search-s']:.2f} "
            f"| {r['check-s']:.2f} | {before} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
