"""The clients of federated PPO on LunarLander (the PPO study, "Environment Configurations"):
one LunarLander-v3 environment per client, on the moon, the earth or mars.

The PPO study's ``experiment.py`` starts from three base clients (one per planet, wind
power 0.5) and ``add_derived_tasks`` adds ``num_to_add_per_task`` = 10 clients per
planet with a random wind power in [0, 15]: 33 clients. ``client_table`` builds
that table reproducibly from the run seed; a real SuperNode may instead describe its
own environment in its ``node_config`` (``client_from_node_config``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from config.options import ConfigError

ENV_ID = "LunarLander-v3"
PLANETS: dict[str, float] = {"moon": -1.6, "earth": -9.8, "mars": -3.73}  # gravity, m/s^2
GRAVITY_RANGE = (-12.0, 0.0)  # gymnasium asserts -12 < gravity < 0
WIND_POWER_RANGE = (0.0, 20.0)  # gymnasium's recommended range
TURBULENCE_POWER_RANGE = (0.0, 2.0)  # gymnasium's recommended range
# Stream constant of the derived clients' wind draws (distinct from any (round, partition)
# stream of ``tasks.base.local_seed``, whose second entry is a round number >= 1).
CLIENT_TABLE_STREAM = 0x11AA_D3E5
LABEL_PATTERN = re.compile(r"[A-Za-z0-9._-]+")  # labels name the clients' log files


@dataclass(frozen=True)
class ClientEnv:
    """One client's environment: LunarLander-v3 with its planet's physics.

    Attributes
    ----------
    label : str
        Unique client label, e.g. ``moon-00`` (names its log files).
    planet : str
        ``moon``, ``earth`` or ``mars``.
    gravity : float
        Gravity in m/s^2 (negative), in gymnasium's range (-12, 0).
    wind_power : float
        Maximum wind force; 0 disables wind.
    enable_wind : bool
        Whether wind (and turbulence) act: ``wind_power > 0``.
    turbulence_power : float
        Maximum rotational turbulence (only with wind).
    """

    label: str
    planet: str
    gravity: float
    wind_power: float
    enable_wind: bool
    turbulence_power: float

    def env_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``gymnasium.make(ENV_ID, ...)`` for this environment."""
        kwargs = asdict(self)
        del kwargs["label"], kwargs["planet"]
        return kwargs


def _client(
    label: str, planet: str, gravity: float, wind_power: float, turbulence_power: float
) -> ClientEnv:
    wind = float(wind_power)
    return ClientEnv(label, planet, float(gravity), wind, wind > 0, float(turbulence_power))


def client_table(
    seed: int,
    derived_per_base: int = 10,
    base_wind_power: float = 0.5,
    max_wind_power: float = 15.0,
    turbulence_power: float = 1.5,
) -> tuple[ClientEnv, ...]:
    """The clients of a run: 3 base clients, then ``derived_per_base`` per planet.

    Base clients ``moon-00``, ``earth-00``, ``mars-00`` have wind power
    ``base_wind_power``; derived clients ``<planet>-01`` ... (moon's first, then the
    earth's, then mars') draw theirs uniformly from [0, ``max_wind_power``] with a
    generator seeded by ``SeedSequence([seed, CLIENT_TABLE_STREAM])``.
    """
    if derived_per_base < 0:
        raise ValueError(f"derived_per_base must be >= 0, got {derived_per_base}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, CLIENT_TABLE_STREAM]))
    base = [
        _client(f"{planet}-00", planet, gravity, base_wind_power, turbulence_power)
        for planet, gravity in PLANETS.items()
    ]
    derived = [
        _client(f"{planet}-{i:02d}", planet, gravity, rng.uniform(0.0, max_wind_power),
                turbulence_power)
        for planet, gravity in PLANETS.items()
        for i in range(1, derived_per_base + 1)
    ]  # fmt: skip
    return (*base, *derived)


def _number(node_config: Mapping[str, Any], key: str, default: float) -> float:
    value = node_config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"node config '{key}' must be a finite number, got {value!r}")
    return float(value)


def client_from_node_config(
    node_config: Mapping[str, Any],
    *,
    default_wind_power: float = 0.5,
    turbulence_power: float = 1.5,
) -> ClientEnv | None:
    """The environment a SuperNode describes in its ``node_config``, if it does.

    Keys: ``planet`` (required: moon, earth, mars), ``gravity`` (default: the
    planet's; in (-12, 0)), ``wind-power`` (default ``default_wind_power``; in
    [0, 20]) and ``label`` (default ``<planet>-node-<partition-id>``). Returns
    ``None`` when ``planet`` is absent (the client then takes its table entry).
    """
    if "planet" not in node_config:
        return None
    planet = node_config["planet"]
    if planet not in PLANETS:
        raise ConfigError(
            f"node config 'planet' = {planet!r} is not valid; valid values: "
            + ", ".join(repr(p) for p in PLANETS)
        )
    gravity = _number(node_config, "gravity", PLANETS[planet])
    low, high = GRAVITY_RANGE
    if not low < gravity < high:
        raise ConfigError(
            f"node config 'gravity' = {gravity!r} is out of range; "
            f"valid range: ({low:g}, {high:g})"
        )
    wind = _number(node_config, "wind-power", default_wind_power)
    low, high = WIND_POWER_RANGE
    if not low <= wind <= high:
        raise ConfigError(
            f"node config 'wind-power' = {wind!r} is out of range; "
            f"valid range: [{low:g}, {high:g}]"
        )
    suffix = f"-{int(node_config['partition-id']):02d}" if "partition-id" in node_config else ""
    label = str(node_config.get("label", f"{planet}-node{suffix}"))
    if not LABEL_PATTERN.fullmatch(label):
        raise ConfigError(
            f"node config 'label' = {label!r} is not valid; use letters, digits, '.', '_', '-'"
        )
    return _client(label, planet, gravity, wind, turbulence_power)


# The gravity feature is gravity / GRAVITY_SCALE: moon -0.16, mars -0.373, earth -0.98,
# the scale of LunarLander's own observations (positions and velocities of order 1).
GRAVITY_SCALE = 10.0


class GravityObservation(gym.ObservationWrapper):
    """LunarLander's 8 observations plus a 9th, the environment's gravity / 10 m/s^2.

    LunarLander's observation (position, velocity, angle, angular velocity, leg
    contacts) carries no acceleration, so a Markov policy cannot tell the moon from
    the earth: one policy for all planets must fire its main engine as if it did not
    know how fast it falls. Every lander knows its planet's gravity; given it as an
    input, one federated policy can act per planet (a contextual policy, as in
    multi-task RL) while every parameter is still shared.
    """

    def __init__(self, env: gym.Env, gravity: float) -> None:
        super().__init__(env)
        box = env.observation_space
        if not isinstance(box, gym.spaces.Box) or box.shape is None or len(box.shape) != 1:
            raise TypeError(f"GravityObservation needs a flat Box observation, got {box}")
        self._feature = np.array([gravity / GRAVITY_SCALE], dtype=box.dtype)
        # One space on every planet (gymnasium's gravity range), so that one policy fits all.
        low, high = (bound / GRAVITY_SCALE for bound in GRAVITY_RANGE)
        self.observation_space = gym.spaces.Box(
            low=np.append(box.low, low).astype(box.dtype),
            high=np.append(box.high, high).astype(box.dtype),
            dtype=box.dtype,
        )

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return np.concatenate([observation, self._feature])


def make_env(client: ClientEnv, *, observe_gravity: bool = False, **kwargs: Any) -> gym.Env:
    """A fresh LunarLander-v3 with ``client``'s physics (``kwargs``: e.g. render_mode);
    with ``observe_gravity`` its observation ends with the gravity feature
    (``GravityObservation``)."""
    env = gym.make(ENV_ID, **client.env_kwargs(), **kwargs)
    return GravityObservation(env, client.gravity) if observe_gravity else env
