"""The docs are generated where they can be, and hold together: the tables are the
code's, every page of the nav exists, the README's links into the docs resolve.

``mkdocs build --strict`` (in ``.ci/run``) checks the rest: links between pages,
anchors, the API reference."""

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from server_app import config
from strategies.mechanisms import threat_models

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = (REPO / "README.md").read_text()
MKDOCS = (REPO / "mkdocs.yml").read_text()


def _gen_tables():
    """``docs/gen_tables.py`` as a module (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("gen_tables", DOCS / "gen_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _block(page: str, name: str) -> str:
    """The text between ``name``'s BEGIN and END markers in ``docs/page``."""
    text = (DOCS / page).read_text()
    found = re.findall(rf"<!-- BEGIN {name} -->\n(.*?)\n<!-- END {name} -->", text, re.S)
    assert len(found) == 1, f"docs/{page}: expected one '{name}' block between markers"
    return found[0]


def test_run_config_table_is_generated_from_the_code():
    assert _block("reference/run-config.md", "run-config") == config.markdown_table()


def test_threat_model_table_is_generated_from_the_code():
    assert _block("privacy.md", "threat-models") == threat_models.markdown_table()


def test_gen_tables_finds_nothing_stale():
    assert _gen_tables().stale_pages() == []


def test_pyproject_defaults_block_is_generated_from_the_declarations():
    text = (REPO / "pyproject.toml").read_text()
    found = re.findall(r"# BEGIN run-config[^\n]*\n(.*?)\n# END run-config", text, re.S)
    assert found == [config.pyproject_defaults()]
    assert found[0].splitlines()[:2] == ['task = "digits"', 'strategy = "fedavg"']
    assert '"dp.target-delta" = 1e-05' in found[0].splitlines()
    assert '"dp.reproducible-noise" = false' in found[0].splitlines()


def test_a_changed_default_makes_pyproject_stale(monkeypatch):
    gen = _gen_tables()
    declared = config.pyproject_defaults()
    changed = declared.replace('"fedprox.mu" = 0.1', '"fedprox.mu" = 0.2')
    assert changed != declared
    monkeypatch.setattr(config, "pyproject_defaults", lambda: changed)
    assert gen.PYPROJECT in gen.stale_pages()
    with pytest.raises(ValueError):
        gen.replace_defaults("[tool.flwr.app.config]\nseed = 1\n", declared)


def test_gen_tables_replaces_only_the_marked_block():
    gen = _gen_tables()
    text = "before\n<!-- BEGIN t -->\nold\n<!-- END t -->\nafter\n"
    assert gen.replace_block(text, "t", "new") == text.replace("old", "new")
    with pytest.raises(ValueError):
        gen.replace_block("no markers", "t", "new")


def _nav_pages() -> list[str]:
    """The Markdown files the nav of mkdocs.yml names (``Title: page.md`` lines)."""
    return re.findall(r":\s*([\w./-]+\.md)\s*$", MKDOCS, re.M)


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    nav = _nav_pages()
    assert "index.md" in nav
    missing = [page for page in nav if not (DOCS / page).is_file()]
    assert not missing, f"mkdocs.yml names pages that do not exist: {missing}"
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == set(nav), f"pages outside the nav: {sorted(pages - set(nav))}"


def test_the_build_is_strict_and_static():
    assert "docs_dir: docs" in MKDOCS
    assert "site_dir: site" in MKDOCS
    assert "gen_tables.py" in MKDOCS.split("exclude_docs:", 1)[1].split("\n\n", 1)[0]
    assert "hooks:" not in MKDOCS  # nothing of the app is imported at build time
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "nice -n 10 mkdocs build --strict || rc=1" in ci  # a failed build fails CI (.ci/run)


def test_benchmarks_page_includes_the_benchmarks_file():
    # one page per section: the overview and the section pages include, between them,
    # every line of the file once
    assert '--8<-- "bench/BENCHMARKS.md:1:' in (DOCS / "benchmarks.md").read_text()
    assert (REPO / "bench" / "BENCHMARKS.md").is_file()
    lines = (REPO / "bench" / "BENCHMARKS.md").read_text().splitlines()
    pages = [DOCS / "benchmarks.md", *sorted((DOCS / "benchmarks").glob("*.md"))]
    ranges = [
        (int(a), int(b))
        for page in pages
        for a, b in re.findall(r'--8<-- "bench/BENCHMARKS.md:(\d+):(\d+)"', page.read_text())
    ]
    covered = sorted(n for a, b in ranges for n in range(a, b + 1))
    headings = [i for i, line in enumerate(lines, 1) if line.startswith("## ")]
    assert len(pages) > 10 and len(ranges) == len(pages)
    assert covered == [n for n in range(1, len(lines) + 1) if n not in headings]


def test_benchmark_page_titles_drop_code_marks():
    gen = _gen_tables()
    assert gen.page_title("Hierarchical FL (`python -m lab.comparison`)") == (
        "Hierarchical FL (python -m lab.comparison)"
    )
    assert gen.page_title("Deployed rounds (``)") == "Deployed rounds"


# A source document called "the seed": its possessive, and phrases that only make sense
# for a document. Words are joined by \s+ (a phrase may wrap; the pattern's own text here
# does not match itself). The random seed is written otherwise ("the run seed", "one
# seed's spread", "every seed's audit"), so the guard needs no exceptions.
SOURCE_CALLED_SEED = re.compile(
    "|".join(
        [
            r"\bthe\s+seed['’]s\b",
            r"\bthe\s+seeds['’]",
            r"\bthe\s+seed\s+(?:does|uses|writes|leaves|names|sorts|draws|hard-codes|asks|cuts)\b",
            r"\bpart\s+\d+\s+of\s+the\s+seed\b",
            r"\bchanges\s+from\s+the\s+seed\b",
            r"\bas\s+in\s+the\s+seed\b",
            r"\bdeparture\s+from\s+the\s+seed\b",
            r"\bseed['’]s\s+(?:rule|theorem|section|setting|settings|model|mlp)\b",
        ]
    ),
    re.IGNORECASE,
)


def test_no_file_cites_what_a_reader_cannot_open():
    """No tracked file names an issue number, an internal source document ("seed" plus
    three digits, or a source called "the seed": ``SOURCE_CALLED_SEED``) or a path
    outside the repository: a reader cannot resolve them."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    pattern = re.compile("|".join([r"\bissue[ -]\d+", r"\bseed 0\d\d\b", r"\.\./" + "shared"]))
    cited, seeds = [], []
    for name in tracked:
        path = REPO / name
        if path.suffix not in {".py", ".md", ".toml", ".yml", ".yaml", ".json", ".sh", ""}:
            continue
        if not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        if match := pattern.search(text):
            cited.append(f"{name}: {match.group(0)}")
        seeds += [f"{name}: {m.group(0)!r}" for m in SOURCE_CALLED_SEED.finditer(text)]
    assert not cited, cited
    assert not seeds, (
        "name the source instead of 'the seed' (the names in docs/index.md, \"Sources\": "
        f"the PPO study, the SmartFedProx study, ...): {seeds}"
    )


# Built with str.format so that this file's own text holds none of them.
@pytest.mark.parametrize(
    "text",
    [
        "the {s}'s Theorem 1",
        "The {s}'s setting: 10 clients",
        "the {s}s' 9-33 planets",
        "k-means on the weights (the\n{s}'s rule)",
        "the {s}’s rule",
        "The {s} writes Tr(P) <= B",
        "the {s} hard-codes 32x32",
        "Part 2 of the {s}:",
        "Changes from the {s}: any input channels",
        "CG-NG and CG-NP, as in the {s}, clip per batch",
        "(a departure from the {s})",
        "the Subspace-DP-FL {s}'s section 6",
        "the {s} asks",
    ],
)
def test_source_called_seed_is_caught(text):
    assert SOURCE_CALLED_SEED.search(text.format(s="seed"))


@pytest.mark.parametrize(
    "text",
    [
        "derive DP noise from the {s}",
        "no epsilon holds against anyone who knows the {s}",
        "within one {s}'s spread",
        "every {s}'s audit fails",
        "the run {s}'s stream",
        "the spread over {s}s",
        "the {s} of this training's DP randomness",
        "a {s} fixes the client table",
        "whatever the {s}.",
    ],
)
def test_random_seed_wording_passes(text):
    assert not SOURCE_CALLED_SEED.search(text.format(s="seed"))


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    broken = [link for link in local if not (REPO / link).exists()]
    assert not broken, f"README links to missing files: {broken}"


def test_readme_is_the_front_door():
    assert len(README.splitlines()) <= 200
    assert "mkdocs build --strict" in README


def test_api_docstrings_have_no_sphinx_roles():
    # mkdocstrings shows :class:`X` as raw text: the rendered packages use ``X``
    role = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`")
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for package in ("privacy", "tasks", "deploy")
        for path in sorted((REPO / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if role.search(line)
    ]
    assert not found, f"Sphinx roles in rendered docstrings: {found[:10]}"


def test_math_and_wide_tables_are_configured():
    assert "pymdownx.arithmatex" in MKDOCS and "generic: true" in MKDOCS
    assert "javascripts/mathjax.js" in MKDOCS and "tex-mml-chtml.js" in MKDOCS
    assert (DOCS / "javascripts" / "mathjax.js").is_file()
    css = (DOCS / "stylesheets" / "extra.css").read_text()
    assert "stylesheets/extra.css" in MKDOCS and "white-space: nowrap" in css


SHIPPED = ("server_app", "client_app", "strategies", "protocol", "privacy", "tasks")
MODULE_DOCSTRING_LINES, DOCSTRING_LINES = 15, 25  # rationale goes to docs/notes.md


def _long_docstrings(paths) -> list[str]:
    """``path:name (lines)`` of every docstring over its limit (a module's 15, any other 25)."""
    import ast

    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                continue
            doc = ast.get_docstring(node, clean=False)
            lines = len(doc.strip("\n").splitlines()) if doc else 0
            limit = MODULE_DOCSTRING_LINES if isinstance(node, ast.Module) else DOCSTRING_LINES
            if lines > limit:
                found.append(f"{path.name}:{getattr(node, 'name', '<module>')} ({lines})")
    return found


def test_docstrings_summarise_within_their_line_limits():
    paths = [p for package in SHIPPED for p in sorted((REPO / package).rglob("*.py"))]
    assert _long_docstrings(paths) == []


def test_a_long_docstring_is_found(tmp_path):
    module = tmp_path / "m.py"
    body = "\n".join(f"line {i}" for i in range(16))
    module.write_text(f'"""{body}"""\n\ndef f():\n    """{body}"""\n')
    assert _long_docstrings([module]) == ["m.py:<module> (16)"]
