"""Time the ServerApp spends writing a round's results, as the run grows.

``RunDirectory.commit`` and ``RunDirectory.record_round`` (server_app/results.py) are
called once per round: the commit writes the server state (``checkpoint/server.pt``),
the record the round's rows of metrics.csv and participation.csv, TensorBoard scalars
and the LeNet-sized global model. This times it for
``--rounds`` rounds of ``--clients`` participation rows each and prints the median ms
per round of the first and last 10 rounds, so a cost that grows with the rounds shows.

    python bench/results_files.py --rounds 1000 --clients 10
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, MetricRecord

from server_app.results import RunDirectory
from server_app.rounds import RoundResult
from tasks.vision.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=10)
    args = parser.parse_args()
    model = build_model("lenet", 1, 10, 8, seed=0)
    arrays = ArrayRecord(model.state_dict())
    per_round = []
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = RunDirectory.create(Path(tmp), "digits", "fedavg", "none")
        for server_round in range(1, args.rounds + 1):
            clients = [
                {
                    "round": server_round,
                    "node-id": 1000 + c,
                    "replied": True,
                    "error": "",
                    "num-examples": 115,
                    "train-loss": 0.5 + 1e-3 * c,
                    "train-accuracy": 0.8,
                }
                for c in range(args.clients)
            ]
            metrics = {"train-loss": 0.5, "train-accuracy": 0.8, "num-examples": 1150}
            result = RoundResult(
                server_round,
                arrays,
                train=MetricRecord(metrics),
                central_eval=MetricRecord({"eval-loss": 0.4, "eval-accuracy": 0.85}),
                clients=clients,
                seconds=0.1,
            )
            state = {"arrays": {k: v.clone() for k, v in model.state_dict().items()}}
            started = time.perf_counter()
            run_dir.commit(server_round, state)
            run_dir.record_round(result)
            per_round.append(time.perf_counter() - started)
    first = statistics.median(per_round[:10]) * 1e3
    last = statistics.median(per_round[-10:]) * 1e3
    print(f"torch {torch.__version__}; {args.rounds} rounds x {args.clients} clients")
    print(f"record_round: rounds 1-10 {first:.2f} ms, last 10 rounds {last:.2f} ms")


if __name__ == "__main__":
    main()
