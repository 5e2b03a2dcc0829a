"""Flower's SuperNode with a shorter wait between pulls: ``python -m deploy.supernode``.

It runs ``flower-supernode`` unchanged (same options, code and log) after replacing
the ``time`` module Flower's SuperNode loop sees with ``PollClock`` (why: the
package docstring); ``check_flower`` first requires Flower 1.42's (or 1.41's, the same) loop with
exactly the waits it replaces. ``ActivationRetry`` retries an activation the
SuperLink refuses right after a restart (ApiError 2004). ``--heartbeat-interval``
sets the node's heartbeat (Flower: 30 s; the SuperLink lists a node offline after two
missed). Use it as ``flower-supernode``, with more options::

    python -m deploy.supernode --poll-interval 0.5 --superlink superlink.lab.example:9093 ...

Details and measurements: docs/deploy.md, "The warm executor".
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import sys
import time
from collections.abc import Callable, Sequence
from logging import ERROR, INFO, WARNING
from types import ModuleType
from typing import Any

# The SuperNode loops this was written against (the same source in both series)
FLOWER_SERIES = ("1.41.", "1.42.")
# The waits of start_client_internal in Flower 1.41/1.42: seconds -> how many calls
PULL_WAIT = 3.0  # after a pull that brought no message
REPLY_WAIT = 0.5  # between two looks at the node's state for the reply and its objects
FLOWER_WAITS = {PULL_WAIT: 1, REPLY_WAIT: 2}
DEFAULT_POLL_INTERVAL = 0.5
DEFAULT_REPLY_POLL_INTERVAL = 0.05
# Flower 1.41/1.42: a node is offline HEARTBEAT_PATIENCE (2) x HEARTBEAT_DEFAULT_INTERVAL
# (30 s) after its last heartbeat; 15 s more for the SuperLink to notice.
DEFAULT_ACTIVATION_WAIT = 75.0
DEFAULT_ACTIVATION_RETRY_INTERVAL = 2.0  # one refused request each: cheap, and a rejoin
# comes at most this long after the SuperLink lists the crashed node offline
# The node's heartbeat interval: announced at activation and with each heartbeat
# (flwr.supernode.fleet_http_connection) and the pace of Flower's sender
# (flwr.supercore.heartbeat); the SuperLink accepts [10, 1800] s.
FLOWER_HEARTBEAT_INTERVAL = 30.0
HEARTBEAT_INTERVAL_RANGE = (10.0, 1800.0)
HEARTBEAT_MODULES = ("flwr.supernode.fleet_http_connection", "flwr.supercore.heartbeat")
ACTIVATION_FAILED = 2004  # ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED (HTTP 412)


class PollClock:
    """The ``time`` that ``start_client_internal`` sees: its 3 s and 0.5 s waits
    shortened, everything else the real ``time``."""

    def __init__(self, poll_interval: float, reply_poll_interval: float) -> None:
        self.poll_interval = poll_interval
        self.reply_poll_interval = reply_poll_interval

    def sleep(self, seconds: float) -> None:
        if seconds == PULL_WAIT:
            seconds = self.poll_interval
        elif seconds == REPLY_WAIT:
            seconds = self.reply_poll_interval
        time.sleep(seconds)

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def activation_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is the SuperLink's answer 2004 (HTTP 412) to an activation: the
    node is still online (a crashed predecessor not yet marked offline) or its key is
    not registered."""
    response = getattr(exc, "response", None)
    if getattr(response, "status_code", None) != 412:
        return False
    try:
        payload = json.loads(response.text)
    except (ValueError, TypeError):
        return False
    return isinstance(payload, dict) and payload.get("code") == ACTIVATION_FAILED


class ActivationRetry:
    """Wraps the Fleet client's ``ActivateNode``: a refusal 2004 is retried every
    ``interval`` seconds until ``wait`` seconds have passed since the first one, with
    a log line; then (or on any other error) the error goes on to Flower's SuperNode."""

    def __init__(
        self,
        wait: float,
        interval: float = DEFAULT_ACTIVATION_RETRY_INTERVAL,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        log: Callable[..., None] | None = None,
    ) -> None:
        self.wait, self.interval = wait, interval
        self.clock, self.sleep = clock, sleep
        self.log = log
        self.retries = 0

    def _log(self, level: int, message: str, *args: Any) -> None:
        if self.log is None:
            from flwr.common.logger import log

            self.log = log
        self.log(level, message, *args)

    def __call__(self, activate: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(activate)
        def activate_with_retry(*args: Any, **kwargs: Any) -> Any:
            deadline = None
            while True:
                try:
                    return activate(*args, **kwargs)
                except Exception as exc:
                    if not activation_refused(exc):
                        raise
                    now = self.clock()
                    if deadline is None:
                        deadline = now + self.wait
                        self._log(
                            WARNING,
                            "deploy.supernode: the SuperLink refused to activate this node "
                            "(2004): it still counts a previous SuperNode with this key "
                            "as online (one that crashed within the last ~60 s, or is "
                            "still running), or the key is not registered; retrying "
                            "every %g s for up to %g s ('--activation-wait')",
                            self.interval,
                            self.wait,
                        )
                    if now >= deadline:
                        self._log(
                            ERROR,
                            "deploy.supernode: activation still refused after %g s: is another "
                            "SuperNode running with this key, or is the key not registered "
                            "('flwr supernode register')?",
                            self.wait,
                        )
                        raise
                    self.retries += 1
                    self.sleep(min(self.interval, deadline - now))

        return activate_with_retry


def sleeps(source: str) -> dict[float | None, int]:
    """The constant arguments of the ``time.sleep(...)`` calls in ``source``, counted;
    calls whose argument is not a number literal count under ``None``."""
    found: dict[float | None, int] = {}
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "sleep"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "time"
        ):
            arg = node.args[0] if len(node.args) == 1 and not node.keywords else None
            ok = isinstance(arg, ast.Constant) and isinstance(arg.value, int | float)
            seconds = float(arg.value) if ok else None
            found[seconds] = found.get(seconds, 0) + 1
    return found


def check_flower(version: str, module: ModuleType) -> None:
    """Refuse (``SystemExit``) unless ``module`` is Flower 1.41/1.42's SuperNode loop with
    exactly the waits this command shortens."""
    if not version.startswith(FLOWER_SERIES):
        raise SystemExit(
            f"deploy.supernode: written for the SuperNode loop of Flower "
            f"{' and '.join(s + 'x' for s in FLOWER_SERIES)}, this is "
            f"Flower {version}; run flower-supernode instead"
        )
    waits = sleeps(inspect.getsource(module))
    if waits != FLOWER_WAITS:
        raise SystemExit(
            f"deploy.supernode: {module.__name__} waits {waits} (seconds: calls), not "
            f"{FLOWER_WAITS}; run flower-supernode instead"
        )


def set_heartbeat_interval(seconds: float) -> None:
    """Make this process's SuperNode announce and keep a heartbeat every ``seconds``
    (Flower: 30), or refuse (``SystemExit``) unless Flower reads the interval from the
    two module constants this replaces. In a SuperNode's process the only heartbeat
    sender is the node's: each ClientApp's runs in the ClientApp's own process."""
    import importlib

    modules = [importlib.import_module(name) for name in HEARTBEAT_MODULES]
    for module in modules:
        if getattr(module, "HEARTBEAT_DEFAULT_INTERVAL", None) != FLOWER_HEARTBEAT_INTERVAL:
            raise SystemExit(
                f"deploy.supernode: {module.__name__} has no HEARTBEAT_DEFAULT_INTERVAL = "
                f"{FLOWER_HEARTBEAT_INTERVAL:g}; run without --heartbeat-interval"
            )
    for module in modules:
        module.HEARTBEAT_DEFAULT_INTERVAL = seconds


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our two options; the rest is ``flower-supernode``'s, passed on unchanged."""
    parser = argparse.ArgumentParser(
        prog="python -m deploy.supernode",
        description="flower-supernode with a shorter wait between pulls from the "
        "SuperLink (Flower waits 3 s). Every other option is flower-supernode's "
        "(flower-supernode --help).",
        allow_abbrev=False,  # a prefix of one of flower-supernode's options is theirs
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=DEFAULT_POLL_INTERVAL,
        help="seconds after a pull that brought no message (Flower: 3; default: %(default)s)",
    )
    parser.add_argument(
        "--reply-poll-interval",
        type=float,
        default=DEFAULT_REPLY_POLL_INTERVAL,
        help="seconds between two looks for the ClientApp's reply (Flower: 0.5; "
        "default: %(default)s)",
    )
    parser.add_argument(
        "--activation-wait",
        type=float,
        default=DEFAULT_ACTIVATION_WAIT,
        help="seconds to keep retrying an activation the SuperLink refuses (2004: the "
        "node of a crashed SuperNode with this key is not yet offline); 0: do not retry "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--activation-retry-interval",
        type=float,
        default=DEFAULT_ACTIVATION_RETRY_INTERVAL,
        help="seconds between two activation attempts (default: %(default)s)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=FLOWER_HEARTBEAT_INTERVAL,
        help="seconds between the node's heartbeats as announced to the SuperLink, which "
        "lists the node offline after two missed; a crashed SuperNode's node is then "
        "offline, its pending messages answered with an error, after twice this "
        "(Flower: 30; default: %(default)s)",
    )
    args, rest = parser.parse_known_args(argv)
    low, high = HEARTBEAT_INTERVAL_RANGE
    if not low <= args.heartbeat_interval <= high:
        parser.error(
            f"--heartbeat-interval = {args.heartbeat_interval} must be in [{low:g}, {high:g}] "
            "seconds (the SuperLink's range)"
        )
    if not 0 <= args.activation_wait <= 3600:
        parser.error(f"--activation-wait = {args.activation_wait} must be in [0, 3600] seconds")
    if not 0.1 <= args.activation_retry_interval <= 60:
        parser.error(
            f"--activation-retry-interval = {args.activation_retry_interval} must be in "
            "[0.1, 60] seconds"
        )
    if not 0.05 <= args.poll_interval <= 60:
        parser.error(f"--poll-interval = {args.poll_interval} must be in [0.05, 60] seconds")
    if not 0.01 <= args.reply_poll_interval <= 5:
        parser.error(
            f"--reply-poll-interval = {args.reply_poll_interval} must be in [0.01, 5] seconds"
        )
    return args, rest


def main(argv: Sequence[str] | None = None) -> None:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    # Imported here: `--help` and a bad option answer without importing Flower.
    import flwr.supernode.start_client_internal as loop
    from flwr.common.logger import log
    from flwr.supercore.version import package_version
    from flwr.supernode.cli import flower_supernode

    check_flower(package_version, loop)
    loop.time = PollClock(args.poll_interval, args.reply_poll_interval)
    if args.heartbeat_interval != FLOWER_HEARTBEAT_INTERVAL:
        set_heartbeat_interval(args.heartbeat_interval)
    if args.activation_wait > 0:
        from flwr.supernode.fleet_http_client import FleetHttpClient

        retry = ActivationRetry(args.activation_wait, args.activation_retry_interval)
        FleetHttpClient.ActivateNode = retry(FleetHttpClient.ActivateNode)
    log(
        INFO,
        "deploy.supernode: pulling again %.2f s after a pull that brought no message "
        "(Flower: %g s), looking for replies every %.2f s (Flower: %g s), heartbeat "
        "every %g s (Flower: %g s)",
        args.poll_interval, PULL_WAIT, args.reply_poll_interval, REPLY_WAIT,
        args.heartbeat_interval, FLOWER_HEARTBEAT_INTERVAL,
    )  # fmt: skip
    sys.argv = ["flower-supernode", *rest]
    flower_supernode()


if __name__ == "__main__":
    main()
