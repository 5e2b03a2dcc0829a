"""App code reads run-config options typed, not back by string.

An AST scan over the app's packages finds every ``x["key"]`` and ``x.get("key")`` whose
literal ``key`` is a declared run-config key (``server_app.config.all_options``). The
config layer itself parses the flat dict and may read it by string (``CONFIG_LAYER``);
everywhere else a part reads its typed settings object. The reads that remain outside
it are counted per file in ``REMAINING``: the test fails on a new one (or a file over
its count), and on a count that has gone down without the table following.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from server_app import config

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("server_app", "client_app", "strategies", "tasks", "lab")

# Where the flat run-config is parsed into typed objects.
CONFIG_LAYER = frozenset(
    {
        "server_app/config.py",
        "config/settings.py",
        "config/options.py",
    }
)

# String reads of options not yet moved to typed settings, per file (a ratchet: lower
# a count when a read goes, never raise one).
REMAINING: dict[str, int] = {
    "client_app/canary.py": 6,
    "client_app/halves/dpsgd.py": 1,
    "client_app/mods.py": 1,
    "client_app/node.py": 1,
    "server_app/plots.py": 3,
    "server_app/recorder.py": 1,
    "server_app/run_status.py": 1,
    "server_app/setup.py": 2,
    "server_app/tracking.py": 2,
    "strategies/algorithms/clustered/settings.py": 2,
    "strategies/mechanisms/subspace_dp.py": 1,
    "strategies/mechanisms/threat_models.py": 6,
    "strategies/runtime/aggregation.py": 1,
    "strategies/secure/secagg_plus.py": 2,
    "tasks/__init__.py": 1,
}


# Allowed for good: the readers of what a run saved or a study declares (a finished
# run's config.json, a preset's table, a results table's ``seed`` column, a study's
# experiment entries; the lunar lander's plots of finished runs). They read a file,
# not a live run's options, and there is no part whose settings object they could be
# handed; reading a saved run-config is the config layer's job done after the fact.
# Counted all the same, so a new read here is a choice made in this table.
SAVED_READERS: dict[str, int] = {
    "lab/check.py": 1,
    "lab/comparison.py": 7,
    "lab/comparison_plots.py": 1,
    "lab/figures.py": 12,
    "lab/study.py": 2,
    "lab/sweep.py": 2,
    "tasks/lunar_lander/plots.py": 4,
}


def option_reads(path: Path, keys: frozenset[str]) -> list[tuple[int, str]]:
    """``(line, key)`` of every read of a run-config key by string literal in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        literal = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            literal = node.slice
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and node.args
        ):
            literal = node.args[0]
        if isinstance(literal, ast.Constant) and literal.value in keys:
            found.append((node.lineno, literal.value))
    return found


def scan() -> dict[str, list[tuple[int, str]]]:
    """Every string read of an option outside the config layer, by file."""
    keys = frozenset(opt.key for opt in config.all_options())
    reads = {}
    for package in SCANNED:
        for path in sorted((REPO / package).rglob("*.py")):
            name = path.relative_to(REPO).as_posix()
            if name not in CONFIG_LAYER and (found := option_reads(path, keys)):
                reads[name] = found
    return reads


def test_the_scan_finds_subscripts_and_gets_of_declared_keys_only(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        'a = o["dp.clip-norm"]\n'
        'b = cfg.options.get("smart.selection", "x")\n'
        'c = config["server-round"]\n'  # a message key, not a run-config key
        '"""x["fedprox.mu"] in a docstring"""\n'
        'd = run_config["seed"]\n'
        'need["fedprox.mu"] = 1\n'  # a write names the key, it reads nothing
    )
    keys = frozenset({"dp.clip-norm", "smart.selection", "fedprox.mu", "seed"})
    assert option_reads(source, keys) == [(1, "dp.clip-norm"), (2, "smart.selection"), (5, "seed")]


def test_no_option_is_read_by_string_outside_the_config_layer():
    counts = Counter({name: len(found) for name, found in scan().items()})
    over = {
        name: [f"{line}: {key!r}" for line, key in found]
        for name, found in scan().items()
        if counts[name] > {**REMAINING, **SAVED_READERS}.get(name, 0)
    }
    assert not over, (
        "read the part's typed settings instead of the run-config by string "
        f"(config.settings.Settings): {over}"
    )
    stale = {name: n for name, n in {**REMAINING, **SAVED_READERS}.items() if counts[name] < n}
    assert not stale, f"fewer string reads than REMAINING allows, lower it: {stale}"
