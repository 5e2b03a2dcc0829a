"""CI type-checks the accounting, the wire protocol, the strategies and the ServerApp
with mypy (pyproject.toml)."""

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_runs_mypy_over_the_core_packages():
    mypy = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert {"privacy", "protocol", "strategies", "server_app"} <= set(mypy["packages"])
    assert not mypy.get("overrides")  # no module's errors ignored wholesale
    assert mypy["python_version"] == "3.11"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert "mypy" in ci
    assert ci.index("mypy") < next(i for i, line in enumerate(ci) if line.startswith("pytest"))
    assert ".mypy_cache/" in (REPO / ".gitignore").read_text().splitlines()
