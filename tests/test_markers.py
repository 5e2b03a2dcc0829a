"""The selections in tests/conftest.py name tests that exist: a ``SLOW`` entry that matches
nothing (a moved file, a renamed test) would put slow tests back into the fast default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import E2E_GROUPS, SLOW

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("entry", SLOW)
def test_each_slow_entry_names_a_test_file_and_a_test_in_it(entry):
    path, _, name = entry.partition("::")
    source = ROOT / path
    assert source.is_file(), f"SLOW names {path}, which does not exist"
    if name:
        pattern = rf"^(async )?def {re.escape(name)}\w*\("
        assert re.search(pattern, source.read_text(), re.M), f"no test {name}* in {path}"


@pytest.mark.parametrize("module", sorted(E2E_GROUPS))
def test_each_e2e_group_names_an_end_to_end_module(module):
    assert (ROOT / "tests" / "e2e" / f"{module}.py").is_file(), module
