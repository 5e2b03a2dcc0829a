"""protocol.masking: SecAgg+ masks are AES-256-CTR keystreams, pairwise seeds agree on
both sides, and masks that the clients add and subtract cancel in the sum."""

from __future__ import annotations

import base64
import hashlib
import itertools

import numpy as np
import pytest
from Crypto.Cipher import AES
from flwr.supercore.primitives.asymmetric import (
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

from protocol.masking import MASKED, mask, masked_record, pairwise_seed, reduce, transport_dtype
from protocol.records import to_numpy


def _key_pair() -> tuple[bytes, bytes]:
    private, public = generate_key_pairs()
    return private_key_to_bytes(private), public_key_to_bytes(public)


def test_masks_are_uniform_deterministic_per_seed_and_independent_across_seeds():
    a, b = mask(b"\x01" * 32, 200_000, 2**32), mask(b"\x02" * 32, 200_000, 2**32)

    assert np.array_equal(a, mask(b"\x01" * 32, 200_000, 2**32))
    assert a.max() < 2**32 and not np.array_equal(a, b)
    counts = np.bincount((a >> np.uint64(28)).astype(np.int64), minlength=16)
    chi2 = float(np.sum((counts - a.size / 16) ** 2 / (a.size / 16)))
    assert chi2 < 45.0  # chi-square with 15 dof: p ~ 1e-4
    assert abs(np.corrcoef(a[:-1].astype(float), a[1:].astype(float))[0, 1]) < 0.01
    full = mask(b"\x03" * 32, 1000, 2**64)
    assert full.dtype == np.uint64 and full.max() > 2**63  # the whole range is used


def test_a_mask_is_the_aes_ctr_keystream_of_another_implementation():
    """The same values from PyCryptodome's AES-256-CTR (key SHA-256(seed), nonce 0), an
    implementation independent of the ``cryptography`` package the app uses."""
    seed = bytes(range(32))
    key = hashlib.sha256(seed).digest()
    stream = AES.new(key, AES.MODE_CTR, nonce=b"", initial_value=bytes(16)).encrypt(bytes(8 * 50))
    words = np.frombuffer(stream, dtype="<u8")
    assert np.array_equal(mask(seed, 50, 2**64), words)
    assert np.array_equal(mask(seed, 50, 2**20), words & np.uint64(2**20 - 1))


def test_a_shorter_mask_is_a_prefix_and_every_modulus_bounds_it():
    seed = b"\x07" * 32
    long = mask(seed, 300, 2**64)
    assert np.array_equal(mask(seed, 100, 2**64), long[:100])
    assert mask(seed, 0, 2**32).shape == (0,)
    for bits in (1, 8, 31, 32, 33, 63):
        values = mask(seed, 300, 2**bits)
        assert values.dtype == np.uint64 and int(values.max()) < 2**bits
        assert np.array_equal(values, long & np.uint64(2**bits - 1))


def test_two_clients_derive_the_same_pairwise_seed_and_a_third_another():
    (sk_a, pk_a), (sk_b, pk_b), (sk_c, pk_c) = (_key_pair() for _ in range(3))
    ab = pairwise_seed(sk_a, pk_b)
    assert ab == pairwise_seed(sk_b, pk_a)
    assert len(base64.urlsafe_b64decode(ab)) == 32  # Flower's HKDF-SHA256 key, base64
    assert pairwise_seed(sk_a, pk_c) != ab and pairwise_seed(sk_c, pk_b) != ab


@pytest.mark.parametrize("bits", [16, 32, 64])
def test_pairwise_masks_cancel_in_the_sum(bits):
    """Each client adds the mask it shares with every lower id and subtracts the one it
    shares with every higher id (client_app.secagg_mod): the sum of the masked vectors
    is the sum of the plain ones, mod M, and no masked vector is its plain one."""
    modulus, length = 2**bits, 64
    pairs = [_key_pair() for _ in range(4)]
    rng = np.random.default_rng(0)
    plain = [rng.integers(0, min(modulus, 2**32), size=length, dtype=np.uint64) for _ in pairs]
    masked = []
    for i, ((sk, _), vector) in enumerate(zip(pairs, plain, strict=True)):
        vector = vector.copy()
        for j, (_, pk) in enumerate(pairs):
            if j == i:
                continue
            pairwise = mask(pairwise_seed(sk, pk), length, modulus)
            vector = vector + pairwise if i > j else vector - pairwise  # wraps mod 2^64
        masked.append(reduce(vector, modulus))
        assert not np.array_equal(masked[-1], reduce(plain[i], modulus))
    total = reduce(np.sum(masked, axis=0, dtype=np.uint64), modulus)
    assert np.array_equal(total, reduce(np.sum(plain, axis=0, dtype=np.uint64), modulus))


def test_reduce_keeps_the_residue_mod_a_power_of_two():
    vector = np.array([0, 1, 2**32 - 1, 2**32, 2**32 + 5, 2**64 - 1], dtype=np.uint64)
    assert reduce(vector, 2**64) is vector
    assert reduce(vector, 2**32).tolist() == [0, 1, 2**32 - 1, 0, 5, 2**32 - 1]
    assert reduce(vector, 2).tolist() == [0, 1, 1, 0, 1, 1]


@pytest.mark.parametrize(
    ("modulus", "dtype"),
    [
        (2, np.uint32),
        (2**16, np.uint32),
        (2**32, np.uint32),
        (2**33, np.uint64),
        (2**64, np.uint64),
    ],
)
def test_transport_dtype_is_the_narrowest_that_holds_the_ring(modulus, dtype):
    assert transport_dtype(modulus) == np.dtype(dtype)


def test_a_masked_record_holds_only_the_reduced_vector_in_its_wire_dtype():
    vector = np.array([1, 2**32 + 3, 2**40], dtype=np.uint64)
    for modulus, want in ((2**32, [1, 3, 0]), (2**64, [1, 2**32 + 3, 2**40])):
        content = masked_record(vector, modulus)
        assert list(content.keys()) == [MASKED]
        assert not content.metric_records and not content.config_records
        record = content.array_records[MASKED]
        assert list(record.keys()) == [MASKED]
        got = to_numpy(record[MASKED])
        assert got.dtype == transport_dtype(modulus) and got.tolist() == want


def test_every_pair_of_distinct_seeds_gives_distinct_masks():
    seeds = [bytes([k]) * 32 for k in range(6)]
    masks = [mask(seed, 16, 2**64) for seed in seeds]
    for a, b in itertools.combinations(masks, 2):
        assert not np.array_equal(a, b)
