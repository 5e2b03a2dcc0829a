"""Per-client PPO training logs: episodes and policy-weight snapshots (the PPO study's
``WeightStorageCallback`` data), one ``.npz`` per client and round.

Design notes: ``docs/notes.md``, ``tasks.lunar_lander.logs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

_SCALARS = (
    "label",
    "planet",
    "gravity",
    "wind_power",
    "partition_id",
    "server_round",
    "rollout_size",
)


@dataclass
class ClientRoundLog:
    """What one client recorded during one round of local PPO training."""

    label: str
    planet: str
    gravity: float
    wind_power: float
    partition_id: int
    server_round: int
    rollout_size: int
    episode_rewards: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    episode_end_steps: list[int] = field(default_factory=list)
    weight_steps: list[int] = field(default_factory=list)
    weights: list[np.ndarray] = field(default_factory=list)

    def file_name(self) -> str:
        return f"{self.label}-round-{self.server_round:04d}.npz"

    def save(self, directory: str | Path) -> Path:
        """Write the log as ``<directory>/<label>-round-<r>.npz`` (atomic rename)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        arrays = {
            "label": np.array(self.label),
            "planet": np.array(self.planet),
            "gravity": np.float64(self.gravity),
            "wind_power": np.float64(self.wind_power),
            "partition_id": np.int64(self.partition_id),
            "server_round": np.int64(self.server_round),
            "rollout_size": np.int64(self.rollout_size),
            "episode_rewards": np.asarray(self.episode_rewards, dtype=np.float64),
            "episode_lengths": np.asarray(self.episode_lengths, dtype=np.int64),
            "episode_end_steps": np.asarray(self.episode_end_steps, dtype=np.int64),
            "weight_steps": np.asarray(self.weight_steps, dtype=np.int64),
            "weights": (
                np.stack(self.weights).astype(np.float32)
                if self.weights
                else np.zeros((0, 0), dtype=np.float32)
            ),
        }
        path = directory / self.file_name()
        tmp = directory / f".{path.stem}.tmp.npz"
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> ClientRoundLog:
        with np.load(path, allow_pickle=False) as data:
            scalars = {key: data[key].item() for key in _SCALARS}
            return cls(
                **scalars,
                episode_rewards=data["episode_rewards"].tolist(),
                episode_lengths=data["episode_lengths"].tolist(),
                episode_end_steps=data["episode_end_steps"].tolist(),
                weight_steps=data["weight_steps"].tolist(),
                weights=list(data["weights"]),
            )


def _logs(directory: str | Path) -> list[ClientRoundLog]:
    files = sorted(Path(directory).glob("*-round-*.npz"))
    if not files:
        raise FileNotFoundError(f"no client logs (*-round-*.npz) in {directory}")
    return [ClientRoundLog.load(f) for f in files]


def clients_dir(run_dir: str | Path) -> Path:
    """Where a run's clients wrote their files in a simulation: ``curator/clients`` in a
    privacy run (the server's artifacts directory is owner-only there), else
    ``clients``."""
    private = Path(run_dir) / "curator" / "clients"
    return private if private.is_dir() else Path(run_dir) / "clients"


def load_episodes(directory: str | Path) -> pd.DataFrame:
    """All episodes of all clients in ``directory``, one row each.

    Columns: label, planet, gravity, wind_power, partition_id, server_round,
    rollout_size, reward, length, end_step, local_epoch (= end_step / rollout_size).
    Sorted by label then end_step.
    """
    frames = []
    for log in _logs(directory):
        if not log.episode_rewards:
            continue
        frame = pd.DataFrame(
            {
                "reward": log.episode_rewards,
                "length": log.episode_lengths,
                "end_step": log.episode_end_steps,
            }
        )
        for key in _SCALARS:
            frame[key] = getattr(log, key)
        frames.append(frame)
    if not frames:
        raise ValueError(f"the client logs in {directory} hold no finished episode")
    episodes = pd.concat(frames, ignore_index=True)
    episodes["local_epoch"] = episodes["end_step"] / episodes["rollout_size"]
    return episodes.sort_values(["label", "end_step"], ignore_index=True)


def load_snapshots(directory: str | Path) -> tuple[pd.DataFrame, np.ndarray]:
    """Every weight snapshot in ``directory``: (one row per snapshot, weight matrix).

    The frame has columns label, planet, partition_id, server_round, step and is
    aligned with the rows of the returned ``float32[N, P]`` matrix.
    """
    rows, weights = [], []
    for log in _logs(directory):
        for step, vector in zip(log.weight_steps, log.weights, strict=True):
            rows.append(
                {
                    "label": log.label,
                    "planet": log.planet,
                    "partition_id": log.partition_id,
                    "server_round": log.server_round,
                    "step": step,
                }
            )
            weights.append(vector)
    if not weights:
        raise ValueError(f"the client logs in {directory} hold no weight snapshots")
    return pd.DataFrame(rows), np.stack(weights).astype(np.float32)
