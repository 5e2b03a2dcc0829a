"""The client half of SecAgg+ (:mod:`strategies.secure.secagg_plus`): a mod that answers the four
stages of a secure round.

Setup, share-keys and unmask are Flower's own (``flwr.client.mod.secure_aggregation.
secaggplus_mod``: fresh key pairs each round, Shamir shares of the mask seed b_i and of
sk1_i, each encrypted to its neighbour; shares of b_j or sk1_j, as the server asks).
The collect stage is ours: Flower's expects a legacy ``FitRes`` and masks with a
32-bit-seeded MT19937 (see :mod:`protocol.masking`). Here the client

Design notes: ``docs/notes.md``, ``client_app.secagg_mod``.
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

from privacy.mechanisms import client_noise_generator
from privacy.skellam import SecureSumEncoding
from privacy.subspace import flatten
from protocol import keys
from protocol.masking import (
    MAX_CIPHERTEXT_BYTES,
    MAX_KEY_BYTES,
    mask,
    masked_record,
    pairwise_seed,
    reduce,
)
from protocol.records import InvalidReply, arrays_of

ROUND = "secagg-round"  # the state record's tag: the group id (server round) it belongs to


def encoding_of(config) -> SecureSumEncoding:
    """The encoding the server's train config asks for."""
    return SecureSumEncoding(
        clip_norm=float(config[keys.SECAGG_CLIP_NORM]),
        scale=float(config[keys.SECAGG_SCALE]),
        modulus=2 ** int(config[keys.SECAGG_MODULUS_BITS]),
        client_variance=float(config.get(keys.SECAGG_VARIANCE, 0.0)),
        coordinate_range=float(config.get(keys.SECAGG_COORDINATE_RANGE, 0.0)),
    )


class Refused(ValueError):
    """A SecAgg+ request that an honest server never sends."""


def check_setup(configs: ConfigRecord) -> None:
    """Refuse parameters no honest server sends: 2 <= t <= shares <= cohort (t = 1 would
    make every share the secret itself)."""
    cohort = int(configs[Key.SAMPLE_NUMBER])
    shares, threshold = int(configs[Key.SHARE_NUMBER]), int(configs[Key.THRESHOLD])
    if not 2 <= threshold <= shares <= cohort:
        raise Refused(
            f"setup asks for threshold {threshold}, {shares} shares, cohort {cohort}; "
            "an honest server sends 2 <= threshold <= shares <= cohort"
        )


def check_neighbours(state: SecAggPlusState, configs: ConfigRecord) -> None:
    """Refuse a share-keys request naming more neighbours than the shares set up, or
    relaying a public key larger than any honest client's."""
    if len(configs) > state.share_num:
        raise Refused(
            f"share-keys lists {len(configs)} neighbours (this client included), "
            f"more than the {state.share_num} shares set up"
        )
    for node, pair in configs.items():
        if any(len(key) > MAX_KEY_BYTES for key in cast(list[bytes], pair)):
            raise Refused(f"share-keys relays a key of node {node} over {MAX_KEY_BYTES} bytes")


def check_unmask(state: SecAggPlusState, configs: ConfigRecord) -> None:
    """Refuse an unmask request an honest server never sends.

    The server's lists partition the nodes this client exchanged shares with in this
    round (itself and every neighbour whose shares the collect stage forwarded):
    ``active`` those whose masked vector reached the sum (this client among them),
    ``dead`` the others. A node in both would get its mask seed b_j *and* its key
    sk1_j revealed, and with them its vector; a node outside that set, or one left
    out, is a list this client never saw the round produce."""
    active = cast(list[int], configs[Key.ACTIVE_NODE_ID_LIST])
    dead = cast(list[int], configs[Key.DEAD_NODE_ID_LIST])
    both = sorted(set(active) & set(dead))
    if both:
        raise Refused(
            f"unmask lists node(s) {both} as both surviving and dropped: answering would "
            "reveal both secrets of each, and with them its vector"
        )
    if len(set(active)) != len(active) or len(set(dead)) != len(dead):
        raise Refused("unmask lists a node twice")
    if state.nid not in active:
        raise Refused(f"unmask does not list this client ({state.nid}) as surviving")
    shared = set(state.rd_seed_share_dict)  # itself and the neighbours whose shares arrived
    listed = set(active) | set(dead)
    if listed - shared:
        raise Refused(
            f"unmask lists node(s) {sorted(listed - shared)} that exchanged no shares with "
            "this client in this round"
        )
    if shared - listed:
        raise Refused(
            f"unmask leaves out node(s) {sorted(shared - listed)} that exchanged shares "
            "with this client in this round"
        )


def _receive_shares(state: SecAggPlusState, configs: ConfigRecord) -> list[int]:
    """Store the shares forwarded to this client; the neighbours that sent them."""
    sources = cast(list[int], configs[Key.SOURCE_LIST])
    ciphertexts = cast(list[bytes], configs[Key.CIPHERTEXT_LIST])
    if len(ciphertexts) + 1 < state.threshold:
        raise ValueError("SecAgg+: fewer neighbours than the reconstruction threshold")
    if len(set(sources)) != len(sources) or state.nid in sources:
        raise Refused("collect forwards shares from a node twice, or from this client")
    if any(len(c) > MAX_CIPHERTEXT_BYTES for c in ciphertexts):
        raise Refused(f"collect forwards a ciphertext over {MAX_CIPHERTEXT_BYTES} bytes")
    for src, ciphertext in zip(sources, ciphertexts, strict=True):
        if src not in state.ss2_dict:
            raise Refused(f"collect forwards shares from node {src}, not a neighbour")
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
    # The rest of the ClientApp trains without the round's secrets in its context (what
    # it keeps, and saves: client_app.state, never holds them); secagg_mod stores the
    # state again once the masked vector is made.
    forget(ctxt)
    try:
        reply = call_next(msg, ctxt)
    except Exception as err:
        error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(err))
        reply = Message(error, reply_to=msg)
    server_round = int(msg.content[keys.CONFIG].get(keys.SERVER_ROUND, 0))
    rng = client_noise_generator(ctxt.run_config, ctxt.node_config, server_round)
    vector = _vector(msg, reply, rng)
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


def forget(ctxt: Context) -> None:
    """Drop a secure round's secrets from ``ctxt`` (nothing when it holds none)."""
    ctxt.state.pop(RECORD_KEY_STATE, None)


def _is_stage(msg: Message) -> bool:
    return (
        msg.metadata.message_type == MessageType.TRAIN
        and RECORD_KEY_CONFIGS in msg.content.config_records
    )


def _load(ctxt: Context, stage: object, group: str) -> SecAggPlusState:
    """This round's protocol state: fresh at setup; else the state set up for the
    round ``group`` (a stage of another round is refused)."""
    saved = dict(ctxt.state.config_records.get(RECORD_KEY_STATE, {}))
    if stage == Stage.SETUP:
        return SecAggPlusState()
    if saved.pop(ROUND, None) != group:
        raise Refused(f"a {stage} request of a round this client did not set up")
    return SecAggPlusState(**saved)


def _answer(
    state: SecAggPlusState,
    configs: ConfigRecord,
    msg: Message,
    ctxt: Context,
    call_next: ClientAppCallable,
) -> RecordDict:
    if state.current_stage == Stage.SETUP:
        check_setup(configs)
        state.nid = msg.metadata.dst_node_id
        return RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(_setup(state, configs), False)})
    if state.current_stage == Stage.SHARE_KEYS:
        check_neighbours(state, configs)
        return RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(_share_keys(state, configs), False)})
    if state.current_stage == Stage.COLLECT_MASKED_VECTORS:
        return _collect(state, configs, msg, ctxt, call_next)
    check_unmask(state, configs)
    return RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(_unmask(state, configs), False)})


def secagg_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Answer a SecAgg+ stage (TRAIN messages carrying its record); pass anything else on
    (a secure round's secrets do not outlive it: any other message drops them)."""
    if not _is_stage(msg):
        forget(ctxt)
        return call_next(msg, ctxt)
    configs = ConfigRecord(dict(msg.content.config_records[RECORD_KEY_CONFIGS]))
    stage = configs.get(Key.STAGE)
    try:
        state = _load(ctxt, stage, msg.metadata.group_id)
        check_stage(state.current_stage, configs)
        state.current_stage = cast(str, configs.pop(Key.STAGE))
        check_configs(state.current_stage, configs)
        content = _answer(state, configs, msg, ctxt, call_next)
    except Exception as err:  # a refused or failed stage ends this client's round
        forget(ctxt)
        log(WARNING, "secagg_mod: SecAgg+ %s refused: %s", stage, err)
        why = str(err) if isinstance(err, Refused) else f"{type(err).__name__}: {err}"
        reason = f"SecAgg+ {stage} refused: {why}"
        error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason)
        return Message(error, reply_to=msg)
    if state.current_stage == Stage.UNMASK:
        forget(ctxt)  # the round's last stage: nothing of it is needed again
    else:
        record = ConfigRecord(state.to_dict())
        record[ROUND] = msg.metadata.group_id
        ctxt.state[RECORD_KEY_STATE] = record
    return Message(content, reply_to=msg)
