"""API keys and the peer rule: who may call a genserve app (docs/security.md).

- Keys come from GENSERVE_API_KEYS (comma-separated) and/or GENSERVE_API_KEYS_FILE (one per line; a line may hold
  `sha256:<hex>` of a key instead, so the file need not hold the key itself; `#` starts a comment line). Only the
  SHA-256 digests are kept. A call presents its key as `authorization: Bearer <key>` (gRPC metadata or the HTTP
  header, as OpenAI clients send it); the digest of what it presents is compared with every configured digest with
  `hmac.compare_digest`, so neither the comparison nor which key matched shows in the timing.
- Admin keys (GENSERVE_ADMIN_KEYS, comma-separated, and/or `admin:<key>` or `admin:sha256:<hex>` lines in the key
  file) are API keys that may also call the admin operations (loading and unloading LoRA adapters). With keys
  configured, an admin call with no or a wrong key is UNAUTHENTICATED and one with a plain API key
  PERMISSION_DENIED; with no keys configured, admin calls follow the peer rule like every other call.
- With no keys configured, only callers on this host are served: a loopback peer (127.0.0.0/8, ::1, an IPv4-mapped
  ::ffff:127.x, a unix socket). `insecure` (GENSERVE_INSECURE=1, `make serve --insecure`) serves everyone instead.
- A missing and a wrong key get the same message; no key, digest or header value is ever logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from .errors import PermissionDenied, Unauthenticated

KEYS_ENV = "GENSERVE_API_KEYS"
KEYS_FILE_ENV = "GENSERVE_API_KEYS_FILE"
ADMIN_KEYS_ENV = "GENSERVE_ADMIN_KEYS"
INSECURE_ENV = "GENSERVE_INSECURE"
HASHED_PREFIX = "sha256:"
ADMIN_PREFIX = "admin:"
NOT_ADMIN = "this call needs an admin key (GENSERVE_ADMIN_KEYS, or an `admin:` line of the key file)"
BAD_KEY = "missing or invalid API key: send the metadata (or HTTP header) `authorization: Bearer <key>`"
REMOTE_NEEDS_KEY = "this server takes calls from other hosts only with an API key"


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _key_line(line: str, where: str) -> bytes:
    """The digest a key-file line (or a GENSERVE_API_KEYS entry) stands for; errors name the place, never the key."""
    if any(c.isspace() for c in line):
        raise ValueError(f"{where}: a key must not contain whitespace")
    if line.startswith(HASHED_PREFIX):
        hexdigest = line[len(HASHED_PREFIX):]
        try:
            raw = bytes.fromhex(hexdigest)
        except ValueError:
            raw = b""
        if len(raw) != hashlib.sha256().digest_size:
            raise ValueError(f"{where}: `sha256:` must be followed by 64 hex digits")
        return raw
    return digest(line)


def _env_keys(environ: Mapping[str, str], name: str) -> list[bytes]:
    return [_key_line(entry.strip(), f"{name} entry {i + 1}")
            for i, entry in enumerate(environ.get(name, "").split(",")) if entry.strip()]


def load_keys(environ: Mapping[str, str] = os.environ) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """The digests of every configured key (admin keys included) and of the admin keys; empty when no variable is
    set. A key file that is set but holds no key is an error: it means keys were wanted."""
    found, admin = _env_keys(environ, KEYS_ENV), _env_keys(environ, ADMIN_KEYS_ENV)
    path = environ.get(KEYS_FILE_ENV, "")
    if path:
        lines = [(n, line.strip()) for n, line in enumerate(Path(path).read_text().splitlines(), 1)
                 if line.strip() and not line.lstrip().startswith("#")]
        if not lines:
            raise ValueError(f"{KEYS_FILE_ENV}: {path} holds no key")
        for n, line in lines:
            is_admin = line.startswith(ADMIN_PREFIX)
            key = _key_line(line.removeprefix(ADMIN_PREFIX), f"{KEYS_FILE_ENV} line {n}")
            (admin if is_admin else found).append(key)
    return tuple(dict.fromkeys(found + admin)), tuple(dict.fromkeys(admin))


def load_digests(environ: Mapping[str, str] = os.environ) -> tuple[bytes, ...]:
    """The configured keys' digests (admin keys included); empty when no key variable is set."""
    return load_keys(environ)[0]


def insecure(environ: Mapping[str, str] = os.environ) -> bool:
    """GENSERVE_INSECURE is set to 1 / true / yes."""
    return environ.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes")


def bearer(authorization: str | None) -> str | None:
    """The key in an `authorization: Bearer <key>` value (the scheme in any case), else None."""
    scheme, _, key = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def grpc_peer_host(peer: str) -> str:
    """The host of a gRPC peer string: 'ipv4:127.0.0.1:5000' -> '127.0.0.1', 'ipv6:[::1]:5000' (also sent as
    'ipv6:%5B::1%5D:5000') -> '::1'; a 'unix:/path' peer stays whole."""
    kind, _, address = unquote(peer).partition(":")
    if kind == "ipv4":
        return address.rpartition(":")[0]
    if kind == "ipv6":
        return address.rpartition(":")[0].removeprefix("[").removesuffix("]")
    return peer


def is_local(host: str | None) -> bool:
    """True for a loopback address (IPv4-mapped ones too: a dual-stack listener reports 127.0.0.1 callers as
    ::ffff:127.0.0.1) and for a unix socket, which only this host can open. Anything unparsable is remote."""
    if host is None:
        return False
    if host.startswith(("unix:", "unix-abstract:")):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


@dataclass(frozen=True)
class Access:
    """Who may call: `digests` of the API keys (empty: no keys), and whether callers from other hosts are served
    without one."""

    digests: tuple[bytes, ...] = ()
    insecure: bool = False
    admin_digests: tuple[bytes, ...] = ()  # those of `digests` that may also call the admin operations

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Access:
        digests, admin = load_keys(environ)
        return cls(digests, insecure(environ), admin)

    def _match(self, key: str) -> bytes | None:
        """The configured digest equal to the key's, checking every one of them (constant time in which matches)."""
        presented, found = digest(key), None
        for candidate in self.digests:
            if hmac.compare_digest(presented, candidate):
                found = candidate
        return found

    def caller(self, authorization: str | None, host: str | None) -> str:
        """The identity a call's rate limits are kept under: its key's digest, or without keys its host.
        Raises Unauthenticated when the call may not be served."""
        if self.digests:
            key = bearer(authorization)
            matched = self._match(key) if key is not None else None
            if matched is None:
                raise Unauthenticated(BAD_KEY)
            return "key:" + matched.hex()
        if not self.insecure and not is_local(host):
            raise Unauthenticated(REMOTE_NEEDS_KEY)
        return f"host:{host}"

    def admin(self, authorization: str | None, host: str | None) -> str:
        """`caller` for an admin operation: with keys configured, the key must also be an admin key (else
        PermissionDenied); without keys, the peer rule as for every call."""
        caller = self.caller(authorization, host)
        admin = False
        for candidate in self.admin_digests:  # every one compared, as in `_match`
            admin |= hmac.compare_digest(caller, "key:" + candidate.hex())
        if self.digests and not admin:
            raise PermissionDenied(NOT_ADMIN)
        return caller

    def describe(self) -> str:
        """One line for the start-up log: what this server accepts."""
        if self.digests:
            admin = f", {len(self.admin_digests)} of them admin" if self.admin_digests else ""
            return f"auth: API keys required ({len(self.digests)} configured){admin}"
        if self.insecure:
            return ("auth: INSECURE: no API keys and --insecure: EVERY host that reaches these ports may use every "
                    "model")
        return (f"auth: off: no API keys ({KEYS_ENV} / {KEYS_FILE_ENV}), so only callers on this host are served; "
                "calls from other hosts get UNAUTHENTICATED")
