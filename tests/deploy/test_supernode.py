"""``python -m deploy.supernode``: Flower's SuperNode loop with shorter waits.

The loop itself (``start_client_internal``) runs here against a stand-in connection
whose pulls bring no message, with ``time.sleep`` recorded instead of slept: patched,
it waits ``--poll-interval`` between pulls; as Flower ships it, 3 s.
``tests/e2e/test_deployment.py`` runs the guide's block that starts it against a
SuperLink, and ``bench/deployed.py`` times it.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import flwr.supernode.cli
import flwr.supernode.start_client_internal as loop
import pytest
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.version import package_version
from flwr.supernode.fleet_http_client import FleetHttpClient
from flwr.supernode.nodestate import NodeStateFactory

from deploy import supernode


class _Stop(Exception):
    """Ends the SuperNode loop after the stand-in's last pull."""


@pytest.fixture
def slept(monkeypatch) -> list[float]:
    """Every ``time.sleep`` call's seconds, none slept."""
    calls: list[float] = []
    monkeypatch.setattr(time, "sleep", calls.append)
    return calls


def _run_loop(monkeypatch, pulls: int) -> None:
    """Flower's SuperNode loop on a connection whose ``pulls`` pulls bring nothing;
    the pull after them stops it."""
    count = 0

    def receive():
        nonlocal count
        count += 1
        if count > pulls:
            raise _Stop
        return None  # no message

    @contextmanager
    def connection(**_):
        unused = lambda *a: pytest.fail("only pulls expected")  # noqa: E731
        yield 7, receive, unused, unused, unused, unused, unused, unused

    monkeypatch.setattr(loop, "_init_connection", connection)
    monkeypatch.setattr(loop, "register_signal_handlers", lambda **_: None)  # pytest's stay
    with pytest.raises(_Stop):
        loop.start_client_internal(
            state_factory=NodeStateFactory(objectstore_factory=ObjectStoreFactory()),
            server_address="127.0.0.1:9092",
            node_config={},
            insecure=True,
            isolation="process",  # starts no SuperExec
        )
    assert count == pulls + 1


def test_flower_waits_3_s_after_an_empty_pull(monkeypatch, slept):
    """The baseline this command changes: Flower as installed (1.41 or 1.42)."""
    _run_loop(monkeypatch, pulls=3)
    assert slept == [3, 3, 3]


def test_the_patched_loop_waits_the_poll_interval(monkeypatch, slept):
    monkeypatch.setattr(loop, "time", supernode.PollClock(0.25, 0.02))
    _run_loop(monkeypatch, pulls=3)
    assert slept == [0.25, 0.25, 0.25]


def test_poll_clock_shortens_only_flowers_two_waits(slept):
    clock = supernode.PollClock(poll_interval=0.4, reply_poll_interval=0.03)
    for seconds in (3, 0.5, 1.0, 0.1):
        clock.sleep(seconds)
    assert slept == [0.4, 0.03, 1.0, 0.1]
    assert clock.monotonic is time.monotonic  # the rest is the real module's


def test_sleeps_counts_each_literal_wait():
    source = textwrap.dedent(
        """
        import time
        def f(x):
            time.sleep(3)
            time.sleep(0.5)
            time.sleep(0.5)
            time.sleep(x)
            time.sleep(seconds=2)
            other.sleep(9)
        """
    )
    assert supernode.sleeps(source) == {3.0: 1, 0.5: 2, None: 2}  # None: not a literal
    assert supernode.sleeps(Path(loop.__file__).read_text()) == supernode.FLOWER_WAITS


def test_check_flower_accepts_the_installed_loop_only(tmp_path):
    supernode.check_flower(package_version, loop)  # Flower 1.42 as pinned (or 1.41)
    supernode.check_flower("1.41.0", loop)  # the same loop
    supernode.check_flower("1.42.0", loop)
    with pytest.raises(SystemExit, match=r"Flower 1\.43\.0; run flower-supernode instead"):
        supernode.check_flower("1.43.0", loop)
    other = tmp_path / "other_loop.py"
    other.write_text("import time\n\ndef wait():\n    time.sleep(3)\n")
    spec = importlib.util.spec_from_file_location("other_loop", other)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit, match=r"other_loop waits \{3\.0: 1\}"):
        supernode.check_flower(package_version, module)


def test_options_pass_through_unchanged():
    args, rest = supernode.parse_args(
        ["--poll-interval", "0.2", "--superlink", "h:9092", "--port", "9094",
         "--node-config", "partition-id=0 num-partitions=3", "--isolation", "process"]
    )  # fmt: skip
    assert (args.poll_interval, args.reply_poll_interval) == (0.2, 0.05)
    assert rest == [
        "--superlink", "h:9092", "--port", "9094",
        "--node-config", "partition-id=0 num-partitions=3", "--isolation", "process",
    ]  # fmt: skip
    _, rest = supernode.parse_args(["--poll", "9"])  # no abbreviations: not ours
    assert rest == ["--poll", "9"]


@pytest.mark.parametrize(
    ("option", "value"),
    [("--poll-interval", "0"), ("--poll-interval", "61"), ("--reply-poll-interval", "0")],
)
def test_out_of_range_intervals_are_refused(option, value, capsys):
    with pytest.raises(SystemExit):
        supernode.parse_args([option, value])
    assert f"{option} = {float(value)} must be in" in capsys.readouterr().err


def test_main_patches_the_loop_then_runs_flower_supernode(monkeypatch):
    seen = {}

    def flower_supernode():
        seen["argv"], seen["time"] = list(sys.argv), loop.time

    monkeypatch.setattr(flwr.supernode.cli, "flower_supernode", flower_supernode)
    monkeypatch.setattr(loop, "time", loop.time)  # restored after the test
    monkeypatch.setattr(FleetHttpClient, "ActivateNode", FleetHttpClient.ActivateNode)
    monkeypatch.setattr(sys, "argv", sys.argv)
    supernode.main(["--insecure", "--poll-interval", "0.3", "--superlink", "h:9092"])
    assert seen["argv"] == ["flower-supernode", "--insecure", "--superlink", "h:9092"]
    # Activation refusals (2004) are retried (tests/deploy/test_supernode_activation.py).
    assert hasattr(FleetHttpClient.ActivateNode, "__wrapped__")
    clock = seen["time"]
    assert isinstance(clock, supernode.PollClock)
    assert (clock.poll_interval, clock.reply_poll_interval) == (0.3, 0.05)
