"""CI type-checks the accounting, the wire protocol, the strategies and the ServerApp
with mypy (pyproject.toml)."""

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_runs_mypy_over_the_core_packages():
    mypy = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert {"privacy", "protocol", "strategies", "server_app"} <= set(mypy["packages"])
    # No module's errors ignored wholesale: an override only stops mypy reading a
    # third-party library's sources (its names are then Any), never one of ours.
    ours = {*mypy["packages"], "tasks", "client_app", "lab", "config", "deploy"}
    for override in mypy.get("overrides", []):
        assert set(override) == {"module", "follow_imports"}, override
        assert override["follow_imports"] == "skip"
        assert not {m.split(".")[0] for m in override["module"]} & ours, override
    assert mypy["python_version"] == "3.11"
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "nice -n 10 mypy || rc=1" in ci  # started before the tests; its failure fails CI
    assert ci.index("nice -n 10 mypy || rc=1") < next(
        i for i, line in enumerate(ci) if line.startswith("pytest")
    )
    assert 'wait "$checks_pid"' in ci
    assert ".mypy_cache/" in (REPO / ".gitignore").read_text().splitlines()
