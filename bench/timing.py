"""Timing helper shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from importlib import metadata


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` in ms over ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def machine_info(package: str, *extra: str) -> str:
    """CPU, library versions (with ``package``'s) and thread counts, then ``extra``
    lines, as markdown bullets."""
    import flwr
    import numpy as np
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return "\n".join(
        [
            f"- CPU: {platform.processor() or platform.machine()}, os.cpu_count() = "
            f"{os.cpu_count()}, usable = {len(os.sched_getaffinity(0))}; GPU: {gpu}",
            f"- python {platform.python_version()}, numpy {np.__version__}, torch "
            f"{torch.__version__}, flwr {flwr.__version__}, {package} "
            f"{metadata.version(package)}",
            f"- torch threads {torch.get_num_threads()} (interop "
            f"{torch.get_num_interop_threads()}); OMP_NUM_THREADS = "
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}",
            *(f"- {line}" for line in extra),
        ]
    )
