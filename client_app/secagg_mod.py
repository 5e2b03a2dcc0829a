"""The client half of SecAgg+ (:mod:`strategies.secagg`): a mod that answers the four
stages of a secure round.

Setup, share-keys and unmask are Flower's own (``flwr.client.mod.secure_aggregation.
secaggplus_mod``: fresh key pairs each round, Shamir shares of the mask seed b_i and of
sk1_i, each encrypted to its neighbour; shares of b_j or sk1_j, as the server asks).
The collect stage is ours: Flower's expects a legacy ``FitRes`` and masks with a
32-bit-seeded MT19937 (see :mod:`protocol.masking`). Here the client

1. decrypts the shares forwarded to it and checks their sender and addressee;
2. trains through the rest of the mod chain (``privacy_mod`` clips the update under
   DP-FedAvg); a failed training is a zero update (weight 0 without DP);
3. encodes Δ = trained − received as integers mod M
   (:class:`privacy.skellam.SecureSumEncoding`): under DP the clipped Δ, conditionally
   rounded, plus its Skellam noise share from the client's secret generator; without
   DP w·Δ with coordinates clipped, and the weight w itself; under adaptive clipping
   the norm bit as one more integer;
4. answers only ``x + PRG(b_i) + Σ_j ±PRG(s_ij) mod M``: no metrics, no arrays.
"""

from __future__ import annotations

from logging import WARNING
from typing import cast

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.client.mod.secure_aggregation.secaggplus_mod import (
    SecAggPlusState,
    _setup,
    _share_keys,
    _unmask,
    check_configs,
    check_stage,
)
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

from client_app.mods import _generator
from privacy.skellam import SecureSumEncoding
from privacy.subspace import flatten
from protocol import keys
from protocol.masking import mask, masked_record, pairwise_seed, reduce
from protocol.records import InvalidReply, arrays_of


def encoding_of(config) -> SecureSumEncoding:
    """The encoding the server's train config asks for."""
    return SecureSumEncoding(
        clip_norm=float(config[keys.SECAGG_CLIP_NORM]),
        scale=float(config[keys.SECAGG_SCALE]),
        modulus=2 ** int(config[keys.SECAGG_MODULUS_BITS]),
        client_variance=float(config.get(keys.SECAGG_VARIANCE, 0.0)),
        coordinate_range=float(config.get(keys.SECAGG_COORDINATE_RANGE, 0.0)),
    )


def _receive_shares(state: SecAggPlusState, configs: ConfigRecord) -> list[int]:
    """Store the shares forwarded to this client; the neighbours that sent them."""
    sources = cast(list[int], configs[Key.SOURCE_LIST])
    ciphertexts = cast(list[bytes], configs[Key.CIPHERTEXT_LIST])
    if len(ciphertexts) + 1 < state.threshold:
        raise ValueError("SecAgg+: fewer neighbours than the reconstruction threshold")
    for src, ciphertext in zip(sources, ciphertexts, strict=True):
        actual, dst, seed_share, sk1_share = share_keys_plaintext_separate(
            decrypt(state.ss2_dict[src], ciphertext)
        )
        if actual != src or dst != state.nid:
            raise ValueError(
                f"SecAgg+: a share from {actual} to {dst} arrived as {src} -> {state.nid}"
            )
        state.rd_seed_share_dict[src] = seed_share
        state.sk1_share_dict[src] = sk1_share
    return list(sources)


def _update(msg: Message, reply: Message) -> tuple[np.ndarray, float, float]:
    """(flat Δ in float64, num-examples, norm bit) of a train reply; zeros for a failure."""
    received = msg.content[keys.ARRAYS]
    reference = arrays_of(received)
    size = sum(a.size for a in reference)
    if reply.has_error():
        log(WARNING, "secagg_mod: training failed (%s); a zero update", reply.error.reason)
        return np.zeros(size), 0.0, 1.0
    try:
        trained = arrays_of(reply.content.get(keys.ARRAYS), received)
    except InvalidReply as err:
        log(WARNING, "secagg_mod: unusable update (%s); a zero update", err)
        return np.zeros(size), 0.0, 1.0
    delta = flatten(trained) - flatten(reference)
    metrics = reply.content.get(keys.METRICS) or {}
    examples = float(metrics.get(keys.NUM_EXAMPLES, 0.0))
    bit = float(metrics.get(keys.DP_NORM_BIT, 1.0))
    if not np.all(np.isfinite(delta)):
        log(WARNING, "secagg_mod: non-finite update; a zero update")
        return np.zeros(size), 0.0, 1.0
    return delta, examples, bit


def _vector(msg: Message, reply: Message, rng: np.random.Generator) -> np.ndarray:
    """The client's integer vector mod M (module docstring, step 3)."""
    config = msg.content[keys.CONFIG]
    encoding = encoding_of(config)
    delta, examples, bit = _update(msg, reply)
    if encoding.clip_norm == 0:  # plain secure FedAvg: weighted update and the weight
        max_weight = float(config[keys.SECAGG_MAX_WEIGHT])
        weight = min(max(examples, 0.0), max_weight) / max_weight
        span = encoding.coordinate_range
        delta = np.append(np.clip(delta, -span, span) * weight, weight)
    vector = encoding.encode(delta, rng)
    if config.get(keys.SECAGG_NORM_BIT):
        vector = np.append(vector, np.uint64(1 if bit >= 0.5 else 0))
    return vector


def _collect(
    state: SecAggPlusState,
    configs: ConfigRecord,
    msg: Message,
    ctxt: Context,
    call_next: ClientAppCallable,
) -> RecordDict:
    neighbours = _receive_shares(state, configs)
    try:
        reply = call_next(msg, ctxt)
    except Exception as err:
        error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(err))
        reply = Message(error, reply_to=msg)
    vector = _vector(msg, reply, _generator(msg, ctxt))
    modulus = 2 ** int(msg.content[keys.CONFIG][keys.SECAGG_MODULUS_BITS])
    vector += mask(state.rd_seed, vector.size, modulus)  # uint64: wraps mod 2^64
    for other in neighbours:
        pairwise = mask(
            pairwise_seed(state.sk1, state.public_keys_dict[other][0]), vector.size, modulus
        )
        if state.nid > other:
            vector += pairwise
        else:
            vector -= pairwise
    content = masked_record(reduce(vector, modulus), modulus)
    content[RECORD_KEY_CONFIGS] = ConfigRecord({})
    return content


def secagg_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Answer a SecAgg+ stage (TRAIN messages carrying its record); pass anything else on."""
    if (
        msg.metadata.message_type != MessageType.TRAIN
        or RECORD_KEY_CONFIGS not in msg.content.config_records
    ):
        return call_next(msg, ctxt)
    records = ctxt.state.config_records
    if RECORD_KEY_STATE not in records:
        records[RECORD_KEY_STATE] = ConfigRecord({})
    state = SecAggPlusState(**records[RECORD_KEY_STATE])
    configs = ConfigRecord(dict(msg.content.config_records[RECORD_KEY_CONFIGS]))
    check_stage(state.current_stage, configs)
    state.current_stage = cast(str, configs.pop(Key.STAGE))
    check_configs(state.current_stage, configs)
    if state.current_stage == Stage.SETUP:
        state.nid = msg.metadata.dst_node_id
        content = RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(_setup(state, configs), False)})
    elif state.current_stage == Stage.SHARE_KEYS:
        content = RecordDict(
            {RECORD_KEY_CONFIGS: ConfigRecord(_share_keys(state, configs), False)}
        )
    elif state.current_stage == Stage.COLLECT_MASKED_VECTORS:
        content = _collect(state, configs, msg, ctxt, call_next)
    else:
        content = RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(_unmask(state, configs), False)})
    records[RECORD_KEY_STATE] = ConfigRecord(state.to_dict())
    return Message(content, reply_to=msg)
