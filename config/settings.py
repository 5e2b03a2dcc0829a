"""Settings a part of the app owns: one frozen dataclass per strategy or mechanism.

Each field is one run-config key (``PREFIX.field-name``) declared once with
:func:`setting` (default, help, range or choices); the ServerApp derives from these
classes the option list it validates, the ``pyproject.toml`` defaults and the docs'
run-config table (:mod:`server_app.config`), and each part reads its own settings
typed through :meth:`Typed.part`, never back by string. ``check`` refuses, with the key and
the valid values, combinations the part cannot run or cannot account for.

This module imports nothing of the app or of Flower (``strategies/`` never imports
``tasks/``, where :class:`config.options.Option` lives, so the metadata is plain).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar, Self, TypeVar

from config.options import Option, Scalar, parse_options


class SettingsError(ValueError):
    """A combination of valid values a part cannot run (the message names the keys)."""


def setting(
    default: Scalar,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> Any:
    """A dataclass field that is one run-config key, always ``PREFIX.field-name`` of
    its class (see the module docstring): one scheme, no per-field names."""
    spec = {"help": help, "choices": choices, "low": low, "high": high}
    spec |= {"low_open": low_open, "high_open": high_open}
    return field(default=default, metadata={"option": spec})


S = TypeVar("S", bound="Settings")


class Typed:
    """A run's parsed options, read typed: ``part(DPSettings).clip_norm``.

    Mixed into the frozen dataclasses that carry a run's ``options`` (the run-config,
    the strategy factories' settings, the checks' choice); each part's settings object
    is built once, on first use, and shared by every holder of the same ``parts`` and
    ``options`` (a copy with other ``options`` builds its own)."""

    options: Mapping[str, Scalar]
    parts: dict[tuple[type, int], tuple[Mapping[str, Scalar], Any]]

    def part(self, cls: type[S]) -> S:
        """The settings of part ``cls``, from ``options`` (its defaults for a key the
        options lack)."""
        # Keyed by the options object too (each entry holds it, so its id stays unique).
        key = (cls, id(self.options))
        if key not in self.parts:
            built = cls.from_options(ChainMap(self.options, cls.defaults()))  # type: ignore[arg-type]
            self.parts[key] = (self.options, built)
        return self.parts[key][1]


@dataclass(frozen=True)
class Choice(Typed):
    """What the parts' checks see of a run: the choices, the options and the task's
    traits (``traits``: what the chosen task supports; ``tasks_with``: the tasks with
    each trait, for the error message; ``head_only``, ``warm_start``: the task's own
    settings that other parts' checks depend on)."""

    strategy: str
    privacy: str
    task: str
    num_rounds: int
    options: Mapping[str, Scalar]
    traits: frozenset[str] = frozenset()
    tasks_with: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    head_only: bool = False  # the task trains and shares only its head (subspace.head-only)
    warm_start: int = 0  # the task's epochs on public data before round 1 (subspace.warm-start)
    parts: dict[tuple[type, int], tuple[Mapping[str, Scalar], Any]] = field(
        default_factory=dict, compare=False, repr=False
    )


@dataclass(frozen=True)
class RunOptions(Typed):
    """A run's parsed options alone, read typed (``RunOptions(cfg.options).part(...)``):
    for a reader that has the options but not the run's other choices."""

    options: Mapping[str, Scalar]
    parts: dict[tuple[type, int], tuple[Mapping[str, Scalar], Any]] = field(
        default_factory=dict, compare=False, repr=False
    )


class Settings:
    """Base of the parts' frozen settings dataclasses."""

    PREFIX: ClassVar[str]
    # The field values under which the part is off (its check skipped, nothing of it
    # built), e.g. SecAgg+'s ``{"enabled": False}``; empty: on whenever it is chosen.
    OFF: ClassVar[Mapping[str, Scalar]] = {}

    @classmethod
    def on_in(cls, run: Typed) -> bool:
        """Whether ``run`` turns this part on (a field differs from ``OFF``), read
        without building, and so checking, the part's other keys."""
        values = ChainMap(run.options, cls.defaults())
        return not cls.OFF or any(values[cls.key(k)] != off for k, off in cls.OFF.items())

    @classmethod
    def key(cls, name: str) -> str:
        """The run-config key of field ``name``."""
        return f"{cls.PREFIX}.{name.replace('_', '-')}"

    @classmethod
    def field_key(cls, f: Field) -> str:
        """The run-config key of dataclass field ``f``: ``PREFIX.field-name``."""
        return cls.key(f.name)

    @classmethod
    def specs(cls) -> list[tuple[str, Scalar, dict]]:
        """``(key, default, metadata)`` of every field, in declaration order."""
        return [
            (cls.field_key(f), f.default, f.metadata["option"])
            for f in fields(cls)  # type: ignore[arg-type]
            if "option" in f.metadata
        ]

    @classmethod
    def options(cls) -> tuple[Option, ...]:
        """The run-config options this part declares, in declaration order."""
        return tuple(Option(key, default, **spec) for key, default, spec in cls.specs())

    @classmethod
    def defaults(cls) -> dict[str, Scalar]:
        """Every key of this part with its declared default."""
        return {key: default for key, default, _ in cls.specs()}

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        """The settings of a run-config's parsed options (a field that is no key keeps
        its default)."""
        keyed = (f for f in fields(cls) if "option" in f.metadata)  # type: ignore[arg-type]
        return cls(**{f.name: options[cls.field_key(f)] for f in keyed})

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> Self:
        """The settings of a flat run-config as Flower hands it (each key parsed and
        range-checked, its default where absent): how a ClientApp reads its part's keys."""
        return cls.from_options(parse_options(run_config, cls.options()))

    def kwargs(self) -> dict[str, Any]:
        """Every keyed field by name: the constructor arguments of the part these
        settings configure (a registry builds it with ``Part(**settings.kwargs())``)."""
        keyed = (f for f in fields(self) if "option" in f.metadata)  # type: ignore[arg-type]
        return {f.name: getattr(self, f.name) for f in keyed}

    @staticmethod
    def check(choice: Choice) -> None:
        """Refuse what this part cannot run with the other choices (default: nothing)."""


def listed(values: tuple[str, ...] | list[str]) -> str:
    """``'a', 'b', 'c'``: valid values as the error messages list them."""
    return ", ".join(repr(v) for v in values)
