"""The layering of docs/architecture.md, read from the sources' module-level imports."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from bench.trace_round import circles  # the import-circle finder the trace reports with

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (
    "config",
    "server_app",
    "client_app",
    "strategies",
    "protocol",
    "privacy",
    "tasks",
    "lab",
    "deploy",
)
FAB = ("config", "server_app", "client_app", "strategies", "protocol", "privacy", "tasks")

# package -> packages of ours it may not import. deploy/ (the runtime beside Flower on a
# SuperNode's machine) may import Flower and nothing of ours; nothing imports it.
FORBIDDEN = {
    # the run-config layer: declarations and parsing, below every package that reads them
    "config": set(PACKAGES) - {"config"},
    "privacy": {"tasks", "strategies", "protocol", "client_app", "server_app", "lab", "deploy"},
    "tasks": {"strategies", "protocol", "client_app", "server_app", "lab", "deploy"},
    "protocol": {"strategies", "client_app", "server_app", "lab", "tasks", "deploy"},
    "strategies": {"tasks", "client_app", "server_app", "lab", "deploy"},
    # client_app runs the mechanisms' client mods, which live beside their server halves
    "client_app": {"server_app", "lab", "deploy"},
    "server_app": {"client_app", "lab", "deploy"},
    "deploy": set(PACKAGES) - {"deploy"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, type_checking: bool = False, deferred: bool = False) -> set[str]:
    """The modules ``path`` imports when it is imported (``TYPE_CHECKING`` blocks unless
    ``type_checking``, and imports inside functions unless ``deferred``; a package's
    ``__init__`` is not counted as a dependency of the modules inside it)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test)
            and not type_checking
        ):
            continue
        walk = deferred or isinstance(node, ast.If | ast.Try)
        for inner in ast.walk(node) if walk else [node]:
            if isinstance(inner, ast.ImportFrom) and inner.module and not inner.level:
                for alias in inner.names:  # ``from pkg import submodule`` needs the submodule
                    submodule = f"{inner.module}.{alias.name}"
                    names.add(submodule if submodule in MODULES else inner.module)
            elif isinstance(inner, ast.Import):
                names |= {a.name for a in inner.names}
    return names


MODULES = _modules()
GRAPH = {m: {d for d in _imports(p) if d in MODULES and d != m} for m, p in MODULES.items()}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_a_layer_it_may_not(package):
    wrong = sorted(
        f"{module} imports {dep}"
        for module, deps in GRAPH.items()
        if module.split(".")[0] == package
        for dep in deps
        if dep.split(".")[0] in FORBIDDEN[package]
    )
    assert wrong == []


@pytest.mark.parametrize("package", ["config", "privacy", "tasks"])
def test_privacy_and_tasks_import_no_flower(package):
    wrong = sorted(
        f"{module} imports {name}"
        for module, path in MODULES.items()
        if module.split(".")[0] == package
        for name in _imports(path)
        if name.split(".")[0] == "flwr"
    )
    assert wrong == []


def test_there_is_no_import_cycle():
    assert circles(GRAPH) == []


def _full_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Imports among the modules of ``packages``, type hints and deferred imports too."""
    graph = {
        module: {
            d
            for d in _imports(path, type_checking=True, deferred=True)
            if d in MODULES and d != module
        }
        for module, path in MODULES.items()
        if module.split(".")[0] in packages
    }
    return {m: {d for d in deps if d in graph} for m, deps in graph.items()}


@cache
def _fab_cycles() -> tuple[tuple[str, ...], ...]:
    """The cycles of the shipped packages' full graph: parsed once, not once per package."""
    return tuple(tuple(cycle) for cycle in circles(_full_graph(FAB)))


@pytest.mark.parametrize("package", FAB)
def test_shipped_packages_have_no_import_cycle_even_through_hints_or_deferred_imports(package):
    """A shipped module imports no module that imports it back, not for a type hint nor
    inside a function: each part stands on the ones below it (a hint the other way is a
    Protocol where it is used; what both need lives in a module below both)."""
    cycles = _fab_cycles()
    assert [c for c in cycles if c[0].split(".")[0] == package] == []


def test_a_deferred_import_that_closes_a_circle_is_found(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from privacy.events import Release\n")
    assert "privacy.events" in _imports(module, deferred=True)
    assert "privacy.events" not in _imports(module)


def test_the_fab_ships_the_app_and_not_the_offline_tools():
    import tomllib

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "fab-include"
    ]
    assert {entry.split("/")[0] for entry in include if entry.endswith(".py")} == set(FAB)


def test_a_cycle_is_found_when_there_is_one():
    global GRAPH
    saved = GRAPH
    GRAPH = {**saved, "lab.checks": {"lab.study"}, "lab.study": {"lab.checks"}}
    try:
        with pytest.raises(AssertionError):
            test_there_is_no_import_cycle()
    finally:
        GRAPH = saved
    three = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert circles(three) == [["a", "b", "c", "a"]]
    assert circles({**three, "c": {"d"}}) == []


def test_a_type_hint_that_closes_a_circle_is_found(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from strategies.registry import build\n"
    )
    assert "strategies.registry" in _imports(module, type_checking=True)
    assert "strategies.registry" not in _imports(module)


# What a run without DP or clustering never uses: imported where it is used
# (privacy.events, strategies.algorithms.clustered), not when the apps start (~0.5 s of SciPy's
# optimize and signal packages at every start-up; bench/BENCHMARKS.md).
ON_USE_ONLY = ("dp_accounting", "sklearn.cluster", "scipy.signal")


def test_the_apps_start_without_what_only_dp_or_clustering_uses():
    import subprocess
    import sys

    script = (
        "import sys, server_app.app, client_app.app\n"
        f"print(' '.join(m for m in {ON_USE_ONLY!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [], "imported at start-up; find the chain with -X importtime"
