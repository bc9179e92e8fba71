"""Where the server's keys come from: ``SWITCHBOARD_SECRET_KEY``, a key file
(``SWITCHBOARD_SECRET_KEY_FILE``, one a line), or the embedded default's
``secret.key``, generated in its data directory on first start."""

from __future__ import annotations

import base64
import contextlib
import os
import pathlib
import secrets

from switchboard_server.config import Settings
from switchboard_server.sealing.keyring import (
    EMBEDDED_KEY_FILE,
    KEY_BYTES,
    KEY_ENV,
    KEY_FILE_ENV,
    Keyring,
    SecretKeyError,
    parse_key,
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
