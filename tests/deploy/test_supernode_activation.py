"""``python -m deploy.supernode`` retries an activation the SuperLink refuses with 2004.

A SuperNode restarted within about a minute of a crash finds its node still
``online`` at the SuperLink (``activate_node`` accepts only registered or offline
nodes); Flower's SuperNode then exits with code 305. :class:`ActivationRetry` wraps
Flower's own Fleet HTTP client (``FleetHttpClient.ActivateNode``), here talking to a
stand-in SuperLink (``httpx.MockTransport``) that answers as Flower's does: HTTP 412
with ``{"code": 2004, "detail": "Failed to activate SuperNode."}`` until the node is
offline, then the node id. Time is a fake clock; nothing sleeps.
"""

from __future__ import annotations

import inspect

import httpx
import pytest
from flwr.proto.fleet_pb2 import ActivateNodeRequest, ActivateNodeResponse
from flwr.supercore.error import ApiErrorCode
from flwr.supernode.fleet_http_client import FleetHttpClient

from deploy import supernode

REFUSED = {"code": 2004, "detail": "Failed to activate SuperNode."}
NODE_ID = 4242


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _client(refusals: int, answer: dict | None = None) -> tuple[FleetHttpClient, list[str]]:
    """Flower's Fleet client against a SuperLink that refuses ``refusals`` activations
    (with ``answer``, default 2004) and then activates node NODE_ID."""
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) <= refusals:
            return httpx.Response(412, json=answer or REFUSED)
        body = ActivateNodeResponse(node_id=NODE_ID).SerializeToString()
        return httpx.Response(200, content=body)

    client = FleetHttpClient("http://superlink.test:9092")
    client._client = httpx.Client(transport=httpx.MockTransport(handler))
    return client, calls


def _retrying(monkeypatch, wait: float, interval: float = 5.0):
    clock, lines = FakeClock(), []
    retry = supernode.ActivationRetry(
        wait, interval, clock=clock, sleep=clock.sleep, log=lambda *a: lines.append(a)
    )
    flowers = inspect.unwrap(FleetHttpClient.ActivateNode)
    monkeypatch.setattr(FleetHttpClient, "ActivateNode", retry(flowers))
    return retry, clock, lines


def _activate(client: FleetHttpClient) -> ActivateNodeResponse:
    return client.ActivateNode(ActivateNodeRequest(public_key=b"k", heartbeat_interval=30))


def test_the_constant_is_flowers_code():
    assert ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED == supernode.ACTIVATION_FAILED


def test_flowers_client_alone_fails_on_the_first_refusal():
    client, calls = _client(refusals=1)
    with pytest.raises(httpx.HTTPStatusError) as raised:
        _activate(client)
    assert raised.value.response.status_code == 412
    assert supernode.activation_refused(raised.value)
    assert calls == ["/v1/fleet/activate-node"]


def test_refusals_are_retried_until_the_node_is_offline(monkeypatch):
    retry, clock, lines = _retrying(monkeypatch, wait=75.0, interval=5.0)
    client, calls = _client(refusals=11)  # offline after 55 s of refusals
    assert _activate(client).node_id == NODE_ID
    assert len(calls) == 12
    assert clock.slept == [5.0] * 11 and retry.retries == 11
    ((level, text, *args),) = lines  # one line, at the first refusal
    assert level == supernode.WARNING
    assert "refused to activate this node (2004)" in text and args == [5.0, 75.0]


def test_the_wait_is_bounded_then_flowers_error_goes_on(monkeypatch):
    _, clock, lines = _retrying(monkeypatch, wait=12.0, interval=5.0)
    client, calls = _client(refusals=100)
    with pytest.raises(httpx.HTTPStatusError):
        _activate(client)
    # Refused at t = 0, 5, 10 and 12 s (the last sleep is what is left of the wait).
    assert clock.slept == [5.0, 5.0, 2.0]
    assert len(calls) == 4
    assert [line[0] for line in lines] == [supernode.WARNING, supernode.ERROR]
    assert "not registered" in lines[-1][1]


@pytest.mark.parametrize(
    ("status", "answer"),
    [
        (412, {"code": 2003, "detail": "another precondition"}),
        (401, {"code": 2004, "detail": "not the 412 of a refused activation"}),
    ],
)
def test_other_errors_are_not_retried(monkeypatch, status, answer):
    _, clock, lines = _retrying(monkeypatch, wait=75.0)
    calls: list[int] = []

    def handler(request):
        calls.append(1)
        return httpx.Response(status, json=answer)

    client = FleetHttpClient("http://superlink.test:9092")
    client._client = httpx.Client(transport=httpx.MockTransport(handler))
    with pytest.raises(httpx.HTTPStatusError):
        _activate(client)
    assert len(calls) == 1 and clock.slept == [] and lines == []


def test_options_are_checked_and_passed_over():
    args, rest = supernode.parse_args(["--activation-wait", "30", "--insecure"])
    assert args.activation_wait == 30.0 and rest == ["--insecure"]
    assert supernode.parse_args([])[0].activation_wait == supernode.DEFAULT_ACTIVATION_WAIT
    with pytest.raises(SystemExit):
        supernode.parse_args(["--activation-wait", "-1"])
    with pytest.raises(SystemExit):
        supernode.parse_args(["--activation-retry-interval", "0"])
