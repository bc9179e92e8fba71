"""TLS for the HTTP listeners: the gRPC listener's certificate and key, reloaded on
change and on ``SIGHUP``.

One ``ssl.SSLContext`` serves the board's and the metrics listener's
handshakes. A context's certificate applies to the handshakes that start
after it is loaded, so loading the files again into the same context
rotates the certificate for new connections while open ones carry on.
A new pair is first loaded into a scratch context: a half-written file or
a key that does not match leaves the served pair as it was (and is
logged). The HTTP listeners ask for no client certificate
(``SWITCHBOARD_TLS_CLIENT_CA`` is the gRPC listener's alone): the board
signs people in with tokens, and browsers handle client certificates badly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import ssl
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: Seconds between looks at the certificate files' modification times.
WATCH_INTERVAL = 2.0


def _stamp(path: pathlib.Path) -> tuple[int, int, int]:
    """What changes when a file is rewritten or replaced (renamed over)."""
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


def _context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


@dataclass
class ServerTLS:
    """A server context for ``cert`` and ``key`` that follows the files on disk."""

    cert: pathlib.Path
    key: pathlib.Path

    def __post_init__(self) -> None:
        self.context = _context()
        self.context.load_cert_chain(self.cert, self.key)
        self._stamps = self._read_stamps()

    def _read_stamps(self) -> tuple[tuple[int, int, int], ...]:
        return (_stamp(self.cert), _stamp(self.key))

    def reload(self, *, force: bool = False) -> bool:
        """Loads the files again when they changed (always with ``force``, as on
        ``SIGHUP``); whether a pair was loaded.

        Safe to call at any time: a pair that does not load is logged and the
        current one kept.
        """
        try:
            stamps = self._read_stamps()
            if stamps == self._stamps and not force:
                return False
            _context().load_cert_chain(self.cert, self.key)  # throws unless the pair is whole
        except (OSError, ssl.SSLError) as exc:
            log.warning(
                "http tls: certificate not reloaded; serving the previous one",
                extra={"cert": str(self.cert), "error": str(exc)},
            )
            return False
        self.context.load_cert_chain(self.cert, self.key)
        self._stamps = stamps
        log.info(
            "http tls: certificate reloaded",
            extra={"cert": str(self.cert), "reason": "SIGHUP" if force else "files changed"},
        )
        return True

    async def watch(self, interval: float = WATCH_INTERVAL) -> None:
        """Reloads whenever the files change, until cancelled.

        On the event loop's thread, like the handshakes that use the context
        (an OpenSSL context is not to be changed under a concurrent handshake);
        a stat of two files and, rarely, reading a few kilobytes.
        """
        while True:
            await asyncio.sleep(interval)
            try:
                self.reload()
            except Exception:
                log.exception("http tls: certificate watch failed; retrying")


def server_tls(cert: pathlib.Path | None, key: pathlib.Path | None) -> ServerTLS | None:
    """TLS when both files are configured, none when neither; one without the other is an error."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError("SWITCHBOARD_TLS_CERT and SWITCHBOARD_TLS_KEY must be set together")
    return ServerTLS(cert, key)
