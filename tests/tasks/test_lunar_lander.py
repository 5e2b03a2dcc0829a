"""Federated PPO on LunarLander (the PPO study) without Flower: client table, node-config
environments, policy weights, the FedProx hooks, tiny local PPO rounds, evaluation
and options.

Local training runs SB3's real PPO on tiny budgets (256 env steps, one update
epoch): well under a second per round on one CPU thread.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import replace
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env

from config.options import ConfigError
from tasks.base import DPSGD, NUM_EXAMPLES, TRAIN_LOSS, LocalTraining
from tasks.lunar_lander import ClientEnv, LunarLanderTask, client_from_node_config, client_table
from tasks.lunar_lander import ppo as ppo_module
from tasks.lunar_lander.clients import PLANETS, make_env
from tasks.lunar_lander.logs import ClientRoundLog, load_episodes, load_snapshots
from tasks.lunar_lander.ppo import (
    ScaledReward,
    build_policy,
    evaluate_episodes,
    flatten_state_dict,
    linear_over_rounds,
    load_optimizer_tensors,
    observes_gravity,
    optimizer_tensors,
    play_episodes,
    proximal_gradient_hooks,
    sample_actions,
    train_ppo,
    unflatten_state_dict,
)
from tasks.lunar_lander.task import OPTIMIZER_PARAMS_KEY, TRAIN_LEARNING_RATE, episode_stats
from tasks.proximal import proximal_term

TRAIN_KEYS = {
    NUM_EXAMPLES,
    TRAIN_LOSS,
    "train-reward",
    "train-episodes",
    "train-entropy-loss",
    "train-approx-kl",
    "train-learning-rate",
    "train-epochs",
    "train-seconds",
}
EVAL_KEYS = {NUM_EXAMPLES, "eval-reward", "eval-reward-std", "eval-reward-se", "eval-length"}
# Rollouts of 2 envs x 64 steps = 128 env steps; 256 local steps = 2 rollouts, 2 updates.
TINY = {
    "seed": 3,
    "ppo.derived-per-base": 1,
    "ppo.n-steps": 64,
    "ppo.n-envs": 2,
    "ppo.batch-size": 64,
    "ppo.n-epochs": 1,
    "ppo.local-steps": 256,
    "ppo.check-freq": 64,
    "ppo.eval-episodes": 1,
}


@pytest.fixture(scope="module")
def task() -> LunarLanderTask:
    return LunarLanderTask(TINY)


@pytest.fixture(scope="module")
def earth(task) -> ClientEnv:
    return task.clients[1]  # earth-00: heavy gravity, episodes end within ~100 steps


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- client table


def test_client_table_lists_base_clients_then_derived_ones_per_planet():
    # Execute
    table = client_table(seed=0, derived_per_base=2, max_wind_power=15.0)

    # Assert
    assert [c.label for c in table] == [
        "moon-00", "earth-00", "mars-00",
        "moon-01", "moon-02", "earth-01", "earth-02", "mars-01", "mars-02",
    ]  # fmt: skip
    assert [(c.planet, c.gravity) for c in table[:3]] == [
        ("moon", -1.6), ("earth", -9.8), ("mars", -3.73)
    ]  # fmt: skip
    assert all(c.wind_power == 0.5 and c.enable_wind for c in table[:3])
    assert all(c.gravity == PLANETS[c.planet] for c in table)
    assert all(0.0 <= c.wind_power <= 15.0 for c in table[3:])
    assert all(c.enable_wind is (c.wind_power > 0) for c in table)
    assert all(c.turbulence_power == 1.5 for c in table)


def test_client_table_is_reproducible_from_the_seed_alone():
    # Execute
    first, again = client_table(seed=7), client_table(seed=7)
    other = client_table(seed=8)

    # Assert
    assert first == again
    assert len(first) == 33  # the PPO study: 3 base clients + 10 derived per planet
    assert first[:3] == other[:3]
    assert [c.wind_power for c in first[3:]] != [c.wind_power for c in other[3:]]
    assert len({c.wind_power for c in first[3:]}) == 30


def test_client_table_draws_winds_in_the_configured_range():
    # Execute
    table = client_table(seed=1, derived_per_base=50, base_wind_power=0.0, max_wind_power=2.0)

    # Assert
    winds = np.array([c.wind_power for c in table[3:]])
    assert winds.min() >= 0.0 and winds.max() <= 2.0
    assert winds.max() > 1.5 and winds.min() < 0.5  # uniform over [0, 2], 150 draws
    assert not any(c.enable_wind for c in table[:3])  # wind power 0: no wind


def test_task_has_one_partition_per_table_entry():
    # Prepare
    task = LunarLanderTask({"seed": 5, "ppo.derived-per-base": 2})

    # Execute
    partitions = [task.load_partition(i, 9) for i in range(9)]

    # Assert
    assert task.num_partitions() == 9
    assert tuple(partitions) == task.clients == client_table(5, derived_per_base=2)
    assert task.load_central_test() == task.clients[:3]
    assert LunarLanderTask({}).num_partitions() == 33


def test_partition_count_mismatch_says_how_many_supernodes_to_start():
    # Prepare
    task = LunarLanderTask({"ppo.derived-per-base": 0})

    # Execute / Assert
    with pytest.raises(ValueError, match=r"ppo\.derived-per-base") as err:
        task.load_partition(0, 5)
    message = str(err.value)
    assert "3 clients" in message and "num-partitions=5" in message
    assert '"num-supernodes=3"' in message


# ---------------------------------------------------------------- node config


def test_node_config_defines_the_clients_environment():
    # Execute
    env = client_from_node_config(
        {"planet": "mars", "gravity": -4, "wind-power": 2.5, "label": "lab-mars"},
        turbulence_power=0.5,
    )
    default = client_from_node_config({"planet": "moon", "partition-id": 4})

    # Assert
    assert env == ClientEnv("lab-mars", "mars", -4.0, 2.5, True, 0.5)
    assert default == ClientEnv("moon-node-04", "moon", -1.6, 0.5, True, 1.5)
    assert client_from_node_config({"partition-id": 0, "num-partitions": 3}) is None


def test_task_reads_node_config_with_its_own_wind_options():
    # Prepare
    task = LunarLanderTask({"ppo.base-wind-power": 0.0, "ppo.turbulence-power": 1.0})

    # Execute
    env = task.partition_from_node_config({"planet": "earth", "label": "e1"})

    # Assert
    assert env == ClientEnv("e1", "earth", -9.8, 0.0, False, 1.0)
    assert task.partition_from_node_config({"partition-id": 1}) is None


@pytest.mark.parametrize(
    ("node_config", "match"),
    [
        ({"planet": "venus"}, r"'planet' = 'venus'.*'moon', 'earth', 'mars'"),
        ({"planet": "moon", "gravity": -12.0}, r"'gravity' = -12\.0.*\(-12, 0\)"),
        ({"planet": "moon", "gravity": 0}, r"'gravity' = 0\.0.*\(-12, 0\)"),
        ({"planet": "moon", "gravity": "low"}, r"'gravity' must be a finite number"),
        ({"planet": "moon", "wind-power": 25.0}, r"'wind-power' = 25\.0.*\[0, 20\]"),
        ({"planet": "moon", "label": "../x"}, r"'label'"),
    ],
)
def test_invalid_node_config_is_rejected(node_config, match):
    with pytest.raises(ConfigError, match=match):
        client_from_node_config(node_config)


# ---------------------------------------------------------------- model


def test_build_model_is_deterministic_for_a_seed_and_leaves_the_global_rng(task):
    # Prepare
    rng_before = torch.get_rng_state()

    # Execute
    first, again, other = task.build_model(11), task.build_model(11), task.build_model(12)

    # Assert
    assert _same_weights(_weights(first), _weights(again))
    assert not _same_weights(_weights(first), _weights(other))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert sum(t.numel() for t in first.state_dict().values()) == 9797  # 8-64-64-{4,1} x2


def test_flattened_weights_unflatten_into_the_same_policy(task):
    # Prepare
    reference = task.build_model(0).state_dict()
    flat = flatten_state_dict(task.build_model(1).state_dict())

    # Execute
    restored = unflatten_state_dict(flat, reference)

    # Assert
    assert _same_weights(restored, task.build_model(1).state_dict())
    with pytest.raises(ValueError, match="do not fill"):
        unflatten_state_dict(flat[:-1], reference)


def test_policy_weights_round_trip_through_array_record_bit_exactly(task):
    # Prepare
    state = task.build_model(0).state_dict()

    # Execute
    back = ArrayRecord(state).to_torch_state_dict()

    # Assert
    assert list(back) == list(state)
    for key, tensor in state.items():
        assert back[key].dtype == tensor.dtype == torch.float32
        assert torch.equal(back[key], tensor)
    task.build_model(1).load_state_dict(back, strict=True)


# ---------------------------------------------------------------- FedProx hooks


def _ppo_like_loss(policy: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    observations = torch.randn(6, 8, generator=generator)
    actions = torch.tensor([0, 1, 2, 3, 2, 1])
    values, log_prob, entropy = policy.evaluate_actions(observations, actions)
    return -(log_prob * torch.linspace(-1, 1, 6)).mean() + values.pow(2).mean() - entropy.mean()


def _gradients(policy: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    policy.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in policy.parameters()]


def _drift(policy: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))


def test_proximal_hooks_add_the_gradient_of_the_proximal_term():
    # Prepare
    policy, mu = build_policy(0), 0.7
    anchor = [p.detach().clone() for p in policy.parameters()]
    plain_policy = build_policy(0)

    # Execute: hooks anchored at the start weights, then the weights drift
    with proximal_gradient_hooks(policy, mu):
        _drift(policy)
        hooked = _gradients(policy, _ppo_like_loss(policy))
    _drift(plain_policy)
    expected = _gradients(plain_policy, _ppo_like_loss(plain_policy)
                          + proximal_term(plain_policy, anchor, mu))  # fmt: skip
    plain = _gradients(plain_policy, _ppo_like_loss(plain_policy))

    # Assert
    for got, want in zip(hooked, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert not all(torch.allclose(g, p) for g, p in zip(hooked, plain, strict=True))
    # the hooks are gone after the block
    after = _gradients(policy, _ppo_like_loss(policy))
    assert all(torch.equal(a, p) for a, p in zip(after, plain, strict=True))


def test_proximal_hooks_with_mu_zero_leave_gradients_unchanged():
    # Prepare
    policy = build_policy(0)
    _drift(policy)
    plain = _gradients(policy, _ppo_like_loss(policy))

    # Execute
    with proximal_gradient_hooks(policy, 0.0):
        _drift(policy)
        _drift(policy)  # any drift: no term
        hooked = _gradients(policy, _ppo_like_loss(policy))
    policy_again = build_policy(0)
    for _ in range(3):
        _drift(policy_again)
    reference = _gradients(policy_again, _ppo_like_loss(policy_again))

    # Assert
    assert all(torch.equal(h, r) for h, r in zip(hooked, reference, strict=True))
    assert not all(torch.equal(h, p) for h, p in zip(hooked, plain, strict=True))


# ---------------------------------------------------------------- local training


@pytest.fixture(scope="module")
def two_rounds(task, earth, tmp_path_factory):
    """Two rounds of local PPO of one client, with logs; returns what they produced."""
    out = tmp_path_factory.mktemp("clients")
    model = task.build_model(0)
    start = _weights(model)
    state: dict = {}
    metrics, after = [], []
    for server_round in (1, 2):
        local = LocalTraining(
            server_round=server_round, seed=100 + server_round, state=state,
            partition_id=1, artifacts_dir=str(out),
        )  # fmt: skip
        metrics.append(task.train(model, earth, local))
        after.append(_weights(model))
    return {"start": start, "after": after, "metrics": metrics, "state": state, "dir": out}


def test_train_changes_the_policy_and_reports_the_same_keys(two_rounds):
    # Assert
    start, after, metrics = two_rounds["start"], two_rounds["after"], two_rounds["metrics"]
    assert not _same_weights(start, after[0]) and not _same_weights(after[0], after[1])
    for round_metrics in metrics:
        assert set(round_metrics) == TRAIN_KEYS
        assert round_metrics[NUM_EXAMPLES] == 256
        assert all(type(v) in (int, float) for v in round_metrics.values())
        assert np.isfinite(round_metrics[TRAIN_LOSS])
        assert round_metrics["train-approx-kl"] >= 0
        assert round_metrics["train-epochs"] == 1.0  # 2 rollouts, 1 epoch each, no KL stop
        # entropy loss = -entropy, entropy of 4 actions in (0, log 4]
        assert -np.log(4) - 1e-6 <= round_metrics["train-entropy-loss"] < 0
    assert two_rounds["state"] == {"ppo-timesteps": 512}


def test_a_round_too_short_to_end_an_episode_leaves_train_reward_out_not_nan(earth):
    # One rollout of 2 envs x 8 steps: no LunarLander episode ends in 8 steps, so the mean
    # episode reward is undefined; sent as NaN, the server would reject the whole reply.
    short = LunarLanderTask(
        {**TINY, "ppo.n-steps": 8, "ppo.batch-size": 16, "ppo.local-steps": 16}
    )
    model = short.build_model(0)
    start = _weights(model)

    # Execute
    metrics = short.train(model, earth, LocalTraining(server_round=1, seed=7, state={}))

    # Assert: the update is sent, with every metric it has defined and finite
    assert metrics["train-episodes"] == 0 and "train-reward" not in metrics
    assert set(metrics) == TRAIN_KEYS - {"train-reward"}
    assert all(np.isfinite(v) for v in metrics.values())
    assert not _same_weights(start, _weights(model))


def test_train_writes_episode_and_weight_logs(two_rounds, earth):
    # Execute
    directory = two_rounds["dir"]
    episodes = load_episodes(directory)
    frame, weights = load_snapshots(directory)
    log = ClientRoundLog.load(directory / "earth-00-round-0001.npz")

    # Assert: snapshots every 64 cumulative env steps, and the trained weights at the end
    assert frame["step"].tolist() == [64, 128, 192, 256, 256, 320, 384, 448, 512, 512]
    assert frame["server_round"].tolist() == [1] * 5 + [2] * 5
    assert weights.shape == (10, 9797) and weights.dtype == np.float32
    # Rollout 1 acts with the received weights; rollout 3 (round 2) with round 1's result.
    np.testing.assert_array_equal(weights[0], flatten_state_dict(two_rounds["start"]))
    np.testing.assert_array_equal(weights[4], flatten_state_dict(two_rounds["after"][0]))
    np.testing.assert_array_equal(weights[5], flatten_state_dict(two_rounds["after"][0]))
    np.testing.assert_array_equal(weights[9], flatten_state_dict(two_rounds["after"][1]))
    assert not np.array_equal(weights[2], weights[0])  # rollout 2 follows update 1
    assert (log.label, log.planet, log.gravity, log.wind_power) == (
        "earth-00", "earth", earth.gravity, earth.wind_power
    )  # fmt: skip
    assert (log.partition_id, log.server_round, log.rollout_size) == (1, 1, 128)
    # Episodes: the reported ones, ending within the client's cumulative steps
    for server_round, metrics in enumerate(two_rounds["metrics"], start=1):
        rows = episodes[episodes["server_round"] == server_round]
        assert len(rows) == metrics["train-episodes"] >= 1
        assert rows["reward"].mean() == pytest.approx(metrics["train-reward"])
        low, high = 256 * (server_round - 1), 256 * server_round
        assert rows["end_step"].between(low + 1, high).all()
        assert (rows["length"] >= 1).all()


def test_train_leaves_no_sb3_log_folder(task, earth, tmp_path, monkeypatch):
    # Prepare: SB3's default logger would make a folder per learn() call in here
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("SB3_LOGDIR", raising=False)
    local = LocalTraining(server_round=1, seed=7, state={}, partition_id=1)

    # Execute
    task.train(task.build_model(0), earth, local)

    # Assert
    assert list(tmp_path.glob("SB3-*")) == []


def test_train_is_reproducible_and_keeps_the_global_rngs(task, earth):
    # Prepare
    models = [task.build_model(0) for _ in range(3)]
    states = (np.random.get_state()[1].copy(), random.getstate(), torch.get_rng_state())

    # Execute
    for model, seed in zip(models, (5, 5, 6), strict=True):
        task.train(model, earth, LocalTraining(server_round=1, seed=seed))

    # Assert
    assert _same_weights(_weights(models[0]), _weights(models[1]))
    assert not _same_weights(_weights(models[0]), _weights(models[2]))
    assert np.array_equal(np.random.get_state()[1], states[0])
    assert random.getstate() == states[1]
    assert torch.equal(torch.get_rng_state(), states[2])


def test_subprocess_environments_train_the_same_policy(task, earth):
    # Prepare: the same round with env copies in subprocesses (SB3's SubprocVecEnv)
    subproc = LunarLanderTask({**TINY, "ppo.vec-env": "subproc"})
    models = [task.build_model(0), task.build_model(0)]

    # Execute
    dummy_metrics = task.train(models[0], earth, LocalTraining(1, seed=5))
    subproc_metrics = subproc.train(models[1], earth, LocalTraining(1, seed=5))

    # Assert
    assert _same_weights(_weights(models[0]), _weights(models[1]))
    timing = "train-seconds"  # the one metric of the clock, not of what was learnt
    assert subproc_metrics.pop(timing) > 0 and dummy_metrics.pop(timing) > 0
    assert subproc_metrics == dummy_metrics


def test_train_runs_whole_rollouts():
    # Prepare: 200 steps asked, rollouts of 128
    task = LunarLanderTask({**TINY, "ppo.local-steps": 200})
    model, state = task.build_model(0), {"ppo-timesteps": 1000}

    # Execute
    metrics = task.train(model, task.clients[1], LocalTraining(1, seed=0, state=state))

    # Assert
    assert metrics[NUM_EXAMPLES] == 256
    assert state == {"ppo-timesteps": 1256}


def test_a_planets_own_local_steps_apply_to_its_clients_only():
    # Prepare: the moon's clients take 3 rollouts of 128 (384 steps), earth's the
    # default 256, mars' 128; table: moon-00, earth-00, mars-00, then 1 derived each
    task = LunarLanderTask({**TINY, "ppo.local-steps-moon": 384, "ppo.local-steps-mars": 100})
    steps = {}
    for client in task.clients:
        model, state = task.build_model(0), {}

        # Execute
        metrics = task.train(model, client, LocalTraining(1, seed=0, state=state))
        steps[client.label] = (metrics[NUM_EXAMPLES], state["ppo-timesteps"])

    # Assert: derived clients follow their planet; mars' 100 rounds up to one rollout
    assert steps == {
        "moon-00": (384, 384), "earth-00": (256, 256), "mars-00": (128, 128),
        "moon-01": (384, 384), "earth-01": (256, 256), "mars-01": (128, 128),
    }  # fmt: skip


def test_a_planets_own_learning_rate_applies_to_its_clients_only():
    # Prepare: the moon's clients at 6e-4, earth's and mars' at ppo.lr 1e-3
    # (TINY's rollout of 128 in batches of 64: two updates a round, so the rate is set)
    task = LunarLanderTask({**TINY, "ppo.lr": 1e-3, "ppo.lr-moon": 6e-4})
    rates = {}
    for client in task.clients:
        model = task.build_model(0)

        # Execute
        metrics = task.train(model, client, LocalTraining(1, seed=0, state={}))
        rates[client.label] = metrics[TRAIN_LEARNING_RATE]

    # Assert
    assert rates == pytest.approx({
        "moon-00": 6e-4, "earth-00": 1e-3, "mars-00": 1e-3,
        "moon-01": 6e-4, "earth-01": 1e-3, "mars-01": 1e-3,
    })  # fmt: skip


def test_a_planets_learning_rate_decays_with_the_schedule():
    # Prepare: 4 rounds, linear decay, 2 rollouts a round: round 2's last update runs
    # at 2/4 of the planet's start (as test_ppo_trains_with_the_scheduled_learning_rate)
    task = LunarLanderTask(TINY | {"num-server-rounds": 4, "ppo.lr-schedule": "linear",
                                   "ppo.lr-mars": 8e-4})  # fmt: skip
    earth, mars = task.clients[1], task.clients[2]

    # Execute
    rates = {
        client.label: task.train(task.build_model(0), client, LocalTraining(2, seed=5))[
            TRAIN_LEARNING_RATE
        ]
        for client in (earth, mars)
    }

    # Assert
    assert rates == pytest.approx({"earth-00": 3e-4 / 2, "mars-00": 8e-4 / 2}, rel=1e-9)


def test_a_negative_planet_local_steps_is_refused():
    with pytest.raises(ConfigError, match=r"ppo\.local-steps-earth"):
        LunarLanderTask({**TINY, "ppo.local-steps-earth": -1})


def test_proximal_term_pulls_local_training_towards_the_global_policy(task, earth):
    # Prepare
    start = flatten_state_dict(task.build_model(0).state_dict())
    drift = {}

    # Execute
    for mu in (0.0, 100.0):
        model = task.build_model(0)
        task.train(model, earth, LocalTraining(server_round=1, seed=5, proximal_mu=mu))
        drift[mu] = np.linalg.norm(flatten_state_dict(model.state_dict()) - start)

    # Assert
    assert 0 < drift[100.0] < drift[0.0]


def test_train_rejects_dp_sgd(task, earth):
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    with pytest.raises(ValueError, match="lunar-lander does not support dp-sgd"):
        task.train(task.build_model(0), earth, LocalTraining(1, seed=0, dp_sgd=dp))


# ---------------------------------------------------------------- evaluation


def test_evaluate_on_a_client_environment(task, earth):
    # Prepare
    model = task.build_model(0)

    # Execute
    metrics = task.evaluate(model, earth)

    # Assert
    assert set(metrics) == EVAL_KEYS - {"eval-reward-se"}  # none from one episode
    assert metrics[NUM_EXAMPLES] == 1
    assert metrics["eval-reward-std"] == 0.0
    assert 1 <= metrics["eval-length"] <= 1000
    assert task.evaluate(model, earth) == metrics


def test_episode_stats_reports_the_standard_error_of_the_mean():
    # Execute
    stats = episode_stats([100.0, 200.0, 150.0, 250.0], [10, 20, 30, 40])

    # Assert: sample std of (100, 200, 150, 250) = sqrt(12500/3) = 64.55; / sqrt(4)
    assert stats[NUM_EXAMPLES] == 4
    assert stats["eval-reward"] == 175.0
    assert stats["eval-reward-std"] == pytest.approx(np.sqrt(3125.0))  # population std
    assert stats["eval-reward-se"] == pytest.approx(np.sqrt(12500.0 / 3.0) / 2.0)
    assert stats["eval-length"] == 25.0


def test_seeded_episodes_are_the_same_when_evaluated_twice(task, earth):
    # Prepare
    model = task.build_model(0)
    seeds = [11, 12, 13, 11]
    threads = torch.get_num_threads()

    # Execute
    first = evaluate_episodes(model, earth, seeds)
    second = evaluate_episodes(model, earth, seeds)

    # Assert: each episode follows from its seed alone, whatever ran before it
    assert first == second
    assert torch.get_num_threads() == threads  # evaluation's single thread is undone
    rewards, lengths = first
    assert rewards[0] == rewards[3] and lengths[0] == lengths[3]
    assert len(set(rewards[:3])) == 3
    alone = evaluate_episodes(model, earth, [13])
    assert alone == ([rewards[2]], [lengths[2]])


def _always(model: torch.nn.Module, action: int) -> torch.nn.Module:
    """``model`` made to pick ``action`` in every state (its action logits' bias)."""
    with torch.no_grad():
        model.action_net.weight.zero_()
        model.action_net.bias.zero_()
        model.action_net.bias[action] = 10.0
    return model


def _replayed_outcome(model, client: ClientEnv, seed: int) -> tuple[str, int]:
    """An episode played by hand with gymnasium: how it ended, read off the last step."""
    env = make_env(client)
    obs, _ = env.reset(seed=seed)
    steps, done = 0, False
    while not done:
        action, _ = model.predict(obs, deterministic=True)
        obs, reward, terminated, truncated, _ = env.step(int(action))
        steps, done = steps + 1, terminated or truncated
    env.close()
    if truncated and not terminated:
        return "time-limit", steps
    return ("crashed" if reward == -100 else "at-rest" if reward == 100 else "?"), steps


def test_play_episodes_says_how_each_episode_ended(task):
    # Prepare: a lander that never fires its engines, on the Moon, where it sometimes
    # falls softly enough to come to rest (seeds picked by hand: 1 crashes, 2 rests)
    moon = next(c for c in task.clients if c.planet == "moon")
    model = _always(task.build_model(0), 0)
    seeds = [1, 2]

    # Execute
    episodes = play_episodes(model, moon, seeds)

    # Assert: the outcomes and lengths of episodes replayed by hand, both kinds present
    assert [_replayed_outcome(model, moon, s) for s in seeds] == list(
        zip(episodes.outcomes, episodes.lengths, strict=True)
    )
    assert {"crashed", "at-rest"} <= set(episodes.outcomes)
    assert evaluate_episodes(model, moon, seeds) == (episodes.returns, episodes.lengths)


def test_play_episodes_counts_a_truncated_episode_as_time_limit(task, monkeypatch):
    # Prepare: a 20-step time limit; the idle lander needs ~200 steps to fall on the Moon
    moon = next(c for c in task.clients if c.planet == "moon")
    model = _always(task.build_model(0), 0)
    short = lambda client, **kw: gym.wrappers.TimeLimit(make_env(client, **kw), 20)  # noqa: E731
    monkeypatch.setattr(ppo_module, "make_env", short)

    # Execute
    episodes = play_episodes(model, moon, [1, 2])

    # Assert
    assert episodes.outcomes == ["time-limit", "time-limit"] and episodes.lengths == [20, 20]


def test_stochastic_episodes_are_seeded_and_leave_the_global_rng_alone(task, earth):
    # Prepare: an untrained policy, near uniform over the 4 actions
    model = task.build_model(0)
    seeds = [11, 12, 13, 11]
    torch.manual_seed(5)
    expected_draw = torch.rand(1)
    torch.manual_seed(5)

    # Execute
    first = evaluate_episodes(model, earth, seeds, stochastic=True)
    second = evaluate_episodes(model, earth, seeds, stochastic=True)
    greedy = evaluate_episodes(model, earth, seeds)

    # Assert: the sampled actions follow from each episode's seed alone ...
    assert first == second
    rewards, lengths = first
    assert rewards[0] == rewards[3] and lengths[0] == lengths[3]
    assert evaluate_episodes(model, earth, [13], stochastic=True) == ([rewards[2]], [lengths[2]])
    # ... they are not the most likely actions, and torch's generator was not drawn from
    assert rewards[:3] != greedy[0][:3]
    assert torch.equal(torch.rand(1), expected_draw)


def test_sampled_actions_follow_the_policys_action_probabilities(task):
    # Prepare: one observation, its action probabilities, 20 000 seeded draws
    model = task.build_model(3)
    obs = np.array([[0.1, 0.8, -0.2, -0.5, 0.05, 0.0, 0.0, 0.0]], dtype=np.float32)
    with torch.no_grad():
        probs = model.get_distribution(model.obs_to_tensor(obs)[0]).distribution.probs[0].numpy()
    draws = 20_000
    generators = [np.random.default_rng([7, k]) for k in range(draws)]

    # Execute
    actions = sample_actions(model, np.repeat(obs, draws, axis=0), generators)

    # Assert: every action's frequency within 4 binomial standard errors of its probability
    counts = np.bincount(actions, minlength=4) / draws
    assert actions.shape == (draws,) and set(np.unique(actions)) <= {0, 1, 2, 3}
    np.testing.assert_allclose(counts, probs, atol=4 * np.sqrt(0.25 / draws))


def test_eval_policy_stochastic_evaluates_sampled_episodes(earth):
    # Prepare
    greedy = LunarLanderTask(TINY | {"ppo.eval-episodes": 3})
    sampled = LunarLanderTask(TINY | {"ppo.eval-episodes": 3, "ppo.eval-policy": "stochastic"})
    model = greedy.build_model(0)
    seeds = greedy.eval_seeds(greedy.clients.index(earth))

    # Execute
    metrics = sampled.evaluate(model, earth)

    # Assert: the task plays the seeded episodes with sampled actions
    rewards, lengths = evaluate_episodes(model, earth, seeds, stochastic=True)
    assert metrics == episode_stats(rewards, lengths)
    assert metrics != greedy.evaluate(model, earth)


def test_eval_seeds_are_the_same_every_round_and_differ_per_environment():
    # Prepare
    task = LunarLanderTask(TINY | {"ppo.eval-episodes": 20})

    # Execute
    seeds = [task.eval_seeds(index) for index in range(3)]

    # Assert
    assert all(len(s) == 20 and len(set(s)) == 20 for s in seeds)
    assert task.eval_seeds(0) == seeds[0]
    assert not set(seeds[0]) & set(seeds[1])
    assert LunarLanderTask(TINY | {"ppo.eval-episodes": 20, "seed": 4}).eval_seeds(0) != seeds[0]


def test_central_evaluation_reports_every_planet_reproducibly():
    # Prepare
    task = LunarLanderTask(TINY | {"ppo.eval-episodes": 3})
    model, central = task.build_model(0), task.load_central_test()
    singles = [task.evaluate(model, env) for env in central]

    # Execute
    metrics = task.evaluate(model, central)

    # Assert
    planet_keys = {f"eval-reward{s}-{p}" for p in PLANETS for s in ("", "-std", "-se")}
    assert set(metrics) == EVAL_KEYS | planet_keys
    assert metrics[NUM_EXAMPLES] == 9
    for planet, single in zip(PLANETS, singles, strict=True):  # base clients: index = position
        for key in ("eval-reward", "eval-reward-std", "eval-reward-se"):
            assert metrics[f"{key}-{planet}"] == pytest.approx(single[key])
        assert single["eval-reward-se"] == pytest.approx(
            single["eval-reward-std"] * np.sqrt(3 / 2) / np.sqrt(3)
        )
    assert metrics["eval-reward"] == pytest.approx(np.mean([m["eval-reward"] for m in singles]))
    assert len({m["eval-reward"] for m in singles}) == 3
    assert task.evaluate(model, central) == metrics


# ---------------------------------------------------------------- gravity input


def test_gravity_observation_appends_the_planets_gravity_to_every_observation():
    # Prepare
    moon, earth = client_table(0, derived_per_base=0)[:2]
    plain = make_env(earth)
    envs = {env: make_env(env, observe_gravity=True) for env in (moon, earth)}

    # Execute
    first_plain, _ = plain.reset(seed=7)
    firsts = {env: observe.reset(seed=7)[0] for env, observe in envs.items()}
    nexts = {env: observe.step(2)[0] for env, observe in envs.items()}

    # Assert: 8 observations unchanged, then gravity / 10 (moon -0.16, earth -0.98)
    assert plain.observation_space.shape == (8,)
    np.testing.assert_array_equal(firsts[earth][:8], first_plain)
    assert firsts[moon][8] == np.float32(-0.16) and firsts[earth][8] == np.float32(-0.98)
    assert nexts[moon][8] == np.float32(-0.16) and nexts[earth][8] == np.float32(-0.98)
    # one space on every planet: gymnasium's gravity range (-12, 0) / 10
    assert envs[moon].observation_space == envs[earth].observation_space
    assert envs[moon].observation_space.low[8] == np.float32(-1.2)
    assert envs[moon].observation_space.high[8] == 0.0
    for env in (plain, *envs.values()):
        env.close()


def test_observe_gravity_builds_a_policy_with_a_ninth_input():
    # Prepare
    task = LunarLanderTask(TINY | {"ppo.observe-gravity": True})

    # Execute
    model, plain = task.build_model(0), LunarLanderTask(TINY).build_model(0)

    # Assert
    first = next(p for name, p in model.named_parameters() if name.endswith("0.weight"))
    assert first.shape[1] == 9
    assert observes_gravity(model) and not observes_gravity(plain)
    assert not observes_gravity(build_policy(0))
    with pytest.raises(ValueError, match="not a LunarLander policy"):
        observes_gravity(PPO.policy_aliases["MlpPolicy"](
            gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Discrete(4), lambda _: 3e-4
        ))  # fmt: skip


def test_gravity_policy_trains_and_evaluates_on_the_gravity_it_is_given(earth):
    # Prepare
    task = LunarLanderTask(TINY | {"ppo.observe-gravity": True})
    model = task.build_model(0)
    before = _weights(model)

    # Execute
    metrics = task.train(model, earth, LocalTraining(1, seed=5))
    rewards, lengths = evaluate_episodes(model, earth, [11, 12])

    # Assert: it trained, and the gravity input reaches the policy's actions
    assert metrics[NUM_EXAMPLES] == 256 and not _same_weights(before, _weights(model))
    obs = make_env(earth, observe_gravity=True).reset(seed=11)[0]
    moon_obs = obs.copy()
    moon_obs[8] = np.float32(-0.16)
    with torch.no_grad():
        logits = [
            model.get_distribution(model.obs_to_tensor(o)[0]).distribution.logits
            for o in (obs, moon_obs)
        ]
    assert not torch.equal(*logits)
    assert len(rewards) == 2 and all(1 <= n <= 1000 for n in lengths)


def test_net_width_sets_both_hidden_layers_of_policy_and_value_networks():
    # Execute
    wide = LunarLanderTask(TINY | {"ppo.net-width": 32}).build_model(0)
    default = LunarLanderTask(TINY).build_model(0)

    # Assert: 8 inputs -> 32 -> 32 -> 4 actions / 1 value; the default is SB3's 64
    shapes = {name: tuple(p.shape) for name, p in wide.named_parameters()}
    for net in ("policy_net", "value_net"):
        assert shapes[f"mlp_extractor.{net}.0.weight"] == (32, 8)
        assert shapes[f"mlp_extractor.{net}.2.weight"] == (32, 32)
    assert shapes["action_net.weight"] == (4, 32) and shapes["value_net.weight"] == (1, 32)
    assert default.net_arch == {"pi": [64, 64], "vf": [64, 64]}
    with pytest.raises(ValueError, match="net_width"):
        build_policy(0, net_width=0)


def test_a_wider_policy_trains_at_its_width_and_resets_kept_adam_state(earth):
    # Prepare: Adam state kept from a round of the default width
    local = LocalTraining(1, seed=5)
    LunarLanderTask(TINY | {"ppo.keep-optimizer": True}).train(
        LunarLanderTask(TINY).build_model(0), earth, local
    )
    steps = local.state_tensors["adam.0.step"].item()
    task = LunarLanderTask(TINY | {"ppo.keep-optimizer": True, "ppo.net-width": 16})
    model = task.build_model(0)
    before = _weights(model)

    # Execute
    task.train(model, earth, local)

    # Assert: trained in place at width 16, with fresh Adam moments of width 16
    assert not _same_weights(before, _weights(model))
    assert {k: v.shape for k, v in _weights(model).items()} == {
        k: v.shape for k, v in before.items()
    }
    assert local.state_tensors["adam.0.step"].item() == steps
    assert local.state_tensors["adam.0.exp_avg"].shape == (16, 8)


# ---------------------------------------------------------------- optimizer state


def test_adam_state_round_trips_through_tensors_and_rejects_another_shape():
    # Prepare: two Adam steps give every parameter moments and a step count
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()
    tensors = optimizer_tensors(optimizer)
    fresh = torch.optim.Adam(model.parameters(), lr=0.1)
    other = torch.optim.Adam(torch.nn.Linear(3, 3).parameters(), lr=0.1)

    # Execute
    loaded = load_optimizer_tensors(fresh, tensors)
    rejected = load_optimizer_tensors(other, tensors)

    # Assert
    assert len(tensors) == 4 * 3 and tensors["adam.0.step"].item() == 2.0
    assert loaded and optimizer_tensors(fresh).keys() == tensors.keys()
    assert all(torch.equal(optimizer_tensors(fresh)[k], v) for k, v in tensors.items())
    assert not rejected and not other.state_dict()["state"]


def test_ppo_optimizer_state_survives_a_round_trip_through_the_client_state(earth):
    # Prepare: the client's state goes through the record a ClientApp keeps it in
    task = LunarLanderTask(TINY | {"ppo.keep-optimizer": True})
    model = task.build_model(0)
    local = LocalTraining(1, seed=5)
    task.train(model, earth, local)
    record = ArrayRecord(local.state_tensors)
    restored = {k: torch.from_numpy(record[k].numpy()) for k in record}
    steps = restored["adam.0.step"].item()

    # Execute
    second = LocalTraining(2, seed=6, state=dict(local.state), state_tensors=restored)
    task.train(model, earth, second)

    # Assert: 2 updates of 2 minibatches per round; the second round continues the count
    assert steps == 4.0
    assert second.state_tensors["adam.0.step"].item() == 2 * steps
    assert second.state[OPTIMIZER_PARAMS_KEY] == [
        [name, list(p.shape)] for name, p in model.named_parameters()
    ]


def test_ppo_optimizer_state_resets_when_the_architecture_changes(earth):
    # Prepare: the kept state belongs to parameters of other shapes
    task = LunarLanderTask(TINY | {"ppo.keep-optimizer": True})
    model = task.build_model(0)
    local = LocalTraining(1, seed=5)
    task.train(model, earth, local)
    local.state[OPTIMIZER_PARAMS_KEY] = [["mlp_extractor.other", [3]]]
    steps = local.state_tensors["adam.0.step"].item()

    # Execute
    task.train(model, earth, local)

    # Assert: fresh moments (the step count restarts) for the current architecture
    assert local.state_tensors["adam.0.step"].item() == steps
    assert local.state[OPTIMIZER_PARAMS_KEY][0][0] == next(iter(model.named_parameters()))[0]


def test_ppo_without_keep_optimizer_keeps_no_optimizer_state(task, earth):
    # Prepare: a state left by an earlier run that kept it
    local = LocalTraining(1, seed=5, state={OPTIMIZER_PARAMS_KEY: []})
    local.state_tensors["adam.0.step"] = torch.tensor(9.0)

    # Execute
    task.train(task.build_model(0), earth, local)

    # Assert
    assert local.state_tensors == {} and OPTIMIZER_PARAMS_KEY not in local.state


@pytest.mark.parametrize(
    ("server_round", "progress_remaining", "expected"),
    [
        (1, 1.0, 1e-3),  # the first update of the run: the initial rate
        (1, 0.0, 7.5e-4),  # the end of round 1 of 4: a quarter of the way down
        (2, 0.5, 6.25e-4),  # halfway through round 2: (1 + 0.5) / 4 of the way
        (4, 0.0, 0.0),  # the end of the run
    ],
)
def test_linear_schedule_decays_over_the_runs_rounds(server_round, progress_remaining, expected):
    rate = linear_over_rounds(
        progress_remaining, initial=1e-3, server_round=server_round, num_rounds=4
    )
    assert rate == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize("server_round", [0, 5])
def test_linear_schedule_refuses_a_round_outside_the_run(server_round):
    with pytest.raises(ValueError, match=r"round \d is outside the run's 4 rounds"):
        linear_over_rounds(0.5, initial=1e-3, server_round=server_round, num_rounds=4)


@pytest.mark.parametrize(
    ("schedule", "server_round", "expected"),
    [("constant", 3, 3e-4), ("linear", 1, 3e-4 * 3 / 4), ("linear", 3, 3e-4 / 4)],
)
def test_ppo_trains_with_the_scheduled_learning_rate(earth, schedule, server_round, expected):
    # Prepare: 2 rollouts a round, so the last update runs at progress_remaining 0
    task = LunarLanderTask(TINY | {"ppo.lr-schedule": schedule, "num-server-rounds": 4})

    # Execute
    metrics = task.train(task.build_model(0), earth, LocalTraining(server_round, seed=5))

    # Assert: the rate SB3 set on Adam for the round's last update
    assert metrics["train-learning-rate"] == pytest.approx(expected, rel=1e-9)


def test_linear_schedule_refuses_a_round_past_num_server_rounds(earth):
    task = LunarLanderTask(TINY | {"ppo.lr-schedule": "linear", "num-server-rounds": 2})
    with pytest.raises(ValueError, match=r"ppo\.lr-schedule='linear' decays over num-server"):
        task.train(task.build_model(0), earth, LocalTraining(3, seed=5))


# ---------------------------------------------------------------- reward scale


def test_scaled_reward_scales_what_ppo_sees_and_leaves_the_episode_returns_raw(earth):
    # Prepare: two identically seeded vectorised copies of earth-00, one scaled by 1/4
    raw_env = make_vec_env(partial(make_env, earth), n_envs=2, seed=11)
    scaled_env = ScaledReward(make_vec_env(partial(make_env, earth), n_envs=2, seed=11), 0.25)
    raw_env.reset(), scaled_env.reset()
    running, logged, sums = np.zeros(2), [], []

    # Execute: 300 no-op steps (a lander that never fires lands or crashes within ~100)
    try:
        for _ in range(300):
            noop = np.zeros(2, dtype=np.int64)
            _, raw, done, raw_infos = raw_env.step(noop)
            _, scaled, _, scaled_infos = scaled_env.step(noop)
            # Assert: PPO sees exactly a quarter of every reward (0.25 is exact in binary)
            np.testing.assert_array_equal(scaled, raw * 0.25)
            running += raw
            for i in np.flatnonzero(done):
                logged.append((raw_infos[i]["episode"]["r"], scaled_infos[i]["episode"]["r"]))
                sums.append(running[i])
                running[i] = 0.0
    finally:
        raw_env.close(), scaled_env.close()

    # Assert: the Monitor inside each copy logs the raw return, the same in both
    assert len(logged) >= 4
    for (raw_return, scaled_return), total in zip(logged, sums, strict=True):
        assert scaled_return == raw_return == pytest.approx(total, abs=1e-5)


def test_reward_scale_shrinks_the_value_loss_and_logs_raw_episode_returns(task, earth):
    # Prepare: the same seed and start, one run learning from rewards x 0.01; rollouts
    # of 2 x 128 steps, long enough for episodes on Earth to end in the first one
    raw = replace(task.config, n_steps=128)
    scaled = replace(raw, reward_scale=0.01)

    # Execute: one rollout (256 local steps), one update
    runs = [train_ppo(build_policy(0), earth, cfg, seed=5) for cfg in (raw, scaled)]

    # Assert: the rollout acts with the same (initial) policy in both, so its
    # episodes are the same and logged raw; value loss falls by far more than 100x
    assert runs[0].log.episode_rewards
    assert runs[0].log.episode_rewards == runs[1].log.episode_rewards
    value_losses = [run.train_values["train/value_loss"] for run in runs]
    assert value_losses[1] < value_losses[0] / 100


@pytest.mark.parametrize(("threads", "learning"), [(1, 1), (2, 2), (0, 3)])
def test_ppo_learns_on_its_torch_threads_and_restores_the_processs(
    task, earth, monkeypatch, threads, learning
):
    # The process has 3 threads (as a ClientApp of num-cpus 3 under Ray); 0 keeps them.
    seen = []
    learn = PPO.learn

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return learn(self, *args, **kwargs)

    monkeypatch.setattr(PPO, "learn", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert (
            LunarLanderTask(TINY | {"ppo.torch-threads": threads}).config.torch_threads == threads
        )
        train_ppo(build_policy(0), earth, replace(task.config, torch_threads=threads), seed=5)
        assert seen == [learning]
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_the_default_is_one_torch_thread():
    assert LunarLanderTask({}).config.torch_threads == 1


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan")])
def test_reward_scale_must_be_positive_and_finite(scale):
    with pytest.raises(ConfigError, match=r"ppo\.reward-scale"):
        LunarLanderTask(TINY | {"ppo.reward-scale": scale})


# ---------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("ppo.local-steps", 0),
        ("ppo.n-envs", 0),
        ("ppo.vec-env", "ray"),
        ("ppo.lr", 0.0),
        ("ppo.batch-size", 1),
        ("ppo.n-epochs", 0),
        ("ppo.gamma", 1.5),
        ("ppo.gae-lambda", -0.1),
        ("ppo.clip-range", 0.0),
        ("ppo.max-grad-norm", 0.0),
        ("ppo.check-freq", 0),
        ("ppo.eval-episodes", 0),
        ("ppo.derived-per-base", -1),
        ("ppo.max-wind-power", 25.0),
        ("ppo.turbulence-power", 3.0),
        ("ppo.device", "tpu"),
        ("ppo.n-steps", 2.5),
        ("ppo.observe-gravity", "yes"),
        ("ppo.lr-schedule", "cosine"),
        ("ppo.eval-policy", "greedy"),
        ("ppo.net-width", 0),
        ("ppo.torch-threads", -1),
    ],
)
def test_invalid_option_names_its_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        LunarLanderTask({key: value})


def test_rollout_of_one_step_is_rejected():
    with pytest.raises(ConfigError, match=r"'ppo\.n-steps' x 'ppo\.n-envs' = 1 x 1"):
        LunarLanderTask({"ppo.n-steps": 1, "ppo.n-envs": 1})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'ppo\.device' = 'cuda'"):
        LunarLanderTask({"ppo.device": "cuda"})


def test_options_have_one_line_help():
    assert all(opt.key.startswith("ppo.") for opt in LunarLanderTask.OPTIONS)
    assert all(opt.help and "\n" not in opt.help for opt in LunarLanderTask.OPTIONS)
    assert LunarLanderTask({}).config.device == "cpu"


def test_target_kl_ends_the_update_epochs_early(task, earth):
    # Prepare: one rollout of 2 x 128 steps, 4 minibatches of 64, 5 epochs over it; a
    # target KL no update can stay under once the policy has moved
    cfg = replace(task.config, n_steps=128, n_epochs=5)
    stopping = replace(cfg, target_kl=1e-9)

    # Execute
    runs = [train_ppo(build_policy(0), earth, c, seed=5) for c in (cfg, stopping)]

    # Assert: SB3 counts the epochs it began; the first minibatch leaves the policy
    # unchanged (KL 0), the second exceeds 1.5e-9 and ends the first epoch
    assert cfg.ppo_kwargs()["target_kl"] is None
    assert stopping.ppo_kwargs()["target_kl"] == 1e-9
    assert runs[0].train_values["train/n_updates"] == 5
    assert runs[1].train_values["train/n_updates"] == 1


def test_the_epochs_the_kl_stop_leaves_are_reported_per_rollout(earth):
    # Prepare: 2 rollouts of 2 x 64 steps, 3 epochs over each; a target KL no update can
    # stay under once the policy has moved (as in the test above)
    options = TINY | {"ppo.n-epochs": 3}

    # Execute
    metrics = [
        LunarLanderTask(options | extra).train(
            LunarLanderTask(options).build_model(0), earth, LocalTraining(1, seed=5)
        )
        for extra in ({}, {"ppo.target-kl": 1e-9})
    ]

    # Assert: every epoch ran without the stop; with it, each rollout's first epoch ended
    assert metrics[0]["train-epochs"] == 3.0
    assert metrics[1]["train-epochs"] == 1.0


def test_train_seconds_time_ppo_learn_alone(earth, monkeypatch):
    # Prepare: building the round's environments takes 0.3 s longer than it does
    build = ppo_module.training_env

    def slow_build(*args, **kwargs):
        time.sleep(0.3)
        return build(*args, **kwargs)

    monkeypatch.setattr(ppo_module, "training_env", slow_build)
    task = LunarLanderTask(TINY)
    model = task.build_model(0)

    # Execute
    started = time.perf_counter()
    metrics = task.train(model, earth, LocalTraining(1, seed=5))
    seconds = time.perf_counter() - started

    # Assert: the environments' build is left out, PPO's own work is counted
    assert 0 < metrics["train-seconds"] <= seconds - 0.3


@pytest.mark.parametrize("target", [-0.01, float("nan")])
def test_target_kl_must_be_non_negative(target):
    with pytest.raises(ConfigError, match=r"ppo\.target-kl"):
        LunarLanderTask(TINY | {"ppo.target-kl": target})
