"""Rewrite the generated tables of the docs from the code.

    python docs/gen_tables.py           # rewrite the tables in place
    python docs/gen_tables.py --check   # exit 1, naming the pages, if one is stale

Each table sits between two marker comments in its page, e.g.
``<!-- BEGIN run-config -->`` and ``<!-- END run-config -->``; only the text between
them is replaced. The build stays static: ``mkdocs build`` imports nothing of the app,
and ``tests/test_docs.py`` checks that the committed tables are the code's.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
if str(REPO) not in sys.path:  # `python docs/gen_tables.py` puts only docs/ on the path
    sys.path.insert(0, str(REPO))


def _run_config() -> str:
    from server_app import config

    return config.markdown_table()


def _threat_models() -> str:
    from strategies import threat_models

    return threat_models.markdown_table()


# marker name -> (page under docs/, the function that generates its table)
TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "run-config": ("reference/run-config.md", _run_config),
    "threat-models": ("privacy.md", _threat_models),
}


def replace_block(text: str, name: str, table: str) -> str:
    """``text`` with the block between ``name``'s markers replaced by ``table``."""
    pattern = re.compile(
        rf"(<!-- BEGIN {re.escape(name)} -->\n).*?(\n<!-- END {re.escape(name)} -->)", re.S
    )
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"expected exactly one '<!-- BEGIN {name} -->' ... END block")
    return pattern.sub(lambda m: m.group(1) + table + m.group(2), text)


def stale_pages() -> list[Path]:
    """Pages whose generated tables differ from the code's (nothing is written)."""
    stale = []
    for name, (page, generate) in TABLES.items():
        path = DOCS / page
        text = path.read_text()
        if replace_block(text, name, generate()) != text:
            stale.append(path)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale pages")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for path in stale:
            print(f"{path.relative_to(REPO)} is stale: run python docs/gen_tables.py")
        return 1 if stale else 0
    for name, (page, generate) in TABLES.items():
        path = DOCS / page
        text = path.read_text()
        new = replace_block(text, name, generate())
        if new != text:
            path.write_text(new)
            print(f"rewrote {path.relative_to(REPO)} ({name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
