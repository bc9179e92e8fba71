"""Notify-hook secrets sealed at rest: the operator's keys and AES-256-GCM.

A hook secret is kept in the database only sealed, under the first of the
keys the operator supplies (``SWITCHBOARD_SECRET_KEY``, several separated by
commas, or ``SWITCHBOARD_SECRET_KEY_FILE``, one a line; the embedded default
generates ``secret.key`` in its data directory). A sealed value is
``0x01 | key id (8 bytes) | nonce (12) | ciphertext and tag``: the key id
(a hash of the key) says which key opens it, so keys can be rotated, and the
endpoint's id is the associated data, so a sealed secret moved to another
endpoint's row does not open.

At start (``prepare``) a server checks its keys against the database: every
key id the database uses must be among its keys and open what it sealed,
else the server refuses to start, naming the setting. In the same
transaction it seals what is left in plaintext (hooks set before migration
0019) and re-seals what another key sealed under the first key, so after a
rotation's restart the old key can be dropped; then it rewrites the table
(``VACUUM FULL endpoints``) without the replaced row versions. A row in
``secret_key_checks`` (a random value sealed under the first key) makes a
wrong key fail at start even before any hook exists.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import logging
import os
import pathlib
import secrets
import uuid
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from switchboard_server import errors
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.db import sealing as sealing_queries

log = logging.getLogger(__name__)

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


def read_key_file(path: pathlib.Path, setting: str) -> tuple[bytes, ...]:
    """The keys of a key file: one per line, the encrypting one first; ``#`` comments."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SecretKeyError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    keys = tuple(
        parse_key(line, f"{setting} ({path}, line {n})") for n, line in enumerate(lines, 1) if line
    )
    if not keys:
        raise SecretKeyError(f"{setting}: {path} holds no key")
    return keys


def generated_key_file(data_dir: pathlib.Path) -> pathlib.Path:
    """``<data_dir>/secret.key``, made (mode 0600, one new key) if it does not exist.

    Written to a temporary file and linked into place, so that two processes
    starting on one data directory end up with the same complete file.
    """
    path = data_dir / EMBEDDED_KEY_FILE
    if path.exists():
        return path
    data_dir.mkdir(parents=True, exist_ok=True)
    temporary = data_dir / f".{EMBEDDED_KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode("ascii") + "\n")
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def load(settings: Settings) -> Keyring:
    """The server's keyring: ``SWITCHBOARD_SECRET_KEY``, else the key file, else
    (the embedded default only) ``<data_dir>/secret.key``, generated on first
    start; else none (hooks cannot be set)."""
    if settings.secret_keys and settings.secret_key_file is not None:
        raise SecretKeyError(f"set {KEY_ENV} or {KEY_FILE_ENV}, not both")
    if settings.secret_keys:
        return Keyring(settings.secret_keys, KEY_ENV)
    if settings.secret_key_file is not None:
        path = settings.secret_key_file
        return Keyring(read_key_file(path, KEY_FILE_ENV), f"{KEY_FILE_ENV} ({path})")
    if settings.database_url is None:
        path = generated_key_file(settings.data_dir)
        where = f"the key file {path} (or {KEY_ENV}, {KEY_FILE_ENV})"
        return Keyring(read_key_file(path, where), where)
    return Keyring()


async def prepare(db: Database, keyring: Keyring) -> int:
    """Checks the keys against the database and seals what is not sealed under
    the first key; how many endpoints' secrets it sealed.

    One transaction under an advisory lock, so replicas starting together
    take turns and the later ones find nothing left to do. ``SecretKeyError``
    (the server must not start) when a key the database uses is missing or
    wrong, or when the database holds hook secrets and there is no key.
    """
    async with db.transaction() as conn:
        await sealing_queries.lock(conn)
        checks = await sealing_queries.checks(conn)
        if not keyring.keys:
            if checks:
                raise keyring.missing(checks[0][0])
            if await sealing_queries.any_secret(conn):
                raise SecretKeyError(
                    "this database holds notify hook secrets, and no key is set to seal "
                    f"them with: set {KEY_ENV} or {KEY_FILE_ENV}"
                )
            return 0
        for _, sealed in checks:
            keyring.opens_check(sealed)
        first = keyring.ids[0]
        resealed = [
            (
                row,
                keyring.reseal(row.endpoint_id, row.plaintext, row.sealed),
                keyring.reseal(row.endpoint_id, row.previous_plaintext, row.previous_sealed),
            )
            for row in await sealing_queries.pending(conn, first)
        ]
        await sealing_queries.store(conn, resealed)
        await sealing_queries.keep_only_check(conn, key_id=first, sealed=keyring.check_value())
        xid = await sealing_queries.current_xid(conn) if resealed else None
    if xid is not None:
        await compact(db, after=xid)
    return len(resealed)


async def compact(
    db: Database, *, after: str | None = None, attempts: int = 10, horizon: float = 30.0
) -> bool:
    """Rewrites ``endpoints`` without the row versions the pass replaced: they
    held plaintext (or secrets under a key being retired) until vacuumed.

    First waits (up to ``horizon`` seconds) until no session can still see
    the versions transaction ``after`` replaced: VACUUM FULL copies a version
    some snapshot may still read (a replica starting beside this one, say)
    into the new file. Each try then waits at most a second for the table's
    lock (a longer wait would hold up every read of the table queued behind
    it); a try that does not get it is made again after a pause, up to
    ``attempts`` tries. Whether it was rewritten with the old versions gone;
    if not, a warning says what to run."""
    stale = ""
    if after is not None:
        deadline = asyncio.get_running_loop().time() + horizon
        while True:
            async with db.connection() as conn:
                if await sealing_queries.horizon_passed(conn, xid=after):
                    break
            if asyncio.get_running_loop().time() >= deadline:
                stale = "a transaction older than the sealing still ran"
                break
            await asyncio.sleep(0.1)
    problem = ""
    for attempt in range(attempts):
        try:
            async with db.connection() as conn:
                await sealing_queries.compact(conn)
        except errors.Retryable as exc:  # (unavailable, or a lock not taken in time)
            problem = exc.message
        else:
            if not stale:
                return True
            problem = stale  # rewritten, but with the versions that one could see
            break
        if attempt + 1 < attempts:
            await asyncio.sleep(0.2 * (attempt + 1))
    log.warning(
        "could not rewrite endpoints without its replaced row versions (which hold "
        "the secrets as they were); run VACUUM FULL endpoints",
        extra={"error": problem[:300]},
    )
    return False
