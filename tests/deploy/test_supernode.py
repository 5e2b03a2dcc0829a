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


def test_heartbeat_interval_is_checked_and_not_passed_on(capsys):
    args, rest = supernode.parse_args(["--heartbeat-interval", "10", "--insecure"])
    assert args.heartbeat_interval == 10.0 and rest == ["--insecure"]
    assert supernode.parse_args([])[0].heartbeat_interval == 30.0  # Flower's
    for value in ("9.5", "1801"):
        with pytest.raises(SystemExit):
            supernode.parse_args(["--heartbeat-interval", value])
        assert f"--heartbeat-interval = {float(value)} must be in [10, 1800]" in (
            capsys.readouterr().err
        )


@pytest.fixture
def heartbeat_restored(monkeypatch):
    """Flower's heartbeat constants as installed, put back after the test."""
    import flwr.supercore.heartbeat
    import flwr.supernode.fleet_http_connection

    for module in (flwr.supernode.fleet_http_connection, flwr.supercore.heartbeat):
        assert module.HEARTBEAT_DEFAULT_INTERVAL == 30  # Flower 1.41/1.42
        monkeypatch.setattr(module, "HEARTBEAT_DEFAULT_INTERVAL", 30)


class _OneWait:
    """A stop event whose first wait is recorded and stops the sender."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def is_set(self) -> bool:
        return bool(self.waits)

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        return True


def _sender_wait() -> float:
    """The wait after a successful heartbeat of Flower's HeartbeatSender."""
    from flwr.supercore.heartbeat import HeartbeatSender

    sender = HeartbeatSender(lambda: True)
    sender._stop_event = _OneWait()  # _run sends, then waits on it
    sender._run()
    (wait,) = sender._stop_event.waits
    return wait


def test_the_sender_keeps_the_announced_interval(heartbeat_restored):
    # Flower: (interval - 5 s call timeout) x U(0.7, 0.9); offline after 2 x interval.
    assert 17.5 <= _sender_wait() <= 22.5
    supernode.set_heartbeat_interval(10)
    assert all(3.5 <= _sender_wait() <= 4.5 for _ in range(20))


def test_activation_and_heartbeats_announce_the_interval(heartbeat_restored, monkeypatch):
    from flwr.proto.fleet_pb2 import ActivateNodeResponse, DeactivateNodeResponse
    from flwr.proto.heartbeat_pb2 import SendNodeHeartbeatResponse
    from flwr.supercore.primitives.asymmetric import generate_key_pairs
    from flwr.supernode.fleet_http_connection import http_request_response

    announced: list[tuple[str, float]] = []

    def activate(self, request):
        announced.append(("activate", request.heartbeat_interval))
        return ActivateNodeResponse(node_id=7)

    def heartbeat(self, request):
        announced.append(("heartbeat", request.heartbeat_interval))
        return SendNodeHeartbeatResponse(success=True)

    monkeypatch.setattr(FleetHttpClient, "ActivateNode", activate)
    monkeypatch.setattr(FleetHttpClient, "SendNodeHeartbeat", heartbeat)
    monkeypatch.setattr(FleetHttpClient, "DeactivateNode", lambda *_: DeactivateNodeResponse())
    supernode.set_heartbeat_interval(12.5)
    with http_request_response(
        "127.0.0.1:9", insecure=True, authentication_keys=generate_key_pairs()
    ) as connection:
        assert connection[0] == 7
        deadline = time.monotonic() + 10
        while len(announced) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert announced == [("activate", 12.5), ("heartbeat", 12.5)]


def test_heartbeat_interval_refused_unless_flower_reads_it_there(heartbeat_restored, monkeypatch):
    import flwr.supercore.heartbeat

    monkeypatch.delattr(flwr.supercore.heartbeat, "HEARTBEAT_DEFAULT_INTERVAL")
    with pytest.raises(SystemExit, match=r"flwr\.supercore\.heartbeat has no HEARTBEAT"):
        supernode.set_heartbeat_interval(10)
    import flwr.supernode.fleet_http_connection as connection

    assert connection.HEARTBEAT_DEFAULT_INTERVAL == 30  # nothing changed


def test_main_sets_the_heartbeat_interval_only_when_asked(heartbeat_restored, monkeypatch):
    import flwr.supercore.heartbeat
    import flwr.supernode.fleet_http_connection as connection

    monkeypatch.setattr(flwr.supernode.cli, "flower_supernode", lambda: None)
    monkeypatch.setattr(loop, "time", loop.time)
    monkeypatch.setattr(FleetHttpClient, "ActivateNode", FleetHttpClient.ActivateNode)
    monkeypatch.setattr(sys, "argv", sys.argv)
    supernode.main(["--insecure"])
    assert connection.HEARTBEAT_DEFAULT_INTERVAL == 30
    supernode.main(["--insecure", "--heartbeat-interval", "10"])
    assert connection.HEARTBEAT_DEFAULT_INTERVAL == 10
    assert flwr.supercore.heartbeat.HEARTBEAT_DEFAULT_INTERVAL == 10
