"""The certificates and SuperNode keys `python -m lab.deploy certs` writes."""

from __future__ import annotations

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from lab import deploy


def test_server_certificate_is_signed_by_the_ca_for_every_host(tmp_path):
    ca, server, keys = deploy.write_all(tmp_path, ["127.0.0.1", "localhost", "lab.example"], 2)
    ca_cert = x509.load_pem_x509_certificate(ca.public.read_bytes())
    cert = x509.load_pem_x509_certificate(server.public.read_bytes())
    cert.verify_directly_issued_by(ca_cert)  # raises if not signed by the CA
    assert ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "lab.example"]
    server_key = serialization.load_pem_private_key(server.private.read_bytes(), None)
    assert server_key.public_key().public_numbers() == cert.public_key().public_numbers()
    assert len(keys) == 2


def test_supernode_keys_are_openssh_p384_pairs_with_private_files_0600(tmp_path):
    _, server, keys = deploy.write_all(tmp_path, ["127.0.0.1"], 3)
    for pair in [server, *keys]:
        assert stat.S_IMODE(pair.private.stat().st_mode) == 0o600
    publics = set()
    for pair in keys:
        private = serialization.load_ssh_private_key(pair.private.read_bytes(), None)
        public = serialization.load_ssh_public_key(pair.public.read_bytes())
        assert isinstance(public, ec.EllipticCurvePublicKey)
        assert public.curve.name == "secp384r1"
        assert private.public_key().public_numbers() == public.public_numbers()
        assert pair.public.read_text().startswith("ecdsa-sha2-nistp384 ")
        publics.add(pair.public.read_text())
    assert len(publics) == 3  # one distinct key per SuperNode


def test_existing_files_are_kept_unless_forced(tmp_path):
    ca, _, _ = deploy.write_all(tmp_path, ["127.0.0.1"], 1)
    before = ca.private.read_bytes()
    with pytest.raises((FileExistsError, SystemExit, ValueError), match="exist"):
        deploy.write_all(tmp_path, ["127.0.0.1"], 1)
    assert ca.private.read_bytes() == before
    deploy.write_all(tmp_path, ["127.0.0.1"], 1, force=True)
    assert ca.private.read_bytes() != before
