"""Notify-hook secrets sealed at rest: the operator's keys and AES-256-GCM.

The parts: ``keyring`` (the sealed format, :class:`Keyring`, parsing keys),
``key_sources`` (:func:`load`: the setting, a key file, or the embedded
default's generated one), ``startup_pass`` (:func:`prepare`: the keys checked
against the database, what is not sealed under the first key sealed; :func:`compact`).
"""

from __future__ import annotations

from switchboard_server.sealing.key_sources import generated_key_file, load, read_key_file
from switchboard_server.sealing.keyring import (
    EMBEDDED_KEY_FILE,
    KEY_BYTES,
    KEY_ENV,
    KEY_FILE_ENV,
    Keyring,
    SecretKeyError,
    id_of,
    key_id,
    parse_key,
    parse_keys,
)
from switchboard_server.sealing.startup_pass import compact, prepare

__all__ = [
    "EMBEDDED_KEY_FILE",
    "KEY_BYTES",
    "KEY_ENV",
    "KEY_FILE_ENV",
    "Keyring",
    "SecretKeyError",
    "compact",
    "generated_key_file",
    "id_of",
    "key_id",
    "load",
    "parse_key",
    "parse_keys",
    "prepare",
    "read_key_file",
]
