"""Certificates and SuperNode keys for a deployed SuperLink (TLS + SuperNode auth).

Writes, with the ``cryptography`` package (a Flower dependency), what Flower 1.41's
TLS and SuperNode authentication need (docs/deploy.md walks through using them;
Flower's guides: "Enable TLS connections" and "Authenticate SuperNodes")::

    python -m lab.deploy certs --out certs \\
        --hosts 127.0.0.1 localhost superlink.lab.example --supernodes 3

Design notes: ``docs/notes.md``, ``lab.deploy``.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CURVE = ec.SECP384R1  # NIST P-384: the curve Flower's guide and `flwr supernode register` use
CA_CERT, CA_KEY = "ca.crt", "ca.key"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
_CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates valid from a little before now


@dataclass(frozen=True)
class KeyPair:
    """Paths of a written certificate or public key and its private key."""

    public: Path
    private: Path


def _check_free(paths: Iterable[Path], force: bool) -> None:
    """Raise ``FileExistsError`` naming the first existing path (unless ``force``)."""
    if force:
        return
    for path in paths:
        if path.exists():
            raise FileExistsError(f"{path} exists (pass --force / force=True to overwrite)")


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` readable by the owner only (0600, also when the file existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    path.chmod(0o600)


def _pem_private(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def subject_alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """``IPAddress`` entries for IP literals, ``DNSName`` entries for the other hosts."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def write_ca(
    out: Path, *, common_name: str = "flower-privacy-lab CA", days: int = 365, force: bool = False
) -> KeyPair:
    """Write a CA key (``ca.key``, 0600) and its self-signed certificate (``ca.crt``).

    Returns
    -------
    KeyPair
        ``public`` is the certificate, ``private`` the key.
    """
    out.mkdir(parents=True, exist_ok=True)
    pair = KeyPair(out / CA_CERT, out / CA_KEY)
    _check_free((pair.public, pair.private), force)
    key = ec.generate_private_key(CURVE())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA384())
    )
    _write_private(pair.private, _pem_private(key))
    pair.public.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return pair


def write_server_cert(
    out: Path, hosts: Sequence[str], ca: KeyPair, *, days: int = 365, force: bool = False
) -> KeyPair:
    """Write the SuperLink's key (``server.key``, 0600) and a certificate signed by
    ``ca`` (``server.pem``) whose SubjectAltNames are ``hosts`` (the first is the CN).

    Returns
    -------
    KeyPair
        ``public`` is the certificate, ``private`` the key.
    """
    if not hosts:
        raise ValueError("give at least one host name or IP address for the certificate")
    out.mkdir(parents=True, exist_ok=True)
    pair = KeyPair(out / SERVER_CERT, out / SERVER_KEY)
    _check_free((pair.public, pair.private), force)
    ca_key = serialization.load_pem_private_key(ca.private.read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.public.read_bytes())
    key = ec.generate_private_key(CURVE())
    now = datetime.datetime.now(datetime.UTC)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(subject_alt_names(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), False
        )
        .sign(ca_key, hashes.SHA384())
    )
    _write_private(pair.private, _pem_private(key))
    pair.public.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return pair


def write_supernode_keys(out: Path, count: int, *, force: bool = False) -> list[KeyPair]:
    """Write ``count`` SuperNode authentication key pairs, ``supernode-<k>.key`` (OpenSSH
    private key, 0600) and ``supernode-<k>.pub`` (OpenSSH public key line), k = 0..count-1.

    Returns
    -------
    list[KeyPair]
        One pair per SuperNode: ``public`` for ``flwr supernode register``, ``private``
        for ``flower-supernode --auth-supernode-private-key``.
    """
    out.mkdir(parents=True, exist_ok=True)
    pairs = [KeyPair(out / f"supernode-{k}.pub", out / f"supernode-{k}.key") for k in range(count)]
    _check_free((p for pair in pairs for p in (pair.public, pair.private)), force)
    for k, pair in enumerate(pairs):
        key = ec.generate_private_key(CURVE())
        private = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
        public = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        _write_private(pair.private, private)
        pair.public.write_bytes(public + f" supernode-{k}\n".encode())
    return pairs


def write_all(
    out: Path, hosts: Sequence[str], supernodes: int, *, days: int = 365, force: bool = False
) -> tuple[KeyPair, KeyPair, list[KeyPair]]:
    """CA, SuperLink certificate and SuperNode keys in ``out``; nothing is written if any
    of the files exists (unless ``force``)."""
    targets = [CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY]
    targets += [f"supernode-{k}.{ext}" for k in range(supernodes) for ext in ("key", "pub")]
    _check_free((out / name for name in targets), force)
    ca = write_ca(out, days=days, force=force)
    server = write_server_cert(out, hosts, ca, days=days, force=force)
    return ca, server, write_supernode_keys(out, supernodes, force=force)


def main(argv: list[str] | None = None) -> None:
    """``python -m lab.deploy certs --out DIR --hosts H [H ...] --supernodes N``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    certs = commands.add_parser("certs", help="CA, SuperLink certificate, SuperNode keys")
    certs.add_argument("--out", type=Path, default=Path("certs"), help="output folder")
    certs.add_argument(
        "--hosts",
        nargs="+",
        required=True,
        help="SuperLink names and IP addresses clients dial (keep 127.0.0.1)",
    )
    certs.add_argument("--supernodes", type=int, default=0, help="SuperNode key pairs")
    certs.add_argument("--days", type=int, default=365, help="certificate validity")
    certs.add_argument("--force", action="store_true", help="overwrite existing files")
    args = parser.parse_args(argv)
    try:
        ca, server, keys = write_all(
            args.out, args.hosts, args.supernodes, days=args.days, force=args.force
        )
    except FileExistsError as err:
        raise SystemExit(str(err)) from None
    print(f"CA certificate:       {ca.public}  (key {ca.private}: keep offline)")
    print(f"SuperLink certificate: {server.public}  key {server.private}  SANs {args.hosts}")
    for pair in keys:
        print(f"SuperNode key pair:   {pair.private}  {pair.public}")


if __name__ == "__main__":
    main()
