"""``bench/peer_digits.py``'s whole-process measurement: the CPU seconds of a child
process, and pfl's script run over other rounds without being edited."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def peer_digits():
    sys.path.insert(0, str(BENCH))
    try:
        import peer_digits

        yield peer_digits
    finally:
        sys.path.remove(str(BENCH))


def test_timed_run_counts_the_childs_cpu_seconds(peer_digits):
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    proc, wall, cpu = peer_digits.timed_run([sys.executable, "-c", burn])
    assert proc.returncode == 0
    assert cpu >= 0.3  # the child's own 0.3 s, plus its start-up
    assert wall > 0


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_pfl_rounds_launcher_sets_the_scripts_rounds_and_runs_its_main(
    peer_digits, tmp_path, clock
):
    script = tmp_path / "peer.py"
    script.write_text(
        "import sys, time\nNUM_ROUNDS = 30\n\ndef main():\n"
        "    print(NUM_ROUNDS, sys.argv[1:], time.perf_counter is time.process_time)\n\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    launch = [sys.executable, "-c", peer_digits.PFL_ROUNDS, str(script), "1000", clock, "--child"]
    done = subprocess.run(launch, capture_output=True, text=True, check=True)
    # the CPU clock: the script's lap timer reads the process's CPU seconds
    assert done.stdout.strip() == f"1000 ['--child'] {clock == 'cpu'}"


def test_repeated_pairs_give_each_sides_median_and_the_ratios_range(
    peer_digits, monkeypatch, capsys
):
    engine = iter([0.30, 0.10, 0.20])  # warm rounds of three pairs
    pfl = iter([0.10, 0.10, 0.05])  # pfl's laps: ratios 3, 1, 4

    def one(*_args):
        warm = next(engine)
        return {"warm round s": warm, "round with eval s": warm + 0.01, "process s": 10 * warm,
                "process CPU s": 10 * warm, "accuracy": 0.5}  # fmt: skip

    def other(*_args):
        lap = next(pfl)
        return {"median_round_seconds": lap, "process_wall_s": 30 * lap,
                "process_cpu_s": 30 * lap, "test_accuracy": 0.6}  # fmt: skip

    monkeypatch.setattr(peer_digits, "engine_one", one)
    monkeypatch.setattr(peer_digits, "pfl_run_one", other)
    argv = ["--python", "py", "--sizes", "100", "--repeat", "3"]
    assert peer_digits.engine_vs_pfl_main(argv) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split("|")
    # medians: engine 0.20, pfl 0.10; the ratio is the median of the pairs' (3), not 0.2/0.1
    assert [c.strip() for c in row[5:8]] == ["0.2000", "0.1000", "3.0"]
    assert row[-2].strip() == "3 (1.0-4.0)"
    with pytest.raises(SystemExit):
        peer_digits.engine_vs_pfl_main([*argv[:-1], "0"])
