"""SecAgg+ on Flower's Message API: the server learns only the sum of the sampled
clients' vectors.

Bell, Bonawitz, Gascón, Lepoint, Raykova 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead" (SecAgg+); Bonawitz et al. 2017 (SecAgg, the complete
graph). Flower 1.41 ships the protocol only for its legacy workflow API
(``flwr.server.workflow.SecAggPlusWorkflow`` needs a ``LegacyContext`` and
``ClientProxy`` objects). Reused from Flower here: key agreement (ECDH on P-384 +
HKDF, ``generate_shared_key``), authenticated encryption of the shares (Fernet),
Shamir secret sharing (``combine_shares``), and on the client its setup, share-keys
and unmask stages with their state (``client_app.secagg_mod``). Written by hand: this
server driver on a ``Grid``, and the masking generator.

Design notes: ``docs/notes.md``, ``strategies.secure.secagg_plus``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from cryptography.exceptions import UnsupportedAlgorithm
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.supercore.primitives.asymmetric import bytes_to_public_key

from config.settings import Choice, Settings, SettingsError, listed, setting
from privacy.settings import AuditSettings, DPSettings
from protocol.masking import (
    MASKED,
    MAX_CIPHERTEXT_BYTES,
    MAX_KEY_BYTES,
    MAX_SHARE_BYTES,
    mask,
    pairwise_seed,
    reduce,
    transport_dtype,
)
from protocol.replies import REPLY_MARGIN_BYTES, REPLY_MARGIN_SHARE, oversized_reason
from strategies.runtime.messaging import send_and_receive

ENCODING = "secagg-encoding"  # the collect message's ConfigRecord of encoding parameters
# The largest modulus: the largest power of two a run-config integer (64-bit signed, as
# TOML and Flower's ConfigRecord hold it) can state. The masking works in uint64 up to
# 2^64 (protocol.masking), so this bound is the config's, not the arithmetic's.
MAX_MODULUS = 2**62
KEY_CURVE = "secp384r1"  # Flower's SecAgg+ key pairs (generate_key_pairs)


@dataclass(frozen=True)
class SecAggSettings(Settings):
    """The protocol's parameters, named after Flower's ``SecAggPlusWorkflow``.

    Attributes
    ----------
    num_shares : float
        Shares of each secret: an integer > 2, or a fraction in (0, 1] of the cohort
        (1: every client is every client's neighbour).
    reconstruction_threshold : float
        t: shares that reconstruct a secret, an integer >= 2 or a fraction of
        ``num_shares``. Larger t: more colluders needed, fewer dropouts tolerated.
    clipping_range : float
        Without DP: every update coordinate is clipped to this range before encoding;
        with DP it sets only the scale (the L2 clip bounds the update).
    quantization_range : int
        Integer levels over [-clipping_range, clipping_range]: the scale is
        quantization_range / (2 clipping_range) integers per unit.
    modulus_range : int
        M, the power of two the sum is taken modulo (at most 2⁶⁴).
    max_weight : float
        Without DP, a client's weight is min(num-examples, max_weight) / max_weight.
    min_survivors : int
        The fewest clients whose vectors must reach the sum for it to be unmasked
        (distributed DP calibrates each client's noise share for this many); 0: the
        reconstruction threshold.
    """

    PREFIX: ClassVar[str] = "secagg"
    OFF: ClassVar[dict] = {"enabled": False}
    enabled: bool = setting(
        False,
        "Run each train round as SecAgg+ (strategies/secure/secagg_plus.py): the server obtains "
        "only the sum of the sampled clients' encoded updates. With dp.noise-site = "
        "'client': distributed DP (Skellam), an epsilon against the server itself.",
    )
    num_shares: float = setting(
        1.0,
        "Shares of each client's secrets: a fraction (0, 1] of the cohort (1: every "
        "client is every client's neighbour) or an integer > 2 (Flower's num_shares).",
        low=0.0,
        low_open=True,
    )
    reconstruction_threshold: float = setting(
        0.67,
        "t: shares that reconstruct a secret, a fraction (0, 1] of the shares or an "
        "integer >= 2. A client's update stays hidden unless the server colludes with"
        " t of its neighbours; fewer than t survivors abandon the round.",
        low=0.0,
        low_open=True,
    )
    clipping_range: float = setting(
        8.0,
        "Update coordinates are encoded over [-range, range] (without DP each is "
        "clipped to it); with quantization-range it sets the scale.",
        low=0.0,
        low_open=True,
    )
    quantization_range: int = setting(
        2**22,
        "Integer levels over [-clipping-range, clipping-range] (scale = levels / 2 range).",
        low=2,
    )
    modulus_range: int = setting(
        2**32,
        "M, a power of two in [4, 2^62] (2^62: the largest power of two a run-config "
        "integer, 64-bit signed, holds): the sum is taken modulo M (Flower's default "
        "2^32); a round whose sum could wrap around is refused before anything is "
        "sent.",
        low=4,
    )
    max_weight: float = setting(
        1000.0,
        "Without DP: a client's weight is min(num-examples, max-weight) / max-weight.",
        low=0.0,
        low_open=True,
    )
    min_survivors: int = setting(
        0,
        "The fewest vectors a round's sum needs to be unmasked (distributed DP "
        "calibrates each client's noise share for this many); 0: the reconstruction "
        "threshold.",
        low=0,
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """What secure aggregation can run with."""
        if not SecAggSettings.on_in(choice):
            return
        dp = choice.part(DPSettings)
        if choice.strategy not in SECAGG_STRATEGIES:
            raise SettingsError(
                f"'secagg.enabled' = true gives the server only the sum of the updates; "
                f"'strategy' = {choice.strategy!r} needs each client's own update or report "
                "(cluster assignments, divergences, edge sums, local models); valid values "
                "with secure aggregation: " + listed(SECAGG_STRATEGIES)
            )
        if choice.privacy not in SECAGG_PRIVACY:
            raise SettingsError(
                f"'secagg.enabled' = true is not available with 'privacy' = {choice.privacy!r}; "
                "valid values: " + listed(SECAGG_PRIVACY)
            )
        if choice.privacy != "none" and dp.sampling != "fixed":
            raise SettingsError(
                f"'secagg.enabled' = true with 'privacy' = {choice.privacy!r} needs 'dp.sampling' "
                "= 'fixed': under Poisson sampling the cohort's size depends on who was sampled, "
                "and a secure round of fewer than 2 clients (or below the reconstruction "
                "threshold) is abandoned, a release the subsampled Gaussian's bound does not "
                "cover; valid value: 'fixed'"
            )
        if choice.privacy == "dp-fedavg-adaptive" and dp.noise_site == "client":
            raise SettingsError(
                "'secagg.enabled' = true with 'dp.noise-site' = 'client' (distributed DP) "
                "supports 'privacy' = 'dp-fedavg-fixed' only: adaptive clipping's count of norm "
                "bits has no distributed mechanism here; use 'dp.noise-site' = 'server' (the "
                "bits are summed securely and the server noises their count)"
            )
        if choice.head_only:
            raise SettingsError(
                "'subspace.head-only' = true is not available with 'secagg.enabled' = true"
            )
        if choice.part(AuditSettings).canaries:
            raise SettingsError(
                "'audit.canaries' > 0 is not available with 'secagg.enabled' = true (the "
                "audit's canaries upload crafted updates the secure sum would hide)"
            )
        settings = choice.part(SecAggSettings)  # its own ranges: ValueError, a SettingsError
        cohort = dp.num_sampled_clients if choice.privacy != "none" else 0
        if choice.privacy != "none" and cohort < 2:
            raise SettingsError(
                f"'dp.num-sampled-clients' = {cohort} with 'secagg.enabled' = true: secure "
                "aggregation needs at least 2 clients per round"
            )
        if cohort and settings.survivors_needed(cohort) > cohort:
            raise SettingsError(
                f"'secagg.min-survivors' = {settings.min_survivors} exceeds the "
                f"{cohort} clients sampled per round ('dp.num-sampled-clients')"
            )

    def __post_init__(self) -> None:
        n, t = self.num_shares, self.reconstruction_threshold
        if not (0 < n <= 1 or (float(n).is_integer() and n > 2)):
            raise ValueError(f"'secagg.num-shares' must be in (0, 1] or an integer > 2, got {n!r}")
        if not (0 < t <= 1 or (float(t).is_integer() and t >= 2)):
            raise ValueError(
                "'secagg.reconstruction-threshold' must be in (0, 1] or an integer >= 2, "
                f"got {t!r}"
            )
        if n > 2 and t > 1 and t >= n:
            raise ValueError(
                f"'secagg.reconstruction-threshold' = {t:g} must be below "
                f"'secagg.num-shares' = {n:g}"
            )
        if not (math.isfinite(self.clipping_range) and self.clipping_range > 0):
            raise ValueError(f"'secagg.clipping-range' must be > 0, got {self.clipping_range!r}")
        m, q = self.modulus_range, self.quantization_range
        if not (isinstance(m, int) and 4 <= m <= MAX_MODULUS and m & (m - 1) == 0):
            raise ValueError(
                f"'secagg.modulus-range' must be a power of two in [4, 2^62], got {m!r}"
            )
        if not (isinstance(q, int) and 2 <= q < m):
            raise ValueError(
                "'secagg.quantization-range' must be an integer in "
                f"[2, 'secagg.modulus-range'), got {q!r}"
            )
        if not self.max_weight > 0:
            raise ValueError(f"'secagg.max-weight' must be > 0, got {self.max_weight!r}")
        if not (isinstance(self.min_survivors, int) and self.min_survivors >= 0):
            raise ValueError(
                f"'secagg.min-survivors' must be an integer >= 0, got {self.min_survivors!r}"
            )

    @property
    def scale(self) -> float:
        """Integers per unit of an update coordinate."""
        return self.quantization_range / (2 * self.clipping_range)

    def shares_and_threshold(self, cohort: int) -> tuple[int, int]:
        """(shares, t) for a cohort of ``cohort`` clients, as Flower's workflow resolves
        fractions: an odd share count below the cohort, at least 3 (else the cohort),
        and t >= 2."""
        if self.num_shares <= 1:
            shares = round(self.num_shares * cohort)
            if shares < cohort and shares % 2 == 0:
                shares += 1
            if shares <= 2:
                shares = cohort
        else:
            shares = int(self.num_shares)
        shares = min(shares, cohort)
        if self.reconstruction_threshold <= 1:
            threshold = max(round(self.reconstruction_threshold * shares), 2)
        else:
            threshold = int(self.reconstruction_threshold)
        return shares, min(threshold, shares)

    def survivors_needed(self, cohort: int) -> int:
        """The fewest survivors whose sum is unmasked: max(t, ``min_survivors``)."""
        return max(self.shares_and_threshold(cohort)[1], self.min_survivors)


@dataclass
class SecureSum:
    """What one secure round gave the server."""

    vector: np.ndarray | None
    """Σ of the survivors' vectors mod M (uint64); None when the round was abandoned."""
    survivors: list[int]
    """Nodes whose vector is in the sum."""
    dropped: list[int]
    """Sampled nodes whose vector is not (no reply, an error, or an unusable reply)."""
    replies: list[Message]
    """The collect stage's replies (masked vectors only)."""
    reason: str = ""
    """Why the round was abandoned (empty when it was not)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of each stage, and of the server's unmasking."""
    reasons: dict[int, str] = field(default_factory=dict)
    """Why each sampled node's vector is not in the sum as sent (a dropped node: the
    stage it left and why; a survivor: a refused unmask reply)."""


def ring_neighbours(nodes: list[int], shares: int) -> dict[int, set[int]]:
    """Each node's neighbours (itself included) on a ring of the nodes in a secret random
    order: the ``shares // 2`` nodes on either side (Flower's SecAgg+ graph)."""
    order = list(nodes)
    random.SystemRandom().shuffle(order)
    half = shares // 2
    n = len(order)
    return {
        node: {order[(i + k) % n] for k in range(-half, half + 1)} for i, node in enumerate(order)
    }


class _Round:
    """One secure round's state on the server (see the module docstring)."""

    def __init__(self, grid, settings: SecAggSettings, server_round: int, timeout: float) -> None:
        self.grid, self.settings = grid, settings
        self.server_round, self.timeout = server_round, timeout
        self.seconds: dict[str, float] = {}
        self.keys: dict[int, tuple[bytes, bytes]] = {}
        self.neighbours: dict[int, set[int]] = {}
        self.threshold = 0
        self.reasons: dict[int, str] = {}  # node -> why a stage left it out

    def _message(self, node: int, record: dict, content: RecordDict | None = None) -> Message:
        content = RecordDict(dict(content or {}))
        content[RECORD_KEY_CONFIGS] = ConfigRecord(record)
        return Message(
            content=content,
            dst_node_id=node,
            message_type=MessageType.TRAIN,
            group_id=str(self.server_round),
        )

    def _exchange(
        self, stage: str, messages: list[Message], limit: int | None = None, check=None
    ) -> dict[int, Message]:
        """Send one stage's messages; the usable replies by node. A reply over ``limit``
        bytes is refused as it is pulled, one ``check(node, reply)`` refuses (a reason)
        is dropped; each node left out gets its reason in :attr:`reasons`."""
        started = time.monotonic()
        screen = None if limit is None else (lambda reply: oversized_reason(reply, limit))
        replies = send_and_receive(self.grid, messages, timeout=self.timeout, screen=screen)
        self.seconds[stage] = time.monotonic() - started
        asked = {m.metadata.dst_node_id for m in messages}
        good = {}
        for reply in replies:
            node = reply.metadata.src_node_id
            if node not in asked or node in good:
                continue
            if reply.has_error():
                why = reply.error.reason
            elif RECORD_KEY_CONFIGS not in reply.content.config_records:
                why = f"rejected: no ConfigRecord '{RECORD_KEY_CONFIGS}'"
            else:
                why = check(node, reply) if check is not None else ""
            if why:
                log(WARNING, "SecAgg+ %s: node %d left out: %s", stage, node, why)
                self.reasons.setdefault(node, f"SecAgg+ {stage}: {why}")
                continue
            good[node] = reply
        for node in sorted(asked - set(good)):
            self.reasons.setdefault(node, f"SecAgg+ {stage}: no reply")
        return good

    def _check_keys(self, node: int, reply: Message) -> str:
        """Why a setup reply is refused ("": it is not): two parseable public keys."""
        got = reply.content.config_records[RECORD_KEY_CONFIGS]
        for key in (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2):
            value = got.get(key)
            if not isinstance(value, bytes) or len(value) > MAX_KEY_BYTES:
                return f"rejected: '{key}' is not a public key of at most {MAX_KEY_BYTES} bytes"
            try:
                curve = bytes_to_public_key(value).curve.name
            except (ValueError, TypeError, AttributeError, UnsupportedAlgorithm) as err:
                return f"rejected: '{key}' is not a public key ({type(err).__name__})"
            if curve != KEY_CURVE:
                return f"rejected: '{key}' is a key on {curve}, not {KEY_CURVE}"
        return ""

    def _check_ciphertexts(self, node: int, reply: Message) -> str:
        """Why a share-keys reply is refused: one bounded ciphertext per neighbour."""
        got = reply.content.config_records[RECORD_KEY_CONFIGS]
        dsts, texts = got.get(Key.DESTINATION_LIST, []), got.get(Key.CIPHERTEXT_LIST, [])
        others = self.neighbours[node] - {node}
        if not (isinstance(dsts, list) and isinstance(texts, list) and len(dsts) == len(texts)):
            return "rejected: destination and ciphertext lists of different lengths"
        if len(set(dsts)) != len(dsts) or not set(dsts) <= others:
            return "rejected: a destination twice, or one that is not a neighbour"
        if not all(isinstance(t, bytes) and len(t) <= MAX_CIPHERTEXT_BYTES for t in texts):
            return f"rejected: a ciphertext is not bytes of at most {MAX_CIPHERTEXT_BYTES}"
        return ""

    def _check_shares(self, node: int, reply: Message) -> str:
        """Why an unmask reply is refused: one bounded share per listed neighbour."""
        got = reply.content.config_records[RECORD_KEY_CONFIGS]
        owners, shares = got.get(Key.NODE_ID_LIST, []), got.get(Key.SHARE_LIST, [])
        if not (isinstance(owners, list) and isinstance(shares, list)):
            return "rejected: node and share lists are not lists"
        if len(owners) != len(shares) or len(set(owners)) != len(owners):
            return "rejected: node and share lists of different lengths, or a node twice"
        if not set(owners) <= self.neighbours[node]:
            return "rejected: a share of a node that is not a neighbour"
        if not all(isinstance(x, bytes) and len(x) <= MAX_SHARE_BYTES for x in shares):
            return f"rejected: a share is not bytes of at most {MAX_SHARE_BYTES}"
        return ""

    def setup(self, nodes: list[int]) -> list[int]:
        shares, self.threshold = self.settings.shares_and_threshold(len(nodes))
        self.neighbours = ring_neighbours(nodes, shares)
        record = {
            Key.STAGE: Stage.SETUP,
            Key.SAMPLE_NUMBER: len(nodes),
            Key.SHARE_NUMBER: shares,
            Key.THRESHOLD: self.threshold,
            Key.CLIPPING_RANGE: float(self.settings.clipping_range),
            Key.TARGET_RANGE: int(self.settings.quantization_range),
            Key.MOD_RANGE: min(self.settings.modulus_range, 2**62),  # informational; int64 wire
            Key.MAX_WEIGHT: float(self.settings.max_weight),
        }
        limit = _limit(2 * MAX_KEY_BYTES)
        messages = [self._message(n, record) for n in nodes]
        replies = self._exchange(Stage.SETUP, messages, limit, self._check_keys)
        for node, reply in replies.items():
            got: Mapping[str, Any] = reply.content.config_records[RECORD_KEY_CONFIGS]  # checked
            self.keys[node] = (got[Key.PUBLIC_KEY_1], got[Key.PUBLIC_KEY_2])
        return sorted(self.keys)

    def share_keys(self, active: list[int]) -> tuple[list[int], dict[int, tuple[list, list]]]:
        alive = set(active)
        messages = []
        for node in active:
            record: dict = {
                str(j): list(self.keys[j]) for j in sorted(self.neighbours[node] & alive)
            }
            record[Key.STAGE] = Stage.SHARE_KEYS
            messages.append(self._message(node, record))
        most = max((len(self.neighbours[n]) for n in active), default=0)
        limit = _limit(most * (MAX_CIPHERTEXT_BYTES + 8))
        replies = self._exchange(Stage.SHARE_KEYS, messages, limit, self._check_ciphertexts)
        forward: dict[int, tuple[list, list]] = {node: ([], []) for node in replies}
        for src, reply in replies.items():
            got: Mapping[str, Any] = reply.content.config_records[RECORD_KEY_CONFIGS]  # checked
            dsts, ciphertexts = got.get(Key.DESTINATION_LIST, []), got.get(Key.CIPHERTEXT_LIST, [])
            for dst, ciphertext in zip(dsts, ciphertexts, strict=False):
                if dst in forward and dst in self.neighbours[src]:
                    forward[dst][0].append(src)
                    forward[dst][1].append(ciphertext)
        return sorted(replies), forward

    def collect(
        self, train: dict[int, Message], forward: dict[int, tuple[list, list]], length: int
    ) -> dict[int, Message]:
        messages = []
        for node, (srcs, ciphertexts) in forward.items():
            record = {
                Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                Key.SOURCE_LIST: srcs,
                Key.CIPHERTEXT_LIST: ciphertexts,
            }
            messages.append(self._message(node, record, train[node].content))
        dtype = transport_dtype(self.settings.modulus_range)

        def masked_only(node: int, reply: Message) -> str:
            content = reply.content
            record = content.array_records.get(MASKED)
            array = record[MASKED].numpy() if record is not None and MASKED in record else None
            if array is None or array.dtype != dtype or array.shape != (length,):
                return f"rejected: no masked vector of {length} {dtype} values"
            assert record is not None  # the masked vector came from it
            extra = len(content.array_records) + len(content.metric_records) > 1 or len(record) > 1
            if extra or len(content.config_records) > 1 or len(content[RECORD_KEY_CONFIGS]):
                return "rejected: the masked vector is not all the reply holds"
            return ""

        limit = _limit(length * np.dtype(dtype).itemsize)
        return self._exchange(Stage.COLLECT_MASKED_VECTORS, messages, limit, masked_only)

    def unmask(self, survivors: list[int], dead: list[int]) -> dict[int, list[bytes]]:
        """Shares of b_j (survivors) and sk1_j (the dead) from the survivors, by owner."""
        alive, gone = set(survivors), set(dead)
        messages = [
            self._message(
                node,
                {
                    Key.STAGE: Stage.UNMASK,
                    Key.ACTIVE_NODE_ID_LIST: sorted(self.neighbours[node] & alive),
                    Key.DEAD_NODE_ID_LIST: sorted(self.neighbours[node] & gone),
                },
            )
            for node in survivors
        ]
        most = max((len(self.neighbours[n]) for n in survivors), default=0)
        limit = _limit(most * (MAX_SHARE_BYTES + 8))
        replies = self._exchange(Stage.UNMASK, messages, limit, self._check_shares)
        shares: dict[int, list[bytes]] = {node: [] for node in alive | gone}
        for src, reply in replies.items():
            got: Mapping[str, Any] = reply.content.config_records[RECORD_KEY_CONFIGS]  # checked
            for owner, share in zip(
                got.get(Key.NODE_ID_LIST, []), got.get(Key.SHARE_LIST, []), strict=False
            ):
                if owner in shares and src in self.neighbours[owner]:
                    shares[owner].append(share)
        return shares


def _limit(payload: int) -> int:
    """The most bytes a stage's reply may hold: ``payload`` plus the reply margin
    (:func:`protocol.replies.reply_limit`)."""
    return payload + max(int(REPLY_MARGIN_SHARE * payload), REPLY_MARGIN_BYTES)


def secure_sum(
    grid,
    messages: list[Message],
    settings: SecAggSettings,
    *,
    length: int,
    server_round: int,
    timeout: float,
    survivors_needed: int,
) -> SecureSum:
    """Run one SecAgg+ round over the nodes ``messages`` are addressed to (each carrying
    the strategy's train content) and return the sum of the vectors of ``length``
    integers mod M they encode (see the module docstring). The round is abandoned,
    before anything is unmasked, when fewer than ``survivors_needed`` vectors arrive or
    a secret cannot be reconstructed."""
    sampled = [m.metadata.dst_node_id for m in messages]
    train = {m.metadata.dst_node_id: m for m in messages}
    state = _Round(grid, settings, server_round, timeout)

    def abandoned(reason: str, survivors=(), replies=()) -> SecureSum:
        log(WARNING, "SecAgg+ round %d abandoned, nothing released: %s", server_round, reason)
        dropped = sorted(set(sampled) - set(survivors))
        reasons = {n: state.reasons.get(n, f"SecAgg+ round abandoned: {reason}") for n in sampled}
        return SecureSum(
            None, list(survivors), dropped, list(replies), reason, state.seconds, reasons
        )

    if len(sampled) < 2:
        return abandoned(f"{len(sampled)} client(s) sampled; secure aggregation needs 2")
    with_keys = state.setup(sampled)
    shared, forward = state.share_keys(with_keys) if with_keys else ([], {})
    log(
        INFO,
        "SecAgg+ round %d: keys shared among %d of %d clients; collecting masked vectors",
        server_round,
        len(shared),
        len(sampled),
    )
    collected = state.collect(train, forward, length) if shared else {}
    survivors = sorted(collected)
    replies = [collected[n] for n in survivors]
    needed = max(survivors_needed, state.threshold)
    if len(survivors) < needed:
        return abandoned(
            f"{len(survivors)} of {len(sampled)} vectors arrived, {needed} needed "
            f"(threshold {state.threshold}, 'secagg.min-survivors')",
            survivors,
            replies,
        )
    dead = sorted(set(shared) - set(survivors))
    shares = state.unmask(survivors, dead)
    started = time.monotonic()
    total = np.zeros(length, dtype=np.uint64)
    for node in survivors:
        total += collected[node].content.array_records[MASKED][MASKED].numpy().astype(np.uint64)
    modulus = settings.modulus_range
    for owner, owner_shares in shares.items():
        partners = state.neighbours[owner] & set(survivors) - {owner}
        if owner not in collected and not partners:
            continue  # nobody who reached the sum masked with this dropped node
        if len(owner_shares) < state.threshold:
            return abandoned(
                f"{len(owner_shares)} shares of node {owner}'s secret arrived, "
                f"{state.threshold} needed",
                survivors,
                replies,
            )
        secret = combine_shares(owner_shares)
        if owner in collected:  # its own mask b_i
            total -= mask(secret, length, modulus)
            continue
        for other in partners:  # the masks the survivors shared with it
            pairwise = mask(pairwise_seed(secret, state.keys[other][0]), length, modulus)
            if owner > other:
                total += pairwise
            else:
                total -= pairwise
    state.seconds["server-unmask"] = time.monotonic() - started
    log(
        INFO,
        "SecAgg+ round %d: sum of %d of %d clients' vectors unmasked (%d dropped after "
        "sharing keys); stages %s s",
        server_round,
        len(survivors),
        len(sampled),
        len(dead),
        ", ".join(f"{k} {v:.2f}" for k, v in state.seconds.items()),
    )
    return SecureSum(
        reduce(total, modulus),
        survivors,
        sorted(set(sampled) - set(survivors)),
        replies,
        "",
        state.seconds,
        dict(state.reasons),
    )


SECAGG_STRATEGIES = ("fedavg", "fedprox")
SECAGG_PRIVACY = ("none", "dp-fedavg-fixed", "dp-fedavg-adaptive")
