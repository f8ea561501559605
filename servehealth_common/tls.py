"""TLS for the gRPC port: checking the PEM files named by flags, and credentials that follow
rotated files.

The aggregator's credentials come from :func:`server_credentials`: gRPC asks a fetcher for the
certificate configuration at every new connection, and the fetcher re-reads the files when one
of their modification times changed, so a rotated certificate (cert-manager, a renewed Secret)
is served to new connections without a restart. The agent builds its credentials with
:func:`channel_credentials` before every connection, so it too picks up rotated files.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Sequence

import grpc

log = logging.getLogger(__name__)

_PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"


def check_readable(path: str, flag: str) -> None:
    """Raise ValueError naming ``flag`` unless ``path`` is a file this process can read."""
    if not path:
        return
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: no such file: {path}")
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError as error:
        raise ValueError(f"{flag}: cannot read {path}: {error.strerror or error}") from None


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def _mtimes(paths: Sequence[str]) -> tuple[int, ...]:
    return tuple(os.stat(path).st_mtime_ns for path in paths)


class ReloadingServerCertificate:
    """The certificate-configuration fetcher of ``grpc.dynamic_ssl_server_credentials``.

    Called by gRPC (on one of its threads) at each handshake; returns None while the files are
    unchanged, or a new configuration once their modification times moved. A file that cannot
    be read, or that gRPC rejects, keeps the last good configuration (logged).
    """

    def __init__(self, cert: str, key: str, client_ca: str = "") -> None:
        self._paths = tuple(path for path in (cert, key, client_ca) if path)
        self._cert, self._key, self._client_ca = cert, key, client_ca
        self._lock = threading.Lock()
        self._seen = _mtimes(self._paths)
        self.initial = self._load()

    def _load(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(_read(self._key), _read(self._cert))],
            root_certificates=_read(self._client_ca) if self._client_ca else None,
        )

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            try:
                mtimes = _mtimes(self._paths)
                if mtimes == self._seen:
                    return None
                config = self._load()
            except (OSError, ValueError) as error:
                log.warning("TLS files changed but cannot be read, keeping the old ones: %s", error)
                return None
            self._seen = mtimes
            log.info("TLS certificate files changed: reloaded %s", ", ".join(self._paths))
            return config


def server_credentials(
    cert: str, key: str, client_ca: str = ""
) -> tuple[grpc.ServerCredentials, ReloadingServerCertificate]:
    """TLS server credentials that follow the files; with ``client_ca``, mutual TLS."""
    fetcher = ReloadingServerCertificate(cert, key, client_ca)
    credentials = grpc.dynamic_ssl_server_credentials(
        fetcher.initial, fetcher, require_client_authentication=bool(client_ca)
    )
    return credentials, fetcher


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """Client credentials read from the files now: trust ``ca``; present ``cert`` for mTLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca),
        private_key=_read(key) if key else None,
        certificate_chain=_read(cert) if cert else None,
    )


def check_pair(cert: str, key: str, cert_flag: str, key_flag: str) -> None:
    """Both or neither of a certificate and its key; both readable."""
    if bool(cert) != bool(key):
        raise ValueError(f"{cert_flag} and {key_flag} go together: give both or neither")
    check_readable(cert, cert_flag)
    check_readable(key, key_flag)


def check_pem_certificates(path: str, flag: str) -> None:
    """Raise ValueError naming ``flag`` unless ``path`` holds PEM certificates (the blocks
    ``-----BEGIN CERTIFICATE-----``) that parse. gRPC would take any bytes, and fail to open the
    port ("Failed to bind to address") with no word about the file."""
    if not path:
        return
    because = " (no -----BEGIN CERTIFICATE----- block)"
    try:
        if _PEM_CERTIFICATE in _read(path):
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
            return
    except ssl.SSLError as error:
        because = _because(error)
    except OSError as error:
        raise ValueError(f"{flag}: cannot read {path}: {error.strerror or error}") from None
    raise ValueError(f"{flag} {path}: no PEM certificate in it{because}")


def check_pem_key(cert: str, key: str, cert_flag: str, key_flag: str) -> None:
    """Raise ValueError naming ``key_flag`` unless ``key`` is the unencrypted PEM private key of
    the (checked) certificate in ``cert``."""
    if not cert or not key:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=lambda: b"")  # never prompt on a terminal
    except ssl.SSLError as error:
        if error.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(
                f"{key_flag} {key}: not the private key of the certificate in {cert_flag} {cert}"
            ) from None
        raise ValueError(
            f"{key_flag} {key}: not an unencrypted PEM private key{_because(error)}"
        ) from None
    except OSError as error:
        raise ValueError(f"{key_flag}: cannot read {key}: {error.strerror or error}") from None


def _because(error: ssl.SSLError) -> str:
    """OpenSSL's reason, readable (``NO_CERTIFICATE_OR_CRL_FOUND`` -> " (no certificate or crl
    found)"); nothing when it gave none."""
    return f" ({error.reason.replace('_', ' ').lower()})" if error.reason else ""
