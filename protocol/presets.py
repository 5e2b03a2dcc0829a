"""Presets: a run-config key ``preset`` that names a file of ``experiments/``.

Flower fuses the user's ``--run-config`` over the ``pyproject.toml`` defaults before
any app sees it, so the ServerApp and every ClientApp resolve the preset the same way
from that fused dict alone: a key whose value differs from its default was given on
the command line and overrides the preset; every other key takes the preset's value.
A key given explicitly at its default value cannot be told apart from the default
there; the ServerApp, which also sees the user's overrides (``Grid.run``), refuses
that case instead of running the preset's value (:func:`ambiguous_keys`).

Both sides import this module (the ClientApp through its ``preset_mod``); it imports
nothing from Flower.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Collection, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from config.renamed import renamed_message

PRESET_KEY = "preset"
APP_DIR = Path(__file__).resolve().parents[1]  # the checkout, or the FAB's directory
EXPERIMENTS_DIR = APP_DIR / "experiments"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class PresetError(ValueError):
    """The preset is unknown, unreadable, or cannot be combined with the overrides."""


def available() -> list[str]:
    """The preset names shipped with the app (``experiments/*.toml`` stems)."""
    return sorted(path.stem for path in EXPERIMENTS_DIR.glob("*.toml"))


def preset_name(value: str) -> str:
    """``value`` as a preset name: ``digits-dp-eps8``, ``digits-dp-eps8.toml`` and
    ``experiments/digits-dp-eps8.toml`` all name the same preset."""
    name = value.strip()
    name = name.removeprefix("./").removeprefix("experiments/").removesuffix(".toml")
    if not _NAME.match(name):
        raise PresetError(
            f"'{PRESET_KEY}' = {value!r} is not a preset name: give the stem of a file "
            "in experiments/, e.g. 'digits-dp-eps8'"
        )
    return name


def flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables as Flower's flat keys (``{"dp": {"clip-norm": 1}}`` ->
    ``{"dp.clip-norm": 1}``), as ``flwr.common.config.flatten_dict`` does."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


@cache
def load_preset(value: str) -> dict[str, Any]:
    """The flat run-config of preset ``value`` (a name, see :func:`preset_name`)."""
    name = preset_name(value)
    path = EXPERIMENTS_DIR / f"{name}.toml"
    if not path.is_file():
        close = difflib.get_close_matches(name, available(), n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        # A checkout (not the FAB) also holds the studies' presets, run by their study.
        for study in sorted(APP_DIR.glob(f"studies/*/presets/{name}.toml")):
            hint = (
                f" ({name!r} is a preset of the study studies/{study.parent.parent.name}/: "
                "run it with the command of that study's README.md)"
            )
        raise PresetError(
            f"'{PRESET_KEY}' = {value!r}: no preset {name!r} in experiments/{hint}; "
            f"{len(available())} presets ship with the app (ls experiments/)"
        )
    try:
        values = flatten(tomllib.loads(path.read_text()))
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise PresetError(f"'{PRESET_KEY}' = {value!r}: cannot read {path.name}: {err}") from None
    if PRESET_KEY in values:
        raise PresetError(f"'{PRESET_KEY}' = {value!r}: a preset cannot name another preset")
    renamed = renamed_message(values)
    if renamed:
        raise PresetError(f"'{PRESET_KEY}' = {value!r}: {renamed}")
    return values


@cache
def app_defaults() -> dict[str, Any]:
    """The app's run-config defaults, as Flower fuses them (``[tool.flwr.app.config]``
    of the ``pyproject.toml`` beside the code: the checkout's, or the FAB's)."""
    doc = tomllib.loads((APP_DIR / "pyproject.toml").read_text())
    return flatten(doc["tool"]["flwr"]["app"]["config"])


def overridden(run_config: Mapping[str, Any], defaults: Mapping[str, Any]) -> set[str]:
    """The keys of ``run_config`` that differ from their default (or have none): what
    the user set on the command line, as far as the fused run-config can tell."""
    return {
        key
        for key, value in run_config.items()
        if key not in defaults or not _same(value, defaults[key])
    }


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same kind (``True`` is not ``1``; ``8`` is ``8.0``)."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def resolve(
    run_config: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``run_config`` with its preset applied: the preset's values over the defaults,
    the keys given on the command line (:func:`overridden`) over the preset. Without a
    preset, ``run_config`` unchanged. Idempotent: resolving twice changes nothing."""
    value = str(run_config.get(PRESET_KEY, "") or "")
    if not value:
        return dict(run_config)
    defaults = app_defaults() if defaults is None else defaults
    preset = load_preset(value)
    given = overridden(run_config, defaults)
    resolved = dict(run_config)
    resolved.update({k: v for k, v in preset.items() if k not in given})
    resolved[PRESET_KEY] = preset_name(value)
    return resolved


def ambiguous_keys(
    run_config: Mapping[str, Any],
    explicit: Collection[str],
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, tuple[Any, Any]]:
    """``key -> (value given, preset's value)`` for the keys the user gave explicitly
    (``explicit``) at their default value while the preset sets another value: the
    fused run-config, which is all a ClientApp sees, cannot tell them from unset."""
    value = str(run_config.get(PRESET_KEY, "") or "")
    if not value:
        return {}
    defaults = app_defaults() if defaults is None else defaults
    preset = load_preset(value)
    return {
        key: (run_config[key], preset[key])
        for key in sorted(explicit)
        if key in preset
        and key in run_config
        and key in defaults
        and _same(run_config[key], defaults[key])
        and not _same(preset[key], run_config[key])
    }


def refuse_ambiguous(
    run_config: Mapping[str, Any],
    explicit: Collection[str],
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Raise PresetError naming every :func:`ambiguous_keys` entry."""
    clash = ambiguous_keys(run_config, explicit, defaults)
    if not clash:
        return
    shown = ", ".join(f"{k}={v!r} (the preset has {p!r})" for k, (v, p) in clash.items())
    raise PresetError(
        f"'{PRESET_KEY}' = {run_config[PRESET_KEY]!r}: {shown}: a value equal to the "
        "app's default cannot override a preset (the ClientApps see only Flower's merged "
        "run-config, where it reads as unset); copy the preset to a new file in "
        "experiments/ with that value, or run without the preset"
    )
