"""Hook secrets sealed under the operator's keys (AES-256-GCM): the keys parsed,
and :class:`Keyring`, which seals and opens.

A hook secret is kept in the database only sealed, under the first of the
keys the operator supplies (``SWITCHBOARD_SECRET_KEY``, several separated by
commas, or ``SWITCHBOARD_SECRET_KEY_FILE``, one a line; the embedded default
generates ``secret.key`` in its data directory). A sealed value is
``0x01 | key id (8 bytes) | nonce (12) | ciphertext and tag``: the key id
(a hash of the key) says which key opens it, so keys can be rotated, and the
endpoint's id is the associated data, so a sealed secret moved to another
endpoint's row does not open.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
import uuid
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_ENV = "SWITCHBOARD_SECRET_KEY"
KEY_FILE_ENV = "SWITCHBOARD_SECRET_KEY_FILE"
#: The key file the embedded default generates in its data directory.
EMBEDDED_KEY_FILE = "secret.key"
KEY_BYTES = 32
_VERSION = b"\x01"
_KEY_ID_BYTES = 8
_NONCE_BYTES = 12
_HEADER = len(_VERSION) + _KEY_ID_BYTES
_HOOK_SECRET_AD = b"switchboard hook secret\x00"
_CHECK_AD = b"switchboard key check"


class SecretKeyError(ValueError):
    """The secret keys do not allow the server to start (the message names the setting)."""


def parse_key(text: str, where: str) -> bytes:
    """A 32-byte key from its base64 text (standard or URL-safe, padded or not).

    ``where`` names the setting in the error, which never repeats the text.
    """
    raw = text.strip()
    try:
        key = base64.b64decode(
            raw.replace("-", "+").replace("_", "/") + "=" * (-len(raw) % 4), validate=True
        )
    except (binascii.Error, ValueError):
        raise SecretKeyError(f"{where} is not base64 (make one: openssl rand -base64 32)") from None
    if len(key) != KEY_BYTES:
        raise SecretKeyError(
            f"{where} must be {KEY_BYTES} bytes of base64 (openssl rand -base64 32), "
            f"got {len(key)} bytes"
        )
    return key


def parse_keys(text: str, where: str) -> tuple[bytes, ...]:
    """Keys separated by commas or whitespace, the encrypting one first."""
    parts = text.replace(",", " ").split()
    return tuple(
        parse_key(part, where if len(parts) == 1 else f"{where} (key {n})")
        for n, part in enumerate(parts, 1)
    )


def key_id(key: bytes) -> bytes:
    """The 8-byte id a sealed value records of the key that sealed it."""
    return hashlib.sha256(b"switchboard secret key id\x00" + key).digest()[:_KEY_ID_BYTES]


def id_of(sealed: bytes) -> bytes:
    """The key id recorded in a sealed value."""
    return bytes(sealed[len(_VERSION) : _HEADER])


@dataclass(frozen=True)
class Keyring:
    """The server's keys, the encrypting one first; empty: hooks cannot be set.

    ``source`` names where they came from (a setting), for errors.
    """

    keys: tuple[bytes, ...] = ()
    source: str = KEY_ENV

    @property
    def ids(self) -> tuple[bytes, ...]:
        """The keys' ids, in order."""
        return tuple(key_id(k) for k in self.keys)

    def seal(self, endpoint_id: uuid.UUID, secret: str) -> bytes:
        """``secret`` sealed for endpoint ``endpoint_id`` under the first key."""
        return self._seal(_HOOK_SECRET_AD + endpoint_id.bytes, secret.encode("utf-8"))

    def unseal(self, endpoint_id: uuid.UUID, sealed: bytes) -> str:
        """The secret sealed for ``endpoint_id``; ``SecretKeyError`` if no key opens it."""
        return self._unseal(_HOOK_SECRET_AD + endpoint_id.bytes, sealed).decode("utf-8")

    def reseal(
        self, endpoint_id: uuid.UUID, plaintext: str | None, sealed: bytes | None
    ) -> bytes | None:
        """A secret sealed under the first key: its ``plaintext``, or what ``sealed`` holds."""
        if plaintext is None and sealed is not None:
            plaintext = self.unseal(endpoint_id, sealed)
        return None if plaintext is None else self.seal(endpoint_id, plaintext)

    def check_value(self) -> bytes:
        """A random value sealed under the first key: it shows later starts their key is right."""
        return self._seal(_CHECK_AD, secrets.token_bytes(16))

    def opens_check(self, sealed: bytes) -> None:
        """Raises ``SecretKeyError`` unless one of the keys opens a ``check_value``."""
        self._unseal(_CHECK_AD, sealed)

    def _seal(self, associated: bytes, plaintext: bytes) -> bytes:
        if not self.keys:
            raise self.missing()
        nonce = secrets.token_bytes(_NONCE_BYTES)
        header = _VERSION + key_id(self.keys[0])
        return header + nonce + AESGCM(self.keys[0]).encrypt(nonce, plaintext, associated)

    def _unseal(self, associated: bytes, sealed: bytes) -> bytes:
        sealed = bytes(sealed)
        if not sealed.startswith(_VERSION) or len(sealed) < _HEADER + _NONCE_BYTES:
            raise SecretKeyError("a sealed secret is not in a format this release knows")
        wanted = id_of(sealed)
        for key in self.keys:
            if key_id(key) == wanted:
                nonce = sealed[_HEADER : _HEADER + _NONCE_BYTES]
                try:
                    return AESGCM(key).decrypt(nonce, sealed[_HEADER + _NONCE_BYTES :], associated)
                except InvalidTag:
                    raise SecretKeyError(
                        f"key {wanted.hex()} of {self.source} does not open a value "
                        "sealed under its id (altered, or moved from another row)"
                    ) from None
        raise self.missing(wanted)

    def missing(self, wanted: bytes | None = None) -> SecretKeyError:
        """The error for a key this keyring lacks (``wanted``: its id)."""
        if wanted is None:
            return SecretKeyError(
                f"notify hook secrets need a secret key: set {KEY_ENV} "
                f"or {KEY_FILE_ENV} on the server"
            )
        if not self.keys:
            return SecretKeyError(
                f"this database's notify hook secrets are sealed under key {wanted.hex()}, "
                f"and no key is set: set {KEY_ENV} or {KEY_FILE_ENV} to it"
            )
        held = ", ".join(k.hex() for k in self.ids)
        return SecretKeyError(
            f"this database's notify hook secrets are sealed under key {wanted.hex()}, "
            f"which {self.source} does not hold (its keys: {held}); "
            f"add that key to {KEY_ENV} or {KEY_FILE_ENV}"
        )
