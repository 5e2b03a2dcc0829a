"""Head-only training under a DP wrapper: only the head's arrays are released.

With ``subspace.head-only`` the wrapper clips, noises and updates only the named arrays
(``released_keys``); the others keep the global values whatever a client sends. Integer
arrays always keep the server's value (:func:`privacy.mechanisms.is_released`). The
registry composes :class:`HeadOnlyArrays` only then; every other run releases every
floating array (:class:`strategies.mechanisms.base.ReleasedArrays`).
"""

from __future__ import annotations

from flwr.app import ArrayRecord

from strategies.errors import StopTraining
from strategies.mechanisms.base import ReleasedArrays


class HeadOnlyArrays(ReleasedArrays):
    """The released arrays are the floating ones among ``released_keys``."""

    def __init__(self, released_keys: tuple[str, ...]) -> None:
        super().__init__()
        self.released_keys = released_keys

    def released(self, arrays: ArrayRecord) -> list[bool]:
        """Whether each array is released; StopTraining if a head array is missing."""
        names = list(arrays.keys())
        missing = sorted(set(self.released_keys) - set(names))
        if missing:
            raise StopTraining(f"head-only arrays {missing} are not in the global model")
        floating = super().released(arrays)
        return [key in self.released_keys and f for key, f in zip(names, floating, strict=True)]
