"""API keys (plain and `sha256:` lines, env and file), admin keys, the bearer header, and the peer rule on the peer
strings gRPC and HTTP servers report."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from genserve.services.common.auth import (
    ADMIN_KEYS_ENV,
    BAD_KEY,
    INSECURE_ENV,
    KEYS_ENV,
    KEYS_FILE_ENV,
    NOT_ADMIN,
    REMOTE_NEEDS_KEY,
    Access,
    bearer,
    grpc_peer_host,
    is_local,
    load_digests,
    load_keys,
)
from genserve.services.common.errors import PermissionDenied, Unauthenticated

PLAIN, HASHED = "k-plain-123", "k-hashed-456"


def sha(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(f"# team keys\n{PLAIN}\n\n  sha256:{sha(HASHED).hex()}  \n")
    return path


@pytest.mark.parametrize(
    ("peer", "host", "local"),
    [
        ("ipv4:127.0.0.1:5000", "127.0.0.1", True),
        ("ipv4:127.3.2.1:5000", "127.3.2.1", True),
        ("ipv4:10.0.0.1:1", "10.0.0.1", False),
        ("ipv6:[::1]:5000", "::1", True),
        ("ipv6:%5B::1%5D:5000", "::1", True),  # how grpc-core spells it
        ("ipv6:[::ffff:127.0.0.1]:5", "::ffff:127.0.0.1", True),  # a dual-stack listener's 127.0.0.1 caller
        ("ipv6:%5B::ffff:10.1.2.3%5D:5", "::ffff:10.1.2.3", False),
        ("ipv6:[2001:db8::1]:5", "2001:db8::1", False),
        ("ipv6:[::]:5", "::", False),
        ("unix:/tmp/x", "unix:/tmp/x", True),
        ("", "", False),
        ("garbage", "garbage", False),
    ],
)
def test_grpc_peers_are_local_only_on_loopback_or_a_unix_socket(peer: str, host: str, local: bool) -> None:
    assert grpc_peer_host(peer) == host
    assert is_local(grpc_peer_host(peer)) is local


@pytest.mark.parametrize(
    ("host", "local"),
    [("127.0.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True), ("192.168.1.5", False),
     ("fe80::1", False), ("localhost", False), ("testclient", False), (None, False)],
)
def test_http_client_hosts_are_local_only_on_loopback(host: str | None, local: bool) -> None:
    assert is_local(host) is local


@pytest.mark.parametrize(
    ("header", "key"),
    [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("BEARER abc", "abc"), ("Basic abc", None), ("Bearer", None),
     ("Bearer   ", None), ("abc", None), ("", None), (None, None)],
)
def test_bearer_takes_the_key_of_a_bearer_header_only(header: str | None, key: str | None) -> None:
    assert bearer(header) == key


def test_keys_come_from_the_env_list_and_the_file_plain_or_hashed(key_file: Path) -> None:
    digests = load_digests({KEYS_ENV: " a , b,,", KEYS_FILE_ENV: str(key_file)})
    assert digests == (sha("a"), sha("b"), sha(PLAIN), sha(HASHED))
    assert load_digests({}) == ()


@pytest.mark.parametrize(
    ("content", "message"),
    [("# only a comment\n\n", "holds no key"), ("ok\nsha256:abcd\n", "line 2: `sha256:` must be followed by 64 hex"),
     (f"sha256:{'zz' * 32}\n", "line 1: `sha256:`")],
)
def test_a_bad_key_file_is_refused_naming_the_line_not_the_key(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "keys"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as caught:
        load_digests({KEYS_FILE_ENV: str(path)})
    assert "abcd" not in str(caught.value) and "zz" not in str(caught.value)


def test_a_key_with_whitespace_inside_is_refused() -> None:
    with pytest.raises(ValueError, match=f"{KEYS_ENV} entry 1: a key must not contain whitespace"):
        load_digests({KEYS_ENV: "two words"})


def test_right_and_hashed_keys_are_served_from_any_host(key_file: Path) -> None:
    access = Access.from_env({KEYS_FILE_ENV: str(key_file)})
    plain = access.caller(f"Bearer {PLAIN}", "10.0.0.1")
    hashed = access.caller(f"Bearer {HASHED}", "2001:db8::1")
    assert plain == "key:" + sha(PLAIN).hex() and hashed == "key:" + sha(HASHED).hex()


@pytest.mark.parametrize("header", [None, "", "Bearer wrong", f"Basic {PLAIN}", f"Bearer {PLAIN}x",
                                    f"Bearer sha256:{sha(HASHED).hex()}"])
def test_missing_and_wrong_keys_get_one_message_even_from_this_host(key_file: Path, header: str | None) -> None:
    access = Access.from_env({KEYS_FILE_ENV: str(key_file)})
    with pytest.raises(Unauthenticated) as caught:
        access.caller(header, "127.0.0.1")
    assert str(caught.value) == BAD_KEY


def test_without_keys_this_host_is_served_per_host_and_others_are_refused() -> None:
    access = Access.from_env({})
    assert access.caller(None, "::ffff:127.0.0.1") == "host:::ffff:127.0.0.1"
    assert access.caller("Bearer anything", "127.0.0.1") == "host:127.0.0.1"
    for remote in ("10.0.0.1", "2001:db8::1", None):
        with pytest.raises(Unauthenticated, match=f"^{REMOTE_NEEDS_KEY}$"):
            access.caller(None, remote)


def test_insecure_serves_other_hosts_without_keys_but_keys_still_win(key_file: Path) -> None:
    insecure = Access.from_env({INSECURE_ENV: "1"})
    assert insecure.caller(None, "10.0.0.1") == "host:10.0.0.1"
    assert "INSECURE" in insecure.describe()
    with pytest.raises(Unauthenticated):
        Access.from_env({INSECURE_ENV: "1", KEYS_FILE_ENV: str(key_file)}).caller(None, "10.0.0.1")


def test_the_start_up_line_says_what_is_served_and_never_a_key(key_file: Path) -> None:
    assert "only callers on this host are served" in Access.from_env({}).describe()
    described = Access.from_env({KEYS_FILE_ENV: str(key_file), KEYS_ENV: "a"}).describe()
    assert described == "auth: API keys required (3 configured)"
    assert PLAIN not in described


def test_admin_keys_come_from_their_env_list_and_admin_lines_and_are_api_keys_too(key_file: Path) -> None:
    key_file.write_text(key_file.read_text() + f"admin:root-key\nadmin:sha256:{sha('hashed-root').hex()}\n")
    digests, admin = load_keys({KEYS_FILE_ENV: str(key_file), ADMIN_KEYS_ENV: "env-root"})
    assert admin == (sha("env-root"), sha("root-key"), sha("hashed-root"))
    assert set(admin) < set(digests) and {sha(PLAIN), sha(HASHED)} < set(digests)
    access = Access.from_env({KEYS_FILE_ENV: str(key_file), ADMIN_KEYS_ENV: "env-root"})
    assert access.describe() == "auth: API keys required (5 configured), 3 of them admin"
    assert access.caller("Bearer root-key", "10.0.0.1") == access.admin("Bearer root-key", "10.0.0.1")


def test_an_admin_call_needs_an_admin_key_whenever_keys_are_set(key_file: Path) -> None:
    access = Access.from_env({KEYS_FILE_ENV: str(key_file), ADMIN_KEYS_ENV: "root"})
    assert access.admin("Bearer root", "127.0.0.1") == "key:" + sha("root").hex()
    with pytest.raises(PermissionDenied, match=f"^{NOT_ADMIN.replace('(', '.').replace(')', '.')}$"):
        access.admin(f"Bearer {PLAIN}", "127.0.0.1")
    for header in (None, "Bearer wrong"):
        with pytest.raises(Unauthenticated, match=BAD_KEY[:20]):
            access.admin(header, "127.0.0.1")
    with pytest.raises(PermissionDenied):  # keys but no admin key: nobody loads adapters at run time
        Access.from_env({KEYS_FILE_ENV: str(key_file)}).admin(f"Bearer {PLAIN}", "127.0.0.1")


def test_without_keys_an_admin_call_follows_the_peer_rule() -> None:
    assert Access.from_env({}).admin(None, "127.0.0.1") == "host:127.0.0.1"
    with pytest.raises(Unauthenticated, match=REMOTE_NEEDS_KEY):
        Access.from_env({}).admin(None, "10.0.0.1")
