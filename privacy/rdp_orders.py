"""The RDP orders every accountant of the run evaluates (events, Skellam, calibration)."""

from __future__ import annotations

# RDP orders: dp-accounting's default grid (``DEFAULT_RDP_ORDERS``: 1.1..10.9 by 0.1,
# 11..63, 128..1024; written out so that importing this module does not import
# dp-accounting, and checked against it by tests/privacy/test_accounting.py) plus
# orders just above 1 (weak privacy, large ε), between 64 and 256 and above 1024 (strong
# privacy, small ε). More orders can only lower ε (it is a minimum over orders); orders
# <= 256 cost O(α²) each for sampling without replacement, so they are added sparsely.
RDP_ORDERS: tuple[float, ...] = tuple(
    sorted(
        {1 + x / 10.0 for x in range(1, 100)}
        | {float(a) for a in range(11, 64)}
        | {128.0, 256.0, 512.0, 1024.0}
        | {1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08, 1.09}
        | {72.0, 80.0, 88.0, 96.0, 104.0, 112.0, 120.0, 160.0, 192.0, 224.0}
        | {320.0, 384.0, 448.0, 640.0, 768.0, 896.0, 1536.0, 2048.0, 3072.0, 4096.0}
    )
)
