"""The README is the interface: its commands are what CI runs, its presets are valid.

The generated tables now live in the docs pages: tests/test_docs.py."""

import re
import tomllib
from pathlib import Path

import pytest
from flwr.common.config import flatten_dict, fuse_dicts

from server_app import config

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _section_command(heading: str) -> str:
    """The first line of the first ```bash block under ``## heading``."""
    section = README.split(f"## {heading}\n", 1)[1]
    block = re.search(r"```bash\n(.+?)\n```", section, re.S)
    assert block, f"no bash block under '## {heading}'"
    return block.group(1).splitlines()[0]


@pytest.mark.parametrize("heading", ["Install", "Tests"])
def test_ci_runs_the_readme_commands_verbatim(heading):
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert _section_command(heading) in ci


@pytest.mark.parametrize("preset", sorted((REPO / "experiments").glob("*.toml")), ids=str)
def test_presets_are_valid_run_configs(preset):
    defaults = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    # What Flower does with `--run-config preset.toml`: flatten, then fuse with defaults.
    overrides = flatten_dict(tomllib.loads(preset.read_text()))
    config.load(fuse_dicts(defaults["config"], overrides))
