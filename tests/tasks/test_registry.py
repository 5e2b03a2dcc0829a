"""The task registry: each name's entry is its class, and building one task imports only
that task's module (a digits ClientApp never loads PPO's stable-baselines3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tasks
from tasks.base import Task

REPO = Path(__file__).resolve().parents[2]


def test_each_entry_names_its_class_and_the_registry_keeps_the_tables_order():
    registry = tasks.REGISTRY
    assert list(registry) == list(tasks._TASKS)
    for name, cls in registry.items():
        assert issubclass(cls, Task) and cls.name == name
        assert tasks.get(name) is cls
        assert getattr(tasks, cls.__name__) is cls  # the class by its name too


def test_an_unknown_task_names_the_valid_ones():
    with pytest.raises(tasks.ConfigError, match=r"'task' = 'mnst' is not valid; .*'mnist'"):
        tasks.get("mnst")


def test_building_digits_imports_no_other_tasks_modules():
    probe = (
        "import json, sys; import tasks; "
        "tasks.build({'task': 'digits'}); "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('stable_baselines3', 'gymnasium') "
        "or m.startswith(('tasks.lunar_lander', 'tasks.finance', 'tasks.movielens')))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
