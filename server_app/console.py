"""A quieter console: Flower's per-round chatter at debug level unless asked for.

Flower's strategies log, every round, ``configure_train: Sampled 5 nodes (out of 5)``
and ``aggregate_train: Received 5 results and 0 failures`` (and the same for
evaluation). The app samples clients itself and prints one progress line per round, so
those lines repeat it, or contradict it (Flower's count is of its own sampling, which
the app's strategies replace). :func:`quiet_flower_rounds` demotes them to DEBUG on
Flower's logger; ``log.flower-rounds = true`` keeps them. Replies with errors are still
logged (Flower's ``Received error in reply`` lines).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import ClassVar

from flwr.common.logger import FLOWER_LOGGER

from config.settings import Settings, setting

CHATTER = re.compile(
    r"^(configure_(train|evaluate): Sampled \d+ nodes|aggregate_(train|evaluate): Received \d+)"
)


@dataclass(frozen=True)
class ConsoleSettings(Settings):
    """The console keys (``log.*``)."""

    PREFIX: ClassVar[str] = "log"
    flower_rounds: bool = setting(
        False,
        "Show Flower's per-round lines (sampled nodes, received results) at INFO; "
        "false: at DEBUG (the app's progress line says the same).",
    )


class RoundChatter(logging.Filter):
    """Turns Flower's per-round INFO lines into DEBUG records (dropped unless the
    logger shows DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not CHATTER.match(record.getMessage()):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return FLOWER_LOGGER.isEnabledFor(logging.DEBUG)


_FILTER = RoundChatter()


def quiet_flower_rounds(show: bool) -> None:
    """Demote Flower's per-round lines (``show`` false) or show them (true)."""
    FLOWER_LOGGER.removeFilter(_FILTER)
    if not show:
        FLOWER_LOGGER.addFilter(_FILTER)
