"""``bench/ppo_gradients.py``: the pre-clip gradient norms of PPO's policy and value
networks, per minibatch update, at a reward scale."""

from __future__ import annotations

import tempfile

import pytest
import torch

from bench import ppo_gradients
from tests.tasks import test_lunar_lander as lunar

# Rollouts of 2 envs x 64 steps, batch 64, one epoch: 2 updates per 128-step rollout.
TINY = lunar.TINY | {"task": "lunar-lander", "ppo.derived-per-base": 0}


def test_a_smaller_reward_scale_shrinks_the_value_gradient_not_the_policy_gradient(
    tmp_path, monkeypatch
):
    # Prepare: SB3's default logger would make a folder per learn() call in here
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("SB3_LOGDIR", raising=False)

    # Execute: the same seed and start at scales 1 and 1/100, two chunks of 256 steps
    runs = {
        scale: list(ppo_gradients.gradient_norms(TINY, "earth", scale, 512, seed=3, chunk=256))
        for scale in (1.0, 0.01)
    }

    # Assert: every minibatch update was recorded (2 rollouts x 2 minibatches a chunk)
    for rows in runs.values():
        assert [row["env-steps"] for row in rows] == [256, 512]
        assert [row["updates"] for row in rows] == [4, 4]
    # the value network's gradient is linear in the value error, which the scale
    # multiplies (its initial outputs are near 0): far smaller; the policy's is not,
    # since PPO normalises advantages per minibatch
    first = {scale: rows[0] for scale, rows in runs.items()}
    assert first[0.01]["value"] < first[1.0]["value"] / 20
    assert first[0.01]["policy"] == pytest.approx(first[1.0]["policy"], rel=0.5)
    assert first[1.0]["clipped"] == 1.0  # at scale 1 the value gradient exceeds 0.5
    assert list(tmp_path.glob("SB3-*")) == []  # no SB3 log folder left behind
    # the clip is SB3's own again afterwards
    assert ppo_gradients.sb3_ppo.th.nn.utils.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_
