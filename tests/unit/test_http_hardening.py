"""The HTTP listener's pieces without a server: throttle, forwarded hops, settings, TLS reload."""

from __future__ import annotations

import ipaddress
import pathlib
from datetime import timedelta

import pytest
from switchboard_server.config import Settings
from switchboard_server.web.http_tls import ServerTLS, server_tls
from switchboard_server.web.proxies import Proxies, rightmost_untrusted
from switchboard_server.web.sessions import SigninTokens
from switchboard_server.web.throttle import SigninThrottle, client_key

from tests.support.certs import CertificateAuthority


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_throttle_locks_out_after_max_failures_and_doubles_the_cooldown() -> None:
    clock = Clock()
    throttle = SigninThrottle(
        max_failures=3,
        window=timedelta(seconds=60),
        cooldown=timedelta(seconds=10),
        max_cooldown=timedelta(seconds=25),
        clock=clock,
    )
    for _ in range(2):
        throttle.failed("203.0.113.7")
    assert throttle.retry_after("203.0.113.7") is None
    throttle.failed("203.0.113.7")
    assert throttle.retry_after("203.0.113.7") == 10
    assert throttle.retry_after("203.0.113.8") is None  # per address
    clock.now += 10
    assert throttle.retry_after("203.0.113.7") is None
    for _ in range(3):
        throttle.failed("203.0.113.7")
    assert throttle.retry_after("203.0.113.7") == 20  # soon after the last lockout: doubled
    clock.now += 20
    for _ in range(3):
        throttle.failed("203.0.113.7")
    assert throttle.retry_after("203.0.113.7") == 25  # capped
    clock.now += 25 + 61
    for _ in range(3):
        throttle.failed("203.0.113.7")
    assert throttle.retry_after("203.0.113.7") == 10  # a quiet window resets the doubling


def test_throttle_forgets_old_failures_and_a_success_clears_the_address() -> None:
    clock = Clock()
    throttle = SigninThrottle(max_failures=3, window=timedelta(seconds=60), clock=clock)
    throttle.failed("a")
    throttle.failed("a")
    clock.now += 61
    throttle.failed("a")  # the first two aged out of the window
    assert throttle.retry_after("a") is None
    throttle.failed("a")
    throttle.succeeded("a")
    throttle.failed("a")
    throttle.failed("a")
    assert throttle.retry_after("a") is None


def test_throttle_memory_is_bounded_and_ipv6_counts_per_prefix() -> None:
    throttle = SigninThrottle(max_failures=2, limit=100)
    for n in range(1000):
        throttle.failed(f"10.0.{n // 256}.{n % 256}")
    assert len(throttle) == 100
    throttle.failed("2001:db8::1")
    throttle.failed("2001:db8::2")
    assert throttle.retry_after("2001:db8::ffff") is not None
    assert throttle.retry_after("2001:db8:0:1::1") is None
    assert client_key("::ffff:192.0.2.1") == "192.0.2.1"


def test_the_client_is_the_rightmost_untrusted_hop() -> None:
    proxies = Proxies((ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128")))
    assert rightmost_untrusted(proxies, ["1.1.1.1", "2.2.2.2", "10.0.0.5"], "10.0.0.1") == (
        "2.2.2.2"
    )
    assert rightmost_untrusted(proxies, ["10.0.0.7", "10.0.0.5"], "10.0.0.1") == "10.0.0.7"
    assert rightmost_untrusted(proxies, [], "10.0.0.1") == "10.0.0.1"
    assert rightmost_untrusted(proxies, ["garbage", "10.0.0.5"], "10.0.0.1") == "garbage"
    assert proxies.trusts("::ffff:10.1.2.3") and proxies.trusts("::1")
    assert not proxies.trusts("11.0.0.1") and not proxies.trusts(None)
    assert not Proxies().trusts("127.0.0.1")


def test_signin_tokens_belong_to_their_nonce_and_process() -> None:
    tokens = SigninTokens()
    nonce = tokens.nonce(None)
    assert tokens.nonce(nonce) == nonce  # kept: another open tab stays valid
    assert tokens.nonce("short") != "short"
    assert tokens.check(nonce, tokens.token(nonce))
    assert not tokens.check(nonce, "")
    assert not tokens.check(None, tokens.token(nonce))
    assert not tokens.check(tokens.nonce(None), tokens.token(nonce))
    assert not SigninTokens().check(nonce, tokens.token(nonce))  # another process's key


def test_settings_read_the_http_listener_variables() -> None:
    settings = Settings.from_env(
        {
            "SWITCHBOARD_TLS_CERT": "/etc/sb/cert.pem",
            "SWITCHBOARD_TLS_KEY": "/etc/sb/key.pem",
            "SWITCHBOARD_TRUSTED_PROXIES": "10.0.0.0/8, 192.0.2.7,fd00::/8",
            "SWITCHBOARD_METRICS_LISTEN": "0.0.0.0:9090",
        }
    )
    assert settings.tls_cert == pathlib.Path("/etc/sb/cert.pem")
    assert settings.tls_key == pathlib.Path("/etc/sb/key.pem")
    assert [str(n) for n in settings.trusted_proxies] == [
        "10.0.0.0/8",
        "192.0.2.7/32",
        "fd00::/8",
    ]
    assert settings.metrics_listen == "0.0.0.0:9090"
    default = Settings.from_env({})
    assert default.tls_cert is None and default.trusted_proxies == ()
    assert default.metrics_listen is None
    with pytest.raises(ValueError, match="SWITCHBOARD_TRUSTED_PROXIES"):
        Settings.from_env({"SWITCHBOARD_TRUSTED_PROXIES": "10.0.0.0/33"})


def test_tls_needs_both_files_and_keeps_serving_through_a_bad_rotation(
    tmp_path: pathlib.Path,
) -> None:
    assert server_tls(None, None) is None
    with pytest.raises(ValueError, match="together"):
        server_tls(tmp_path / "cert.pem", None)
    ca = CertificateAuthority(tmp_path)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.issue_to(cert, key, "first")
    tls = ServerTLS(cert, key)
    assert not tls.reload()  # unchanged
    key.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot a key\n")
    assert not tls.reload()  # kept the served pair
    other = tmp_path / "other"
    other.mkdir()
    ca.issue_to(other / "cert.pem", other / "key.pem")
    key.write_bytes((other / "key.pem").read_bytes())
    assert not tls.reload()  # a key that is not the certificate's
    ca.issue_to(cert, key, "second")
    assert tls.reload()
