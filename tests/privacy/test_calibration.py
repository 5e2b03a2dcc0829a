"""Noise calibration and the ``python -m privacy.budget`` CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

from privacy.budget import main
from privacy.calibration import calibrate_noise_multiplier, epsilon_for
from privacy.events import RDP_ORDERS, AccountingError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "setting",
    [
        {
            "sampling": "poisson",
            "accountant": "rdp",
            "sample_size": 10,
            "population": 1000,
            "rounds": 300,
            "target_epsilon": 2.0,
        },
        {
            "sampling": "none",
            "accountant": "pld",
            "sample_size": 5,
            "population": 5,
            "rounds": 5,
            "target_epsilon": 3.0,
        },
        {
            "sampling": "without-replacement",
            "accountant": "rdp",
            "sample_size": 20,
            "population": 500,
            "rounds": 100,
            "target_epsilon": 4.0,
        },
    ],
)
def test_calibrated_multiplier_is_the_smallest_within_target(setting):
    target = setting.pop("target_epsilon")
    z = calibrate_noise_multiplier(target_epsilon=target, target_delta=1e-5, **setting)
    reached = epsilon_for(noise_multiplier=z, target_delta=1e-5, **setting)
    assert target - 1e-3 <= reached <= target
    assert epsilon_for(noise_multiplier=z * (1 - 1e-3), target_delta=1e-5, **setting) > target


def test_unreachable_or_meaningless_targets_are_refused():
    common = {"target_delta": 1e-5, "sample_size": 10, "population": 100, "sampling": "none"}
    with pytest.raises(AccountingError, match="unreachable"):
        calibrate_noise_multiplier(target_epsilon=1e-4, rounds=10, accountant="rdp", **common)
    with pytest.raises(AccountingError, match="so loose"):
        calibrate_noise_multiplier(target_epsilon=1e4, rounds=1, accountant="rdp", **common)
    with pytest.raises(AccountingError, match="use accountant='rdp'"):
        calibrate_noise_multiplier(
            target_epsilon=1.0,
            target_delta=1e-5,
            rounds=10,
            sample_size=10,
            population=100,
            sampling="without-replacement",
            accountant="pld",
        )


def test_fixed_size_sampling_accounts_twice_the_sensitivity(capsys):
    # z is noise std / C (dp.noise-multiplier); replacing one client moves the sum by 2C.
    reference = RdpAccountant(RDP_ORDERS, dp_accounting.NeighboringRelation.REPLACE_ONE)
    reference.compose(
        dp_accounting.SampledWithoutReplacementDpEvent(5, 3, dp_accounting.GaussianDpEvent(1.0)), 4
    )
    epsilon = epsilon_for(
        noise_multiplier=2.0,
        target_delta=1e-5,
        rounds=4,
        sample_size=3,
        population=5,
        sampling="without-replacement",
        accountant="rdp",
    )
    assert epsilon == reference.get_epsilon(1e-5)
    assert (
        main(
            [
                "--noise-multiplier",
                "2",
                "--sample-size",
                "3",
                "--population",
                "5",
                "--rounds",
                "4",
                "--sampling",
                "without-replacement",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["accounted_noise_multiplier"] == 1.0 and report["epsilon"] == epsilon


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "privacy.budget", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_both_modes_agree(capsys):
    # In this process: `python -m privacy.budget` itself runs in test_cli_bad_flags_exit_2.
    setting = ["--sample-size", "20", "--population", "500", "--rounds", "100"]
    assert main(["--noise-multiplier", "1.5", *setting]) == 0
    forward = json.loads(capsys.readouterr().out)
    assert forward["noise_multiplier"] == 1.5 and forward["delta"] == 1e-5
    assert (forward["accountant"], forward["sampling"], forward["rounds"]) == (
        "rdp",
        "poisson",
        100,
    )
    assert forward["neighboring_relation"] == "add-or-remove-one"
    assert forward["epsilon"] == epsilon_for(
        noise_multiplier=1.5,
        target_delta=1e-5,
        rounds=100,
        sample_size=20,
        population=500,
        sampling="poisson",
        accountant="rdp",
    )
    assert main(["--target-epsilon", repr(forward["epsilon"]), *setting]) == 0
    inverse = json.loads(capsys.readouterr().out)
    assert inverse["noise_multiplier"] == pytest.approx(1.5, abs=1e-4)
    assert inverse["epsilon"] == pytest.approx(forward["epsilon"], abs=1e-3)
    assert inverse["epsilon"] <= forward["epsilon"]


def test_cli_bad_flags_exit_2():
    both = _cli(
        "--noise-multiplier",
        "1",
        "--target-epsilon",
        "1",
        "--sample-size",
        "1",
        "--population",
        "2",
        "--rounds",
        "1",
    )
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        ([], "one of the arguments --noise-multiplier --target-epsilon is required"),
        (["--noise-multiplier", "1", "--sampling", "shuffle"], "invalid choice: 'shuffle'"),
        (
            [
                "--noise-multiplier",
                "1",
                "--sampling",
                "without-replacement",
                "--accountant",
                "pld",
            ],
            "use accountant='rdp'",
        ),
        # Without sampling: the same bracket search, on closed-form RDP (Poisson's: 5 s).
        (["--target-epsilon", "1e-5", "--sampling", "none"], "unreachable"),
        (["--noise-multiplier", "1", "--delta", "2"], "--delta in (0, 1)"),
        (["--noise-multiplier", "1", "--rounds", "0"], "count must be an integer >= 1"),
    ],
)
def test_cli_errors_name_the_flag_and_exit_2(args, message, capsys):
    defaults = ["--sample-size", "10", "--population", "100", "--rounds", "10"]
    with pytest.raises(SystemExit) as info:
        main(defaults + args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "--sampling {poisson,without-replacement,none}" in err


def test_rdp_calibration_composes_each_multiplier_once_and_agrees_with_dp_accounting():
    # dp-accounting's calibration asks again for the bracket's ends and its root; each
    # z is composed once here, and the z found is the one its own search finds.
    from dp_accounting import mechanism_calibration

    from privacy import calibration

    def releases(z: float) -> list:
        return [calibration._release(z, rounds=50, sample_size=5, population=5, sampling="none")]

    tried: list[float] = []

    def counted(z: float) -> list:
        tried.append(z)
        return releases(z)

    neighboring = "add-or-remove-one"
    z = calibration.calibrate_parameter(
        counted, target_epsilon=3.0, target_delta=1e-5, accountant="rdp",
        neighboring=neighboring, tolerance=1e-6,
    )  # fmt: skip

    assert len(tried) == len(set(tried)) >= 5  # 1, 2, 4 bracket; brentq's own points

    def fresh():
        return RdpAccountant(RDP_ORDERS, dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)

    def event(p: float):
        return dp_accounting.ComposedDpEvent(
            [calibration.to_dp_event(r, neighboring) for r in releases(p)]
        )

    low, high = calibration._bracket(lambda p: fresh().compose(event(p)).get_epsilon(1e-5), 3.0)
    direct = mechanism_calibration.calibrate_dp_mechanism(
        fresh, event, 3.0, 1e-5,
        bracket_interval=mechanism_calibration.ExplicitBracketInterval(low, high), tol=1e-6,
    )  # fmt: skip
    assert z == direct
    assert fresh().compose(event(z)).get_epsilon(1e-5) <= 3.0
