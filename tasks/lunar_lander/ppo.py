"""Local PPO (Schulman et al., 2017, "Proximal Policy Optimization Algorithms") with
Stable-Baselines3, as the PPO study trains each client: ``PPO("MlpPolicy", ...)`` on
``n_envs`` copies of the client's environment, plus what federating it needs.

Design notes: ``docs/notes.md``, ``tasks.lunar_lander.ppo``.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any, ClassVar, NamedTuple

import gymnasium as gym
import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnv, VecEnvWrapper
from stable_baselines3.common.vec_env.base_vec_env import VecEnvObs, VecEnvStepReturn

from config.settings import Settings, setting
from tasks.lunar_lander.clients import (
    ENV_ID,
    PLANETS,
    TURBULENCE_POWER_RANGE,
    WIND_POWER_RANGE,
    ClientEnv,
    GravityObservation,
    make_env,
)
from tasks.proximal import snapshot_parameters

POLICY = "MlpPolicy"
VEC_ENVS = {"dummy": DummyVecEnv, "subproc": SubprocVecEnv}
LR_SCHEDULES = ("constant", "linear")
EVAL_POLICIES = ("deterministic", "stochastic")
DEFAULT_NET_WIDTH = 64  # SB3's MlpPolicy for PPO: two hidden layers of 64, policy and value


WIND_LOW, WIND_HIGH = WIND_POWER_RANGE
TURBULENCE_LOW, TURBULENCE_HIGH = TURBULENCE_POWER_RANGE


def _planet_steps(planet: str) -> Any:
    """``ppo.local-steps-<planet>``: that planet's clients' env steps per round."""
    return setting(
        0,
        f"Env steps per round of each {planet} client (its base and derived ones; "
        "whole rollouts); 0: ppo.local-steps. Shifts the budget between planets.",
        low=0,
    )


def _planet_rate(planet: str) -> Any:
    """``ppo.lr-<planet>``: that planet's clients' learning rate."""
    return setting(
        0.0,
        f"PPO's Adam learning rate on each {planet} client (its base and derived "
        "ones); 0: ppo.lr. ppo.lr-schedule decays it alike.",
        low=0.0,
    )


@dataclass(frozen=True)
class PPOConfig(Settings):
    """The lunar lander's run-config (``ppo.*``), each key declared once as a field
    (default, range, help); the task reads its options as one instance, ``device``
    resolved and ``num_rounds`` filled in. One client round's local PPO reads it too."""

    PREFIX: ClassVar[str] = "ppo"

    local_steps: int = setting(
        50000,
        "Env steps per client per round (whole rollouts: rounded up to n-steps x n-envs).",
        low=1,
    )
    local_steps_moon: int = _planet_steps("moon")
    local_steps_earth: int = _planet_steps("earth")
    local_steps_mars: int = _planet_steps("mars")
    n_envs: int = setting(4, "Parallel copies of the client's environment.", low=1)
    vec_env: str = setting(
        "dummy", "Vectorisation: `dummy` (one process) or `subproc`.", choices=tuple(VEC_ENVS)
    )
    lr: float = setting(3e-4, "PPO's Adam learning rate.", low=0.0, low_open=True)
    lr_moon: float = _planet_rate("moon")
    lr_earth: float = _planet_rate("earth")
    lr_mars: float = _planet_rate("mars")
    n_steps: int = setting(2048, "Steps per environment copy per PPO rollout.", low=1)
    batch_size: int = setting(64, "PPO minibatch size.", low=1, low_open=True)
    n_epochs: int = setting(10, "PPO passes over each rollout.", low=1)
    gamma: float = setting(0.99, "Discount factor.", low=0.0, high=1.0)
    gae_lambda: float = setting(0.95, "GAE lambda.", low=0.0, high=1.0)
    clip_range: float = setting(0.2, "PPO's probability-ratio clip range.", low=0.0, low_open=True)
    ent_coef: float = setting(0.0, "Entropy bonus coefficient.", low=0.0)
    vf_coef: float = setting(0.5, "Value loss coefficient.", low=0.0)
    max_grad_norm: float = setting(
        0.5, "Gradient norm clip of each PPO update.", low=0.0, low_open=True
    )
    reward_scale: float = setting(
        1.0,
        "PPO learns from the rewards times this (value targets shrink with it; "
        "logged and evaluated rewards stay raw).",
        low=0.0,
        low_open=True,
    )
    target_kl: float = setting(
        0.0,
        "Stop a rollout's update epochs early once a minibatch's approximate KL from "
        "the rollout's policy exceeds 1.5x this (SB3's target_kl; 0: never); the "
        "epochs run per rollout are logged as `train-epochs`.",
        low=0.0,
    )
    check_freq: int = setting(2000, "Env steps between a client's logged weight snapshots.", low=1)
    eval_episodes: int = setting(
        20,
        "Evaluation episodes per environment (the same seeded episodes every round; "
        "standard error needs 2 or more).",
        low=1,
    )
    eval_policy: str = setting(
        "deterministic",
        "How evaluation episodes act: `deterministic` (the most likely action, SB3's "
        "evaluate_policy default) or `stochastic` (actions sampled from the policy, "
        "as PPO trains it; seeded per episode).",
        choices=EVAL_POLICIES,
    )
    derived_per_base: int = setting(
        10,
        "Derived clients per planet (random wind); the run has 3 + 3 x this many clients.",
        low=0,
    )
    base_wind_power: float = setting(
        0.5, "Wind power of the three base clients (0: no wind).", low=WIND_LOW, high=WIND_HIGH
    )
    max_wind_power: float = setting(
        15.0, "Derived clients draw their wind power from [0, this].", low=WIND_LOW, high=WIND_HIGH
    )
    turbulence_power: float = setting(
        1.5,
        "Rotational turbulence of every windy environment.",
        low=TURBULENCE_LOW,
        high=TURBULENCE_HIGH,
    )
    observe_gravity: bool = setting(
        False,
        "The policy also observes its environment's gravity (a 9th input, gravity / 10): "
        "one shared policy can then act per planet.",
    )
    net_width: int = setting(
        DEFAULT_NET_WIDTH,
        "Units in each of the two hidden layers of the policy and of the value network "
        "(SB3's MlpPolicy: 64).",
        low=1,
    )
    keep_optimizer: bool = setting(
        False,
        "Keep each client's PPO Adam moments across its rounds (in its persistent "
        "state, never sent; reset when the policy's architecture changes).",
    )
    lr_schedule: str = setting(
        "constant",
        "`constant`, or `linear`: the learning rate decays from ppo.lr at "
        "round 1 to 0 at the end of round num-server-rounds, following the server's "
        "round (every client sampled in a round trains with the same rates).",
        choices=LR_SCHEDULES,
    )
    device: str = setting(
        "cpu", "Device of local PPO; `auto`: cuda when available.", choices=("cpu", "cuda", "auto")
    )
    torch_threads: int = setting(
        1,
        "torch's intra-op threads while a client's PPO learns; 0: as many as its "
        "process has (under Ray, the ClientApp's num-cpus). One by default: a second "
        "thread speeds up SB3's small MLPs little or not at all, and spins on the core "
        "the simulation's own processes need (studies/lunar-lands/README.md, "
        '"Throughput").',
        low=0,
    )

    # Derived by the task, not a key of its own:
    num_rounds: int = 1
    """``num-server-rounds``: the run's length, which ``linear`` decays over."""

    @property
    def rollout_size(self) -> int:
        """Env steps per PPO rollout, ``n_steps * n_envs`` (derived)."""
        return self.n_steps * self.n_envs

    def learning_rate_at(self, server_round: int) -> float | Callable[[float], float]:
        """SB3's ``learning_rate`` in ``server_round``: ``ppo.lr``, or under
        ``linear`` the schedule ``linear_over_rounds`` for that round."""
        if self.lr_schedule == "constant":
            return self.lr
        return partial(
            linear_over_rounds, initial=self.lr,
            server_round=server_round, num_rounds=self.num_rounds,
        )  # fmt: skip

    def ppo_kwargs(self, server_round: int = 1) -> dict[str, Any]:
        """The hyperparameters SB3's ``PPO`` constructor takes in ``server_round``."""
        return {
            "learning_rate": self.learning_rate_at(server_round),
            "n_steps": self.n_steps,
            "batch_size": self.batch_size,
            "n_epochs": self.n_epochs,
            "gamma": self.gamma,
            "gae_lambda": self.gae_lambda,
            "clip_range": self.clip_range,
            "ent_coef": self.ent_coef,
            "vf_coef": self.vf_coef,
            "max_grad_norm": self.max_grad_norm,
            "target_kl": self.target_kl or None,
        }


def linear_over_rounds(
    progress_remaining: float, *, initial: float, server_round: int, num_rounds: int
) -> float:
    """The learning rate of a linear decay from ``initial`` at the start of round 1 to 0
    at the end of round ``num_rounds``, at SB3's ``progress_remaining`` (1 -> 0 over
    one ``learn()`` call, i.e. over one client's local training) in ``server_round``.

    SB3's own schedules span one ``learn()`` call; a client here calls it once per
    round it is sampled in, so the decay follows the federation's round instead: every
    client sampled in round r trains with the same rates, whatever rounds it missed.
    """
    if not 1 <= server_round <= num_rounds:
        raise ValueError(
            f"round {server_round} is outside the run's {num_rounds} rounds "
            "(ppo.lr-schedule='linear' decays over num-server-rounds)"
        )
    done = (server_round - 1 + (1.0 - progress_remaining)) / num_rounds
    return initial * (1.0 - done)


def _constant_learning_rate(_progress_remaining: float) -> float:
    return 3e-4  # only sizes the policy's own (unused) optimizer; PPO builds its own


@lru_cache(maxsize=2)
def policy_spaces(observe_gravity: bool = False) -> tuple[gym.Space, gym.Space]:
    """LunarLander-v3's observation and action spaces (the same on every planet), the
    observation with the gravity input when ``observe_gravity``."""
    env = gym.make(ENV_ID)
    if observe_gravity:
        env = GravityObservation(env, PLANETS["earth"])  # the space is the same for any
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def observes_gravity(policy: ActorCriticPolicy) -> bool:
    """Whether ``policy`` was built for the gravity input (``build_policy(...,
    observe_gravity=True)``); raises for a policy of neither LunarLander space."""
    for observe in (False, True):
        if policy.observation_space == policy_spaces(observe)[0]:
            return observe
    raise ValueError(f"not a LunarLander policy: observation space {policy.observation_space}")


def build_policy(
    seed: int, *, observe_gravity: bool = False, net_width: int = DEFAULT_NET_WIDTH
) -> ActorCriticPolicy:
    """SB3's MlpPolicy for LunarLander, weights drawn from ``seed`` (global RNG untouched):
    policy and value networks of two hidden layers of ``net_width`` units each;
    ``observe_gravity``: its observation ends with the environment's gravity."""
    if net_width < 1:
        raise ValueError(f"net_width must be >= 1, got {net_width}")
    observation_space, action_space = policy_spaces(observe_gravity)
    net_arch = {"pi": [net_width, net_width], "vf": [net_width, net_width]}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return PPO.policy_aliases[POLICY](
            observation_space, action_space, _constant_learning_rate, net_arch=net_arch
        )


def flatten_state_dict(state_dict: dict[str, torch.Tensor]) -> np.ndarray:
    """All tensors of ``state_dict``, flattened in key order, as one float32 vector."""
    return np.concatenate(
        [t.detach().cpu().reshape(-1).to(torch.float32).numpy() for t in state_dict.values()]
    )


def unflatten_state_dict(
    flat: np.ndarray, reference: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The inverse of ``flatten_state_dict``: ``flat`` cut into ``reference``'s
    keys, shapes and dtypes (e.g. a logged weight snapshot back into a policy)."""
    sizes = [t.numel() for t in reference.values()]
    if flat.ndim != 1 or flat.size != sum(sizes):
        raise ValueError(f"{flat.size} weights do not fill a state dict of {sum(sizes)}")
    pieces = np.split(flat, np.cumsum(sizes)[:-1])
    return {
        key: torch.from_numpy(np.ascontiguousarray(piece)).reshape(t.shape).to(t.dtype)
        for (key, t), piece in zip(reference.items(), pieces, strict=True)
    }


def _add_proximal_gradient(
    param: torch.Tensor, anchor: torch.Tensor, mu: float, grad: torch.Tensor
) -> torch.Tensor:
    return grad + mu * (param.detach() - anchor)


@contextmanager
def proximal_gradient_hooks(module: torch.nn.Module, mu: float) -> Iterator[None]:
    """While active, every gradient of ``module``'s trainable parameters gets
    ``mu * (w - w_global)`` added, ``w_global`` being the weights on entry.

    That is exactly the gradient of the FedProx term ``(mu/2)||w - w_global||^2``
    (Li et al., 2020, eq. 2), so a backward pass of PPO's loss yields the gradient of
    PPO's loss + the proximal term. Tensor hooks run inside ``loss.backward()``,
    i.e. before SB3 clips the gradient norm and steps Adam, just as if the term were
    part of SB3's loss; a callback runs between rollouts and could not do this. A
    leaf's hook fires once per backward pass with its summed gradient; every
    parameter of the actor-critic gets a gradient from PPO's loss, so every one gets
    the term. ``mu <= 0`` registers nothing.
    """
    if mu <= 0:
        yield
        return
    params = [p for p in module.parameters() if p.requires_grad]
    anchors = snapshot_parameters(module)
    handles = [
        p.register_hook(partial(_add_proximal_gradient, p, anchor, mu))
        for p, anchor in zip(params, anchors, strict=True)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class WeightStorageCallback(BaseCallback):
    """The PPO study's ``WeightStorageCallback``: every finished episode and a snapshot of
    the policy weights every ``check_freq`` env steps, plus the trained weights.

    Steps are the client's cumulative env steps: ``start_step`` (steps of earlier
    rounds) + SB3's ``num_timesteps`` (all env copies). A snapshot is taken each time
    the cumulative count passes a multiple of ``check_freq``, and once more when
    training ends (same step as the last one): PPO changes the weights only after
    each rollout, so with ``check_freq`` below the rollout size the in-rollout
    snapshots repeat the weights the rollout acted with, and without the last one
    the weights a client uploads would never be recorded (a departure from the PPO study).
    """

    def __init__(self, check_freq: int, start_step: int = 0) -> None:
        super().__init__(verbose=0)
        self.check_freq = check_freq
        self.start_step = start_step
        self._last_step = start_step
        self.episode_rewards: list[float] = []
        self.episode_lengths: list[int] = []
        self.episode_end_steps: list[int] = []
        self.weight_steps: list[int] = []
        self.weights: list[np.ndarray] = []

    def _on_step(self) -> bool:
        step = self.start_step + self.num_timesteps
        for info in self.locals["infos"]:
            episode = info.get("episode")  # set by the Monitor wrapper at episode end
            if episode is not None:
                self.episode_rewards.append(float(episode["r"]))
                self.episode_lengths.append(int(episode["l"]))
                self.episode_end_steps.append(step)
        if step // self.check_freq > self._last_step // self.check_freq:
            self.weight_steps.append(step)
            self.weights.append(flatten_state_dict(self.model.policy.state_dict()))
        self._last_step = step
        return True

    def _on_training_end(self) -> None:
        self.weight_steps.append(self.start_step + self.num_timesteps)
        self.weights.append(flatten_state_dict(self.model.policy.state_dict()))


OPTIMIZER_PREFIX = "adam"
ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")  # torch.optim.Adam's per-parameter state


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Adam's per-parameter state as ``adam.<parameter index>.<name>`` tensors (on CPU).

    The hyperparameters (``param_groups``) are left out: SB3 sets the learning rate
    before every update and fixes the rest when it builds the optimizer.
    """
    return {
        f"{OPTIMIZER_PREFIX}.{index}.{name}": tensor.detach().cpu().clone()
        for index, entries in optimizer.state_dict()["state"].items()
        for name, tensor in entries.items()
    }


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> bool:
    """Load ``optimizer_tensors``' output into ``optimizer``; returns False, loading
    nothing, when they do not fit its parameters (another count or shape; the task
    also compares the parameters' names, ``parameter_shapes``)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    expected = {
        f"{OPTIMIZER_PREFIX}.{index}.{name}" for index in range(len(params)) for name in ADAM_STATE
    }
    if set(tensors) != expected:
        return False
    state = {}
    for index, param in enumerate(params):
        entries = {name: tensors[f"{OPTIMIZER_PREFIX}.{index}.{name}"] for name in ADAM_STATE}
        if any(entries[name].shape != param.shape for name in ("exp_avg", "exp_avg_sq")):
            return False
        state[index] = entries
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return True


class ScaledReward(VecEnvWrapper):
    """PPO learns from the rewards times ``scale``; the episodes' returns that the
    ``Monitor`` inside each env copy reports (``info["episode"]``) stay raw.

    Why a fixed scale: LunarLander's returns reach hundreds, so SB3's value loss is
    large and its gradient dwarfs the policy's (a norm of 100-650 against 0.3-0.5 in
    the first 65 k steps on the Moon at gamma 0.999). ``max_grad_norm`` clips their
    joint norm, so the policy's part of every step shrinks with the value error, by a
    factor that varies from minibatch to minibatch (Adam undoes a constant factor, not
    a varying one). Advantages are normalised per minibatch, so the
    policy loss does not depend on the scale; the value loss does, by its square.
    SB3's ``VecNormalize(norm_reward=True)`` divides by a running estimate instead, which
    differs between clients (the Moon's returns are not the Earth's) and would put each
    client's value network on its own scale before the server averages them; one
    fixed scale keeps every client's value network in the same units. SB3 ships no
    fixed-scale wrapper, hence these few lines.
    """

    def __init__(self, venv: VecEnv, scale: float) -> None:
        super().__init__(venv)
        self.scale = float(scale)

    def reset(self) -> VecEnvObs:
        return self.venv.reset()

    def step_wait(self) -> VecEnvStepReturn:
        obs, rewards, dones, infos = self.venv.step_wait()
        return obs, rewards * self.scale, dones, infos


def silent_logger() -> Logger:
    """A logger for SB3's ``PPO.set_logger`` that prints and writes nothing.

    Without one, every ``learn()`` call configures SB3's default logger, which makes a
    new empty ``SB3-<timestamp>`` folder under the system temp directory.
    """
    return Logger(folder=None, output_formats=[])


def training_env(client: ClientEnv, cfg: PPOConfig, *, seed: int, observe_gravity: bool) -> VecEnv:
    """The environments local PPO trains on: ``cfg.n_envs`` copies of ``client``'s
    (copy ``i`` seeded ``seed + i``, each inside its own ``Monitor``), observing gravity
    if ``observe_gravity``, their rewards times ``cfg.reward_scale`` (``ScaledReward``)."""
    env_fn = partial(make_env, client, observe_gravity=observe_gravity)
    if cfg.vec_env == "subproc":
        # SB3 starts its workers from multiprocessing's forkserver: preloaded with this
        # module (SB3, torch, the environments), the forkserver imports them once and each
        # round's workers fork with them, instead of each worker importing torch afresh.
        # Takes effect when this process's forkserver first starts.
        multiprocessing.set_forkserver_preload(["__main__", __name__])
    vec_env = make_vec_env(env_fn, n_envs=cfg.n_envs, seed=seed, vec_env_cls=VEC_ENVS[cfg.vec_env])
    return ScaledReward(vec_env, cfg.reward_scale) if cfg.reward_scale != 1.0 else vec_env


@dataclass
class LocalPPOResult:
    """What one round of local PPO produced (the policy itself is updated in place)."""

    timesteps: int
    """Env steps taken (whole rollouts, so possibly more than asked)."""
    train_values: dict[str, float]
    """SB3's ``train/*`` values of the last PPO update (``train/loss``, ...)."""
    log: WeightStorageCallback = field(repr=False)
    """Episodes and weight snapshots of the round."""
    optimizer_state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    """Adam's state after the round (``optimizer_tensors``); empty unless
    ``cfg.keep_optimizer``."""
    learn_seconds: float = 0.0
    """Wall-clock seconds in SB3's ``PPO.learn`` (rollouts and updates: what plain SB3
    does too), not building PPO and its environments or loading the weights."""


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` (0: left as they are), restored on exit."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def preserved_global_rngs(cuda: bool = False) -> Iterator[None]:
    """Restore Python's, numpy's and torch's global RNGs on exit (SB3 seeds them all)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if cuda else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def train_ppo(
    policy: torch.nn.Module,
    client: ClientEnv,
    cfg: PPOConfig,
    *,
    seed: int,
    proximal_mu: float = 0.0,
    start_step: int = 0,
    optimizer_state: dict[str, torch.Tensor] | None = None,
    server_round: int = 1,
) -> LocalPPOResult:
    """Train ``policy`` (in place) with ``cfg.local_steps`` env steps of PPO on ``client``.

    A fresh SB3 ``PPO`` (seeded with ``seed``; env copy ``i`` seeded ``seed + i``;
    the environments observe gravity if ``policy`` does; its networks are as wide as
    ``policy``'s) loads the received weights.
    Its Adam optimizer starts from zero moments, or, with ``cfg.keep_optimizer`` and a
    fitting ``optimizer_state`` (the client's own from its previous round), from that
    state. Optimizer state is never federated. The learning rate is
    ``cfg.learning_rate_at(server_round)``. PPO learns from the rewards times
    ``cfg.reward_scale`` (``ScaledReward``); the logged episodes stay raw.
    PPO learns on ``cfg.torch_threads`` torch threads.
    The environments are closed whatever happens; global RNGs and torch's thread count
    are restored on return.
    """
    vec_env = training_env(client, cfg, seed=seed, observe_gravity=observes_gravity(policy))
    try:
        with preserved_global_rngs(cuda=cfg.device == "cuda"), torch_threads(cfg.torch_threads):
            kwargs = cfg.ppo_kwargs(server_round)
            ppo = PPO(
                POLICY, vec_env, seed=seed, device=cfg.device, verbose=0,
                policy_kwargs={"net_arch": policy.net_arch}, **kwargs,
            )  # fmt: skip
            # No output formats: nothing printed; the last update's values stay in
            # name_to_value because SB3 dumps the logs before each update, not after.
            ppo.set_logger(silent_logger())
            ppo.policy.load_state_dict(policy.state_dict(), strict=True)
            if cfg.keep_optimizer and optimizer_state:
                load_optimizer_tensors(ppo.policy.optimizer, optimizer_state)
            log = WeightStorageCallback(cfg.check_freq, start_step)
            with proximal_gradient_hooks(ppo.policy, proximal_mu):
                started = time.perf_counter()
                ppo.learn(total_timesteps=cfg.local_steps, callback=log)
                learn_seconds = time.perf_counter() - started
        policy.load_state_dict(ppo.policy.state_dict(), strict=True)
    finally:
        vec_env.close()
    values = {
        key: float(value)
        for key, value in ppo.logger.name_to_value.items()
        if key.startswith("train/")
    }
    kept = optimizer_tensors(ppo.policy.optimizer) if cfg.keep_optimizer else {}
    return LocalPPOResult(
        timesteps=int(ppo.num_timesteps), train_values=values, log=log,
        optimizer_state=kept, learn_seconds=learn_seconds,
    )  # fmt: skip


def sample_actions(
    policy: ActorCriticPolicy, obs: np.ndarray, generators: Sequence[np.random.Generator]
) -> np.ndarray:
    """One action per row of ``obs``, drawn from ``policy``'s categorical action
    distribution with that row's generator (inverse CDF of one uniform draw each)."""
    with torch.no_grad():
        tensor, _ = policy.obs_to_tensor(obs)
        probs = policy.get_distribution(tensor).distribution.probs.cpu().numpy()
    cdf = np.cumsum(probs.astype(np.float64), axis=1)
    draws = np.array([g.random() for g in generators]) * cdf[:, -1]
    return np.minimum((cdf <= draws[:, None]).sum(axis=1), probs.shape[1] - 1)


# How an episode ended: LunarLander terminates with a last reward of -100 when the body
# touches the ground or the lander leaves the screen, of +100 when it comes to rest
# (anywhere); the time limit (1 000 steps) truncates an episode that does neither.
CRASHED, AT_REST, TIME_LIMIT = "crashed", "at-rest", "time-limit"
OUTCOMES = (CRASHED, AT_REST, TIME_LIMIT)


class Episodes(NamedTuple):
    """Per-episode results of ``play_episodes``, in the order of its seeds."""

    returns: list[float]
    lengths: list[int]
    outcomes: list[str]


def play_episodes(
    policy: ActorCriticPolicy,
    client: ClientEnv,
    seeds: Sequence[int],
    *,
    stochastic: bool = False,
) -> Episodes:
    """One episode of ``policy`` per seed in ``seeds``, on ``client``'s environment:
    its return, length and how it ended (``OUTCOMES``).

    Actions are the policy's most likely ones (``stochastic=False``, SB3's
    ``deterministic=True``), or sampled from its action distribution, the policy PPO
    trains and plays in its rollouts (``stochastic=True``). Sampled actions come from
    a generator per episode seeded by ``(seeds[k], 1)``, not from torch's global
    generator, so they too are reproducible.

    Episode ``k`` starts from ``reset(seed=seeds[k])``: its terrain, initial push and
    wind, and every random draw of its engines, follow from that seed and the
    policy's actions alone, so a policy evaluated twice plays the same episodes, and
    two policies evaluated with the same seeds face the same starts. (SB3's
    ``evaluate_policy`` seeds only the first reset: later episodes then depend on how
    many engine draws the earlier ones made, i.e. on the policy.) The episodes run in
    lockstep, one batched forward pass per step; each ends at termination or at
    the environment's time limit (1000 steps). The environments observe gravity if
    ``policy`` does.
    """
    observe = observes_gravity(policy)
    envs = [make_env(client, observe_gravity=observe) for _ in seeds]
    # One thread: a forward pass of this MLP on at most a few dozen observations is
    # microseconds of work, which more threads only slow down (22x measured while the
    # cores were busy with training: spinning OpenMP workers).
    # Eval mode once: SB3's predict sets it at every call, a walk over the policy's
    # modules that took a third of an evaluation's CPU.
    policy.set_training_mode(False)
    try:
        with torch_threads(1):
            starts = [env.reset(seed=int(seed))[0] for env, seed in zip(envs, seeds, strict=True)]
            obs = np.stack(starts)
            returns = np.zeros(len(envs))
            lengths = np.zeros(len(envs), dtype=np.int64)
            outcomes = [TIME_LIMIT] * len(envs)
            running = np.ones(len(envs), dtype=bool)
            samplers = [np.random.default_rng([int(seed), 1]) for seed in seeds]
            while running.any():
                playing = np.flatnonzero(running)
                if stochastic:
                    actions = sample_actions(policy, obs[playing], [samplers[i] for i in playing])
                else:  # what policy.predict(..., deterministic=True) returns
                    with torch.no_grad():
                        tensor, _ = policy.obs_to_tensor(obs[playing])
                        dist = policy.get_distribution(tensor)
                        actions = dist.get_actions(deterministic=True).cpu().numpy()
                for index, action in zip(playing, actions, strict=True):
                    obs[index], reward, terminated, truncated, _ = envs[index].step(int(action))
                    returns[index] += float(reward)
                    lengths[index] += 1
                    running[index] = not (terminated or truncated)
                    if terminated:  # LunarLander's last reward: -100 crashed, +100 at rest
                        outcomes[index] = CRASHED if reward < 0 else AT_REST
    finally:
        for env in envs:
            env.close()
    return Episodes([float(r) for r in returns], [int(n) for n in lengths], outcomes)


def evaluate_episodes(
    policy: ActorCriticPolicy,
    client: ClientEnv,
    seeds: Sequence[int],
    *,
    stochastic: bool = False,
) -> tuple[list[float], list[int]]:
    """Returns and lengths of ``play_episodes``."""
    episodes = play_episodes(policy, client, seeds, stochastic=stochastic)
    return episodes.returns, episodes.lengths
