"""Clustered FedAvg's settings: its run-config keys (``cluster.*``), the rules each
takes, and the privacy settings under which clustering stays sound."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from config.settings import Choice, Settings, SettingsError, listed, setting
from strategies.mechanisms.base import DPSettings

ASSIGN_RULES = ("l2", "loss")
SPACES = ("weights", "directions")
UPDATE_RULES = ("kmeans", "assignment")
INIT_RULES = ("shared", "distinct")


def check_rules(k: int, assign: str, space: str, update: str, init: str) -> None:
    """ValueError unless the rules are valid and fit together (the strategy's own check)."""
    if k < 1:
        raise ValueError(f"k = {k} must be at least 1")
    for name, value, valid in (
        ("assign", assign, ASSIGN_RULES),
        ("space", space, SPACES),
        ("update", update, UPDATE_RULES),
        ("init", init, INIT_RULES),
    ):
        if value not in valid:
            raise ValueError(f"{name} = {value!r}; valid values: {valid}")
    if update == "assignment" and space != "weights":
        raise ValueError(
            f"space = {space!r} has no effect with update = 'assignment' (no k-means "
            "runs); valid value: 'weights'"
        )


def describe_rules(k: int, assign: str, space: str, update: str, init: str) -> list[str]:
    """The summary lines of the rules (the strategy logs them at start)."""
    start = {"shared": "one initial model", "distinct": "K distinct initial models"}[init]
    rule = {"l2": "closest to last upload (L2)", "loss": "lowest client score (IFCA)"}[assign]
    if update == "assignment":
        how = "each model the mean of its assignees' uploads (IFCA)"
    else:
        points = {"weights": "the uploads", "directions": "unit update directions"}[space]
        how = f"k-means (n_init=10) on {points}, clusters matched to models, mean"
    return [
        f"Clustered FedAvg: K = {k} global models",
        f"Start: {start}",
        f"Assignment: {rule}; ties and unseen clients at random",
        f"Update: {how}",
    ]


# Privacy under which clustered FedAvg stays sound: under local noise every client's
# upload is itself private, so k-means over uploads is post-processing; under DP-FedAvg
# there is no k-means: each client's update enters the private mean of the model it
# was assigned by its own data (strategies.mechanisms.clustered_dp), one Gaussian per round.
CLUSTERED_PRIVACY = ("none", "laplace", "dp-sgd", "dp-fedavg-fixed", "dp-fedavg-adaptive")
CENTRAL_CLUSTERED = ("dp-fedavg-fixed", "dp-fedavg-adaptive")


@dataclass(frozen=True)
class ClusterSettings(Settings):
    """Clustered FedAvg's run-config keys (``cluster.*``)."""

    PREFIX: ClassVar[str] = "cluster"
    k: int = setting(
        3,
        "Clustered FedAvg: number K of global models.",
        low=1,
    )
    assign: str = setting(
        "l2",
        "Clustered FedAvg: how a client picks its model: `l2` (closest weights to its"
        " last upload, the PPO study's rule) or `loss` (best local evaluation, IFCA).",
        choices=ASSIGN_RULES,
    )
    space: str = setting(
        "weights",
        "Clustered FedAvg: what k-means clusters each round: `weights` (the uploaded"
        " weights, the PPO study's rule) or `directions` (each update's unit direction, the"
        " cosine of clustered FL; clients that move farther in the same direction, e.g."
        " with more local steps, stay together).",
        choices=SPACES,
    )
    update: str = setting(
        "kmeans",
        "Clustered FedAvg: how the K models are updated each round: `kmeans` (k-means"
        " over the uploads, clusters matched to the models, the PPO study's rule) or"
        " `assignment` (each model the mean of the uploads of the clients assigned to it,"
        " IFCA). Under DP-FedAvg no k-means runs: always by assignment.",
        choices=UPDATE_RULES,
    )
    init: str = setting(
        "shared",
        "Clustered FedAvg: what the K models start as: `shared` (K copies of the run's"
        " initial model, the PPO study's rule) or `distinct` (model 0 the run's initial model,"
        " model k the task's model drawn from its own seed, derived from `seed`; IFCA's"
        " random initialisation, so a loss-based assignment can tell them apart in"
        " round 1).",
        choices=INIT_RULES,
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """The privacy settings under which clustering stays sound."""
        if choice.strategy != "clustered":
            return
        cluster = choice.part(ClusterSettings)
        if choice.privacy not in CLUSTERED_PRIVACY:
            raise SettingsError(
                f"'privacy' = {choice.privacy!r} cannot protect 'strategy' = 'clustered': "
                "valid values with clustered: " + listed(CLUSTERED_PRIVACY)
            )
        if cluster.update == "assignment" and cluster.space != "weights":
            raise SettingsError(
                f"'cluster.space' = {cluster.space!r} has no effect with "
                "'cluster.update' = 'assignment': no k-means runs there (each model is the "
                "mean of its assignees' uploads); valid value: 'weights'"
            )
        if cluster.init == "distinct" and choice.warm_start > 0:
            raise SettingsError(
                "'cluster.init' = 'distinct' draws models 1..K-1 afresh, which would skip "
                f"'subspace.warm-start' = {choice.warm_start}; valid "
                "values with a warm start: 'shared'"
            )
        if choice.privacy in CENTRAL_CLUSTERED:
            if cluster.space != "weights":
                raise SettingsError(
                    f"'cluster.space' = {cluster.space!r} has no effect with "
                    f"'privacy' = {choice.privacy!r}: no k-means runs there (each client's "
                    "update enters the private mean of the model it was assigned); "
                    "valid value: 'weights'"
                )
            if choice.part(DPSettings).noise_site != "server":
                raise SettingsError(
                    f"'strategy' = 'clustered' with 'privacy' = {choice.privacy!r} needs "
                    "'dp.noise-site' = 'server': the server assigns each client a model from "
                    "its raw scores or upload, so no guarantee could hold against it"
                )
            return
        if choice.privacy != "none" and cluster.assign == "loss":
            raise SettingsError(
                "'cluster.assign' = 'loss' lets each client release which model fits its data "
                f"best, which no mechanism protects; with 'privacy' = {choice.privacy!r} use "
                "'cluster.assign' = 'l2' (assignment from the already private uploads)"
            )
