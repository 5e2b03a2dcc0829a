"""Clustered FedAvg's assignment: which of the K global models each sampled client
trains from, by L2 distance to its last upload or by its own query scores (IFCA).

A choice is ``(model, how, score)``: ``how`` is ``"l2"``, ``"loss"`` or ``"random"``
(an unseen client, a tie, an invalid query reply; ``score`` NaN)."""

from __future__ import annotations

import math
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from protocol import keys
from protocol.keys import cluster_model_key, cluster_score_key
from protocol.records import InvalidReply
from protocol.replies import metrics_of
from strategies.runtime.messaging import send_and_receive, size_screen

QUERY_TYPE = f"{MessageType.EVALUATE}.{keys.CLUSTER_QUERY}"  # "evaluate.cluster"
Choice = tuple[int, str, float]


def pick_lowest(scores: np.ndarray, rng: np.random.Generator) -> tuple[int, str | None]:
    """The index of the lowest score; ties are drawn uniformly from ``rng``.

    Returns (index, None) for a unique minimum and (index, "random") for a tie.
    """
    tied = np.flatnonzero(scores == scores.min())
    if len(tied) == 1:
        return int(tied[0]), None
    return int(rng.choice(tied)), "random"


def query_scores(reply: Message | None, k: int) -> np.ndarray:
    """The K scores of a query reply, or InvalidReply (none, error, missing, non-finite)."""
    if reply is None:
        raise InvalidReply("no reply to the cluster query")
    if reply.has_error():
        raise InvalidReply(f"error reply: {reply.error.reason}")
    metrics = metrics_of(reply)
    scores = []
    for i in range(k):
        value = metrics.get(cluster_score_key(i))
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidReply(f"'{cluster_score_key(i)}' missing or not a number")
        if not math.isfinite(value):
            raise InvalidReply(f"'{cluster_score_key(i)}' = {value} is not finite")
        scores.append(float(value))
    return np.asarray(scores)


def random_choice(rng: np.random.Generator, k: int) -> Choice:
    """A model drawn uniformly from ``rng``."""
    return int(rng.integers(k)), "random", math.nan


def assign_l2(
    nodes: list[int], models_flat: np.ndarray, uploads: dict[int, np.ndarray], rng
) -> dict[int, Choice]:
    """Each node's model closest to its last upload (unseen nodes and ties: at random)."""
    choices = {}
    for node in nodes:
        if node not in uploads:
            choices[node] = random_choice(rng, len(models_flat))
            continue
        distances = np.linalg.norm(models_flat - uploads[node], axis=1)
        k, tie = pick_lowest(distances, rng)
        choices[node] = (k, "random", math.nan) if tie else (k, "l2", float(distances[k]))
    return choices


def assign_loss(
    server_round: int,
    nodes: list[int],
    models: list[ArrayRecord],
    models_flat: np.ndarray,
    grid: Grid,
    rng: np.random.Generator,
    timeout: float,
) -> dict[int, Choice]:
    """Each node's model of lowest score on its own data (IFCA), from one query of the K
    models per node (an invalid reply, a tie, K equal models: at random)."""
    k_models = len(models)
    if (models_flat == models_flat[0]).all():
        return {node: random_choice(rng, k_models) for node in nodes}  # nothing to tell apart
    config = {keys.SERVER_ROUND: server_round, keys.CLUSTER_K: k_models}
    queries = [
        Message(
            content=RecordDict(
                {
                    keys.CONFIG: ConfigRecord({**config}),
                    **{cluster_model_key(k): m for k, m in enumerate(models)},
                }
            ),
            dst_node_id=node,
            message_type=QUERY_TYPE,
            group_id=str(server_round),
        )
        for node in nodes
    ]
    replies = {
        m.metadata.src_node_id: m
        for m in send_and_receive(grid, queries, timeout=timeout, screen=size_screen(queries))
    }
    choices = {}
    for node in nodes:
        try:
            scores = query_scores(replies.get(node), k_models)
        except InvalidReply as err:
            log(WARNING, "Clustered: node %d gets a random model: %s", node, err)
            choices[node] = random_choice(rng, k_models)
            continue
        k, tie = pick_lowest(scores, rng)
        choices[node] = (k, "random", math.nan) if tie else (k, "loss", float(scores[k]))
    return choices
