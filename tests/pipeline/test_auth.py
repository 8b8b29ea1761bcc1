"""The ``tenantauth`` extension: its config errors (which never quote a token), the
``Authorization`` schemes over HTTP and gRPC, hostile headers, reloading the tokens file,
and ``X-Scope-OrgID`` where auth is off."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from pipeline.auth import (
    DEFAULT_TENANT,
    TENANT_RE,
    TENANT_RULE,
    AuthConfig,
    TokenAuth,
    redact_token,
    tenant_from_header,
)
from pipeline.config import Duration, dec_hook, decode_struct
from pipeline.config.tls import ReceiverAuth
from pipeline.errors import ConfigError, InvalidData

KEY = "extensions.tenantauth"
TOKEN_A = "tok-A-5f2b9c0e7d1a4e83"
TOKEN_B = "tok-B-0a9e8d7c6b5a4f32"
TOKEN_C = "tok-C-77e1c2d3b4a59687"
SECRETS = (TOKEN_A, TOKEN_B, TOKEN_C)
FAST = Duration(0.05)


def bearer(token: str, scheme: str = "Bearer") -> dict[str, str]:
    return {"Authorization": f"{scheme} {token}"}


def basic(user: str, token: str, scheme: str = "Basic") -> dict[str, str]:
    encoded = base64.b64encode(f"{user}:{token}".encode()).decode()
    return {"Authorization": f"{scheme} {encoded}"}


def write(path: Path, text: str) -> None:
    """As a careful operator does: written beside, then renamed into place."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def problems_of(cfg: AuthConfig, key: str = KEY) -> list[str]:
    with pytest.raises(ConfigError) as err:
        cfg.validate(key)
    return err.value.problems


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text
        assert secret[6:] not in text  # nor its random part


def rewrite(path: Path, text: str) -> None:
    """Written in place: same inode, another size."""
    path.write_text(text)


def remove(path: Path) -> None:
    path.unlink()


async def eventually(check: Callable[[], bool]) -> None:
    """Poll: the reload task runs every 50 ms, later on a busy machine."""
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.01)


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.yaml"
    write(path, f"{TOKEN_A}: team-a\n'{TOKEN_B}': team-b\n")
    return path


@pytest.fixture
def logs() -> Iterator[list[dict[str, Any]]]:
    """Captured log events; none may contain a token."""
    with capture_logs() as captured:
        yield captured
    assert_no_secret(repr(captured))


@pytest.fixture
async def auth(tokens_file: Path, logs: list[dict[str, Any]]) -> AsyncIterator[TokenAuth]:
    a = TokenAuth(AuthConfig(tokens_file=str(tokens_file), reload_interval=FAST),
                  "tenantauth", None)
    await a.start()
    yield a
    await a.shutdown()


class TestTenantName:
    def test_names(self) -> None:
        """Names of 1-64 safe characters pass; nothing else does, not even with a final
        newline (which ``$`` would let through ``match``)."""
        for ok in ("a", "team-a", "Team_B.prod", "0", "x" * 64, DEFAULT_TENANT):
            assert TENANT_RE.match(ok)
        for bad in ("", "x" * 65, "-a", ".a", "_a", "a b", "a/b", "a\n", "a\x00", "é",
                    "a'; DROP TABLE x; --", "a|b", "$(id)"):
            assert not TENANT_RE.match(bad)
            assert not TENANT_RE.search(bad)


class TestTenantFromHeader:
    def test_missing_is_none(self) -> None:
        """No header: no tenant named (the caller uses its default)."""
        assert tenant_from_header(None) is None

    def test_valid_name(self) -> None:
        """A valid name is the tenant, as written."""
        assert tenant_from_header("team-a") == "team-a"
        assert tenant_from_header("x" * 64) == "x" * 64

    @pytest.mark.parametrize("value", [
        "a'; DROP TABLE x; --", "", "x" * 65, "\x00", "team\n", "tëam", "租户", "../etc",
        " team-a", "team-a ", "a\r\nX-Injected: 1"])
    def test_hostile_values_are_refused(self, value: str) -> None:
        """Present but not a tenant name: ``InvalidData`` (a 400), naming the header and
        not echoing the value."""
        with pytest.raises(InvalidData) as err:
            tenant_from_header(value)
        message = str(err.value)
        assert message.startswith("X-Scope-OrgID: ")
        if len(value) > 1:
            assert value not in message


class TestRedactToken:
    def test_shows_a_prefix_and_the_length(self) -> None:
        """Four characters and the length: tokens can be told apart, not used."""
        assert redact_token(TOKEN_A) == f"tok-…({len(TOKEN_A)} chars)"
        assert TOKEN_A not in redact_token(TOKEN_A)

    def test_short_or_odd_tokens(self) -> None:
        """A token too short to be valid shows nothing; control characters show as ``?``."""
        assert redact_token("short") == "…(5 chars)"
        assert redact_token("") == "…(0 chars)"
        assert redact_token("\x1b[2J" + "x" * 20) == "?[2J…(24 chars)"


class TestConfig:
    def test_defaults_and_durations(self) -> None:
        """``{}`` decodes to the defaults; ``reload_interval`` takes ``50ms``-style
        durations; unknown keys are errors."""
        cfg = msgspec.convert({}, AuthConfig, dec_hook=dec_hook)
        assert (cfg.tokens_file, cfg.tokens, cfg.reload_interval) == ("", {}, 5.0)
        cfg = msgspec.convert({"reload_interval": "50ms"}, AuthConfig, dec_hook=dec_hook)
        assert cfg.reload_interval == pytest.approx(0.05)
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"token_file": "x"}, AuthConfig, dec_hook=dec_hook)
        assert msgspec.convert({"authenticator": "tenantauth"}, ReceiverAuth).authenticator \
            == "tenantauth"
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({}, ReceiverAuth)

    def test_valid_file_and_inline(self, tokens_file: Path) -> None:
        """File and inline tokens together; the same token twice for the same tenant is
        no conflict."""
        AuthConfig(tokens_file=str(tokens_file), tokens={TOKEN_C: "team-c"}).validate(KEY)
        AuthConfig(tokens_file=str(tokens_file), tokens={TOKEN_A: "team-a"}).validate(KEY)
        AuthConfig(tokens={TOKEN_A: "team-a"}).validate(KEY)

    def test_neither_file_nor_tokens(self) -> None:
        """Auth with no tokens at all is a mistake, named at the key."""
        assert problems_of(AuthConfig()) == [
            f"{KEY}.tokens_file: give tokens_file (a YAML file of token: tenant) or "
            "tokens, or both"]

    def test_through_the_loader(self, tmp_path: Path) -> None:
        """``decode_struct`` calls ``validate()`` without a key and prefixes the path."""
        with pytest.raises(ConfigError) as err:
            decode_struct({"tokens_file": str(tmp_path / "missing.yaml")}, AuthConfig, KEY)
        assert err.value.problems == [
            f"{KEY}.tokens_file: cannot read {tmp_path / 'missing.yaml'}: "
            "No such file or directory"]
        cfg = decode_struct({"tokens": {TOKEN_A: "team-a"}, "reload_interval": "2s"},
                            AuthConfig, KEY)
        assert isinstance(cfg, AuthConfig) and cfg.reload_interval == 2.0

    def test_admin_tenants_are_tenant_names(self) -> None:
        """``admin_tenants`` names tenants; a value that is not one is named at the key."""
        cfg = AuthConfig(tokens={TOKEN_A: "team-a"}, admin_tenants=["ops", "x' OR 1"])
        assert problems_of(cfg) == [
            f"{KEY}.admin_tenants: \"x' OR 1\" is not a tenant name ({TENANT_RULE})"]
        ok = AuthConfig(tokens={TOKEN_A: "team-a"}, admin_tenants=["team-a"])
        ok.validate(KEY)
        auth = TokenAuth(ok, "tenantauth", None)
        assert auth.is_admin("team-a") and not auth.is_admin("team-b")

    def test_reload_interval_must_be_positive(self) -> None:
        """Built by hand with 0, the watcher would spin."""
        problems = problems_of(AuthConfig(tokens={TOKEN_A: "a"}, reload_interval=Duration(0)))
        assert problems == [f"{KEY}.reload_interval: must be greater than 0"]

    @pytest.mark.parametrize(("content", "expected"), [
        (f"{TOKEN_A}: team-a\n{TOKEN_B}: [team-b\n",
         "is not valid YAML (line 3, column 1)"),
        (f"- {TOKEN_A}\n- team-a\n", "must be a mapping of token: tenant, got a list"),
        (f"{TOKEN_A}\n", "must be a mapping of token: tenant, got a single value"),
        ("", "is empty (expected a mapping of token: tenant)"),
        ("# all revoked?\n", "is empty (expected a mapping of token: tenant)"),
    ])
    def test_file_is_not_a_mapping(self, tmp_path: Path, content: str, expected: str) -> None:
        """Not YAML (PyYAML's own message would quote the line: not used), not a mapping,
        empty."""
        path = tmp_path / "tokens.yaml"
        path.write_text(content)
        problems = problems_of(AuthConfig(tokens_file=str(path)))
        assert problems == [f"{KEY}.tokens_file: {path} {expected}"]
        assert_no_secret(str(problems))

    def test_file_unreadable(self, tmp_path: Path) -> None:
        """Missing, a directory, not UTF-8, a tag PyYAML would construct."""
        cases = {
            tmp_path / "missing.yaml": "cannot read {p}: No such file or directory",
            tmp_path: "{p} is not a regular file",
        }
        latin = tmp_path / "latin.yaml"
        latin.write_bytes(f"{TOKEN_A}: \xe9quipe\n".encode("latin-1"))
        cases[latin] = "{p} is not UTF-8 text (byte 24)"
        for path, expected in cases.items():
            problems = problems_of(AuthConfig(tokens_file=str(path)))
            assert problems == [f"{KEY}.tokens_file: {expected.format(p=path)}"]

    def test_every_bad_entry_by_line(self, tmp_path: Path) -> None:
        """Each bad entry is reported, all at once, by its line; no message holds a token
        (not even the one in a tenant's place, line 9) nor the tenant beside it."""
        path = tmp_path / "tokens.yaml"
        path.write_text(
            f"{TOKEN_A}: team-a\n"             # 1 fine
            "short-token: team-a\n"            # 2 too short
            f"'{TOKEN_B} x': team-b\n"         # 3 whitespace
            f'"{TOKEN_B}\\t": team-b\n'        # 4 control character
            "1234567890123456789: team-b\n"    # 5 a number, not a string
            f"{TOKEN_C}: 2024\n"               # 6 the tenant is a number
            f"{TOKEN_C}x: team c\n"            # 7 tenant name with a space
            f"{TOKEN_A}: team-z\n"             # 8 line 1's token, another tenant
            f"team-b: {TOKEN_B}\n"             # 9 written tenant: token
            f"{TOKEN_A}: team-a\n"             # 10 line 1 again: no conflict
            f"{TOKEN_C}y: !!python/object:os.system {{}}\n"  # 11 a tag: never constructed
            f"tök-ëñ-unicode-token-0: team-u\n"  # 12 non-ASCII
        )
        where = f"{KEY}.tokens_file"
        tenant_rule = ("the tenant name must be 1-64 letters, digits, '.', '_' or '-', "
                       "starting with a letter or digit")
        problems = problems_of(AuthConfig(tokens_file=str(path)))
        assert problems == [
            f"{where}: line 2: the token is shorter than 16 characters",
            f"{where}: line 3: the token may hold only visible ASCII characters "
            "(no whitespace, control or non-ASCII characters)",
            f"{where}: line 4: the token may hold only visible ASCII characters "
            "(no whitespace, control or non-ASCII characters)",
            f"{where}: line 5: the token is not a string (quote it)",
            f"{where}: line 6: the tenant is not a string (quote it)",
            f"{where}: line 7: {tenant_rule}",
            f"{where}: line 8: the same token as tokens_file line 1, with a different tenant",
            f"{where}: line 9: the token is shorter than 16 characters",
            f"{where}: line 11: the tenant is not a string (quote it)",
            f"{where}: line 12: the token may hold only visible ASCII characters "
            "(no whitespace, control or non-ASCII characters)",
        ]
        text = "\n".join(problems)
        assert_no_secret(text)
        assert "short-token" not in text and "team-" not in text and "1234567890" not in text

    def test_inline_entries_and_conflicts_with_the_file(self, tokens_file: Path) -> None:
        """Inline tokens are named by entry number; a token of the file given inline with
        another tenant is a conflict."""
        cfg = AuthConfig(tokens_file=str(tokens_file),
                         tokens={TOKEN_B: "team-z", "x" * 15: "team-x", TOKEN_C: "bad name"})
        problems = problems_of(cfg)
        assert problems == [
            f"{KEY}.tokens: entry 1: the same token as tokens_file line 2, "
            "with a different tenant",
            f"{KEY}.tokens: entry 2: the token is shorter than 16 characters",
            f"{KEY}.tokens: entry 3: the tenant name must be 1-64 letters, digits, '.', '_' "
            "or '-', starting with a letter or digit",
        ]
        assert_no_secret(str(problems))
        assert "x" * 15 not in str(problems)

    def test_too_long_token(self) -> None:
        """A token that could not fit in a 4096-byte header is refused at once."""
        assert problems_of(AuthConfig(tokens={"t" * 2049: "a"})) == [
            f"{KEY}.tokens: entry 1: the token is longer than 2048 characters"]


class TestHttp:
    async def test_bearer(self, auth: TokenAuth) -> None:
        """``Bearer TOKEN``, the scheme in any case, the header key in any case."""
        assert auth.tenant_of_http(bearer(TOKEN_A)) == "team-a"
        assert auth.tenant_of_http(bearer(TOKEN_B, "bearer")) == "team-b"
        assert auth.tenant_of_http(bearer(TOKEN_B, "BEARER")) == "team-b"
        assert auth.tenant_of_http({"authorization": f"Bearer {TOKEN_A}"}) == "team-a"
        assert auth.tenant_of_http({"AUTHORIZATION": f"  Bearer   {TOKEN_A} "}) == "team-a"

    async def test_basic(self, auth: TokenAuth) -> None:
        """Basic auth: the password is the token, the username anything (even empty or
        holding a colon-free tenant of its own)."""
        assert auth.tenant_of_http(basic("pyroscope", TOKEN_A)) == "team-a"
        assert auth.tenant_of_http(basic("", TOKEN_B, "basic")) == "team-b"
        assert auth.tenant_of_http(basic("team-b", TOKEN_A)) == "team-a"
        # the token as username, no password: not what the SDKs send
        assert auth.tenant_of_http(basic(TOKEN_A, "")) is None

    @pytest.mark.parametrize("headers", [
        {},
        {"Content-Type": "application/x-protobuf"},
        {"Authorization": ""},
        {"Authorization": "Bearer"},
        {"Authorization": TOKEN_A},
        {"Authorization": f"Token {TOKEN_A}"},
        {"Authorization": f"Bearer {TOKEN_A}x"},
        {"Authorization": f"Bearer {TOKEN_A[:-1]}"},
        {"Authorization": f"Bearer {TOKEN_C}"},
        {"Authorization": f"Bearer {TOKEN_A} {TOKEN_A}"},
        {"Authorization": f"Basic {TOKEN_A}"},
        {"Authorization": "Basic " + base64.b64encode(TOKEN_A.encode()).decode()},
        {"Authorization": "Basic " + base64.b64encode(f"u:{TOKEN_A}".encode()).decode()[:-1]},
        {"Authorization": "Basic " + base64.b64encode(b"u:\xff\xfe" * 10).decode()},
        {"Authorization": "Bearer \x00\x01\x02"},
        {"Authorization": f"Bearer {TOKEN_A}\u200b"},
        {"Authorization": f"Bеarer {TOKEN_A}"},  # a Cyrillic е
        {"X-Scope-OrgID": "team-a"},
    ])
    async def test_refused(self, auth: TokenAuth, headers: dict[str, str]) -> None:
        """Missing, unknown, malformed or garbage: ``None``, never an exception."""
        assert auth.tenant_of_http(headers) is None

    async def test_oversized_header(self, auth: TokenAuth) -> None:
        """Over 4096 bytes is refused without decoding, even with a good token inside."""
        padded = f"Bearer {TOKEN_A}" + " " * (4097 - len(f"Bearer {TOKEN_A}"))
        assert auth.tenant_of_http({"Authorization": padded}) is None
        assert auth.tenant_of_http({"Authorization": padded[:4096]}) == "team-a"
        assert auth.tenant_of_http({"Authorization": "Basic " + "A" * 10**6}) is None

    async def test_two_authorization_headers(self, auth: TokenAuth) -> None:
        """A repeated header is refused: which one a proxy in front checked is unknown."""
        multidict = pytest.importorskip("multidict")
        headers = multidict.CIMultiDict([("Authorization", f"Bearer {TOKEN_A}"),
                                         ("authorization", f"Bearer {TOKEN_B}")])
        assert auth.tenant_of_http(headers) is None
        assert auth.tenant_of_http({"Authorization": f"Bearer {TOKEN_A}",
                                    "authorization": f"Bearer {TOKEN_A}"}) is None
        one = multidict.CIMultiDictProxy(multidict.CIMultiDict(
            [("AUTHORIZATION", f"Bearer {TOKEN_B}")]))
        assert auth.tenant_of_http(one) == "team-b"


class TestGrpc:
    async def test_str_and_bytes_values(self, auth: TokenAuth) -> None:
        """The ``authorization`` metadata key, its value as ``str`` or ``bytes``."""
        assert auth.tenant_of_grpc([("user-agent", "grpc-python"),
                                    ("authorization", f"Bearer {TOKEN_A}")]) == "team-a"
        assert auth.tenant_of_grpc((("authorization", f"bearer {TOKEN_B}".encode()),)) \
            == "team-b"
        value = base64.b64encode(f"u:{TOKEN_A}".encode())
        assert auth.tenant_of_grpc([("authorization", b"Basic " + value)]) == "team-a"

    @pytest.mark.parametrize("metadata", [
        [],
        [("authorization", f"Bearer {TOKEN_C}")],
        [("authorization", b"Bearer \xff" + TOKEN_A.encode())],
        [("authorization", b"Bearer " + TOKEN_A.encode() + b" " * 5000)],
        [("authorization", f"Bearer {TOKEN_A}"), ("authorization", f"Bearer {TOKEN_A}")],
        [("authorization-bin", TOKEN_A.encode())],
        [("authorization",)],
        [("authorization", None)],
        [("authorization", 12345)],
        ["authorization"],
        None,
    ])
    async def test_refused(self, auth: TokenAuth, metadata: Any) -> None:
        """Missing, repeated, unknown or garbage metadata: ``None``, never an exception."""
        assert auth.tenant_of_grpc(metadata) is None


class TestCounters:
    async def test_requests_are_counted(self, auth: TokenAuth) -> None:
        """Every call counts as authenticated or not; the repr shows the state."""
        auth.tenant_of_http(bearer(TOKEN_A))
        auth.tenant_of_grpc([("authorization", f"Bearer {TOKEN_B}")])
        auth.tenant_of_http({})
        auth.tenant_of_http(bearer(TOKEN_C))
        auth.tenant_of_grpc([])
        assert auth.metrics == {"authenticated_requests": 2, "unauthenticated_requests": 3}
        assert repr(auth) == ("<TokenAuth tenantauth tokens=2 tenants=2 "
                              "{'authenticated_requests': 2, 'unauthenticated_requests': 3}>")


class TestLifecycle:
    async def test_shutdown_without_start_and_twice(self, tokens_file: Path) -> None:
        """``shutdown()`` is idempotent and safe without ``start()``."""
        a = TokenAuth(AuthConfig(tokens_file=str(tokens_file)), "tenantauth", None)
        await a.shutdown()
        await a.start()
        await a.shutdown()
        await a.shutdown()

    async def test_bad_tokens_fail_start(self, tmp_path: Path) -> None:
        """At start, invalid tokens are a ``ConfigError`` under the extension's key."""
        path = tmp_path / "tokens.yaml"
        path.write_text("short: team-a\n")
        a = TokenAuth(AuthConfig(tokens_file=str(path)), "tenantauth/x", None)
        with pytest.raises(ConfigError) as err:
            await a.start()
        assert err.value.problems == [
            "extensions.tenantauth/x.tokens_file: line 1: "
            "the token is shorter than 16 characters"]
        await a.shutdown()

    async def test_inline_only_needs_no_watcher(self, logs: list[dict[str, Any]]) -> None:
        """Inline tokens work alone, and nothing polls a file."""
        a = TokenAuth(AuthConfig(tokens={TOKEN_C: "team-c"}), "tenantauth", None)
        await a.start()
        assert a.tenant_of_http(bearer(TOKEN_C)) == "team-c"
        assert a._task is None
        await a.shutdown()
        assert [e["event"] for e in logs] == ["auth_tokens_loaded"]
        assert logs[0]["tokens"] == 1 and logs[0]["component"] == "tenantauth"

    async def test_no_raw_token_is_kept(self, auth: TokenAuth) -> None:
        """Tokens read from the file are kept only as keyed digests."""
        assert_no_secret(repr(vars(auth)))
        assert auth.tenant_of_http(bearer(TOKEN_A)) == "team-a"


class TestReload:
    async def test_file_change_is_picked_up(self, auth: TokenAuth, tokens_file: Path,
                                            logs: list[dict[str, Any]]) -> None:
        """A renamed-in file and an in-place edit are both seen; a token taken out of the
        file stops working; inline tokens stay."""
        write(tokens_file, f"{TOKEN_A}: team-x\n{TOKEN_C}: team-c\n")
        await eventually(lambda: auth.tenant_of_http(bearer(TOKEN_A)) == "team-x")
        assert auth.tenant_of_http(bearer(TOKEN_C)) == "team-c"
        assert auth.tenant_of_http(bearer(TOKEN_B)) is None
        reloaded = [e for e in logs if e["event"] == "auth_tokens_reloaded"]
        assert reloaded[0]["tokens"] == 2 and reloaded[0]["log_level"] == "info"

        rewrite(tokens_file, f"{TOKEN_B}: team-b\n")
        await eventually(lambda: auth.tenant_of_http(bearer(TOKEN_B)) == "team-b")
        assert auth.tenant_of_http(bearer(TOKEN_A)) is None
        assert auth.metrics["tokens_reloaded"] == 2

    async def test_failed_reload_keeps_the_tokens(self, auth: TokenAuth, tokens_file: Path,
                                                  logs: list[dict[str, Any]]) -> None:
        """A bad file, an empty one or none at all: the tokens in force stay, the reason is
        logged once per change, without the token; a good file is then taken."""
        def failures() -> list[dict[str, Any]]:
            return [e for e in logs if e["event"] == "auth_tokens_reload_failed"]

        write(tokens_file, f"{TOKEN_A}: team-a\nshort: team-b\n{TOKEN_C}: team-c\n")
        await eventually(lambda: len(failures()) == 1)
        failed = failures()[0]
        assert failed["log_level"] == "warning"
        assert failed["reason"] == ("extensions.tenantauth.tokens_file: line 2: "
                                    "the token is shorter than 16 characters")
        assert failed["tokens"] == 2
        assert auth.tenant_of_http(bearer(TOKEN_B)) == "team-b"
        assert auth.tenant_of_http(bearer(TOKEN_C)) is None

        write(tokens_file, "")
        await eventually(lambda: len(failures()) == 2)
        remove(tokens_file)
        await eventually(lambda: len(failures()) == 3)
        assert "No such file or directory" in failures()[2]["reason"]
        await asyncio.sleep(0.2)  # unchanged: not reported again
        assert len(failures()) == 3
        assert auth.tenant_of_http(bearer(TOKEN_A)) == "team-a"
        assert auth.metrics["tokens_reload_failed"] == 3

        write(tokens_file, f"{TOKEN_C}: team-c\n")
        await eventually(lambda: auth.tenant_of_http(bearer(TOKEN_C)) == "team-c")
        assert auth.tenant_of_http(bearer(TOKEN_A)) is None

    async def test_shutdown_stops_watching(self, auth: TokenAuth, tokens_file: Path) -> None:
        """After ``shutdown()`` the file is no longer read."""
        await auth.shutdown()
        write(tokens_file, f"{TOKEN_C}: team-c\n")
        await asyncio.sleep(0.2)
        assert auth.tenant_of_http(bearer(TOKEN_C)) is None


def _loaded() -> TokenAuth:
    a = TokenAuth(AuthConfig(tokens={TOKEN_A: "team-a"}), "tenantauth", None)
    asyncio.run(a.start())  # inline tokens only: no task is left behind
    return a


_AUTH = _loaded()
_b64 = st.binary(max_size=200).map(lambda b: base64.b64encode(b).decode())
_header_values = (
    st.text(max_size=300)
    | st.builds(str.__add__, st.sampled_from(["Bearer ", "Basic ", "bAsIc  ", "Bearer\t"]),
                st.text(max_size=300) | _b64)
    | st.builds(lambda u, p: "Basic " + base64.b64encode(f"{u}:{p}".encode()).decode(),
                st.text(max_size=50), st.text(max_size=50) | st.just(TOKEN_A))
)


class TestNeverRaises:
    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.dictionaries(st.text(max_size=20) | st.just("Authorization"), _header_values,
                           max_size=4))
    def test_http(self, headers: dict[str, str]) -> None:
        """Any header mapping gives a tenant or ``None``; only the right token gives one."""
        tenant = _AUTH.tenant_of_http(headers)
        assert tenant in (None, "team-a")

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.tuples(st.text(max_size=20) | st.just("authorization"),
                              _header_values | st.binary(max_size=300)), max_size=4))
    def test_grpc(self, metadata: list[tuple[str, str | bytes]]) -> None:
        """The same for gRPC metadata, ``str`` and ``bytes`` values."""
        assert _AUTH.tenant_of_grpc(metadata) in (None, "team-a")
