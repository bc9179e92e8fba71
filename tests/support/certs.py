"""Test certificates made with ``cryptography``: a CA, server and client certificates.

Everything lives in one directory as PEM files. Serial numbers are random 63-bit
numbers with the top bit set, so that every certificate of one kind has the same
encoded length (a test rewrites a certificate in place with the same size).
"""

from __future__ import annotations

import datetime
import ipaddress
import pathlib
import secrets
import socket
import ssl
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAY = datetime.timedelta(days=1)


def _serial() -> int:
    return (1 << 62) | secrets.randbits(62)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass
class Issued:
    """A certificate and its key, written as PEM files."""

    cert: pathlib.Path
    key: pathlib.Path
    serial: int


class CertificateAuthority:
    """A self-signed CA that issues server and client certificates into ``folder``."""

    def __init__(self, folder: pathlib.Path, name: str = "Switchboard Test CA") -> None:
        self.folder = folder
        self.key = _key()
        now = datetime.datetime.now(datetime.UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(_serial())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + 30 * _DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
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
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        self.path = folder / f"{name.replace(' ', '-').lower()}.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self, stem: str, *, server: bool = True, key: ec.EllipticCurvePrivateKey | None = None
    ) -> Issued:
        """A leaf certificate: for ``localhost``, ``127.0.0.1`` and ``::1`` (server) or a client.

        Writes ``<stem>.crt`` and ``<stem>.key`` (a fresh key unless one is given).
        """
        return self._issue(
            stem, self.folder / f"{stem}.crt", self.folder / f"{stem}.key", server, key
        )

    def issue_to(
        self, cert: pathlib.Path, key: pathlib.Path, common_name: str = "switchboard"
    ) -> Issued:
        """A server certificate at ``cert``, its fresh key at ``key`` (a rotation in place)."""
        return self._issue(common_name, cert, key, True, None)

    def _issue(
        self,
        common_name: str,
        cert_path: pathlib.Path,
        key_path: pathlib.Path,
        server: bool,
        key: ec.EllipticCurvePrivateKey | None,
    ) -> Issued:
        key = key or _key()
        now = datetime.datetime.now(datetime.UTC)
        serial = _serial()
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(now - _DAY)
            .not_valid_after(now + 30 * _DAY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.IPAddress(ipaddress.ip_address("::1")),
                    ]
                ),
                critical=False,
            )
        cert = builder.sign(self.key, hashes.SHA256())
        # The key first: a watcher that sees the new certificate finds its key in place.
        key_path.write_bytes(_key_pem(key))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Issued(cert_path, key_path, serial)


def load_key(path: pathlib.Path) -> ec.EllipticCurvePrivateKey:
    """A private key from a PEM file written by :meth:`CertificateAuthority.issue`."""
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


def served_serial(
    address: str, cacert: pathlib.Path, client: Issued | None = None, timeout: float = 10
) -> int:
    """The serial number of the certificate a TLS server at ``host:port`` presents now.

    A fresh TCP connection and handshake (verified against ``cacert``; with a
    client certificate for mutual TLS). Blocking: call it in a thread.
    """
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(cacert))
    context.set_alpn_protocols(["h2"])
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    with (
        socket.create_connection((host, int(port)), timeout=timeout) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number
