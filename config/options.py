"""Declarative run-config options: one spec per key, parsed and validated in one place.

Flower hands every process the run-config as a flat ``dict[str, bool | int | float |
str]`` (nested TOML tables flattened with dots, e.g. ``"fedprox.mu"``). Each part of
the app (top level, strategies, privacy, each task) declares its keys as a tuple of
``Option``; ``parse_options`` turns the flat dict into plain Python values,
checking type, range and choices, and naming the key and the valid values on error.

This module is the bottom config layer (``config/``): every package may import it,
and it imports nothing of the app or of Flower.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from config.renamed import renamed_message

Scalar = bool | int | float | str


class ConfigError(ValueError):
    """A run-config value is unknown, of the wrong type, or out of range."""


@dataclass(frozen=True)
class Option:
    """One run-config key.

    Parameters
    ----------
    key : str
        The flat, kebab-case key as written in ``pyproject.toml`` (``"fedprox.mu"``).
    default : bool | int | float | str
        Default value; its type is the option's type (an ``int`` given for a
        ``float`` option is accepted and converted).
    help : str
        One line for the README table.
    choices : tuple of str, optional
        Valid values of a string option.
    low, high : float, optional
        Inclusive bounds of a numeric option.
    low_open, high_open : bool
        Make the corresponding bound exclusive.
    """

    key: str
    default: Scalar
    help: str
    choices: tuple[str, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def parse(self, value: Any) -> Scalar:
        """Return ``value`` converted to this option's type, or raise ConfigError."""
        kind = type(self.default)
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"'{self.key}' must be true or false, got {value!r}")
            return value
        if kind is str:
            if not isinstance(value, str):
                raise ConfigError(f"'{self.key}' must be a string, got {value!r}")
            if self.choices is not None and value not in self.choices:
                raise ConfigError(
                    f"'{self.key}' = {value!r} is not valid; valid values: "
                    + ", ".join(repr(c) for c in self.choices)
                )
            return value
        # Numeric: reject bools (True is an int in Python) and non-integral ints.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"'{self.key}' must be a number, got {value!r}")
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ConfigError(f"'{self.key}' must be an integer, got {value!r}")
            value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(f"'{self.key}' must be finite, got {value!r}")
        self._check_range(value)
        return value

    def read(self, run_config: Mapping[str, Any]) -> Scalar:
        """This key's value in a flat run-config as Flower hands it, parsed (its
        default where the key is absent): how a part reads a single declared key."""
        return self.parse(run_config[self.key]) if self.key in run_config else self.default

    def _check_range(self, value: float) -> None:
        too_low = self.low is not None and (
            value < self.low or (self.low_open and value == self.low)
        )
        too_high = self.high is not None and (
            value > self.high or (self.high_open and value == self.high)
        )
        if too_low or too_high:
            raise ConfigError(
                f"'{self.key}' = {value!r} is out of range; valid range: " + self.range_text()
            )

    def range_text(self) -> str:
        """Human-readable valid values, for errors and the README table."""
        if self.choices is not None:
            return ", ".join(f"`{c}`" for c in self.choices)
        if self.low is None and self.high is None:
            return "any " + type(self.default).__name__
        left = "(" if self.low_open or self.low is None else "["
        right = ")" if self.high_open or self.high is None else "]"
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        return f"{left}{low}, {high}{right}"


def parse_options(run_config: Mapping[str, Any], options: Iterable[Option]) -> dict[str, Scalar]:
    """Parse the given options out of ``run_config`` (missing keys take defaults)."""
    return {
        opt.key: opt.parse(run_config[opt.key]) if opt.key in run_config else opt.default
        for opt in options
    }


def unknown_keys_message(
    run_config_keys: Iterable[str],
    known: Iterable[str],
    removed: Mapping[str, str] | None = None,
) -> str | None:
    """One line naming every key of ``run_config_keys`` not in ``known`` (a renamed key,
    :mod:`config.renamed`, alone with its new name; ``removed``: keys that existed once,
    with what to use instead; else the closest known keys), or None if all are known."""
    known = set(known)
    unknown = sorted(set(run_config_keys) - known)
    message = renamed_message(unknown)
    if message or not unknown:
        return message
    hints = []
    for key in unknown:
        if removed and key in removed:
            hints.append(f"'{key}' (removed: {removed[key]})")
            continue
        close = difflib.get_close_matches(key, sorted(known), n=3)
        hints.append(f"'{key}'" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    return "unknown run-config key(s): " + "; ".join(hints)


def check_unknown_keys(
    run_config: Mapping[str, Any],
    options: Iterable[Option],
    removed: Mapping[str, str] | None = None,
) -> None:
    """Raise ConfigError naming every key of ``run_config`` that no option declares
    (:func:`unknown_keys_message`)."""
    message = unknown_keys_message(run_config, (opt.key for opt in options), removed)
    if message:
        raise ConfigError(message)


def to_field_names(values: Mapping[str, Scalar], prefix: str = "") -> dict[str, Scalar]:
    """Map ``{"vision.batch-size": 32}`` to ``{"batch_size": 32}`` for a dataclass."""
    out = {}
    for key, value in values.items():
        name = key[len(prefix) :] if prefix and key.startswith(prefix) else key
        out[name.replace("-", "_").replace(".", "_")] = value
    return out
