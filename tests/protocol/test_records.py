"""protocol.records: ArrayRecords to numpy arrays and back, with their checks."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from protocol.records import (
    InvalidReply,
    arrays_of,
    as_float,
    as_int,
    copy_record,
    new_record,
    non_finite_array,
    to_array,
    to_numpy,
    to_record,
)


def _record(**arrays) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})


REFERENCE = _record(w=np.zeros((2, 3)), b=np.zeros(3), n=np.array(0, dtype=np.int64))


@pytest.mark.parametrize(
    "value",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(12.0).reshape(3, 4).T,  # Fortran order: Array.numpy()
        np.float64(3.5),
        np.zeros((0, 3)),
        np.array([True, False]),
        np.arange(5, dtype=">i4"),
        np.ones((2, 3, 4), dtype=np.float16),
    ],
)
def test_to_numpy_equals_array_numpy(value):
    array = Array(np.asarray(value))
    got, want = to_numpy(array), array.numpy()
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    got[...] = 0  # a new writable array, as np.load returns
    np.testing.assert_array_equal(array.numpy(), want)


def test_to_numpy_leaves_malformed_bytes_to_array_numpy():
    array = Array(np.arange(4, dtype=np.float32))
    truncated = Array(
        dtype=array.dtype, shape=array.shape, stype=array.stype, data=array.data[:-2]
    )
    with pytest.raises(ValueError):
        truncated.numpy()
    with pytest.raises(ValueError):
        to_numpy(truncated)


def test_to_numpy_without_copy_is_a_read_only_view():
    view = to_numpy(Array(np.arange(3.0)), copy=False)
    assert view.tolist() == [0.0, 1.0, 2.0] and not view.flags.writeable


def test_to_numpy_reads_an_array_whose_header_disagrees_as_flower_does():
    """An Array whose declared shape is not the payload's falls back to Array.numpy()."""
    real = Array(np.arange(6.0).reshape(2, 3))
    relabelled = Array(dtype=real.dtype, shape=(3, 2), stype=real.stype, data=real.data)
    np.testing.assert_array_equal(to_numpy(relabelled), relabelled.numpy())
    assert to_numpy(relabelled).shape == (2, 3)  # what the bytes hold


def test_arrays_of_returns_the_arrays_in_key_order():
    record = _record(w=np.ones((2, 3)), b=np.full(3, 2.0), n=np.array(4, dtype=np.int64))
    w, b, n = arrays_of(record, REFERENCE)
    assert w.shape == (2, 3) and b.tolist() == [2.0, 2.0, 2.0] and int(n) == 4


@pytest.mark.parametrize(
    ("record", "match"),
    [
        (ConfigRecord({"w": 1.0}), "expected an ArrayRecord 'arrays', got ConfigRecord"),
        (None, "expected an ArrayRecord 'arrays', got NoneType"),
        (_record(w=np.zeros((2, 3)), b=np.zeros(3)), "array keys differ"),
        (_record(b=np.zeros(3), w=np.zeros((2, 3)), n=np.array(0)), "array keys differ"),
        (
            _record(w=np.zeros((3, 2)), b=np.zeros(3), n=np.array(0, dtype=np.int64)),
            r"array 'w' has shape \(3, 2\)/float64, expected \(2, 3\)/float64",
        ),
        (
            _record(w=np.zeros((2, 3), np.float32), b=np.zeros(3), n=np.array(0, np.int64)),
            r"array 'w' has shape \(2, 3\)/float32, expected \(2, 3\)/float64",
        ),
        (
            _record(w=np.zeros((2, 3)), b=np.array([0, np.inf, 0]), n=np.array(0, np.int64)),
            "array 'b' contains NaN or Inf",
        ),
    ],
)
def test_arrays_of_refuses_what_must_not_enter_an_aggregate(record, match):
    with pytest.raises(InvalidReply, match=match):
        arrays_of(record, REFERENCE)


def test_arrays_of_without_reference_checks_only_finiteness():
    arrays = arrays_of(_record(anything=np.ones(7), n=np.array([3], dtype=np.int64)))
    assert [a.shape for a in arrays] == [(7,), (1,)]
    with pytest.raises(InvalidReply, match="array 'x' contains NaN or Inf"):
        arrays_of(_record(x=np.array([np.nan])))


def test_non_finite_array_names_the_first_floating_array_with_nan_or_inf():
    assert non_finite_array(REFERENCE) is None
    assert non_finite_array(ArrayRecord()) is None
    bad = _record(a=np.ones(2), b=np.array([1.0, -np.inf]), c=np.array([np.nan]))
    assert non_finite_array(bad) == "b"
    assert non_finite_array(_record(i=np.array([2**62], dtype=np.int64))) is None
    assert non_finite_array(_record(h=np.array([np.inf], dtype=np.float16))) == "h"


def test_to_record_rounds_integer_averages():
    reference = ArrayRecord({"n": Array(np.array([4], dtype=np.int64))})
    out = to_record(reference, [np.array([4.6])])

    assert out["n"].numpy().tolist() == [5] and out["n"].numpy().dtype == np.int64


def test_to_record_keeps_the_references_keys_and_dtypes():
    reference = _record(w=np.zeros(2, np.float32), n=np.array([0], np.int32))
    # np.rint rounds halves to even, as every aggregate of an integer array does.
    out = to_record(reference, [np.array([0.1, 0.2]), np.array([6.5])])
    assert list(out.keys()) == ["w", "n"]
    assert out["w"].dtype == "float32" and out["n"].dtype == "int32"
    np.testing.assert_array_equal(out["w"].numpy(), np.array([0.1, 0.2], np.float32))
    assert out["n"].numpy().tolist() == [6]
    with pytest.raises(ValueError):
        to_record(reference, [np.zeros(2)])  # one array short


def test_copy_record_shares_no_buffer_and_keeps_everything():
    record = _record(w=np.arange(4.0).reshape(2, 2), n=np.array(3, dtype=np.int64))
    copy = copy_record(record)
    assert list(copy.keys()) == list(record.keys())
    for key in record:
        assert copy[key].dtype == record[key].dtype and copy[key].shape == record[key].shape
        np.testing.assert_array_equal(copy[key].numpy(), record[key].numpy())
        assert copy[key].data is not record[key].data
    copy["w"] = Array(np.zeros((2, 2)))
    assert record["w"].numpy().tolist() == [[0.0, 1.0], [2.0, 3.0]]


def test_as_float_and_as_int_convert_record_values_as_float_and_int_do():
    metrics = MetricRecord({"n": 3, "loss": 0.25, "hist": [1.0, 2.0]})
    config = ConfigRecord({"round": "7", "z": 1.5})
    assert as_float(metrics["n"]) == 3.0 and isinstance(as_float(metrics["n"]), float)
    assert as_float(metrics["loss"]) == 0.25
    assert as_float(config["round"]) == 7.0  # a string parses, as float("7") does
    assert as_int(config["z"]) == 1  # truncates, as int(1.5) does
    assert as_int(config["round"]) == 7
    with pytest.raises(TypeError):
        as_float(metrics["hist"])  # a list is no number
    with pytest.raises(TypeError):
        as_int(None)


def test_to_record_writes_the_bytes_flowers_array_writes():
    # to_record's cached-header encoder against what it replaced: Array(np.asarray(...)).
    reference = _record(
        w=np.zeros((2, 3), dtype=np.float32),
        n=np.array(0, dtype=np.int64),
        h=np.zeros(4, dtype=np.float16),
        e=np.zeros((0, 3)),
    )
    arrays = [
        np.arange(6.0).reshape(2, 3) / 7,  # float64 into float32
        np.array(2.6),  # rounded into int64
        np.arange(4, dtype=np.float32)[::-1] * 1.5,  # a strided view into float16
        np.zeros((0, 3)),
    ]
    for _ in range(2):  # the second time from the cached headers
        got = to_record(reference, arrays)
        for key, value in zip(reference, arrays, strict=True):
            dtype = np.dtype(reference[key].dtype)
            value = np.rint(value) if np.issubdtype(dtype, np.integer) else value
            want = Array(np.asarray(value, dtype=dtype))
            assert got[key].data == want.data
            assert (got[key].dtype, tuple(got[key].shape), got[key].stype) == (
                want.dtype,
                tuple(want.shape),
                want.stype,
            )
    assert int(to_numpy(got["n"])) == 3


@pytest.mark.parametrize(
    "value", [np.arange(6, dtype=np.float32).reshape(2, 3), np.float64(2.5), np.zeros(0, np.int64)]
)
def test_to_array_builds_the_array_flowers_constructor_builds(value):
    """The same fields, dirty flag and object id (the content hash Flower's messages
    carry) as ``Array(dtype=..., shape=..., stype=..., data=...)`` and Flower's encoder."""
    ours = to_array(np.asarray(value))
    direct = Array(dtype=ours.dtype, shape=tuple(ours.shape), stype=ours.stype, data=ours.data)
    flowers = Array.from_numpy_ndarray(np.asarray(value))
    assert ours.__dict__ == direct.__dict__
    assert ours.object_id == direct.object_id == flowers.object_id
    assert ours.deflate() == flowers.deflate()
    ours.data = flowers.data  # Flower's dirty tracking still applies
    assert ours.is_dirty


@pytest.mark.parametrize(
    ("kind", "items"),
    [
        (ArrayRecord, {"w": to_array(np.arange(6, dtype=np.float32)), "n": to_array(np.int64(3))}),
        (MetricRecord, {"num-examples": 16, "loss": 0.25, "hist": [1.0, 2.0]}),
        (ArrayRecord, {}),
        (ConfigRecord, {"server-round": 3, "mode": "fit", "blob": b"x", "flags": [True]}),
        (RecordDict, {"metrics": MetricRecord({"x": 1.0}), "arrays": ArrayRecord()}),
    ],
)
def test_new_record_builds_the_record_flowers_constructor_builds(kind, items):
    """The same type, items in order, dirty flag and object id as ``kind(items)``."""
    ours = new_record(kind, items)
    flowers = kind(dict(items))
    assert type(ours) is kind and list(ours.items()) == list(items.items())
    assert {k: v for k, v in ours.__dict__.items() if k != "_data"} == {
        k: v for k, v in flowers.__dict__.items() if k != "_data"
    }
    assert ours.object_id == flowers.object_id
    assert ours.__dict__["_data"] is not items  # the record holds its own dict


@pytest.mark.parametrize(
    ("kind", "items"),
    [
        (ArrayRecord, {"w": np.zeros(2)}),  # not an Array
        (MetricRecord, {"loss": "low"}),  # not a number
        (MetricRecord, {3: 1.0}),  # not a str key
        (RecordDict, {"metrics": {"x": 1.0}}),  # not a record
    ],
)
def test_new_record_refuses_what_flowers_checks_refuse(kind, items):
    with pytest.raises(TypeError):
        kind(items)
    with pytest.raises(TypeError):
        new_record(kind, items)
