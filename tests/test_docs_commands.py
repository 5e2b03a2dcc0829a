"""Every `flwr run` the README and the docs show runs as written on the federation it
names: each fenced command's run-config (its preset resolved) and federation pass the
checks `python -m lab check` runs (the ServerApp's own validation), and every private
run on a simulation names the federation it needs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from lab import check

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# What `python -m lab.connections` registers for `local-simulation`.
CONNECTION_SIZE = "num-supernodes=10 client-resources-num-cpus=1"
# Commands whose run-config is a placeholder the reader fills in, and why.
PLACEHOLDERS = {
    "runs/<run>": "resume-from names the reader's own run directory",
    "rerun.toml": "written by the snippet above it from a run directory",
}


def fenced_commands(text: str) -> list[str]:
    """The `flwr run` commands of the fenced code blocks of ``text``, continuation
    lines joined and comments dropped."""
    commands = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if line.startswith("flwr run "):
                commands.append(line)
    return commands


def _commands() -> list[tuple[str, str]]:
    return [
        (f"{page.relative_to(REPO)}: {cmd}", cmd)
        for page in PAGES
        for cmd in fenced_commands(page.read_text())
    ]


COMMANDS = _commands()


def parse(command: str) -> tuple[str, list[str], list[str]]:
    """(connection, --run-config values, --federation-config values) of a command."""
    argv = shlex.split(command, comments=True)
    assert argv[:3] == ["flwr", "run", "."], command
    run_config, federation, rest = [], [], argv[3:]
    connection = rest[0]
    i = 1
    while i < len(rest):
        if rest[i] in ("--run-config", "-c"):
            run_config.append(rest[i + 1])
            i += 2
        elif rest[i] == "--federation-config":
            federation.append(rest[i + 1])
            i += 2
        elif rest[i] == "|" or rest[i].startswith("2>"):  # the shell's, not flwr's
            break
        else:
            assert rest[i] == "--stream", (rest[i], command)
            i += 1
    return connection, run_config, federation


def test_the_docs_show_commands_to_check():
    assert len(COMMANDS) >= 15
    assert any("preset=" in cmd for _, cmd in COMMANDS)


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_flwr_run_passes_lab_check(where, command, monkeypatch, tmp_path):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))  # no connection: sizes come from here
    connection, run_config, federation = parse(command)
    if any(p in " ".join(run_config) for p in PLACEHOLDERS):
        pytest.skip(next(w for p, w in PLACEHOLDERS.items() if p in " ".join(run_config)))
    if connection == "local-simulation" and not federation:
        federation = [CONNECTION_SIZE]
    line = check.check(run_config, federation, connection)
    assert line.startswith("OK: ")
    private = line.startswith("OK: PRIVATE")
    if private and connection == "local-simulation":
        # Privacy that learns depends on the federation: the command names it.
        assert "--federation-config" in command, f"{where}: name the federation"
        assert "federation: " in line and "SuperNodes (--federation-config)" in line


def test_a_preset_file_beside_pairs_is_refused_by_the_check():
    with pytest.raises(check.CheckError, match=r"Flower drops 'experiments/x\.toml'.*preset='x'"):
        check.check(["experiments/x.toml num-server-rounds=5"])


def test_the_check_names_a_misspelled_key_and_a_short_federation(monkeypatch, tmp_path):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    with pytest.raises(check.CheckError, match=r"'fedprox\.muu' \(did you mean fedprox\.mu\?\)"):
        check.check(["fedprox.muu=0.1"])
    with pytest.raises(check.CheckError, match=r"'dp.num-sampled-clients' = 20 needs at least 20"):
        check.check(
            ["privacy='dp-fedavg-fixed' dp.target-epsilon=8 dp.num-sampled-clients=20"],
            ["num-supernodes=10 client-resources-num-cpus=1"],
        )
    with pytest.raises(check.CheckError, match="unknown field"):
        check.check([], ["num-supernode=10"])


def test_check_prints_one_line_and_exits_2_on_an_error(capsys):
    assert check.main(["--run-config", "strategy='fedsgd'"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: 'strategy' = 'fedsgd' is not valid")


def test_python_m_lab_dispatches_check(capsys):
    from lab.__main__ import main

    assert main(["check", "--run-config", "fedprox.muu=0.1"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown run-config key(s): 'fedprox.muu'")
    assert main(["nope"]) == 2
