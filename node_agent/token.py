"""The agent's ServiceAccount token, read from its projected file for every new stream.

In Kubernetes the token is a ``serviceAccountToken`` projected volume (audience
``ray-serve-health``), which the kubelet rewrites well before the token expires (at 80 % of
its lifetime, by an atomic symlink swap). The token is sent once per Report stream, as the
``authorization: Bearer <token>`` call metadata, so reading the (1 KiB) file at every
(re)connection is all that rotation needs.

Outside Kubernetes there is no such file. With the default path the agent then connects
without a token (said once), which an aggregator run with ``--auth none`` accepts; a path
given explicitly must exist.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: Where deploy/ mounts the projected token (a volume of its own, not the API token's).
DEFAULT_TOKEN_FILE = "/var/run/secrets/ray-serve-health/token"


class TokenFile:
    """``read()`` the current token of ``path``; ``required`` makes a missing file an error
    (OSError) instead of "no token"."""

    def __init__(self, path: str, *, required: bool) -> None:
        self.path = path
        self.required = required
        self._token: str | None = None
        self._said_missing = False

    def read(self) -> str | None:
        """The token now in the file; None if there is no file and none is required. Raises
        OSError for a required file that is missing, or a file that is unreadable or empty."""
        try:
            with open(self.path, encoding="ascii", errors="replace") as file:
                token = file.read().strip()
        except FileNotFoundError:
            if self.required:
                raise FileNotFoundError(f"--token-file {self.path}: no such file") from None
            if not self._said_missing:
                self._said_missing = True
                log.info(
                    "no token file at %s: connecting without a token (the aggregator must run "
                    "with --auth none)",
                    self.path,
                )
            self._token = None
            return None
        if not token:
            raise OSError(f"--token-file {self.path} is empty")
        if self._token is not None and token != self._token:
            log.info("token file %s changed: this stream sends the new token", self.path)
        self._token, self._said_missing = token, False
        return token
