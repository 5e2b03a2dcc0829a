"""The SecAgg+ masks, which the clients add and the server removes
(:mod:`strategies.secure.secagg_plus` drives the protocol, :mod:`client_app.secagg_mod`
answers it).

**Masks.** Flower's ``pseudo_rand_gen`` folds its 32-byte seed into 32 bits by XOR and
draws from NumPy's MT19937: 2³² possible masks per seed, a search an honest-but-curious
server can run, from a generator that is not cryptographic. :func:`mask` is the
AES-256-CTR keystream under SHA-256(seed) (``cryptography``, which Flower already
depends on): uniform on Z_M for every power of two M <= 2⁶⁴.

A client's collect reply holds only its masked vector (:func:`masked_record`), in the
narrowest unsigned dtype that holds Z_M (:func:`transport_dtype`).
"""

from __future__ import annotations

import hashlib

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

# The largest item an honest party sends in a SecAgg+ stage, with ample room: a P-384
# public key is 215 bytes (PEM), an encrypted pair of shares 612, a share 52-200. Both
# sides refuse larger ones (the server before relaying them, a client before using them).
MAX_KEY_BYTES = 1024
MAX_CIPHERTEXT_BYTES = 4096
MAX_SHARE_BYTES = 2048

MASKED = "secagg-masked"  # the collect reply's ArrayRecord (one flat array) and its key


def mask(seed: bytes, length: int, modulus: int) -> np.ndarray:
    """``length`` values uniform on Z_modulus (a power of two <= 2⁶⁴) as uint64: the
    AES-256-CTR keystream under key SHA-256(``seed``), nonce 0 (each seed masks one
    vector: keys and seeds are fresh every round)."""
    key = hashlib.sha256(seed).digest()
    encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    stream = encryptor.update(bytes(8 * length)) + encryptor.finalize()
    values = np.frombuffer(stream, dtype="<u8").astype(np.uint64, copy=True)
    if modulus < 2**64:
        values &= np.uint64(modulus - 1)
    return values


def pairwise_seed(private_key: bytes, public_key: bytes) -> bytes:
    """The seed two clients share: ECDH of one's sk1 with the other's pk1 (Flower's)."""
    return generate_shared_key(bytes_to_private_key(private_key), bytes_to_public_key(public_key))


def reduce(vector: np.ndarray, modulus: int) -> np.ndarray:
    """``vector`` (uint64, any value) reduced mod ``modulus`` (uint64 wraps mod 2⁶⁴)."""
    return vector if modulus == 2**64 else vector & np.uint64(modulus - 1)


def transport_dtype(modulus: int) -> np.dtype:
    """The narrowest unsigned dtype holding Z_modulus: a masked vector's wire format."""
    return np.dtype(np.uint32) if modulus <= 2**32 else np.dtype(np.uint64)


def masked_record(vector: np.ndarray, modulus: int) -> RecordDict:
    """The collect reply's content: only the masked vector, in its wire dtype."""
    array = Array(reduce(vector, modulus).astype(transport_dtype(modulus)))
    return RecordDict({MASKED: ArrayRecord({MASKED: array})})
