"""Local PPO in a warm child process of the ClientApp (``ppo.trainer-process``).

Flower's simulation runs each ClientApp in a Ray worker process. There SB3's
``PPO.learn`` runs about 7 % slower than in a plain Python process on the same core at
the same moment: ``bench/ppo_twin.py`` trains every client-round twice, in the
ClientApp and in such a process, taking turns (bench/BENCHMARKS.md, "Twins"). Neither
garbage collection (about one collection per client-round on either side) nor Ray's
threads (0.2 % of a core) account for it; sampled with ``perf``, the worker spends more
CPU time in every library alike (Python, torch, libc). With ``ppo.trainer-process``
the ClientApp hands each round's :func:`~tasks.lunar_lander.ppo.train_ppo` call to a
plain child instead, started by its first round and then kept warm: the policy, the
client's environment description and kept Adam moments go down a pipe, the trained
weights, Adam moments and the round's episode log come back (milliseconds per round).
No library does this: SB3's ``SubprocVecEnv`` moves environments into children, not
learning.

The child is ``python -m tasks.lunar_lander.trainer``: it inherits the ClientApp's
environment, CPU affinity and standard error, and ends when its input closes, which is
also what happens when the ClientApp's process ends however it ends. It pays off where
the ClientApp's process lives across rounds (Ray's workers in the simulation); where
each message gets a fresh process, every round would start a cold child (a few
seconds of imports).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import torch

from tasks.lunar_lander.clients import ClientEnv
from tasks.lunar_lander.ppo import LocalPPOResult, PPOConfig, train_ppo

APP_ROOT = Path(__file__).resolve().parents[2]  # where ``tasks`` is importable from


class TrainerError(RuntimeError):
    """The trainer process ended or answered out of protocol."""


class TrainerProcess:
    """A warm child process that runs :func:`train_ppo` calls for this one."""

    def __init__(self) -> None:
        path = os.pathsep.join([str(APP_ROOT), os.environ.get("PYTHONPATH", "")])
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tasks.lunar_lander.trainer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,  # the protocol; the child's prints go to stderr
            env={**os.environ, "PYTHONPATH": path.rstrip(os.pathsep)},
        )
        self._lock = threading.Lock()  # one call at a time on the pipe

    @property
    def pid(self) -> int:
        return self.process.pid

    def train(
        self, policy: torch.nn.Module, client: ClientEnv, cfg: PPOConfig, **kwargs: Any
    ) -> LocalPPOResult:
        """:func:`train_ppo` ``(policy, client, cfg, **kwargs)`` in the child, with
        ``policy`` trained in place here as there. An exception raised there is raised
        here, with the child's traceback as a note."""
        with self._lock:
            try:
                pickle.dump(
                    (policy, client, cfg, kwargs), self.process.stdin, pickle.HIGHEST_PROTOCOL
                )
                self.process.stdin.flush()
                status, *answer = pickle.load(self.process.stdout)
            except (BrokenPipeError, EOFError, pickle.UnpicklingError) as error:
                try:  # its pipe closes a moment before it can be reaped
                    ended = f"exited with code {self.process.wait(timeout=5)}"
                except subprocess.TimeoutExpired:
                    ended = "broke the protocol"
                raise TrainerError(
                    f"the PPO trainer process {self.pid} {ended} (ppo.trainer-process); "
                    "its standard error is the ClientApp's"
                ) from error
        if status == "error":
            error, remote_traceback = answer
            error.add_note(f"raised in the PPO trainer process {self.pid}:\n{remote_traceback}")
            raise error
        result, state = answer
        policy.load_state_dict(state, strict=True)
        return result

    def close(self) -> None:
        """End the child: its input closes, it returns."""
        if self.process.stdin and not self.process.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()


_TRAINER: list[TrainerProcess] = []  # this process's one, started by its first call
_TRAINER_LOCK = threading.Lock()


def train_in_trainer_process(
    policy: torch.nn.Module, client: ClientEnv, cfg: PPOConfig, **kwargs: Any
) -> LocalPPOResult:
    """:func:`train_ppo` in this process's warm trainer process (started on first use;
    started afresh after one that ended)."""
    with _TRAINER_LOCK:
        if _TRAINER and _TRAINER[0].process.poll() is not None:
            _TRAINER.pop().close()  # it ended (killed, out of memory): the next starts anew
        if not _TRAINER:
            _TRAINER.append(TrainerProcess())
        trainer = _TRAINER[0]
    return trainer.train(policy, client, cfg, **kwargs)


def close_trainer_process() -> None:
    """End this process's trainer process, if it has one (also run at exit)."""
    with _TRAINER_LOCK:
        while _TRAINER:
            _TRAINER.pop().close()


atexit.register(close_trainer_process)


def _answer(request: tuple) -> tuple:
    """The child's answer to one request: ``("ok", result, trained weights)`` or
    ``("error", exception, traceback)``."""
    try:
        policy, client, cfg, kwargs = request
        result = train_ppo(policy, client, cfg, **kwargs)
        result.log = result.log.detached()  # no SB3 model or locals: the record only
        return "ok", result, policy.state_dict()
    except Exception as error:  # every failure goes back to the ClientApp
        remote = traceback.format_exc()
        try:
            pickle.dumps(error)
        except Exception:  # one that cannot cross: its text does
            error = TrainerError(f"{type(error).__name__}: {error}")
        return "error", error, remote


def serve() -> None:
    """The child's loop: one pickled request in, one pickled answer out, until its
    input closes."""
    requests = sys.stdin.buffer
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a library's print cannot break it
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        answer = _answer(request)
        try:
            blob = pickle.dumps(answer, pickle.HIGHEST_PROTOCOL)
        except Exception as error:  # an answer that cannot cross
            failure = TrainerError(f"the trainer's answer cannot be pickled: {error!r}")
            blob = pickle.dumps(("error", failure, traceback.format_exc()))
        answers.write(blob)
        answers.flush()


if __name__ == "__main__":
    serve()
