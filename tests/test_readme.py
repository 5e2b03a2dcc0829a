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


def _valid(overrides: dict) -> None:
    defaults = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    # What Flower does with `--run-config preset.toml`: flatten, then fuse with defaults.
    config.load(fuse_dicts(defaults["config"], overrides))


@pytest.mark.parametrize("preset", sorted((REPO / "experiments").glob("*.toml")), ids=str)
def test_presets_are_valid_run_configs(preset):
    _valid(flatten_dict(tomllib.loads(preset.read_text())))


def test_experiments_holds_the_canonical_presets_with_short_headers():
    presets = sorted((REPO / "experiments").glob("*.toml"))
    assert 10 <= len(presets) <= 20, [p.stem for p in presets]
    for preset in presets:
        header = [line for line in preset.read_text().splitlines() if line.startswith("#")]
        assert 1 <= len(header) <= 3, f"{preset.name}: {len(header)} comment lines"


@pytest.mark.parametrize(
    "study_dir", sorted(p.parent for p in (REPO / "studies").glob("*/base.toml")), ids=str
)
def test_study_presets_merge_into_valid_run_configs(study_dir):
    # Every preset of a study, merged over its base.toml as lab.study reads it.
    from lab.study import read_preset

    presets = sorted((study_dir / "presets").glob("*.toml"))
    assert presets, f"{study_dir} has a base.toml but no presets/"
    assert (study_dir / "README.md").is_file()
    for preset in presets:
        merged = read_preset(preset, flatten_dict)
        assert set(merged) > set(flatten_dict(tomllib.loads(preset.read_text())))
        _valid(merged)


def _expand_braces(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [p for alt in match.group(1).split(",") for p in _expand_braces(head + alt + tail)]


def test_every_preset_path_the_docs_and_studies_name_exists():
    # A study's command names its presets by path: a moved or renamed preset fails here.
    pages = [REPO / "README.md", REPO / "bench" / "BENCHMARKS.md", *(REPO / "docs").rglob("*.md")]
    pages += [*(REPO / "studies").glob("*/README.md"), *(REPO / "experiments").glob("*.toml")]
    path = re.compile(r"(?<![\w/.-])(?:experiments|studies/[\w-]+/presets)/[a-z0-9{},*.-]+\.toml")
    missing = [
        f"{page.relative_to(REPO)}: {pattern}"
        for page in pages
        for found in path.findall(page.read_text())
        for pattern in _expand_braces(found)
        if not list(REPO.glob(pattern))
    ]
    assert missing == []
