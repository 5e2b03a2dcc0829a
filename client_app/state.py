"""A client's ``context.state`` on disk, per round, so that it survives a new run.

What a client carries between rounds lives in ``context.state``: its own model under
``strategy = local``, FedBN's local layers, SmartFedProx's divergence history, the task
state (PPO timesteps, epochs done, the DP-SGD accountant's history). A resumed run
(``resume-from``), or a SuperNode restarted mid-run, starts with an empty context;
without the saved state the client would, for instance, restart its DP-SGD accountant
and under-report its epsilon.

Design notes: ``docs/notes.md``, ``client_app.state``.
"""

from __future__ import annotations

import os
import re
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import Context, RecordDict
from flwr.common.logger import log
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from protocol import keys

KEEP = 2  # files per partition: the round in progress and the last finished one
_FILE = re.compile(r"round-(\d+)\.bin")
NEVER_SAVED = frozenset({RECORD_KEY_STATE})  # protocol secrets that live for one round
FILE_MODE, DIR_MODE = 0o600, 0o700


def directory(artifacts_dir: str, partition_id: int) -> Path:
    """Where partition ``partition_id`` keeps its state files."""
    return Path(artifacts_dir) / keys.STATE_DIR / f"partition-{partition_id}"


def _saved_rounds(path: Path) -> list[int]:
    if not path.is_dir():
        return []
    return sorted(int(m.group(1)) for f in path.iterdir() if (m := _FILE.fullmatch(f.name)))


def _private_dir(path: Path) -> None:
    """Make ``path`` (and a missing parent) a directory only its owner can enter."""
    for directory_ in (path.parent, path):
        directory_.mkdir(mode=DIR_MODE, exist_ok=True)  # the mode is masked by the umask
        os.chmod(directory_, DIR_MODE)


def _kept(state: RecordDict) -> RecordDict:
    """``state`` without what must never be saved."""
    return RecordDict({key: record for key, record in state.items() if key not in NEVER_SAVED})


def save(
    context: Context, artifacts_dir: str | None, partition_id: int, server_round: int
) -> None:
    """Write ``context.state`` (less :data:`NEVER_SAVED`) as of the end of
    ``server_round``, owner-only; keep the newest two."""
    kept = _kept(context.state)
    if not artifacts_dir or not len(kept):
        return
    path = directory(artifacts_dir, partition_id)
    try:
        Path(artifacts_dir).mkdir(parents=True, exist_ok=True)
        _private_dir(path)
        target = path / f"round-{server_round}.bin"
        tmp = path / f".{target.name}.tmp"
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), FILE_MODE)  # exactly 0600: the umask only removes bits
            out.write(recorddict_to_proto(kept).SerializeToString())
        os.replace(tmp, target)
        for old in _saved_rounds(path)[:-KEEP]:
            (path / f"round-{old}.bin").unlink(missing_ok=True)
    except OSError as err:  # a read-only or missing disk must not fail the round
        log(WARNING, "client state of partition %d not saved: %s", partition_id, err)


def restore(
    context: Context,
    artifacts_dir: str | None,
    partition_id: int,
    server_round: int,
    *,
    evaluate: bool = False,
) -> int | None:
    """Fill an empty ``context.state`` from the newest file of a round before
    ``server_round`` (``evaluate``: of ``server_round`` or before: evaluating round r
    follows its training, which a resumed run evaluates again after committing it);
    return that round (None when nothing was restored)."""
    if not artifacts_dir or len(context.state):
        return None
    path = directory(artifacts_dir, partition_id)
    last = server_round if evaluate else server_round - 1
    earlier = [r for r in _saved_rounds(path) if r <= last]
    if not earlier:
        return None
    data = (path / f"round-{earlier[-1]}.bin").read_bytes()
    saved: RecordDict = recorddict_from_proto(ProtoRecordDict.FromString(data))
    for key, record in _kept(saved).items():
        context.state[key] = record
    log(INFO, "partition %d: client state of round %d restored", partition_id, earlier[-1])
    return earlier[-1]
