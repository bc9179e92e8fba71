"""Hook secrets' keys and sealing (``switchboard_server.sealing``), and their
settings: parsed from the environment, the embedded default's generated key
file, key files."""

from __future__ import annotations

import base64
import dataclasses
import pathlib
import stat
import uuid

import pytest
from switchboard_server.config import Settings
from switchboard_server.sealing import Keyring, SecretKeyError, key_id, load

K1, K2 = bytes(range(32)), bytes(range(1, 33))
B1, B2 = (base64.b64encode(k).decode() for k in (K1, K2))


def test_the_keys_are_read_from_the_environment_the_encrypting_one_first() -> None:
    assert Settings.from_env({}).secret_keys == ()
    assert Settings.from_env({"SWITCHBOARD_SECRET_KEY": B1}).secret_keys == (K1,)
    both = Settings.from_env({"SWITCHBOARD_SECRET_KEY": f"{B2}, {B1}"})
    assert both.secret_keys == (K2, K1)
    urlsafe = base64.urlsafe_b64encode(K2).decode().rstrip("=")
    assert Settings.from_env({"SWITCHBOARD_SECRET_KEY": urlsafe}).secret_keys == (K2,)
    assert B1 not in repr(both) and "secret_keys" not in repr(both)
    path = Settings.from_env({"SWITCHBOARD_SECRET_KEY_FILE": "/run/keys/sb"}).secret_key_file
    assert path == pathlib.Path("/run/keys/sb")


@pytest.mark.parametrize("value", ["not base64!", base64.b64encode(b"short").decode(), f"{B1},x"])
def test_a_bad_key_names_the_setting_and_does_not_repeat_it(value: str) -> None:
    with pytest.raises(ValueError, match="SWITCHBOARD_SECRET_KEY") as caught:
        Settings.from_env({"SWITCHBOARD_SECRET_KEY": value})
    assert value not in str(caught.value)


def test_the_legacy_signature_is_off_unless_set() -> None:
    assert Settings.from_env({}).hooks_legacy_signature is False
    on = Settings.from_env({"SWITCHBOARD_HOOKS_LEGACY_SIGNATURE": "1"})
    assert on.hooks_legacy_signature is True
    with pytest.raises(ValueError, match="SWITCHBOARD_HOOKS_LEGACY_SIGNATURE"):
        Settings.from_env({"SWITCHBOARD_HOOKS_LEGACY_SIGNATURE": "sometimes"})


def test_a_sealed_secret_opens_only_for_its_endpoint_and_under_its_key() -> None:
    endpoint, other = uuid.uuid4(), uuid.uuid4()
    ring = Keyring((K1,))
    sealed = ring.seal(endpoint, "whsec_abc")
    assert sealed[1:9] == key_id(K1) and b"whsec_abc" not in sealed
    assert ring.seal(endpoint, "whsec_abc") != sealed  # a fresh nonce each time
    assert ring.unseal(endpoint, sealed) == "whsec_abc"
    with pytest.raises(SecretKeyError, match="moved from another row"):
        ring.unseal(other, sealed)
    with pytest.raises(SecretKeyError, match=f"sealed under key {key_id(K1).hex()}"):
        Keyring((K2,)).unseal(endpoint, sealed)
    # Rotation: the new key seals, the old one still opens.
    rotated = Keyring((K2, K1))
    assert rotated.unseal(endpoint, sealed) == "whsec_abc"
    resealed = rotated.reseal(endpoint, None, sealed)
    assert resealed is not None and resealed[1:9] == key_id(K2)
    assert Keyring((K2,)).unseal(endpoint, resealed) == "whsec_abc"
    assert rotated.reseal(endpoint, "plain", None) is not None
    assert rotated.reseal(endpoint, None, None) is None
    with pytest.raises(SecretKeyError, match="SWITCHBOARD_SECRET_KEY"):
        Keyring().seal(endpoint, "x")


def test_the_embedded_default_generates_a_private_key_file_once(tmp_path: pathlib.Path) -> None:
    embedded = Settings(database_url=None, data_dir=tmp_path / "data")
    first = load(embedded)
    path = tmp_path / "data" / "secret.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first.keys) == 1
    assert load(embedded).keys == first.keys  # kept across starts
    assert [p.name for p in path.parent.iterdir()] == ["secret.key"]
    # With a database URL nothing is generated: the operator supplies the key.
    external = dataclasses.replace(embedded, database_url="postgresql://x", data_dir=tmp_path)
    assert load(external).keys == ()
    assert not (tmp_path / "secret.key").exists()


def test_a_key_file_holds_one_key_a_line(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# the new key first\n{B2}\n\n{B1}  # the old one\n")
    ring = load(Settings(database_url="postgresql://x", secret_key_file=path))
    assert ring.keys == (K2, K1)
    path.write_text("nope\n")
    with pytest.raises(SecretKeyError, match=r"SWITCHBOARD_SECRET_KEY_FILE .*line 1"):
        load(Settings(database_url="postgresql://x", secret_key_file=path))
    with pytest.raises(SecretKeyError, match="SWITCHBOARD_SECRET_KEY_FILE: cannot read"):
        load(Settings(database_url="postgresql://x", secret_key_file=tmp_path / "missing"))
    with pytest.raises(SecretKeyError, match="not both"):
        load(Settings(secret_keys=(K1,), secret_key_file=path))
