"""``bench/lunar_lands.py one-planet``: one base client alone with the whole budget, trained
chunk by chunk by the task's own local training with kept Adam state."""

from __future__ import annotations

from bench import lunar_lands
from tests.tasks import test_lunar_lander as lunar

# Chunks of 256 env steps (2 rollouts of 2 envs x 64), one epoch, 2 evaluation episodes.
TINY = lunar.TINY | {"task": "lunar-lander", "ppo.derived-per-base": 0, "ppo.eval-episodes": 2}


def test_one_planet_trains_chunk_by_chunk_and_is_reproducible():
    # Execute
    rows = list(lunar_lands.one_planet(TINY, "earth", 600, seed=3))
    again = list(lunar_lands.one_planet(TINY, "earth", 600, seed=3))

    # Assert: whole chunks until the budget is spent (3 x 256 >= 600), the same run twice
    assert [row["env-steps"] for row in rows] == [256, 512, 768]
    assert {row["planet"] for row in rows} == {"earth"} and {row["seed"] for row in rows} == {3}
    assert all(row["se"] >= 0 for row in rows)
    assert rows == again
    other = list(lunar_lands.one_planet(TINY, "earth", 256, seed=4))
    assert other[0]["reward"] != rows[0]["reward"]
