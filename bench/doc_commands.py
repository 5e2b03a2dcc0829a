"""The DP commands the README and the docs show, run in process, with what they reach.

Every fenced ``flwr run`` of README.md and docs/ (parsed as tests/test_docs_commands.py
parses them) whose run-config, its preset resolved, is private (``privacy`` not
``none``) runs once with the in-process engine on the federation it names, as

    python -m lab.run --engine inprocess --run-config "<its run-config>" \
        --federation-config "<its federation>"

in a child process (``nice -n 10``), its run directory under ``--out``. Prints a
Markdown table: the command's pages, its run-config and federation, the rounds run, ε
(the ledger's, and whom it holds against), the final central accuracy, the status and
the wall time (docs/privacy.md, "The documented DP commands, measured").

    python bench/doc_commands.py                       # every documented DP command
    python bench/doc_commands.py --only banded-mf --rounds 100
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.test_docs_commands import PAGES, PLACEHOLDERS, fenced_commands, parse  # noqa: E402

_RUN_DIR = re.compile(r"run directory: (\S+)")


@dataclass
class Command:
    """One documented command: its run-config, its federation and where it is shown."""

    run_config: str
    federation: str
    pages: list[str] = field(default_factory=list)


def private(run_config: str) -> bool:
    """Whether ``run_config`` (its preset resolved over the app's defaults) is private."""
    from flwr.common.config import parse_config_args

    from protocol import presets

    defaults = presets.app_defaults()
    fused = {**defaults, **parse_config_args([run_config])}
    return str(presets.resolve(fused, defaults).get("privacy", "none")) != "none"


def dp_commands() -> list[Command]:
    """The documented private ``flwr run`` commands on a simulation, each once."""
    found: dict[tuple[str, str], Command] = {}
    for page in PAGES:
        for command in fenced_commands(page.read_text()):
            connection, run_config, federation = parse(command)
            rc, fed = " ".join(run_config), " ".join(federation)
            if connection != "local-simulation" or not rc or any(p in rc for p in PLACEHOLDERS):
                continue
            if private(rc):
                entry = found.setdefault((rc, fed), Command(rc, fed))
                entry.pages.append(str(page.relative_to(REPO)))
    return list(found.values())


def final_metrics(run_dir: Path) -> tuple[int, float]:
    """(last round, central eval-accuracy after it) from ``metrics.csv``."""
    rows = [
        row
        for row in csv.DictReader((run_dir / "metrics.csv").open())
        if row["scope"] == "central-eval" and row.get("eval-accuracy")
    ]
    if not rows:
        return 0, math.nan
    return int(rows[-1]["round"]), float(rows[-1]["eval-accuracy"])


def measure(command: Command, out: Path, rounds: int | None) -> dict:
    """Run ``command`` in process; its rounds, ε, accuracy, status and wall seconds."""
    from server_app import run_status

    run_config = command.run_config
    if rounds is not None:
        run_config += f" num-server-rounds={rounds}"
    run_config += f" output-dir='{out}'"
    argv = ["nice", "-n", "10", sys.executable, "-m", "lab.run", "--engine", "inprocess"]
    argv += ["--run-config", run_config, "--federation-config", command.federation]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - started
    match = _RUN_DIR.search(proc.stdout + proc.stderr)
    if match is None:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:]
        return {"status": f"no run directory ({tail})", "seconds": seconds}
    run_dir = Path(match.group(1))
    last_round, accuracy = final_metrics(run_dir)
    columns = run_status.read(run_dir).columns()
    return {
        "rounds": last_round,
        "epsilon": columns["epsilon"],
        "holds-against": columns["holds-against"],
        "accuracy": accuracy,
        "status": columns["status"],
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/doc-commands"))
    parser.add_argument("--only", default="", help="only commands whose run-config has this")
    parser.add_argument("--rounds", type=int, help="override num-server-rounds (fewer rounds)")
    args = parser.parse_args(argv)
    commands = [c for c in dp_commands() if args.only in c.run_config]
    print("| shown in | in process | rounds | ε (against) | accuracy | status | wall s |")
    print("| --- | --- | ---: | --- | ---: | --- | ---: |")
    for command in commands:
        r = measure(command, args.out.resolve(), args.rounds)
        eps = f"{r['epsilon']:.2f} ({r['holds-against']})" if "epsilon" in r else "-"
        acc = f"{r['accuracy']:.3f}" if "accuracy" in r else "-"
        run_config = command.run_config
        if args.rounds is not None:
            run_config += f" num-server-rounds={args.rounds}"
        shown = f'python -m lab.run --engine inprocess --run-config "{run_config}"'
        shown += f' --federation-config "{command.federation}"'
        print(
            f"| {', '.join(command.pages)} | `{shown}` | {r.get('rounds', '-')} | {eps} "
            f"| {acc} | {r['status']} | {r['seconds']:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
