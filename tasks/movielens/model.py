"""NeuMF, the Neural Matrix Factorization model of NCF (He et al., 2017, section 3.4),
for the Subspace-DP-FL study's MovieLens task.

Two towers over separate user and item embeddings (dimension ``d``,
``movielens.embedding-dim``):

- GMF: the element-wise product ``p_u * q_i`` (``d`` values);
- MLP: ``[p'_u, q'_i]`` (``2d``) through ``Linear(2d, 2d)-ReLU-Linear(2d, d)-ReLU``,
  i.e. hidden layers (32, 16) for ``d = 16`` (the paper's halving tower);

their outputs are concatenated and mapped to one logit by ``Linear(2d, 1)``; the
sigmoid of the logit is the predicted probability of an interaction. Embeddings are
initialised ``N(0, 0.01^2)`` as in the paper, linear layers with PyTorch's default.

Design notes: ``docs/notes.md``, ``tasks.movielens.model``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

EMBEDDING_STD = 0.01
SCORE_CHUNK = 65536  # (user, item) pairs per forward pass in evaluation


class NeuMF(nn.Module):
    """NeuMF scorer; ``forward(users, items)`` maps two ``int64 (batch,)`` index tensors
    to ``(batch,)`` logits.

    Parameters
    ----------
    num_users, num_items : int
        Rows of the user and item embedding tables.
    embedding_dim : int
        ``d``: width of every embedding and of the MLP tower's output.
    """

    def __init__(self, num_users: int, num_items: int, embedding_dim: int = 16) -> None:
        super().__init__()
        if num_users < 1 or num_items < 1:
            raise ValueError(
                f"num_users and num_items must be >= 1, got {num_users} and {num_items}"
            )
        if embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {embedding_dim}")
        d = embedding_dim
        self.user_gmf = nn.Embedding(num_users, d)
        self.item_gmf = nn.Embedding(num_items, d)
        self.user_mlp = nn.Embedding(num_users, d)
        self.item_mlp = nn.Embedding(num_items, d)
        self.mlp = nn.Sequential(
            nn.Linear(2 * d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d), nn.ReLU()
        )
        self.predict = nn.Linear(2 * d, 1)
        for table in (self.user_gmf, self.item_gmf, self.user_mlp, self.item_mlp):
            nn.init.normal_(table.weight, std=EMBEDDING_STD)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Interaction logits, shape ``(batch,)``."""
        gmf = self.user_gmf(users) * self.item_gmf(items)
        mlp = self.mlp(torch.cat([self.user_mlp(users), self.item_mlp(items)], dim=-1))
        return self.predict(torch.cat([gmf, mlp], dim=-1)).squeeze(-1)


def build_model(num_users: int, num_items: int, embedding_dim: int, seed: int) -> NeuMF:
    """A ``NeuMF`` with weights drawn from ``seed``; the global RNG is untouched.
    On the CPU."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return NeuMF(num_users, num_items, embedding_dim)


# --- scoring and NCF's ranking metrics -------------------------------------------------


@torch.no_grad()
def score_pairs(model: nn.Module, users: np.ndarray, items: np.ndarray) -> np.ndarray:
    """Eval-mode logits of (user, item) pairs of any shape, as a float64 array."""
    model.eval()
    device = next(model.parameters()).device
    flat_users = torch.from_numpy(np.ascontiguousarray(users).ravel())
    flat_items = torch.from_numpy(np.ascontiguousarray(items).ravel())
    chunks = [
        model(u.to(device), i.to(device)).cpu()
        for u, i in zip(flat_users.split(SCORE_CHUNK), flat_items.split(SCORE_CHUNK), strict=True)
    ]
    scores = torch.cat(chunks) if chunks else torch.empty(0)
    return scores.double().numpy().reshape(np.shape(users))


def heldout_auc(positive: np.ndarray, negatives: np.ndarray) -> np.ndarray:
    """Per-row AUC of one positive score against its negatives' scores.

    Parameters
    ----------
    positive : numpy.ndarray
        ``(N,)`` scores of the held-out positives.
    negatives : numpy.ndarray
        ``(N, K)`` scores of their negatives.

    Returns
    -------
    numpy.ndarray
        ``(N,)``: ``(#{negatives < positive} + #{negatives == positive} / 2) / K``.
    """
    if negatives.ndim != 2 or negatives.shape[0] != len(positive) or negatives.shape[1] < 1:
        raise ValueError(
            f"negatives must have shape (len(positive), K >= 1) = ({len(positive)}, K), "
            f"got {negatives.shape}"
        )
    below = (negatives < positive[:, None]).sum(axis=1)
    ties = (negatives == positive[:, None]).sum(axis=1)
    return (below + 0.5 * ties) / negatives.shape[1]


def hit_rate(positive: np.ndarray, negatives: np.ndarray, cutoff: int) -> np.ndarray:
    """Per-row hit (1.0) if fewer than ``cutoff`` negatives score at least as high as
    the positive (ties count against it), else 0.0."""
    if cutoff < 1:
        raise ValueError(f"cutoff must be >= 1, got {cutoff}")
    return ((negatives >= positive[:, None]).sum(axis=1) < cutoff).astype(np.float64)
