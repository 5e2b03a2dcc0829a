"""Client side of hierarchical FL (seed 003): which edge this node belongs to, the
client mode to train under, and CP-NP's reply (the clipped, noised delta only)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord

from protocol import keys
from privacy.frontloaded import FrontLoadedDP, clip_and_noise_delta
from tasks.topology import edge_of


def edge_id(
    node_config: Mapping[str, Any], partition_id: int, num_partitions: int, num_edges: int
):
    """The SuperNode's ``edge-id`` if it was started with one, else its partition's."""
    if keys.EDGE_ID in node_config:
        edge = int(node_config[keys.EDGE_ID])
        if not 0 <= edge < num_edges:
            raise ValueError(
                f"node config 'edge-id' = {edge} is not in [0, hier.num-edges = {num_edges})"
            )
        return edge
    return edge_of(partition_id, num_partitions, num_edges)


def front_loaded(config: ConfigRecord) -> FrontLoadedDP | None:
    """The client mode the server asks for (None: the baseline)."""
    if keys.FRONT_LOADED_MODE not in config:
        return None
    return FrontLoadedDP(
        mode=str(config[keys.FRONT_LOADED_MODE]),
        clip=float(config[keys.FRONT_LOADED_CLIP]),
        sigma=float(config[keys.FRONT_LOADED_SIGMA]),
        per_example=bool(config.get(keys.FRONT_LOADED_PER_EXAMPLE, False)),
        delta=float(config.get(keys.DPSGD_DELTA, 1e-5)),
        max_epsilon=float(config.get(keys.DPSGD_MAX_EPSILON, 0.0)),
    )


def cp_np_reply(
    model: torch.nn.Module, received: ArrayRecord, dp: FrontLoadedDP, seed: int
) -> tuple[ArrayRecord, dict[str, float]]:
    """CP-NP: the clipped, noised Δw = w_after − w_before as an ArrayRecord with the
    model's keys (integer buffers, e.g. BatchNorm's counter, send a zero delta)."""
    before = received.to_torch_state_dict()
    after = model.state_dict()
    names = [n for n, t in after.items() if t.is_floating_point()]
    delta = [after[n].detach().cpu() - before[n].cpu() for n in names]
    generator = torch.Generator().manual_seed(int(seed))  # the training's secret DP seed
    noisy, metrics = clip_and_noise_delta(delta, clip=dp.clip, sigma=dp.sigma, generator=generator)
    by_name = dict(zip(names, noisy, strict=True))
    out = OrderedDict(
        (n, by_name[n] if n in by_name else torch.zeros_like(t)) for n, t in after.items()
    )
    return ArrayRecord(out), metrics
