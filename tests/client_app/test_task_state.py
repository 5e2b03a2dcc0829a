"""A task's persistent tensors (PPO's Adam moments under ``ppo.keep-optimizer``) are
kept by the real ClientApp between rounds, written with the client's state files, and
never sent: the real ServerApp and ClientApp in one process (:mod:`tests.inprocess`)."""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context, RecordDict

from client_app import state
from protocol import keys
from tests.inprocess import InProcessGrid, run_config, run_server

NODES = [11, 22, 33]  # the three base planets (ppo.derived-per-base = 0)
TINY_PPO = {
    "task": "lunar-lander",
    "num-server-rounds": 2,
    "fraction-train": 1.0,
    "min-available-nodes": 3,
    "central-eval": False,
    "round-timeout": 60.0,
    "ppo.derived-per-base": 0,
    "ppo.n-steps": 64,
    "ppo.n-envs": 2,
    "ppo.batch-size": 64,
    "ppo.n-epochs": 1,
    "ppo.local-steps": 128,
    "ppo.check-freq": 64,
    "ppo.eval-episodes": 1,
}


def _run(tmp_path: Path, **overrides) -> InProcessGrid:
    config = run_config(**{**TINY_PPO, "output-dir": str(tmp_path), **overrides})
    grid = InProcessGrid(config, NODES)
    run_server(config, grid)
    return grid


def test_adam_state_is_kept_across_rounds_saved_and_never_sent(tmp_path):
    # Execute
    grid = _run(tmp_path, **{"ppo.keep-optimizer": True})

    # Assert: one update of 2 minibatches per round, counted on from round 1 to 2
    for pid, node in enumerate(NODES):
        kept = grid.contexts[node].state[keys.TASK_TENSORS]
        assert float(kept["adam.0.step"].numpy()) == 4.0
        fresh = Context(run_id=1, node_id=node, node_config={}, state=RecordDict(),
                        run_config=grid.run_config)  # fmt: skip
        (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
        state.restore(fresh, str(run_dir / "clients"), pid, 3)
        assert fresh.state[keys.TASK_TENSORS]["adam.0.step"].numpy() == 4.0
    replies_and_messages = [m.content for m in grid.sent]
    assert not any(keys.TASK_TENSORS in content for content in replies_and_messages)


def test_without_keep_optimizer_no_tensors_are_kept(tmp_path):
    # Execute
    grid = _run(tmp_path)

    # Assert
    assert not any(keys.TASK_TENSORS in c.state for c in grid.contexts.values())
