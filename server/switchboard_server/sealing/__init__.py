"""Notify-hook secrets sealed at rest: the operator's keys and AES-256-GCM.

The parts: ``keyring`` (the sealed format, :class:`Keyring`, parsing keys),
``key_sources`` (:func:`load`: the setting, a key file, or the embedded
default's generated one), ``startup_pass`` (:func:`prepare`: the keys checked
against the database, what is not sealed under the first key sealed; :func:`compact`).
"""

from __future__ import annotations

# Only the names used from outside (each ``X as X`` import is a re-export, the
# convention of mypy's and ruff's explicit re-exports; no ``__all__`` repeats them).
from switchboard_server.sealing.key_sources import load as load
from switchboard_server.sealing.keyring import Keyring as Keyring
from switchboard_server.sealing.keyring import SecretKeyError as SecretKeyError
from switchboard_server.sealing.keyring import key_id as key_id
from switchboard_server.sealing.keyring import parse_keys as parse_keys
from switchboard_server.sealing.startup_pass import compact as compact
from switchboard_server.sealing.startup_pass import prepare as prepare
