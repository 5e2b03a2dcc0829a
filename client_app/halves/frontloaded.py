"""Front-loaded DP (CG-NG, CG-NP, CP-NP), client half: the mode the server asks for.

The task trains under it (:mod:`privacy.frontloaded`); under CP-NP the reply is the
clipped, noised delta only.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from client_app.halves import ClientHalf, Round
from privacy.frontloaded import FrontLoadedDP, clip_and_noise_delta
from protocol import keys
from tasks.base import LocalTraining


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


class FrontLoadedHalf(ClientHalf):
    """Trains under the requested mode; replies CP-NP's noisy delta alone."""

    def training(self, r: Round) -> dict:
        dp = front_loaded(r.config)
        if dp is None:
            raise ValueError(
                "a front-loaded 'privacy' mode in this client's run-config, but the server "
                f"sent no '{keys.FRONT_LOADED_MODE}': the client does not train without it"
            )
        return {"front_loaded": dp}

    def reply(self, r: Round, metrics: dict[str, float], local: LocalTraining):
        if local.front_loaded.mode != "cp-np":
            return None
        received = r.msg.content[keys.ARRAYS]
        delta, extra = cp_np_reply(r.model, received, local.front_loaded, local.dp_seed)
        # Only the noisy delta leaves: no loss, divergence or update norm,
        # which no mechanism protects; the example count weights the edge average.
        kept = {keys.NUM_EXAMPLES: metrics[keys.NUM_EXAMPLES], "noise-std": extra["noise-std"]}
        content = RecordDict({keys.ARRAYS: delta, keys.METRICS: MetricRecord(kept)})
        return Message(content=content, reply_to=r.msg)
