"""``python -m lab <command>``: the lab's command-line tools by name.

python -m lab check --run-config "preset='digits-dp-eps8'"   # lab.check
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "check": "lab.check",  # validate a flwr run's run-config and federation
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to ``lab.<command>.main``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(
            "usage: python -m lab {" + ",".join(COMMANDS) + "} ...  (each has --help)",
            file=sys.stderr,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return int(importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
