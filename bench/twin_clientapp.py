"""The app's own ClientApp, every lunar-lander client-round trained twice: the
ClientApp component of `bench/ppo_twin.py`'s runs (its staged ``pyproject.toml`` names
``bench.twin_clientapp:app``).

`LunarLanderTask.train` is wrapped. Before the ClientApp trains, deep copies of its
inputs (the task, the received model, the partition, the kept state and Adam moments)
go to a plain Python process of its own, its twin (started by its first client-round,
then kept warm, on the ClientApp's core since it inherits its affinity), which makes
the same ``task.train`` call on them: the same episodes where PPO is deterministic.
The ClientApp and its twin take turns going first. Only the ClientApp's result is
used; the twin writes no files. Each client-round leaves
``twin-round-R-partition-P.json`` beside its episode log (the twin's standard error
in ``twins/``): both sides' seconds in
``PPO.learn``, their episodes, their cores, and the wall time the pairing added to
the round (the copies, the pickle, the twin's whole call), which the bench takes out
of the run's wall time.

``python -m bench.twin_clientapp THREADS`` is the twin: it reads the path of a
pickled call per line, writes the call's metrics to ``PATH.json`` and answers ``ok``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from client_app.app import app as clientapp
from tasks.lunar_lander.task import LunarLanderTask

ROOT = Path(__file__).resolve().parents[1]  # the app as Flower installed it
_train = LunarLanderTask.train  # the app's own, which both sides call


class Twin:
    """A plain process that makes the same ``task.train`` calls as this one."""

    def __init__(self, jobs: Path) -> None:
        self.jobs = jobs  # its calls, and its standard error (stderr.log)
        jobs.mkdir(parents=True, exist_ok=True)
        self.log = open(self.jobs / "stderr.log", "w")  # noqa: SIM115 (lives with the twin)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.twin_clientapp", str(torch.get_num_threads())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.calls = 0

    def train(self, blob: bytes) -> dict:
        """The call pickled in ``blob``, trained by the twin: its metrics."""
        self.calls += 1
        job = self.jobs / f"call-{self.calls}.pkl"
        job.write_bytes(blob)
        self.process.stdin.write(f"{job}\n")
        self.process.stdin.flush()
        for line in self.process.stdout:  # anything a library printed, then "ok"
            if line.strip() == "ok":
                break
        else:
            self.log.flush()
            stderr = (self.jobs / "stderr.log").read_text()
            raise RuntimeError(f"the twin failed: {stderr[-4000:]}")
        result = json.loads(Path(f"{job}.json").read_text())
        job.unlink()
        Path(f"{job}.json").unlink()
        return result

    def close(self) -> None:
        """End the twin (it also ends when this process does: its input closes)."""
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


_TWIN: list[Twin] = []  # one per ClientApp process, started by its first client-round
_CONTROL = False  # set where `control_app` runs: the ClientApp's side is a second twin


def close_twin() -> None:
    """End this process's twin, if it has one."""
    while _TWIN:
        _TWIN.pop().close()


def _metrics(metrics: dict, seconds: float) -> dict:
    return {
        "metrics": metrics,
        "cpu": sorted(os.sched_getaffinity(0)),
        "call-seconds": seconds,
    }


def twin_train(self: LunarLanderTask, model, partition, local) -> dict:
    """`LunarLanderTask.train`, and the same call by this process's twin."""
    if local.artifacts_dir is None:
        raise ValueError("bench.twin_clientapp needs the client logs (artifacts-dir)")
    added = time.monotonic()
    twin_local = dataclasses.replace(copy.deepcopy(local), artifacts_dir=None)
    blob = pickle.dumps((self, copy.deepcopy(model), partition, twin_local))
    if not _TWIN:
        _TWIN.append(Twin(Path(local.artifacts_dir) / "twins" / f"clientapp-{os.getpid()}"))
    twin = _TWIN[0]
    twin_first = twin.calls % 2 == 1  # the first call (cold twin) goes second
    added = time.monotonic() - added
    if twin_first:
        started = time.monotonic()
        theirs = twin.train(blob)
        added += time.monotonic() - started
    started = time.monotonic()
    if _CONTROL:  # the ClientApp's side played by a second twin, fed the same call
        if len(_TWIN) < 2:
            _TWIN.append(Twin(Path(local.artifacts_dir) / "twins" / f"control-{os.getpid()}"))
        metrics = _TWIN[1].train(blob)["metrics"]
    else:
        metrics = _train(self, model, partition, local)
    ours = _metrics(metrics, time.monotonic() - started)
    if not twin_first:
        started = time.monotonic()
        theirs = twin.train(blob)
        added += time.monotonic() - started
    record = {
        "round": local.server_round,
        "partition": local.partition_id,
        "first": "twin" if twin_first else "clientapp",
        "clientapp": ours,
        "twin": theirs,
        "added-seconds": added,
    }
    name = f"twin-round-{local.server_round}-partition-{local.partition_id}.json"
    (Path(local.artifacts_dir) / name).write_text(json.dumps(record))
    return metrics


def install(control: bool = False) -> None:
    """Wrap `LunarLanderTask.train` in this process (``control``: as `control_app`)."""
    global _CONTROL
    _CONTROL = control
    LunarLanderTask.train = twin_train


# The component. Flower loads it in the simulation's process and pickles it to the Ray
# actors, where its handlers are `client_app.app`'s: the wrapper is installed by the
# lifespan, in whichever process runs a message. (A copy: the app's own is left as is.)
app = copy.copy(clientapp)


@app.lifespan()
def _twin_lifespan(_context) -> Iterator[None]:
    install()
    yield


# The bench's control (``ppo_twin.py --control``): the ClientApp's side of each pair is
# a second twin, fed the same pickled call as the first. Both sides are then the same
# kind of process fed the same way, so their speeds should agree: a ratio away from 1
# is the pairing's own bias. The ClientApp trains nothing (its model goes back as it
# came, its state unchanged), so every round repeats round 1's call.
control_app = copy.copy(clientapp)


@control_app.lifespan()
def _control_lifespan(_context) -> Iterator[None]:
    install(control=True)
    yield


def serve(threads: int) -> None:
    """The twin's loop: one pickled call per line of standard input."""
    torch.set_num_threads(threads)
    for line in sys.stdin:
        job = line.strip()
        task, model, partition, local = pickle.loads(Path(job).read_bytes())
        started = time.monotonic()
        metrics = _train(task, model, partition, local)
        Path(f"{job}.json").write_text(json.dumps(_metrics(metrics, time.monotonic() - started)))
        print("ok", flush=True)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
