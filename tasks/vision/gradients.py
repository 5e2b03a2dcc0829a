"""Per-example gradients on public data: the geometry subspace-dp may start from.

The server holds a public split (``subspace.warm-start``); the top-k subspace of the
per-example gradients of the warm-started model there is a data-dependent metric that
costs no privacy (no client's data is touched). ``torch.func`` computes the gradients
of the cross-entropy one example at a time in a vectorised pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from tasks.vision.data import TensorSplit

# Most values (examples x coordinates) returned at once: 2**28 float64 = 2 GiB.
MAX_VALUES = 2**28


def per_example_gradients(
    model: nn.Module,
    split: TensorSplit,
    keys: Sequence[str],
    *,
    batch_size: int = 64,
    max_values: int = MAX_VALUES,
) -> np.ndarray:
    """Gradients of each example's cross-entropy w.r.t. the state-dict entries ``keys``.

    Returns an (n, d) float64 array, each row flattened in the order of ``keys``;
    entries that are buffers (no gradient, e.g. BatchNorm statistics) are zeros. The
    model is evaluated in eval mode (no dropout, BatchNorm with running statistics) on
    the CPU. At most ``max_values // d`` examples are used (the first ones).

    Raises
    ------
    ValueError
        If a key is not in the model's state dict.
    """
    state = model.state_dict()
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"{type(model).__name__} has no state-dict entries {missing}")
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}
    wanted = [key for key in keys if key in params]
    dim = sum(state[key].numel() for key in keys)
    limit = min(len(split), max(1, max_values // max(dim, 1)))

    def loss(trainable, image, label):
        merged = {**params, **trainable}
        logits = functional_call(model, (merged, buffers), (image.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, label.unsqueeze(0))

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    was_training = model.training
    model.eval()
    rows = []
    try:
        for start in range(0, limit, batch_size):
            stop = min(start + batch_size, limit)
            images, labels = split.images[start:stop], split.labels[start:stop]
            grads = per_example({k: params[k] for k in wanted}, images, labels)
            columns = [
                grads[key].reshape(stop - start, -1)
                if key in grads
                else torch.zeros(stop - start, state[key].numel())
                for key in keys
            ]
            rows.append(torch.cat(columns, dim=1).double().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(rows) if rows else np.zeros((0, dim))
