"""Why ``ppo.reward-scale``: how much of each clipped PPO step the value loss takes (issue 28)

SB3's PPO clips the joint gradient norm of the policy and value losses
(``ppo.max-grad-norm``, 0.5) before each Adam step. This measures, for each minibatch
update, the norm of the gradient on the policy's parameters and on the value network's
(the actor-critic's two networks share no weights), before the clip, with the
preset's PPO settings on one base client's environment, at each reward scale given::

    python bench/ppo_gradients.py experiments/lunar-fl-lands-fedavg.toml --planet moon \\
        --scales 1 0.01 --steps 65536 --seed 0

Per 16 384-step chunk it prints the medians of both norms, the share of updates the
clip shortened and the mean return of the training episodes (raw). One torch thread.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import stable_baselines3.ppo.ppo as sb3_ppo
import torch
from stable_baselines3 import PPO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab import study  # noqa: E402
from tasks.lunar_lander import LunarLanderTask  # noqa: E402
from tasks.lunar_lander.clients import PLANETS  # noqa: E402
from tasks.lunar_lander.ppo import POLICY, silent_logger, training_env  # noqa: E402

CHUNK = 16_384


def gradient_norms(
    config: dict, planet: str, scale: float, steps: int, seed: int, chunk: int = CHUNK
) -> Iterator[dict]:
    """Train SB3's PPO on ``planet``'s base environment for ``steps`` env steps at
    reward ``scale``; after each ``chunk`` of steps yield the chunk's medians of the
    pre-clip gradient norms (``policy``, ``value``), the share of minibatch updates the
    clip shortened (``clipped``), the update count and the mean raw training return."""
    task = LunarLanderTask({**config, "seed": seed})
    client = task.clients[list(PLANETS).index(planet)]  # base clients come first
    cfg = replace(task.config, reward_scale=scale)
    env = training_env(client, cfg, seed=seed, observe_gravity=task.observe_gravity)
    ppo = PPO(
        POLICY, env, seed=seed, device="cpu", verbose=0,
        policy_kwargs={"net_arch": task.build_model(seed).net_arch}, **cfg.ppo_kwargs(),
    )  # fmt: skip
    ppo.set_logger(silent_logger())
    named = list(ppo.policy.named_parameters())
    # mlp_extractor.value_net.* and value_net.* belong to the value network
    is_value = [("value_net" in name) for name, _ in named]
    norms: list[tuple[float, float]] = []
    clip = torch.nn.utils.clip_grad_norm_

    def norm(of_value: bool) -> float:
        pairs = zip(named, is_value, strict=True)
        grads = [p.grad.reshape(-1) for (_, p), value in pairs if value == of_value]
        return float(torch.linalg.vector_norm(torch.cat(grads)))

    def recording_clip(parameters, max_norm, *args, **kwargs):
        norms.append((norm(False), norm(True)))
        return clip(parameters, max_norm, *args, **kwargs)

    sb3_ppo.th.nn.utils.clip_grad_norm_ = recording_clip
    try:
        for done in range(chunk, steps + 1, chunk):
            norms.clear()
            ppo.learn(chunk, reset_num_timesteps=False)
            both = np.array(norms)
            returns = [info["r"] for info in ppo.ep_info_buffer]
            yield {
                "scale": scale,
                "env-steps": done,
                "policy": float(np.median(both[:, 0])),
                "value": float(np.median(both[:, 1])),
                "clipped": float(np.mean(np.hypot(both[:, 0], both[:, 1]) > cfg.max_grad_norm)),
                "updates": len(both),
                "training-return": float(np.mean(returns)) if returns else float("nan"),
            }
    finally:
        sb3_ppo.th.nn.utils.clip_grad_norm_ = clip
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", type=Path, help="take the ppo.* settings from this preset")
    parser.add_argument("--planet", choices=tuple(PLANETS), default="moon")
    parser.add_argument("--scales", nargs="+", type=float, default=[1.0, 0.01])
    parser.add_argument("--steps", type=int, default=65_536)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = dict(study.load_preset(str(args.preset), study.app_defaults()).run_config)
    for scale in args.scales:
        for row in gradient_norms(config, args.planet, scale, args.steps, args.seed):
            print(
                f"scale {scale:g}  {row['env-steps']:>7,} steps  policy {row['policy']:8.3f}  "
                f"value {row['value']:8.3f}  clipped {row['clipped']:5.0%}  "
                f"training return {row['training-return']:7.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
