"""Which arrays a DP wrapper releases: every floating array, or only the head's.

Head-only training (``released_keys``) clips, noises and updates only the named
arrays; the others keep the global values whatever a client sends. Integer arrays
always keep the server's value (:func:`privacy.mechanisms.is_released`).
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord

from privacy.mechanisms import is_released
from protocol.records import arrays_of
from strategies.errors import StopTraining


class ReleasedArrays:
    """The mask of released arrays and their total size d, fixed at the first round."""

    def __init__(self, released_keys: tuple[str, ...] | None = None) -> None:
        self.released_keys = released_keys
        self.mask: list[bool] | None = None
        self.dim = 0  # d of the released arrays, known from round 1

    def fix(self, arrays: ArrayRecord) -> bool:
        """Fix the mask and d from the global model; True the first time only."""
        if self.mask is not None:
            return False
        keys_ = list(arrays.keys())
        floating = [is_released(a) for a in arrays_of(arrays)]
        if self.released_keys is None:
            self.mask = floating
        else:
            missing = sorted(set(self.released_keys) - set(keys_))
            if missing:
                raise StopTraining(f"head-only arrays {missing} are not in the global model")
            self.mask = [
                key in self.released_keys and f for key, f in zip(keys_, floating, strict=True)
            ]
        kept = zip(arrays_of(arrays), self.mask, strict=True)
        self.dim = sum(a.size for a, keep in kept if keep)
        return True

    def select(self, delta: list[np.ndarray]) -> list[np.ndarray]:
        """The released arrays of ``delta``."""
        assert self.mask is not None
        return [d for d, keep in zip(delta, self.mask, strict=True) if keep]

    def merge(self, mean: list[np.ndarray], reference: list[np.ndarray]) -> list[np.ndarray]:
        """The released mean back among zero deltas of the frozen arrays: whatever a
        client sent for those is ignored."""
        assert self.mask is not None
        released = iter(mean)
        return [
            next(released) if keep else np.zeros_like(c)
            for c, keep in zip(reference, self.mask, strict=True)
        ]
