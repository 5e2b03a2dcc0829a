"""What one virtual node's run config costs the simulation's ServerApp process (issue 26).

Flower 1.41's simulation engine (``vce_api._register_node_info_stores``) registers a
``DeprecatedRunInfoStore`` per virtual SuperNode, and each one parses the app's
``pyproject.toml`` (``get_fused_config_from_dir``) and keeps the fused run config twice:
as ``initial_run_config`` and as the node's ``Context.run_config`` (a copy). Nothing is
shared between nodes, so the process that hosts the engine (the ServerApp's) grows by
two run configs per node, and start-up parses ``pyproject.toml`` N times. This measures
both with Flower's own function, for this app and for the peer app::

    python bench/run_config_cost.py --peer ../shared/peers/flower_digits

Memory is what ``tracemalloc`` traces for 200 nodes' configs (both copies), per node.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from pathlib import Path

from flwr.common.config import get_fused_config_from_dir

ROOT = Path(__file__).resolve().parent.parent
NODES = 200


def per_node(app: Path) -> dict[str, float]:
    """Keys, parse time (ms) and traced memory (KiB) of one node's two run configs."""
    keys = len(get_fused_config_from_dir(app, {}))
    started = time.perf_counter()
    for _ in range(NODES):
        get_fused_config_from_dir(app, {})
    parse_ms = (time.perf_counter() - started) / NODES * 1e3
    tracemalloc.start()
    try:
        configs = [get_fused_config_from_dir(app, {}) for _ in range(NODES)]
        copies = [config.copy() for config in configs]  # the Context's run_config
        traced, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del configs, copies
    return {"keys": keys, "parse (ms)": parse_ms, "memory (KiB)": traced / NODES / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", type=Path, help="another Flower app's directory")
    args = parser.parse_args()
    apps = {"this app": ROOT, **({"peer": args.peer} if args.peer else {})}
    print(
        "| app | run-config keys | parse per node (ms) | memory per node (KiB) "
        "| MiB per 1 000 nodes |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, path in apps.items():
        cost = per_node(path)
        print(
            f"| {name} | {cost['keys']} | {cost['parse (ms)']:.2f} | "
            f"{cost['memory (KiB)']:.1f} | {cost['memory (KiB)'] * 1000 / 1024:.1f} |"
        )


if __name__ == "__main__":
    main()
