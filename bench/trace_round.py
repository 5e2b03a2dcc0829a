"""What one private round executes: project files, functions and import circles.

Runs one in-process ``dp-fedavg-fixed`` digits run (``tests.inprocess.run_like_flwr``,
4 virtual SuperNodes) under ``sys.setprofile`` and prints how many of the project's files
and functions it called, by package, the longest classes of strategies/, then the import
circles among the shipped packages (every ``import`` of ours in their sources,
module-level, ``TYPE_CHECKING`` and in-function alike). Two traces: a whole 1-round run
(start-up, the round, the end of the run), and the steady round, round 2 of a 2-round
run, from the ServerApp's ``configure_train`` to the end of its evaluation. Reproduce
from the repository root::

    .venv/bin/python bench/trace_round.py
    .venv/bin/python bench/trace_round.py --list   # the files, too

Numbers before and after each restructuring: bench/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("server_app", "client_app", "strategies", "protocol", "privacy", "tasks")
PROJECT = (*SHIPPED, "lab")
ROUND = (
    "fraction-train=1.0 vision.local-epochs=1 run.divergence-factor=0.0 "
    "privacy='dp-fedavg-fixed' dp.noise-multiplier=1.0 dp.clip-norm=1.0 dp.sampling='fixed' "
    "dp.num-sampled-clients=4"
)


STEADY = 2  # the round traced in steady mode: the first with nothing left to start


def _opens_round(frame, server_round: int) -> bool:
    """``frame`` is the ServerApp's ``configure_train`` of ``server_round`` (called by the
    round loop itself, not a wrapper's call of the strategy it wraps)."""
    caller = frame.f_back
    return (
        frame.f_code.co_name == "configure_train"
        and caller is not None
        and caller.f_code.co_name == "run_rounds"
        and frame.f_locals.get("server_round") == server_round
    )


def _closes_round(frame, server_round: int) -> bool:
    """``frame`` is the round loop's evaluation of ``server_round`` (``_evaluate``)."""
    result = frame.f_locals.get("result")
    return (
        frame.f_code.co_name == "_evaluate"
        and frame.f_code.co_filename.endswith("server_app/rounds.py")
        and getattr(result, "server_round", None) == server_round
    )


def trace_round(output_dir: str, *, steady: bool = False) -> dict[str, set[str]]:
    """{project file: the functions of it called} in a whole 1-round run, or (``steady``)
    in round 2 of a 2-round run only (imports done before are not counted either way)."""
    sys.path.insert(0, str(REPO))
    from tests.inprocess import run_like_flwr

    roots = tuple(str(REPO / package) + "/" for package in PROJECT)
    called: dict[str, set[str]] = {}
    window = {"open": not steady, "closed": False}

    def profile(frame, event, _arg):
        if event == "return" and window["open"] and steady and _closes_round(frame, STEADY):
            window["open"], window["closed"] = False, True
        if event != "call":
            return
        if steady and not window["open"] and _opens_round(frame, STEADY):
            window["open"] = True
        code = frame.f_code
        # Functions and methods only: not module bodies, lambdas or comprehensions.
        mine = code.co_filename.startswith(roots) and not code.co_name.startswith("<")
        if window["open"] and mine:
            name = f"{code.co_qualname}:{code.co_firstlineno}"
            called.setdefault(code.co_filename, set()).add(name)

    rounds = STEADY if steady else 1
    sys.setprofile(profile)
    try:
        outcome = run_like_flwr(f"num-server-rounds={rounds} {ROUND} output-dir='{output_dir}'")
    finally:
        sys.setprofile(None)
    if outcome.returncode:
        raise SystemExit(outcome.output)
    if steady and not window["closed"]:
        raise SystemExit(f"round {STEADY} was never opened and closed: nothing traced")
    return called


def import_graph() -> dict[str, set[str]]:
    """{shipped module: the shipped modules it imports anywhere in its source}."""
    modules = {}
    for package in SHIPPED:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    graph = {}
    for module, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names}
        graph[module] = {d for d in deps if d in modules and d != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles a depth-first walk meets (one per back edge)."""
    state: dict[str, int] = {}
    found = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                found.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def largest_classes(package: str = "strategies", top: int = 3) -> list[tuple[int, str]]:
    """The ``top`` longest classes of ``package`` (lines from ``class`` to their end)."""
    sizes = []
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where = f"{path.relative_to(REPO)}::{node.name}"
                sizes.append((node.end_lineno - node.lineno + 1, where))
    return sorted(sizes, reverse=True)[:top]


def report(title: str, called: dict[str, set[str]], *, listed: bool) -> None:
    """Files and functions of ``called``, by package (and each file where ``listed``)."""
    by_package = Counter(Path(f).relative_to(REPO).parts[0] for f in called)
    print(f"{title}: files executed: {len(called)}")
    print(f"{title}: functions executed: {sum(len(v) for v in called.values())}")
    for package, count in sorted(by_package.items()):
        print(f"  {package}/: {count} files")
    if listed:
        for path in sorted(called):
            print(f"    {Path(path).relative_to(REPO)}: {len(called[path])} functions")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print each file traced")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as output_dir:
        whole = trace_round(output_dir)
    with tempfile.TemporaryDirectory() as output_dir:
        steady = trace_round(output_dir, steady=True)
    report("whole 1-round run", whole, listed=args.list)
    report(f"steady round (round {STEADY} of {STEADY})", steady, listed=args.list)
    for lines, where in largest_classes():
        print(f"class of {lines} lines: {where}")
    found = circles(import_graph())
    print(f"import circles among shipped packages: {len(found)}")
    for circle in found:
        print("  " + " -> ".join(circle))


if __name__ == "__main__":
    main()
