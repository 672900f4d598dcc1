"""TLS for the client: which CA to trust, and the client certificate a mutual-TLS server asks for.

The CLI reads --tls-ca / --tls-cert / --tls-key, defaulting to GENSERVE_TLS_CA / GENSERVE_TLS_CLIENT_CERT /
GENSERVE_TLS_CLIENT_KEY (not GENSERVE_TLS_CERT/KEY: those name the server's own certificate, and one shell may
run both). The SDK takes a `ClientTls` (`ClientTls.from_env()` reads the same variables).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

CA_ENV = "GENSERVE_TLS_CA"
CERT_ENV = "GENSERVE_TLS_CLIENT_CERT"
KEY_ENV = "GENSERVE_TLS_CLIENT_KEY"


@dataclass(frozen=True)
class ClientTls:
    """PEM files: `ca` the roots to trust (None: the system's), `cert` + `key` the client's own certificate."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both cert and key (--tls-cert and --tls-key)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ClientTls | None:
        """None when none of GENSERVE_TLS_CA / _CLIENT_CERT / _CLIENT_KEY is set."""
        ca, cert, key = (environ.get(name) or None for name in (CA_ENV, CERT_ENV, KEY_ENV))
        return cls(ca, cert, key) if ca or cert or key else None

    def credentials(self) -> grpc.ChannelCredentials:
        """Reads the files (OSError naming a missing one) into gRPC's TLS credentials."""
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


def channel(address: str, tls: ClientTls | None, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.credentials(), options=options)


def aio_channel(address: str, tls: ClientTls | None, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)
