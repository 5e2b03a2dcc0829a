"""The whole app in one process: the ServerApp's run loop against the real ClientApp.

:class:`InProcessGrid` is a Flower ``Grid`` whose nodes are the app's ClientApp called
directly, each with its own ``Context`` (node config ``partition-id`` /
``num-partitions``, a ``state`` that persists across messages as in a simulation).
Nodes can be killed (they stop answering and leave ``get_node_ids``, as a SuperNode
whose heartbeat stopped) to test faults, and the node ids are chosen by the test, so a
"new run" can get new ids as Flower gives them. :func:`run_like_flwr` makes the run a
`flwr run` run-config string makes, for the end-to-end modules' variants that need no
part of the Flower runtime (``make_run`` picks one or the other).
"""

from __future__ import annotations

import io
import logging
import time
import tomllib
import traceback
from dataclasses import replace
from pathlib import Path

from flwr.app import Context, Message, RecordDict
from flwr.common.config import parse_config_args
from flwr.common.logger import FLOWER_LOGGER
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from lab.engine import InProcessGrid as EngineGrid
from lab.launcher import _RUN_DIR_LINE, RunOutcome
from server_app import app as server_app
from strategies.mechanisms.base import NOISE_PARAMETER

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

# A digits run small enough for unit tests: 4 clients, 1 local epoch.
TINY = {
    "task": "digits",
    "num-server-rounds": 3,
    "fraction-train": 1.0,
    "min-train-nodes": 2,
    "min-available-nodes": 4,
    "vision.local-epochs": 1,
    "round-timeout": 5.0,
    # Tests of mechanics use noise that swamps 4 clients' updates (eval loss 1e4-1e5 after
    # a round): no ratio check here; test_failure_policy.py tests the divergence guard.
    "run.divergence-factor": 0.0,
    # Bitwise comparisons of two runs hold on a CUDA machine too, where vision.device =
    # auto trains on the GPU (cuDNN's default kernels are not reproducible).
    "vision.deterministic": True,
}


def run_config(**overrides) -> dict:
    """The pyproject defaults with ``TINY`` and ``overrides`` on top (and the test noise,
    :func:`with_test_noise`)."""
    return with_test_noise({**pyproject_defaults(), **TINY, **overrides})


def pyproject_defaults() -> dict:
    """The app's run-config defaults (``[tool.flwr.app.config]``)."""
    return tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]


def with_test_noise(config: dict) -> dict:
    """``config`` with the noise parameter its privacy mechanism needs (z = 1, Laplace
    epsilon = 10) when it sets neither that nor ``dp.target-epsilon``: the app has no
    default noise, tests of mechanics do not care which."""
    key = NOISE_PARAMETER.get(str(config.get("privacy")))
    if key and not float(config.get(key) or 0) and not float(config.get("dp.target-epsilon") or 0):
        config = {**config, key: 1.0 if key == "dp.noise-multiplier" else 10.0}
    return config


class InProcessGrid(EngineGrid):
    """The engine's grid (:class:`lab.engine.InProcessGrid`) with faults for tests: nodes
    that die (they stop answering and leave ``get_node_ids``), every message sent kept
    in ``sent``, and a ClientApp's exception reaching the test unless
    ``errors_as_replies``."""

    def __init__(self, config: dict, node_ids: list[int]) -> None:
        super().__init__(config, node_ids)
        self.dead: set[int] = set()
        self.dies_in_round: dict[int, int] = {}  # node -> round whose train message kills it
        self.sent: list[Message] = []
        self.errors_as_replies = False

    def get_node_ids(self) -> list[int]:
        return [node for node in self.contexts if node not in self.dead]

    def kill(self, node: int) -> None:
        """The node stops answering and is no longer listed."""
        self.dead.add(node)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        alive = []
        for message in messages:
            self.sent.append(message)
            node = message.metadata.dst_node_id
            config = message.content.get("config", {})
            if message.metadata.message_type == "train" and self.dies_in_round.get(node) == int(
                config.get("server-round", -1)
            ):
                self.kill(node)  # it got the message and died training
            if node not in self.dead:
                alive.append(message)
        return super().send_and_receive(alive, timeout=timeout)


def run_server(config: dict, grid: InProcessGrid) -> None:
    """The ServerApp's run (as ``flwr run`` would start it): it builds its own strategy,
    whose partition map knows nothing of a previous run's nodes."""
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    server_app._run(grid, context)


def run_like_flwr(run_config: str, num_supernodes: int = 4) -> RunOutcome:
    """The run ``flwr run . local-simulation --stream --run-config run_config`` makes on
    ``num_supernodes`` virtual SuperNodes, made in this process: the pyproject defaults
    with ``run_config`` (parsed as Flower parses it) on top, each SuperNode the real
    ClientApp, a ClientApp that raises answering with Flower's error reply.

    For the end-to-end tests' checks of what the app computes; what only the Flower
    runtime does (the SuperLink, Ray, serialisation, SecAgg+ over the wire) stays in
    ``tests/e2e``. The output is the app's log (Flower's logger, as ``--stream`` shows
    it); a ServerApp that raises gives return code 1 and the traceback, as a run that
    ends ``finished:failed``."""
    overrides = parse_config_args([run_config])
    config = {**pyproject_defaults(), **overrides}
    grid = InProcessGrid(config, [1000 + i for i in range(num_supernodes)])
    # The Run Flower hands a ServerApp's Grid: the user's overrides, unfused.
    grid.run = replace(Run.create_empty(run_id=1), override_config=overrides)
    grid.errors_as_replies = True
    # What Flower's runtime sets for a ServerApp (tests/conftest.py sets it per test; a
    # module-scoped fixture runs before that).
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s : %(message)s"))
    handler.setLevel(logging.INFO)
    FLOWER_LOGGER.addHandler(handler)
    started, returncode = time.monotonic(), 0
    try:
        run_server(config, grid)
    except Exception:  # the run failed: the test reads why in the output
        returncode = 1
        stream.write(traceback.format_exc())
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    output = stream.getvalue()
    match = _RUN_DIR_LINE.search(output)
    run_dir = Path(match.group(1)) if match else None
    status = "finished:failed" if returncode else "finished:completed"
    return RunOutcome(returncode, output, run_dir, time.monotonic() - started, status)


def make_run(
    flower, run_config: str, *, in_process: bool, federation_config: str = ""
) -> RunOutcome:
    """``flower.run(run_config, federation_config=...)`` (a
    :class:`lab.launcher.LocalSimulation`), or with ``in_process`` the same run made by
    :func:`run_like_flwr` on as many SuperNodes as ``federation_config`` names
    (``num-supernodes``, else the end-to-end harness's 4)."""
    if not in_process:
        return flower.run(run_config, federation_config=federation_config)
    federation = parse_config_args([federation_config]) if federation_config else {}
    return run_like_flwr(run_config, num_supernodes=int(federation.get("num-supernodes", 4)))
