"""Federated PPO on LunarLander-v3 across planets (the PPO study): each client is one
environment (moon, earth or mars gravity, its own wind), trains SB3's PPO locally
from the global policy and sends the policy's weights back.

The model is SB3's ``ActorCriticPolicy`` (MlpPolicy); a partition is a
``ClientEnv``; the central "test set" is the three
base environments. FedProx's proximal term enters through gradient hooks
(``proximal_gradient_hooks``); sample-level DP-SGD is not
supported (client-level mechanisms, e.g. ``privacy='laplace'``, are).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from config.options import ConfigError, Option
from tasks.base import (
    EVAL_REWARD,
    NUM_EXAMPLES,
    NUM_SERVER_ROUNDS,
    SEED,
    TRAIN_LOSS,
    TRAIN_REWARD,
    TRAIN_SECONDS,
    LocalTraining,
    Task,
    resolve_device,
)
from tasks.lunar_lander.clients import (
    PLANETS,
    ClientEnv,
    client_from_node_config,
    client_table,
)
from tasks.lunar_lander.logs import ClientRoundLog
from tasks.lunar_lander.ppo import (
    LocalPPOResult,
    PPOConfig,
    build_policy,
    evaluate_episodes,
    train_ppo,
)

TIMESTEPS_KEY = "ppo-timesteps"  # the client's cumulative env steps, in its persistent state
# The parameter names and shapes the kept Adam state belongs to (persistent state).
OPTIMIZER_PARAMS_KEY = "ppo-optimizer-parameters"
EVAL_STREAM = 0xE7A1  # seed stream of the evaluation episodes
TRAIN_EPISODES = "train-episodes"
TRAIN_ENTROPY_LOSS = "train-entropy-loss"
TRAIN_APPROX_KL = "train-approx-kl"
TRAIN_LEARNING_RATE = "train-learning-rate"
# Update epochs PPO ran per rollout, on average: ppo.n-epochs unless the KL stop fired.
TRAIN_EPOCHS = "train-epochs"
EVAL_REWARD_STD = "eval-reward-std"
EVAL_REWARD_SE = "eval-reward-se"
EVAL_LENGTH = "eval-length"

LUNAR_OPTIONS: tuple[Option, ...] = PPOConfig.options()


def episode_stats(rewards: Sequence[float], lengths: Sequence[int]) -> dict[str, float]:
    """``num-examples`` (episodes), the returns' mean and standard deviation, mean
    length and, from two episodes on, the mean's standard error ``eval-reward-se``
    (sample std / sqrt(n); one episode has none, and a NaN would read as divergence)."""
    returns = np.asarray(rewards, dtype=float)
    n = len(returns)
    stats = {
        NUM_EXAMPLES: n,
        EVAL_REWARD: float(returns.mean()),
        EVAL_REWARD_STD: float(returns.std()),
        EVAL_LENGTH: float(np.mean(lengths)),
    }
    if n > 1:
        stats[EVAL_REWARD_SE] = float(returns.std(ddof=1) / np.sqrt(n))
    return stats


def parameter_shapes(model: torch.nn.Module) -> list[list[Any]]:
    """``[name, shape]`` of every parameter of ``model``, in order (JSON-serialisable)."""
    return [[name, list(param.shape)] for name, param in model.named_parameters()]


class LunarLanderTask(Task):
    """PPO on LunarLander-v3, one environment per client (the PPO study).

    Options: ``LUNAR_OPTIONS`` (``ppo.*``) plus the top-level ``seed``, which
    also draws the derived clients' winds (``client_table``). ``self.clients``
    is the client table; partition ``i`` is ``self.clients[i]``, unless the
    SuperNode's ``node_config`` names a ``planet``.
    """

    name = "lunar-lander"
    OPTIONS: ClassVar[tuple[Option, ...]] = LUNAR_OPTIONS
    SUPPORTS_DP_SGD: ClassVar[bool] = False
    PRIVACY_UNIT: ClassVar[str] = (
        "one client's whole environment interaction (every episode it plays, in every round)"
    )

    def __init__(self, run_config: Mapping[str, Any]) -> None:
        super().__init__(run_config)
        self.seed = int(SEED.read(run_config))
        declared = PPOConfig.from_options(self.options)
        n_steps, n_envs = declared.n_steps, declared.n_envs
        if n_steps * n_envs <= 1:
            raise ConfigError(
                f"'ppo.n-steps' x 'ppo.n-envs' = {n_steps} x {n_envs} must be > 1 "
                "(PPO normalises advantages over the rollout)"
            )
        self.config = cfg = dataclasses.replace(
            declared,
            device=resolve_device(declared.device, "ppo.device"),
            num_rounds=int(NUM_SERVER_ROUNDS.read(run_config)),
        )
        # Each planet's clients' steps per round (ppo.local-steps-<planet>, 0: the default)
        self.planet_steps = {
            planet: getattr(cfg, f"local_steps_{planet}") or cfg.local_steps for planet in PLANETS
        }
        # ... and their learning rate (ppo.lr-<planet>, 0: the default)
        self.planet_rates = {planet: getattr(cfg, f"lr_{planet}") or cfg.lr for planet in PLANETS}
        self.observe_gravity = cfg.observe_gravity
        self.net_width = cfg.net_width
        self.eval_episodes = cfg.eval_episodes
        self.eval_stochastic = cfg.eval_policy == "stochastic"
        self.clients = client_table(
            self.seed,
            derived_per_base=cfg.derived_per_base,
            base_wind_power=cfg.base_wind_power,
            max_wind_power=cfg.max_wind_power,
            turbulence_power=cfg.turbulence_power,
        )

    def num_partitions(self) -> int:
        """The size of the client table: 3 + 3 x ``ppo.derived-per-base``."""
        return len(self.clients)

    def partition_from_node_config(self, node_config: Mapping[str, Any]) -> ClientEnv | None:
        """The environment a SuperNode's ``node_config`` names (``planet=...``), if any."""
        return client_from_node_config(
            node_config,
            default_wind_power=self.config.base_wind_power,
            turbulence_power=self.config.turbulence_power,
        )

    def build_model(self, seed: int) -> torch.nn.Module:
        """SB3's MlpPolicy (actor-critic) for LunarLander, weights drawn from ``seed``,
        hidden layers of ``ppo.net-width`` units; with ``ppo.observe-gravity`` its input
        includes the environment's gravity."""
        return build_policy(seed, observe_gravity=self.observe_gravity, net_width=self.net_width)

    def weight_bound(self, partition: ClientEnv) -> None:
        """None: a train reply's ``num-examples`` counts env steps, not data."""
        return None

    def load_partition(self, partition_id: int, num_partitions: int) -> ClientEnv:
        """Client ``partition_id``'s environment; the table fixes ``num_partitions``."""
        size = len(self.clients)
        if num_partitions != size:
            derived = self.config.derived_per_base
            raise ValueError(
                f"lunar-lander defines {size} clients (3 planets + 3 x ppo.derived-per-base="
                f"{derived} derived ones) but the federation has num-partitions="
                f"{num_partitions}; start {size} SuperNodes (simulation: --federation-config "
                f'"num-supernodes={size}") or set ppo.derived-per-base so that '
                f"3 + 3 x ppo.derived-per-base = {num_partitions}"
            )
        if not 0 <= partition_id < size:
            raise ValueError(f"partition-id {partition_id} is not in [0, {size})")
        return self.clients[partition_id]

    def load_central_test(self) -> tuple[ClientEnv, ...]:
        """The three base environments (moon-00, earth-00, mars-00)."""
        return self.clients[:3]

    def train(
        self, model: torch.nn.Module, partition: ClientEnv, local: LocalTraining
    ) -> dict[str, float]:
        """``ppo.local-steps`` env steps of PPO on the client's environment, in place
        (``ppo.local-steps-<planet>`` and ``ppo.lr-<planet>`` where they are
        set for the client's planet).

        PPO and the environments are fresh every round; the received weights are the
        FedProx anchor. Adam starts from zero moments, or with ``ppo.keep-optimizer``
        from this client's own state of its previous round, kept in
        ``local.state_tensors`` (never sent) together with the names and shapes of the
        policy's parameters it belongs to: a policy whose architecture differs gets
        fresh moments. ``local.state["ppo-timesteps"]`` accumulates the client's env
        steps; with ``local.artifacts_dir`` the round's episodes and weight snapshots
        are written there (``ClientRoundLog``).
        """
        if local.dp_sgd is not None:
            raise ValueError(
                "lunar-lander does not support dp-sgd (sample-level DP-SGD needs "
                "independent training examples, PPO's are correlated transitions); "
                "use a client-level mechanism instead, e.g. privacy='laplace' or "
                "'dp-fedavg-fixed'"
            )
        start_step = int(local.state.get(TIMESTEPS_KEY, 0))
        architecture = parameter_shapes(model)
        kept = local.state.get(OPTIMIZER_PARAMS_KEY) == architecture
        config = dataclasses.replace(
            self.config,
            local_steps=self.planet_steps[partition.planet],
            lr=self.planet_rates[partition.planet],
        )
        result = train_ppo(
            model, partition, config, seed=local.seed,
            proximal_mu=local.proximal_mu, start_step=start_step,
            optimizer_state=local.state_tensors if kept else None,
            server_round=local.server_round,
        )  # fmt: skip
        local.state[TIMESTEPS_KEY] = start_step + result.timesteps
        local.state_tensors.clear()
        local.state.pop(OPTIMIZER_PARAMS_KEY, None)
        if result.optimizer_state:
            local.state_tensors.update(result.optimizer_state)
            local.state[OPTIMIZER_PARAMS_KEY] = architecture
        if local.artifacts_dir is not None:
            self._round_log(partition, local, result).save(local.artifacts_dir)
        rewards = result.log.episode_rewards
        values = result.train_values
        rollouts = result.timesteps // self.config.rollout_size
        # SB3 counts the epochs of a PPO object's whole life; ours lives one round.
        epochs = values.get("train/n_updates")
        defined = {  # None: undefined this round (no episode ended, no PPO update ran)
            TRAIN_LOSS: values.get("train/loss"),
            TRAIN_REWARD: float(np.mean(rewards)) if rewards else None,
            TRAIN_ENTROPY_LOSS: values.get("train/entropy_loss"),
            TRAIN_APPROX_KL: values.get("train/approx_kl"),
            TRAIN_LEARNING_RATE: values.get("train/learning_rate"),  # of the last update
            TRAIN_EPOCHS: epochs / rollouts if epochs is not None and rollouts else None,
            TRAIN_SECONDS: result.learn_seconds,  # SB3's own work, against the round's wall time
        }
        # Left out rather than sent as NaN: the server rejects a reply with a non-finite
        # metric, so a round too short to end an episode would aggregate nothing.
        return {
            NUM_EXAMPLES: result.timesteps,
            TRAIN_EPISODES: len(rewards),
            **{k: float(v) for k, v in defined.items() if v is not None},
        }

    def _round_log(
        self, client: ClientEnv, local: LocalTraining, result: LocalPPOResult
    ) -> ClientRoundLog:
        log = result.log
        return ClientRoundLog(
            label=client.label,
            planet=client.planet,
            gravity=client.gravity,
            wind_power=client.wind_power,
            partition_id=local.partition_id,
            server_round=local.server_round,
            rollout_size=self.config.rollout_size,
            episode_rewards=log.episode_rewards,
            episode_lengths=log.episode_lengths,
            episode_end_steps=log.episode_end_steps,
            weight_steps=log.weight_steps,
            weights=log.weights,
        )

    def eval_seeds(self, index: int) -> list[int]:
        """Seeds of the ``ppo.eval-episodes`` evaluation episodes on the environment at
        table position ``index``: drawn from the run seed and ``index`` only, so every
        round (and every strategy run with the same seed) plays the same episodes."""
        stream = np.random.SeedSequence([self.seed, EVAL_STREAM, index])
        return [int(s) for s in stream.generate_state(self.eval_episodes)]

    def evaluate(
        self, model: torch.nn.Module, data: ClientEnv | Sequence[ClientEnv]
    ) -> dict[str, float]:
        """``ppo.eval-episodes`` episodes per environment, acting as ``ppo.eval-policy``
        says (most likely or sampled actions).

        ``data`` is a client's environment (federated evaluation) or several
        (central evaluation: the metrics over all episodes plus, per planet,
        ``eval-reward-<planet>``, ``eval-reward-std-<planet>`` and the mean's standard
        error ``eval-reward-se-<planet>``). The environment at table position ``i``
        (position in ``data`` for a sequence) plays the episodes of
        ``eval_seeds`` ``(i)``: results are reproducible and rounds comparable.
        """
        if isinstance(data, ClientEnv):
            index = self.clients.index(data) if data in self.clients else 0
            return episode_stats(*self._episodes(model, data, index))
        if not data or not all(isinstance(env, ClientEnv) for env in data):
            raise TypeError("evaluate() takes a ClientEnv or a non-empty sequence of them")
        rewards, lengths = [], []
        by_planet: dict[str, tuple[list[float], list[int]]] = defaultdict(lambda: ([], []))
        for index, env in enumerate(data):
            env_rewards, env_lengths = self._episodes(model, env, index)
            rewards += env_rewards
            lengths += env_lengths
            by_planet[env.planet][0].extend(env_rewards)
            by_planet[env.planet][1].extend(env_lengths)
        metrics = episode_stats(rewards, lengths)
        for planet, (planet_rewards, planet_lengths) in by_planet.items():
            stats = episode_stats(planet_rewards, planet_lengths)
            for key in (EVAL_REWARD, EVAL_REWARD_STD, EVAL_REWARD_SE):
                if key in stats:
                    metrics[f"{key}-{planet}"] = stats[key]
        return metrics

    def _episodes(
        self, model: torch.nn.Module, env: ClientEnv, index: int
    ) -> tuple[list[float], list[int]]:
        return evaluate_episodes(
            model, env, self.eval_seeds(index), stochastic=self.eval_stochastic
        )
