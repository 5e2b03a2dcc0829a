"""Privacy budget CLI: ε for a noise multiplier, or the multiplier for a target ε.

Examples
--------
``python -m privacy.budget --noise-multiplier 1.1 --sample-size 10 --population 1000
--rounds 500``

``python -m privacy.budget --target-epsilon 8 --sample-size 10 --population 100
--rounds 200 --sampling without-replacement``

``--noise-multiplier`` is the app's ``dp.noise-multiplier``: noise std on the sum of
clipped updates / clip norm C. Under fixed-size sampling (replace-one) one client moves
the sum by 2C, so the release is accounted with z/2 (``accounted_noise_multiplier``).

Design notes: ``docs/notes.md``, ``privacy.budget``.
"""

from __future__ import annotations

import argparse
import json
import sys

from privacy.calibration import (
    accounted_noise_multiplier,
    calibrate_noise_multiplier,
    epsilon_for,
)
from privacy.events import ACCOUNTANTS, REQUIRED_NEIGHBORING, SAMPLINGS, AccountingError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m privacy.budget",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--noise-multiplier", type=float, help="z = noise std / clip norm: report its epsilon"
    )
    mode.add_argument("--target-epsilon", type=float, help="find the smallest z meeting it")
    parser.add_argument("--sample-size", type=int, required=True, help="clients per round")
    parser.add_argument("--population", type=int, required=True, help="clients in total")
    parser.add_argument("--rounds", type=int, required=True, help="number of releases")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta (1e-5)")
    parser.add_argument(
        "--sampling", choices=SAMPLINGS, default="poisson", help="client sampling (poisson)"
    )
    parser.add_argument(
        "--accountant", choices=ACCOUNTANTS, default="rdp", help="dp-accounting accountant (rdp)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    setting = {
        "target_delta": args.delta,
        "rounds": args.rounds,
        "sample_size": args.sample_size,
        "population": args.population,
        "sampling": args.sampling,
        "accountant": args.accountant,
    }
    try:
        z = args.noise_multiplier
        if z is None:
            z = calibrate_noise_multiplier(target_epsilon=args.target_epsilon, **setting)
        epsilon = epsilon_for(noise_multiplier=z, **setting)
    except AccountingError as err:
        parser.error(
            f"{err} (flags: --sampling {{{','.join(SAMPLINGS)}}}, --accountant "
            f"{{{','.join(ACCOUNTANTS)}}}, --delta in (0, 1), sizes and --rounds >= 1)"
        )
    report = {
        "epsilon": epsilon,
        "delta": args.delta,
        "noise_multiplier": z,
        "accounted_noise_multiplier": accounted_noise_multiplier(z, args.sampling),
        "target_epsilon": args.target_epsilon,
        "rounds": args.rounds,
        "sample_size": args.sample_size,
        "population": args.population,
        "sampling": args.sampling,
        "accountant": args.accountant,
        "neighboring_relation": REQUIRED_NEIGHBORING[args.sampling],
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
