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


_BENCH_CITED = re.compile(r"(?<![\w/.-])bench/([a-z0-9_]+)\.py")
_BENCH_COMMAND = re.compile(r"python bench/([a-z0-9_]+)\.py ([a-z][a-z0-9-]*)(?![\w/.-])")


def _bench_citation_faults(pages: list[Path], bench: Path) -> list[str]:
    """Citations of a ``bench/`` script that is gone (and not said, in the paragraph, to
    be retired), and commands naming a subcommand the script's parsers do not have."""
    faults = []
    for page in pages:
        for paragraph in re.split(r"\n\s*\n", page.read_text()):
            for name in _BENCH_CITED.findall(paragraph):
                if not (bench / f"{name}.py").is_file() and "retired" not in paragraph:
                    faults.append(f"{page.name}: bench/{name}.py")
            for name, word in _BENCH_COMMAND.findall(paragraph):
                script = bench / f"{name}.py"
                if script.is_file() and f'prog="{name}.py {word}"' not in script.read_text():
                    faults.append(f"{page.name}: bench/{name}.py {word}")
    return faults


def test_every_bench_script_and_subcommand_the_docs_cite_exists():
    # A folded script is cited by its new home's subcommand; a removed one as retired.
    pages = [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "bench" / "BENCHMARKS.md"]
    pages += [*(REPO / "docs").rglob("*.md"), *(REPO / "studies").rglob("*.md")]
    pages += [*(REPO / "studies").rglob("*.toml"), *(REPO / "experiments").glob("*.toml")]
    assert _bench_citation_faults([p for p in pages if p.is_file()], REPO / "bench") == []


def test_a_gone_bench_script_or_subcommand_is_found(tmp_path):
    (tmp_path / "kept.py").write_text('parser = ArgumentParser(prog="kept.py sub")\n')
    page = tmp_path / "page.md"
    page.write_text(
        "Run `python bench/kept.py sub --x 1` or `python bench/kept.py other`.\n\n"
        "`bench/gone.py` measured 3 ms.\n\n"
        "`bench/old.py`, since retired (commit abc1234), measured 4 ms.\n"
    )
    faults = _bench_citation_faults([page], tmp_path)
    assert faults == ["page.md: bench/kept.py other", "page.md: bench/gone.py"]
