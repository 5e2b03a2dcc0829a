"""strategies.runtime.messaging.send_and_receive: every reply, soon, and no later than asked.

Time is a virtual clock (``clock`` fixture): ``time.sleep`` advances it exactly, so the
poll schedule is checked to the microsecond whatever the machine's load.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from strategies.runtime import messaging


class Clock:
    """``time.monotonic``, ``time.sleep`` and ``time.thread_time`` on a virtual clock:
    sleeping costs no CPU time, a grid's pull may cost some (``work``)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.cpu = 0.0

    def monotonic(self) -> float:
        return self.now

    def thread_time(self) -> float:
        return self.cpu

    def work(self, seconds: float) -> None:
        self.now += seconds
        self.cpu += seconds

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(messaging, "time", fake)
    return fake


def _reply(message_id: str):
    return SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=message_id))


class PollingGrid:
    """Replies to message ``i`` become available ``ready_after[i]`` seconds after the
    push (``None``: never)."""

    def __init__(self, ready_after: list[float | None], clock: Clock) -> None:
        self.time = clock
        self.ready_after = ready_after
        self.pulls: list[float] = []
        self.delivered: set[str] = set()

    def push_messages(self, messages):
        self.pushed_at = self.time.monotonic()
        return [str(i) for i, _ in enumerate(messages)]

    def pull_messages(self, message_ids):
        now = self.time.monotonic()
        self.pulls.append(now - self.pushed_at)
        out = []
        for mid in sorted(message_ids):
            ready = self.ready_after[int(mid)]
            if mid not in self.delivered and ready is not None and now - self.pushed_at >= ready:
                self.delivered.add(mid)
                out.append(_reply(mid))
        return out


def test_returns_every_reply_once_soon_after_it_arrives(clock):
    grid = PollingGrid([0.0, 0.05, 0.12], clock)
    replies = messaging.send_and_receive(grid, [object()] * 3, timeout=10)
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["0", "1", "2"]
    # The last reply was ready at 0.12 s: found within one poll interval after it
    # (the intervals grow 1.1x from 2 ms, so the one in force there is < 0.015 s).
    assert 0.12 <= grid.pulls[-1] < 0.12 + 0.015
    gaps = [b - a for a, b in zip(grid.pulls, grid.pulls[1:], strict=False)]
    assert gaps[0] < 0.02  # first polls come fast ...
    assert all(gap <= messaging.MAX_POLL + 0.05 for gap in gaps)  # ... and never slower than this


def test_a_silent_node_costs_the_timeout_and_no_more(clock):
    grid = PollingGrid([0.0, None], clock)
    started = clock.monotonic()
    replies = messaging.send_and_receive(grid, [object()] * 2, timeout=0.3)
    assert [r.metadata.reply_to_message_id for r in replies] == ["0"]
    assert clock.monotonic() - started == pytest.approx(0.3, abs=1e-9)


def test_waits_back_off_to_max_poll(clock):
    grid = PollingGrid([None], clock)
    messaging.send_and_receive(grid, [object()], timeout=4.0, max_poll=0.2)
    gaps = [b - a for a, b in zip(grid.pulls, grid.pulls[1:], strict=False)]
    assert max(gaps) == pytest.approx(0.2, abs=1e-9)
    assert gaps[:3] == pytest.approx([0.002, 0.0022, 0.00242])  # 1.1x from 2 ms
    # ~49 pulls to reach 0.2 s apart (at 1.98 s), then 5 a second: not a busy loop
    assert len(grid.pulls) < 65


class InMemoryGrid(PollingGrid):
    """Named as Flower's simulation grid, whose pulls are in-process."""


@pytest.mark.parametrize(
    ("grid_class", "cap"),
    [(PollingGrid, messaging.MAX_POLL), (InMemoryGrid, messaging.SIMULATION_MAX_POLL)],
)
def test_the_longest_wait_between_pulls_is_the_grids(clock, grid_class, cap):
    # One reply, ready 20 s after the push: a long client-round
    grid = grid_class([20.0], clock)
    messaging.send_and_receive(grid, [object()], timeout=None)
    gaps = [b - a for a, b in zip(grid.pulls, grid.pulls[1:], strict=False)]
    assert max(gaps) == pytest.approx(cap, abs=1e-9)
    # Found within one capped interval of arriving: 0.5 s deployed, 0.05 s simulated
    assert 20.0 <= grid.pulls[-1] <= 20.0 + cap + 1e-9


class CostlyGrid(PollingGrid):
    """A grid whose pull takes ``per_pending`` seconds of CPU for each message still
    pending, as Flower's in-memory LinkState checks each one in the caller's thread."""

    def __init__(self, ready_after, clock, per_pending: float) -> None:
        super().__init__(ready_after, clock)
        self.per_pending = per_pending
        self.pulling = 0.0  # seconds spent inside pulls

    def pull_messages(self, message_ids):
        message_ids = list(message_ids)
        out = super().pull_messages(message_ids)
        cost = self.per_pending * len(message_ids)
        self.time.work(cost)
        self.pulling += cost
        return out


def test_pulls_take_at_most_their_share_of_the_wait_however_many_are_pending(clock):
    # 2 000 clients, all replying at 30 s; a pull costs 5 us per pending ID: 10 ms,
    # what Flower's in-memory LinkState took on this VM (9.5 ms; studies/lunar-lands)
    grid = CostlyGrid([30.0] * 2000, clock, per_pending=5e-6)
    started = clock.monotonic()
    cap = messaging.SIMULATION_MAX_POLL
    replies = messaging.send_and_receive(grid, [object()] * 2000, timeout=None, max_poll=cap)
    assert len(replies) == 2000
    elapsed = clock.monotonic() - started
    # Each wait is at least 9 pulls long: pulls take 10 % of the time, hand-computed
    # from the steady schedule (a 10 ms pull, then 90 ms asleep), not 17 % at the cap
    assert grid.pulling / elapsed == pytest.approx(0.1, abs=0.005)
    gaps = [b - a for a, b in zip(grid.pulls, grid.pulls[1:], strict=False)]
    assert max(gaps) == pytest.approx(0.01 * 10, abs=1e-9)
    # ... and the replies are seen within one such gap of arriving
    assert 30.0 <= grid.pulls[-1] <= 30.0 + 0.1 + 1e-9


def test_a_cheap_pull_keeps_the_caps_schedule(clock):
    # 1 000 pending at 5 us: a 5 ms pull, whose floor (45 ms) is below the 50 ms cap
    grid = CostlyGrid([20.0] * 1000, clock, per_pending=5e-6)
    cap = messaging.SIMULATION_MAX_POLL
    messaging.send_and_receive(grid, [object()] * 1000, timeout=None, max_poll=cap)
    gaps = [b - a for a, b in zip(grid.pulls, grid.pulls[1:], strict=False)]
    assert max(gaps) == pytest.approx(cap + 0.005, abs=1e-9)  # the pull, then the cap


def test_a_costly_pull_delays_the_next_pull_only(clock):
    class OneCostlyPull(PollingGrid):
        def pull_messages(self, message_ids):
            out = super().pull_messages(message_ids)
            if len(self.pulls) == 30:  # a second of CPU
                self.time.work(1.0)
            return out

    grid = OneCostlyPull([20.0], clock)
    messaging.send_and_receive(grid, [object()], timeout=None, max_poll=0.2)
    gaps = [b - a for a, b in zip(grid.pulls, grid.pulls[1:], strict=False)]
    assert gaps[29] == pytest.approx(1.0 + 9.0)  # the pull's second, then nine asleep
    assert max(gaps[31:]) == pytest.approx(0.2, abs=1e-9)  # then back to the cap


def test_a_pull_that_waits_without_working_does_not_lengthen_the_wait(clock):
    class SlowNetwork(PollingGrid):
        def pull_messages(self, message_ids):
            out = super().pull_messages(message_ids)
            self.time.now += 0.3  # a 300 ms round trip: wall time, no CPU here
            return out

    grid = SlowNetwork([60.0], clock)
    messaging.send_and_receive(grid, [object()], timeout=None, max_poll=0.5)
    gaps = [b - a for a, b in zip(grid.pulls, grid.pulls[1:], strict=False)]
    assert max(gaps) == pytest.approx(0.3 + 0.5, abs=1e-9)  # the trip, then the cap


def test_a_pull_that_brings_replies_does_not_lengthen_the_wait(clock):
    class SlowDownload(PollingGrid):
        def pull_messages(self, message_ids):
            out = super().pull_messages(message_ids)
            self.time.now += 2.0 * len(out)  # each reply takes 2 s to download
            return out

    grid = SlowDownload([10.0, 20.0, 30.0], clock)
    messaging.send_and_receive(grid, [object()] * 3, timeout=None, max_poll=0.2)
    # after each download the next pull comes at the cap, not 18 s later
    assert grid.pulls[-1] == pytest.approx(30.0, abs=0.2 + 1e-9)
    gaps = [b - a for a, b in zip(grid.pulls, grid.pulls[1:], strict=False)]
    assert max(gaps) == pytest.approx(2.0 + 0.2, abs=1e-9)


def test_a_grid_without_push_and_pull_is_asked_with_send_and_receive():
    class Double:
        def send_and_receive(self, messages, *, timeout=None):
            return [_reply("x")] if timeout == 7 else []

    assert [
        r.metadata.reply_to_message_id
        for r in messaging.send_and_receive(Double(), [object()], timeout=7)
    ] == ["x"]


def test_the_superlinks_error_reply_names_the_node_the_message_went_to(clock):
    # A node that went offline: the SuperLink answers for it, as node 1.
    from flwr.app import Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
    from flwr.server.superlink.linkstate.utils import (
        create_message_error_unavailable_res_message,
    )

    sent = Message(RecordDict(), dst_node_id=4242, message_type="train")
    sent.metadata.__dict__["_message_id"] = "0"
    unavailable = create_message_error_unavailable_res_message(sent.metadata, "node_unavail")
    assert unavailable.metadata.src_node_id == SUPERLINK_NODE_ID

    class Grid:
        def push_messages(self, messages):
            return ["0"]

        def pull_messages(self, message_ids):
            return [unavailable]

    (reply,) = messaging.send_and_receive(Grid(), [sent], timeout=1.0)
    assert reply.metadata.src_node_id == 4242 and reply.metadata.reply_to_message_id == "0"
    assert reply.error.code == ErrorCode.NODE_UNAVAILABLE
