"""The docs are generated where they can be, and hold together: the tables are the
code's, every page of the nav exists, the README's links into the docs resolve.

``mkdocs build --strict`` (in ``.ci/run``) checks the rest: links between pages,
anchors, the API reference."""

import importlib.util
import re
from pathlib import Path

import pytest

from server_app import config
from strategies import threat_models

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
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert "mkdocs build --strict" in ci


def test_benchmarks_page_includes_the_benchmarks_file():
    assert '--8<-- "bench/BENCHMARKS.md"' in (DOCS / "benchmarks.md").read_text()
    assert (REPO / "bench" / "BENCHMARKS.md").is_file()


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    broken = [link for link in local if not (REPO / link).exists()]
    assert not broken, f"README links to missing files: {broken}"


def test_readme_is_the_front_door():
    assert len(README.splitlines()) <= 200
    assert "mkdocs build --strict" in README
