"""SecAgg+ clients refuse what an honest server never asks.

A lying server that lists a survivor as both surviving and dropped in the unmask stage
would get, from every honest neighbour, a share of its mask seed b_i *and* of its key
sk1_i, and with them its vector. The clients are the real mod
(``client_app.secagg_mod``) on :class:`tests.strategies.secure.test_secagg.ModGrid`; the
server is :func:`strategies.secure.secagg_plus.secure_sum` whose unmask stage lies; last, a whole
private run in process (:mod:`tests.inprocess`) whose second round is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pandas as pd
import pytest
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)

from client_app import secagg_mod
from protocol.masking import MASKED, mask, pairwise_seed
from strategies.secure import secagg_plus as secagg
from strategies.secure.secagg_plus import SecAggSettings, secure_sum
from tests.inprocess import InProcessGrid, run_config, run_server
from tests.strategies.secure.test_secagg import (
    DIM,
    SETTINGS,
    ModGrid,
    _plain,
    _run,
    _train_messages,
)

NODES = [11, 22, 33, 44, 55]
VICTIM = 11


def _updates(nodes, seed=7) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0.0, 0.05, DIM).astype(np.float32).astype(np.float64) for n in nodes}


class LyingServer:
    """Replaces ``_Round.unmask``: lists ``victim`` as dropped to every survivor while
    still listing it as surviving; keeps the victim's sk1 shares for itself and hands
    ``secure_sum`` the rest, so the round goes on as if nothing happened."""

    def __init__(self, victim: int) -> None:
        self.victim = victim
        self.stolen: list[bytes] = []  # shares of the victim's sk1
        self.seed_shares: list[bytes] = []  # shares of the victim's b
        self.round: secagg._Round | None = None
        self.replies: dict[int, object] = {}

    def unmask(self, state: secagg._Round, survivors: list[int], dead: list[int]):
        self.round = state
        alive, gone = set(survivors), set(dead) | {self.victim}
        messages = [
            state._message(
                node,
                {
                    Key.STAGE: Stage.UNMASK,
                    Key.ACTIVE_NODE_ID_LIST: sorted(state.neighbours[node] & alive),
                    Key.DEAD_NODE_ID_LIST: sorted(state.neighbours[node] & gone),
                },
            )
            for node in survivors
        ]
        replies = state._exchange(Stage.UNMASK, messages)
        self.replies = replies
        shares: dict[int, list[bytes]] = {node: [] for node in alive | set(dead)}
        for src, reply in replies.items():
            got = reply.content.config_records[RECORD_KEY_CONFIGS]
            active = len(state.neighbours[src] & alive)
            pairs = zip(got[Key.NODE_ID_LIST], got[Key.SHARE_LIST], strict=True)
            for position, (owner, share) in enumerate(pairs):
                if position >= active and owner == self.victim:
                    self.stolen.append(share)
                    continue
                shares[owner].append(share)
                if owner == self.victim:
                    self.seed_shares.append(share)
        return shares

    def recover(self, masked: np.ndarray) -> np.ndarray:
        """The victim's own vector from its masked upload and the stolen secrets."""
        state = self.round
        assert state is not None
        modulus = SETTINGS.modulus_range
        seed, key = combine_shares(self.seed_shares), combine_shares(self.stolen)
        vector = masked.astype(np.uint64) - mask(seed, masked.size, modulus)
        for other in sorted(state.neighbours[self.victim] - {self.victim}):
            pairwise = mask(pairwise_seed(key, state.keys[other][0]), masked.size, modulus)
            vector = vector - pairwise if self.victim > other else vector + pairwise
        return vector & np.uint64(modulus - 1)


def _lying_run(monkeypatch, grid: ModGrid) -> tuple[LyingServer, secagg.SecureSum]:
    liar = LyingServer(VICTIM)
    monkeypatch.setattr(secagg._Round, "unmask", lambda self, s, d: liar.unmask(self, s, d))
    return liar, _run(grid)


def test_without_the_check_a_lying_server_recovers_a_survivors_update(monkeypatch):
    # The client as it was (Flower's _unmask unchecked): the attack works, to the
    # quantization step. This makes the next test's refusal meaningful.
    monkeypatch.setattr(secagg_mod, "check_unmask", lambda state, configs: None)
    grid = ModGrid(_updates(NODES))

    liar, result = _lying_run(monkeypatch, grid)

    assert result.vector is not None  # the round looked normal to everyone
    # Every survivor (the victim too) sent a share of each of the victim's two secrets.
    assert len(liar.stolen) == len(NODES) and len(liar.seed_shares) == len(NODES)
    (upload,) = [r for r in result.replies if r.metadata.src_node_id == VICTIM]
    recovered = _plain().decode(liar.recover(upload.content[MASKED][MASKED].numpy()))
    weight = 100 / SETTINGS.max_weight
    truth = np.append(weight * grid.updates[VICTIM], weight)
    error = np.max(np.abs(recovered - truth))
    assert error <= 1 / SETTINGS.scale  # 2^-18: one quantization step
    assert np.median(np.abs(grid.updates[VICTIM])) > 1000 / SETTINGS.scale  # not trivially 0


def test_clients_refuse_a_survivor_listed_as_dropped_and_release_no_share(monkeypatch):
    grid = ModGrid(_updates(NODES))

    liar, result = _lying_run(monkeypatch, grid)

    # Every survivor refused with an error reply naming the lie; nothing was released.
    unmask = [r for r in grid.received if r.metadata.src_node_id in NODES][-len(NODES) :]
    assert all(r.has_error() for r in unmask)
    for reply in unmask:
        assert f"[{VICTIM}] as both surviving and dropped" in reply.error.reason
    assert liar.replies == {} and liar.stolen == [] and liar.seed_shares == []
    assert not [
        r
        for r in grid.received
        if not r.has_error()
        and Key.SHARE_LIST in r.content.config_records.get(RECORD_KEY_CONFIGS, {})
    ]
    # The round is abandoned: no sum, as for any round whose secrets cannot be rebuilt.
    assert result.vector is None and "0 shares of node" in result.reason
    # The secrets are gone: asked again, honestly, nobody answers with a share.
    assert all(RECORD_KEY_STATE not in c.state for c in grid.contexts.values())
    state = liar.round
    assert state is not None
    monkeypatch.undo()
    again = secagg._Round.unmask(state, NODES, [])
    assert all(shares == [] for shares in again.values())
    assert all(r.has_error() for r in grid.received[-len(NODES) :])


def _tamper(stage: str, change: Callable[[dict, int], None]):
    """A grid whose ``stage`` messages are changed by ``change(record, node)``."""

    class Tampering(ModGrid):
        def send_and_receive(self, messages, *, timeout=None):
            for message in messages:
                record = message.content.config_records[RECORD_KEY_CONFIGS]
                if record[Key.STAGE] == stage:
                    change(record, message.metadata.dst_node_id)
            return super().send_and_receive(messages, timeout=timeout)

    return Tampering(_updates(NODES))


def _set(key, value):
    return lambda record, node: record.__setitem__(key, value(record, node))


@pytest.mark.parametrize(
    "stage, change, words",
    [
        (  # a node that never took part in the round
            Stage.UNMASK,
            _set(Key.DEAD_NODE_ID_LIST, lambda r, n: [*r[Key.DEAD_NODE_ID_LIST], 99]),
            "[99] that exchanged no shares with this client",
        ),
        (  # a neighbour left out of both lists
            Stage.UNMASK,
            _set(Key.ACTIVE_NODE_ID_LIST, lambda r, n: [m for m in r[Key.ACTIVE_NODE_ID_LIST]
                                                        if m != (11 if n != 11 else 22)]),
            "leaves out node(s) [",
        ),
        (  # the client itself listed as dropped
            Stage.UNMASK,
            _set(Key.ACTIVE_NODE_ID_LIST, lambda r, n: [m for m in r[Key.ACTIVE_NODE_ID_LIST]
                                                        if m != n]),
            "does not list this client",
        ),
        (
            Stage.UNMASK,
            _set(Key.ACTIVE_NODE_ID_LIST, lambda r, n: [*r[Key.ACTIVE_NODE_ID_LIST], n]),
            "lists a node twice",
        ),
        (  # t = 1: every share would be the secret itself
            Stage.SETUP,
            _set(Key.THRESHOLD, lambda r, n: 1),
            "an honest server sends 2 <= threshold <= shares <= cohort",
        ),
        (
            Stage.SETUP,
            _set(Key.SHARE_NUMBER, lambda r, n: 6),
            "an honest server sends 2 <= threshold <= shares <= cohort",
        ),
        (  # a key larger than any honest client's, relayed
            Stage.SHARE_KEYS,
            lambda r, n: [r.__setitem__(k, [b"k" * 2000, r[k][1]]) for k in list(r)
                          if k != Key.STAGE],
            "over 1024 bytes",
        ),
        (  # a ciphertext larger than any honest client's, forwarded
            Stage.COLLECT_MASKED_VECTORS,
            _set(Key.CIPHERTEXT_LIST, lambda r, n: [b"c" * 5000] * len(r[Key.CIPHERTEXT_LIST])),
            "ciphertext over 4096 bytes",
        ),
    ],
    ids=["unknown-node", "left-out", "self-dead", "twice", "threshold-1", "shares>cohort",
         "huge-key", "huge-ciphertext"],
)  # fmt: skip
def test_clients_refuse_what_the_round_did_not_produce(stage, change, words):
    grid = _tamper(stage, change)

    result = _run(grid)

    errors = [r for r in grid.received if r.has_error()]
    assert len(errors) == len(NODES) and all(words in r.error.reason for r in errors)
    assert result.vector is None
    assert not [
        r
        for r in grid.received
        if not r.has_error()
        and Key.SHARE_LIST in r.content.config_records.get(RECORD_KEY_CONFIGS, {})
    ]
    assert all(RECORD_KEY_STATE not in c.state for c in grid.contexts.values())


def test_a_stage_of_a_round_the_client_did_not_set_up_is_refused():
    grid = ModGrid(_updates(NODES[:3]))
    _run(grid)  # round 1, complete: the secrets are gone
    assert all(RECORD_KEY_STATE not in c.state for c in grid.contexts.values())
    settings = SecAggSettings()
    state = secagg._Round(grid, settings, 2, 1.0)
    state.setup(NODES[:3])
    shared, _ = state.share_keys(NODES[:3])
    assert shared == NODES[:3]
    # A share-keys or collect message carrying another round's group id is refused.
    stale = secagg._Round(grid, settings, 1, 1.0)
    stale.keys, stale.neighbours = state.keys, state.neighbours
    replies = stale._exchange(Stage.COLLECT_MASKED_VECTORS, [
        stale._message(n, {Key.STAGE: Stage.COLLECT_MASKED_VECTORS, Key.SOURCE_LIST: [],
                           Key.CIPHERTEXT_LIST: []}, _train_messages([n])[0].content)
        for n in NODES[:3]
    ])  # fmt: skip
    assert replies == {}
    refused = grid.received[-3:]
    assert all("a collect_masked_vectors request of a round" in r.error.reason for r in refused)
    assert all(RECORD_KEY_STATE not in c.state for c in grid.contexts.values())


def test_a_message_outside_a_secure_round_drops_its_secrets():
    grid = ModGrid(_updates(NODES[:3]))
    state = secagg._Round(grid, SecAggSettings(), 1, 1.0)
    state.setup(NODES[:3])
    assert all(RECORD_KEY_STATE in c.state for c in grid.contexts.values())
    (plain,) = _train_messages([NODES[0]])  # an ordinary train message (no SecAgg+ record)

    secagg_mod.secagg_mod(plain, grid.contexts[NODES[0]], grid._train)

    assert RECORD_KEY_STATE not in grid.contexts[NODES[0]].state
    assert all(RECORD_KEY_STATE in grid.contexts[n].state for n in NODES[1:3])


def test_the_honest_server_is_never_refused():
    # Every list the real server sends passes the checks, with dropouts at every stage.
    grid = ModGrid(
        _updates([11, 22, 33, 44, 55, 66, 77]),
        dies={33: Stage.SHARE_KEYS, 55: Stage.COLLECT_MASKED_VECTORS},
    )

    result = secure_sum(
        grid,
        _train_messages(list(grid.updates)),
        SecAggSettings(num_shares=5, reconstruction_threshold=3),
        length=DIM + 1,
        server_round=1,
        timeout=1.0,
        survivors_needed=2,
    )

    assert not [r for r in grid.received if r.has_error()]
    assert result.vector is not None and result.survivors == [11, 22, 44, 66, 77]


def test_a_refused_round_of_a_private_run_releases_and_charges_nothing(monkeypatch, tmp_path):
    # Distributed DP, 4 of 5 clients a round; the server lies in round 2's unmask stage.
    original = secagg._Round.unmask
    liars: list[LyingServer] = []

    def unmask(state, survivors, dead):
        if state.server_round != 2:
            return original(state, survivors, dead)
        liars.append(LyingServer(survivors[0]))
        return liars[-1].unmask(state, survivors, dead)

    monkeypatch.setattr(secagg._Round, "unmask", unmask)
    cfg = run_config(
        **{
            "output-dir": str(tmp_path),
            "secagg.enabled": True,
            "privacy": "dp-fedavg-fixed",
            "dp.noise-site": "client",
            "dp.sampling": "fixed",
            "dp.num-sampled-clients": 4,
            "dp.noise-multiplier": 1.0,
            "dp.clip-norm": 0.5,
            "min-available-nodes": 5,
        }
    )

    run_server(cfg, InProcessGrid(cfg, NODES))

    (liar,) = liars
    assert liar.stolen == [] and liar.seed_shares == []
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert [r["server_round"] for r in ledger["state"]["releases"]] == [1, 3]
    released = pd.read_csv(run_dir / "metrics.csv")
    epsilon = released[released["scope"] == "train"].set_index("round")["dp-epsilon"]
    assert epsilon.loc[2] == epsilon.loc[1] and epsilon.loc[3] > epsilon.loc[2]
    # The model did not move in round 2: its central evaluation is round 1's.
    central = released[released["scope"] == "central-eval"].set_index("round")
    assert central.loc[2, "eval-loss"] == central.loc[1, "eval-loss"]
    assert json.loads((run_dir / "outcome.json").read_text())["status"] == "completed"
