"""SecAgg+ secrets never outlive their round: no file a run leaves, no log line and no
message other than the protocol's own holds a key, mask seed, shared key or share; the
client state that is saved is the owner's alone.

The run is the real ServerApp and ClientApp in one process (:mod:`tests.inprocess`):
distributed DP over SecAgg+, a client that keeps state between rounds (an LR schedule),
and a client lost after sharing its keys (so that shares of its key are released, as
the protocol allows). Every secret the clients held is captured from their contexts
during the run; then every file under the output directory (run directory, client
state, checkpoints, curator) is decoded and searched for each, in every encoding a file
could carry it in.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import stat
import zipfile
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.logger import FLOWER_LOGGER
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
from flwr.supercore.task_identity import TaskIdentity

from client_app import app as client_module
from client_app import state
from protocol import keys
from protocol.masking import pairwise_seed
from tests.inprocess import InProcessGrid, run_config, run_server

NODES = [11, 22, 33, 44, 55]
RUN = {
    "secagg.enabled": True,
    "privacy": "dp-fedavg-fixed",
    "dp.noise-site": "client",
    "dp.sampling": "fixed",
    "dp.num-sampled-clients": 4,
    "dp.noise-multiplier": 1.0,
    "dp.clip-norm": 0.5,
    "secagg.min-survivors": 3,
    "min-available-nodes": 5,
    "num-server-rounds": 2,
    "vision.lr-decay": 0.9,  # the clients keep an epoch count: client state files
}
SECRET_FIELDS = ("sk1", "sk2", "rd_seed", "rd_seed_share_dict:V", "sk1_share_dict:V", "ss2_dict:V")


def _secrets(record: ConfigRecord) -> set[bytes]:
    """The secrets in a client's SecAgg+ state: its keys, mask seed, shared keys, the
    shares it holds, and the pairwise mask seeds they give."""
    found: set[bytes] = set()
    for name in SECRET_FIELDS:
        value = record.get(name)
        found.update(value if isinstance(value, list) else [value] if value else [])
    public = record.get("public_keys_dict:V", [])
    for pk1 in public[::2]:
        if record.get("sk1") and pk1 != record.get("pk1"):
            found.add(pairwise_seed(record["sk1"], pk1))
    return found


class CapturingGrid(InProcessGrid):
    """Records every secret the clients hold after each stage and every reply; the
    first node sent a collect message in round 2 dies there (after sharing keys)."""

    def __init__(self, cfg: dict, nodes: list[int]) -> None:
        super().__init__(cfg, nodes)
        self.secrets: set[bytes] = set()
        self.replies: list[Message] = []
        self.after_unmask: list[bool] = []  # whether a context still held the record
        self.victim: int | None = None

    def send_and_receive(self, messages, *, timeout=None):
        for message in messages:
            stage = message.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE)
            server_round = int(message.content.get("config", {}).get("server-round", 0))
            if self.victim is None and stage == Stage.COLLECT_MASKED_VECTORS and server_round == 2:
                self.victim = message.metadata.dst_node_id
                self.kill(self.victim)
        return super().send_and_receive(messages, timeout=timeout)

    def _answer(self, message: Message, context: Context) -> Message:
        reply = super()._answer(message, context)
        self.replies.append(reply)
        record = context.state.config_records.get(RECORD_KEY_STATE)
        if record is not None:
            self.secrets |= _secrets(record)
        stage = message.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE)
        if stage == Stage.UNMASK:
            self.after_unmask.append(record is not None)
        return reply


def _forms(secret: bytes) -> list[bytes]:
    """How a file could carry ``secret``: raw, hex, base64, or a Python bytes repr."""
    return [
        secret,
        secret.hex().encode(),
        secret.hex().upper().encode(),
        base64.b64encode(secret),
        base64.urlsafe_b64encode(secret),
        base64.b64encode(secret).rstrip(b"="),
        repr(secret)[2:-1].encode(),
    ]


def _decoded(path: Path) -> list[bytes]:
    """The file's bytes and what it decodes to: a zip's members (torch checkpoints), a
    serialised RecordDict's values (client state)."""
    data = path.read_bytes()
    views = [data]
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            views += [archive.read(name) for name in archive.namelist()]
    try:
        record = recorddict_from_proto(ProtoRecordDict.FromString(data))
    except Exception:  # not a RecordDict
        record = None
    if record is not None:
        for config in record.config_records.values():
            for value in config.values():
                items = value if isinstance(value, list) else [value]
                views += [v for v in items if isinstance(v, bytes)]
        for arrays in record.array_records.values():
            views += [arrays[name].data for name in arrays]
    return views


def _leaks(blobs: dict[str, list[bytes]], secrets: set[bytes]) -> list[str]:
    """Where any form of any secret occurs."""
    forms = [form for secret in secrets for form in _forms(secret)]
    return [where for where, views in blobs.items() if any(f in v for v in views for f in forms)]


@pytest.fixture(scope="module")
def secagg_run(tmp_path_factory):
    """The run, under umask 0 (a mode that is right under it is right under any umask)."""
    tmp_path = tmp_path_factory.mktemp("secagg-secrets")
    # What Flower's runtime sets for a ServerApp (tests/conftest.py sets it per test, after
    # a module-scoped fixture).
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    cfg = run_config(**{"output-dir": str(tmp_path), **RUN})
    grid = CapturingGrid(cfg, NODES)
    saved_with_secrets: list[int] = []
    save = state.save

    def spy(context, artifacts_dir, partition_id, server_round):  # what train() saves
        if RECORD_KEY_STATE in context.state:
            saved_with_secrets.append(partition_id)
        save(context, artifacts_dir, partition_id, server_round)

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.DEBUG)
    level = FLOWER_LOGGER.level
    FLOWER_LOGGER.addHandler(handler)
    FLOWER_LOGGER.setLevel(logging.DEBUG)
    umask = os.umask(0)
    mp = pytest.MonkeyPatch()
    mp.setattr(client_module.state, "save", spy)
    try:
        run_server(cfg, grid)
    finally:
        mp.undo()
        os.umask(umask)
        FLOWER_LOGGER.removeHandler(handler)
        FLOWER_LOGGER.setLevel(level)
    return tmp_path, grid, stream.getvalue(), saved_with_secrets


def test_the_run_held_secrets_and_dropped_them_after_each_round(secagg_run):
    out, grid, _, saved_with_secrets = secagg_run

    assert grid.victim is not None
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    assert json.loads((run_dir / "outcome.json").read_text())["status"] == "completed"
    # 5 clients x 2 rounds (4 sampled each): keys, seeds, shared keys, shares: many.
    assert len(grid.secrets) > 100
    # Each survivor's context held no SecAgg+ state once it had answered the unmask.
    assert grid.after_unmask and not any(grid.after_unmask)
    survivors = [n for n in NODES if n != grid.victim]
    assert all(RECORD_KEY_STATE not in grid.contexts[n].state for n in survivors)
    # The ClientApp trained (and saved its state) without the secrets in its context.
    assert saved_with_secrets == []


def test_no_file_the_run_leaves_holds_a_secret(secagg_run):
    out, grid, _, _ = secagg_run

    files = sorted(p for p in out.rglob("*") if p.is_file())
    state_files = [p for p in files if p.parent.parent.name == keys.STATE_DIR]
    assert len(state_files) >= 3  # the client state was saved (and is scanned)
    assert any(p.name == "ledger.json" for p in files) and any(p.suffix == ".pt" for p in files)
    blobs = {str(p.relative_to(out)): _decoded(p) for p in files}

    assert _leaks(blobs, grid.secrets) == []


def test_the_scan_finds_a_secret_where_one_is_written(secagg_run, tmp_path):
    # The check is not vacuous: the state as it used to be saved is found, in each form.
    _, grid, _, _ = secagg_run
    secret = sorted(grid.secrets)[0]
    record = ConfigRecord({"sk1": secret, "pk1": b"public"})
    path = tmp_path / "round-1.bin"
    path.write_bytes(
        recorddict_to_proto(RecordDict({RECORD_KEY_STATE: record})).SerializeToString()
    )

    assert _leaks({"state": _decoded(path)}, grid.secrets) == ["state"]
    for form in _forms(secret):
        assert _leaks({"text": [b"x" + form + b"y"]}, {secret}) == ["text"]


def test_no_log_line_and_no_other_message_holds_a_secret(secagg_run):
    _, grid, log, _ = secagg_run

    assert "SecAgg+ round 2: sum of 3 of 4" in log  # the log was captured, at DEBUG
    assert _leaks({"log": [log.encode()]}, grid.secrets) == []
    # Every message both ways, but the unmask replies (whose shares are the protocol's).
    unmask_replies = {
        id(r)
        for r in grid.replies
        if not r.has_error() and Key.SHARE_LIST in r.content.config_records.get(
            RECORD_KEY_CONFIGS, {}
        )
    }  # fmt: skip
    assert unmask_replies
    messages = [m for m in grid.sent + grid.replies if id(m) not in unmask_replies]
    blobs = {
        f"message {i}": [recorddict_to_proto(m.content).SerializeToString()]
        for i, m in enumerate(messages)
        if not m.has_error()
    }
    assert _leaks(blobs, grid.secrets) == []


def test_client_state_is_owner_only_whatever_the_umask(secagg_run):
    out, _, _, _ = secagg_run

    (root,) = {p for p in out.rglob(keys.STATE_DIR) if p.is_dir()}
    entries = [root, *root.rglob("*")]
    assert len(entries) > len(NODES)
    for entry in entries:
        mode = stat.S_IMODE(entry.stat().st_mode)
        assert mode == (0o700 if entry.is_dir() else 0o600), (entry, oct(mode))


def _context(**records) -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(records), run_config={})


def test_state_files_never_hold_the_secagg_record_nor_restore_one(tmp_path):
    secret = ConfigRecord({"sk1": b"\x07" * 48, "rd_seed": b"\x09" * 32})
    kept = ConfigRecord({"epochs": 3})

    state.save(_context(**{RECORD_KEY_STATE: secret, "task": kept}), str(tmp_path), 0, 1)
    state.save(_context(**{RECORD_KEY_STATE: secret}), str(tmp_path), 0, 2)  # nothing else

    directory = state.directory(str(tmp_path), 0)
    assert sorted(p.name for p in directory.iterdir()) == ["round-1.bin"]
    data = (directory / "round-1.bin").read_bytes()
    assert b"\x07" * 48 not in data and b"\x09" * 32 not in data
    # A file written before this rule, holding the record, restores without it.
    legacy = RecordDict({RECORD_KEY_STATE: secret, "task": kept})
    (directory / "round-1.bin").write_bytes(recorddict_to_proto(legacy).SerializeToString())
    fresh = _context()
    assert state.restore(fresh, str(tmp_path), 0, 2) == 1
    assert list(fresh.state.keys()) == ["task"] and fresh.state["task"]["epochs"] == 3


def test_state_files_tighten_directories_that_exist(tmp_path):
    loose = state.directory(str(tmp_path), 3)
    loose.mkdir(parents=True, mode=0o777)
    os.chmod(loose, 0o777)
    os.chmod(loose.parent, 0o755)

    state.save(_context(task=ConfigRecord({"epochs": 1})), str(tmp_path), 3, 1)

    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    assert stat.S_IMODE(loose.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((loose / "round-1.bin").stat().st_mode) == 0o600
