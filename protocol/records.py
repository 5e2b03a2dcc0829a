"""ArrayRecords to numpy arrays and back, as both sides of a message build and read them."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any, SupportsFloat, SupportsInt, TypeVar, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.constant import SType

from protocol import keys

if TYPE_CHECKING:
    import torch


class InvalidReply(ValueError):
    """A reply that must not enter an aggregate (error, missing, malformed, non-finite)."""


def as_float(value: object) -> float:
    """``float(value)`` of a record's value, which Flower types as a union with lists
    (a list or None raises TypeError here exactly as in ``float``)."""
    return float(cast(SupportsFloat, value))


def as_int(value: object) -> int:
    """``int(value)`` of a record's value (see :func:`as_float`)."""
    return int(cast(SupportsInt, value))


R = TypeVar("R", ArrayRecord, MetricRecord, ConfigRecord)


def records(content: RecordDict, kind: type[R]) -> dict[str, R]:
    """``content.array_records`` (``metric_records``, ``config_records``) as a plain dict,
    for reading: Flower's properties build a synced view that writes every record back
    into ``content`` (7 µs a call against 0.8, and a round reads a reply's several times)."""
    return {key: record for key, record in content.items() if isinstance(record, kind)}


_NPY_V1 = b"\x93NUMPY\x01\x00"  # .npy magic and format version 1.0 (what np.save writes)


def to_numpy(array: Array, *, copy: bool = True) -> np.ndarray:
    """``array.numpy()``, without ``np.load``'s parsing of the ``.npy`` header.

    Flower's ``Array.numpy()`` reads the header with ``ast.literal_eval``, most of the
    cost of decoding a small array (the server decodes every array of every reply;
    bench/vs_flower.py orchestration). A C-order version-1.0 payload whose header states exactly
    the ``dtype`` and ``shape`` the Array declares is read directly from the bytes,
    into a new writable array as ``np.load`` returns (``copy=False``: a read-only
    view of the bytes, for a check that keeps nothing); anything else goes to
    ``array.numpy()``.
    """
    data = array.data
    if array.stype == "numpy.ndarray" and data[:8] == _NPY_V1:
        offset = 10 + int.from_bytes(data[8:10], "little")
        shape = tuple(array.shape)
        dtype, expected, count = _expected_header(array.dtype, shape)
        if (
            not dtype.hasobject
            and data[10:offset].rstrip() == expected
            and len(data) - offset == count * dtype.itemsize
        ):
            view = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
            return view.copy() if copy else view
    return array.numpy()


@lru_cache(maxsize=256)
def _expected_header(dtype_name: str, shape: tuple[int, ...]) -> tuple[np.dtype, bytes, int]:
    # The dtype an Array declares, the .npy header dict np.save writes for it (without
    # its padding) and the element count; once per (dtype, shape) and process.
    dtype = np.dtype(dtype_name)
    header = f"{{'descr': '{dtype.str}', 'fortran_order': False, 'shape': {shape}, }}"
    return dtype, header.encode("latin1"), math.prod(shape)


def to_state_dict(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """``record.to_torch_state_dict()``: the same tensors, each array decoded by
    :func:`to_numpy` (a message's or a checkpoint's largest fixed cost after the
    arithmetic on a small model is ``np.load`` parsing each header)."""
    import torch  # on use: the server's checks and the privacy layer need no torch

    return {key: torch.from_numpy(to_numpy(record[key])) for key in record}


def arrays_of(record: object, reference: ArrayRecord | None = None) -> list[np.ndarray]:
    """The arrays of ``record`` in key order, checked against ``reference``.

    Raises
    ------
    InvalidReply
        If ``record`` is not an ArrayRecord, its keys, shapes or dtypes differ from
        ``reference``, or any value is NaN or infinite.
    """
    if not isinstance(record, ArrayRecord):
        raise InvalidReply(f"expected an ArrayRecord '{keys.ARRAYS}', got {type(record).__name__}")
    if reference is not None and list(record.keys()) != list(reference.keys()):
        raise InvalidReply("array keys differ from the global model's")
    arrays = [to_numpy(record[k]) for k in record]
    if reference is not None:
        for key, got in zip(reference.keys(), arrays, strict=True):
            want = reference[key]
            if tuple(got.shape) != tuple(want.shape) or _dtype_name(got.dtype) != want.dtype:
                raise InvalidReply(
                    f"array '{key}' has shape {got.shape}/{got.dtype}, "
                    f"expected {tuple(want.shape)}/{want.dtype}"
                )
    for key, value in zip(record.keys(), arrays, strict=True):
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            raise InvalidReply(f"array '{key}' contains NaN or Inf")
    return arrays


def non_finite_array(record: ArrayRecord) -> str | None:
    """The key of the first floating array of ``record`` holding a NaN or an infinity,
    or None; read in place (no copy), for checks on every reply and aggregate."""
    for key in record:
        value = to_numpy(record[key], copy=False)
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            return key
    return None


@lru_cache(maxsize=256)
def _npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    # The header np.save writes for a C-order array of this dtype and shape.
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(shape, dtype=np.dtype(descr)), allow_pickle=False)
    data = buffer.getvalue()
    return data[: len(data) - math.prod(shape) * np.dtype(descr).itemsize]


def to_array(ndarray: np.ndarray) -> Array:
    """``Array.from_numpy_ndarray(ndarray)``, the same bytes, with the ``.npy`` header of
    each (dtype, shape) written once per process (hand-written: ``np.save`` re-renders
    the header per call, most of the cost of encoding a small array). Arrays that are not
    C-contiguous, or hold objects, go to Flower's own encoder."""
    if ndarray.dtype.hasobject or not ndarray.flags.c_contiguous:
        return Array.from_numpy_ndarray(ndarray)
    shape = tuple(ndarray.shape)
    data = _npy_header(ndarray.dtype.str, shape) + ndarray.tobytes()
    return _new_array(_dtype_name(ndarray.dtype), shape, data)


@lru_cache(maxsize=64)
def _dtype_name(dtype: np.dtype) -> str:
    return str(dtype)  # numpy renders a dtype's name in Python, 2.5 µs a call


def _direct_array(dtype: str, shape: tuple[int, ...], data: bytes) -> Array:
    return Array(dtype=dtype, shape=shape, stype=SType.NUMPY, data=data)


def _filled_array(dtype: str, shape: tuple[int, ...], data: bytes) -> Array:
    # Array's __init__ parses its arguments for three ways of calling it (4.5 µs, about
    # as long as encoding a small array); its direct form leaves exactly these fields.
    array = Array.__new__(Array)
    array.__dict__.update(_is_dirty=True, dtype=dtype, shape=shape, stype=SType.NUMPY, data=data)
    return array


def _pick_new_array():
    # The filled form only while it leaves what Flower's own constructor leaves (the
    # fields, the dirty flag, the object id), checked once per process.
    probe = ("float32", (2,), b"\x00" * 8)
    ours, flowers = _filled_array(*probe), _direct_array(*probe)
    same = ours.__dict__ == flowers.__dict__ and ours.object_id == flowers.object_id
    return _filled_array if same else _direct_array


_new_array = _pick_new_array()


Rec = TypeVar("Rec", ArrayRecord, MetricRecord, ConfigRecord, RecordDict)


def _set_items(kind: type[Rec], items: Mapping[str, Any]) -> Rec:
    record = kind()
    for key, value in items.items():
        record[key] = value
    return record


def _filled_items(kind: type[Rec], items: Mapping[str, Any]) -> Rec:
    # A record's __setitem__ builds two typing aliases to call its key and value checks
    # (~2.5 µs an item), and ArrayRecord's constructor also copies every Array: 30 µs for
    # a 4-array model, most of a small reply's record building. The same checks, called
    # directly, fill the same dict.
    record = kind()
    fields = record.__dict__
    check_key, check_value = fields["_check_key_fn"], fields["_check_value_fn"]
    for key, value in items.items():
        check_key(key)
        check_value(value)
    fields["_data"].update(items)
    if kind is ArrayRecord and fields["_data"]:
        fields["_is_dirty"] = True  # what ArrayRecord's __setitem__ marks
    return record


def _pick_new_record():
    # The filled form only while it leaves what setting each item leaves (the fields,
    # the dirty flag, the object id) for every kind, checked once per process.
    probes = [
        (ArrayRecord, {"w": _direct_array("float32", (2,), b"\x00" * 8)}),
        (MetricRecord, {"x": 1.0, "n": 2, "v": [1.0, 2.0]}),
        (ConfigRecord, {"s": "a", "b": b"x", "f": False}),
        (RecordDict, {"m": MetricRecord({"x": 1.0}), "c": ConfigRecord({"s": "a"})}),
    ]
    for kind, items in probes:
        ours, flowers = _filled_items(kind, items), _set_items(kind, items)
        if ours.__dict__ != flowers.__dict__ or ours.object_id != flowers.object_id:
            return _set_items
    return _filled_items


_new_record = _pick_new_record()


def new_record(kind: type[Rec], items: Mapping[str, Any]) -> Rec:
    """``kind(items)``, a record holding ``items`` themselves (Flower's ArrayRecord
    constructor copies each Array), each checked by the record's own key and value
    checks; for records built fresh on a message's path."""
    return _new_record(kind, items)


def to_record(reference: ArrayRecord, arrays: list[np.ndarray]) -> ArrayRecord:
    """An ArrayRecord with ``reference``'s keys and dtypes holding ``arrays``.

    Averages of integer arrays (e.g. BatchNorm's ``num_batches_tracked``) are rounded,
    not truncated, so every aggregate keeps the dtypes the next replies validate against.
    """
    out = {}
    for key, value in zip(reference.keys(), arrays, strict=True):
        dtype = np.dtype(reference[key].dtype)
        value = np.rint(value) if np.issubdtype(dtype, np.integer) else value
        out[key] = to_array(np.asarray(value, dtype=dtype))  # Array(...)'s bytes
    return new_record(ArrayRecord, out)


def copy_record(record: ArrayRecord) -> ArrayRecord:
    """A copy of ``record`` that shares no buffer with it."""
    return to_record(record, [record[key].numpy() for key in record])
