"""Tenant authentication: the ``tenantauth`` extension, and ``X-Scope-OrgID`` where it is off.

In the OpenTelemetry Collector's shape (issue #17)::

    extensions:
      tenantauth:
        tokens_file: tokens.yaml        # a YAML mapping `token: tenant`, reloaded on change
        tokens:                         # and/or inline; both are merged
          "${env:TEAM_A_TOKEN}": team-a
        reload_interval: 5s             # how often tokens_file is checked for a change
        admin_tenants: [ops]            # their tokens may read the admin API's /metrics
    receivers:
      otlp:
        protocols:
          grpc: {endpoint: 0.0.0.0:4317, auth: {authenticator: tenantauth}}

A client proves its tenant with ``Authorization: Bearer TOKEN`` (OpenTelemetry SDK
exporters, the ``authorization`` metadata key on gRPC) or with HTTP basic auth whose
password is the token, the username being anything (Pyroscope SDKs). A request without a
known token gets ``None`` here, and the receiver answers 401 / ``UNAUTHENTICATED``.

Tokens are secrets, so:

* what is kept is ``HMAC-SHA256(key, token)`` -> tenant, with a key drawn at start: a
  presented token is hashed the same way and looked up, so the time a lookup takes does
  not depend on how much of a stored token a guess matches, and a memory dump holds no
  token (nor a plain hash of one to guess offline);
* configuration errors and log events name the file line or the entry, never the token,
  nor even the tenant next to it (a file written ``tenant: token`` by mistake would put
  the token in the tenant's place).

The file is polled (size, mtime, inode every ``reload_interval``) rather than watched with
inotify: no dependency, and it sees a Kubernetes Secret's symlink swap and network file
systems alike. A reload that fails keeps the tokens in force and logs why; an empty file
counts as failed, since it is what a writer leaves between truncating and writing. Write
the file elsewhere and rename it into place, so that a reload never sees half of it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import math
import os
import re
import stat
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
import structlog
import yaml

from pipeline.background import file_stamp, stop_task
from pipeline.config.ranges import Duration
from pipeline.errors import ConfigError, InvalidData
from pipeline.records import DEFAULT_TENANT as DEFAULT_TENANT  # re-exported
from pipeline.registry import Context, Factory

# \Z, not $: `$` also matches before a final newline, so "team-a\n" would pass re.match
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
TENANT_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
MIN_TOKEN_LEN = 16
# longer could not be sent: "Basic " + base64("user:" + token) has to fit MAX_HEADER_BYTES
MAX_TOKEN_LEN = 2048
# tokens go in headers and gRPC metadata, which carry visible ASCII only
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+\Z")
MAX_HEADER_BYTES = 4096  # a longer Authorization header is refused without decoding it
MAX_FILE_BYTES = 16 * 1024 * 1024  # a tokens_file pointing at /dev/zero must not hang us
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_STR_TAG = "tag:yaml.org,2002:str"


class AuthConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The ``tenantauth`` extension's section; ``tokens_file`` and ``tokens`` are merged."""

    tokens_file: str = ""
    tokens: dict[str, str] = {}
    # tenants whose tokens have the admin role: the admin API's /metrics (every tenant's
    # counters) answers them alone; their queries still see their own tenant's data only
    admin_tenants: list[str] = []
    # plain float default: the config's JSON Schema cannot encode a Duration default
    reload_interval: Duration = 5.0  # type: ignore[assignment]

    def validate(self, key: str = "") -> None:
        """Raise ``ConfigError`` listing every problem, each starting with ``key`` (e.g.
        ``extensions.tenantauth``); with no key, problems name the field alone
        (``tokens_file: ...``), for ``decode.validate_at`` to prefix."""
        problems: list[str] = []
        if not (math.isfinite(self.reload_interval) and self.reload_interval > 0):
            problems.append(f"{_at(key, 'reload_interval')}: must be greater than 0")
        problems += collect_tokens(self, key, _sha256)[1]
        problems += [f"{_at(key, 'admin_tenants')}: {t[:80]!r} is not a tenant name "
                     f"({TENANT_RULE})" for t in self.admin_tenants
                     if not isinstance(t, str) or not TENANT_RE.match(t)]
        if problems:
            raise ConfigError(problems)


class _Entry(NamedTuple):
    field: str  # "tokens_file" or "tokens"
    label: str  # "line 3", "entry 2": where the user finds it, without the token
    token: object
    tenant: object


def _at(key: str, field: str) -> str:
    return f"{key}.{field}" if key else field


def _sha256(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def collect_tokens(cfg: AuthConfig, key: str, digest: Callable[[str], bytes]
                   ) -> tuple[dict[bytes, str], list[str]]:
    """``digest(token)`` -> tenant for every token of ``cfg`` (file, then inline), and the
    problems found, each starting with ``key``; the tokens themselves are not kept."""
    problems: list[str] = []
    if not cfg.tokens_file and not cfg.tokens:
        problems.append(f"{_at(key, 'tokens_file')}: give tokens_file (a YAML file of "
                        "token: tenant) or tokens, or both")
        return {}, problems
    entries: list[_Entry] = []
    if cfg.tokens_file:
        entries += _file_entries(cfg.tokens_file, _at(key, "tokens_file"), problems)
    entries += [_Entry("tokens", f"entry {i}", token, tenant)
                for i, (token, tenant) in enumerate(cfg.tokens.items(), 1)]
    tenants: dict[bytes, str] = {}
    first: dict[bytes, _Entry] = {}
    for e in entries:
        where = f"{_at(key, e.field)}: {e.label}"
        bad = _entry_problems(e.token, e.tenant)
        if bad or not isinstance(e.token, str) or not isinstance(e.tenant, str):
            problems += [f"{where}: {b}" for b in bad]
            continue
        d = digest(e.token)
        if d in tenants and tenants[d] != e.tenant:
            other = first[d]
            problems.append(f"{where}: the same token as {other.field} {other.label}, "
                            "with a different tenant")
            continue
        tenants.setdefault(d, e.tenant)
        first.setdefault(d, e)
    return tenants, problems


def _entry_problems(token: object, tenant: object) -> list[str]:
    bad = []
    if not isinstance(token, str):
        bad.append("the token is not a string (quote it)")
    elif len(token) < MIN_TOKEN_LEN:
        bad.append(f"the token is shorter than {MIN_TOKEN_LEN} characters")
    elif len(token) > MAX_TOKEN_LEN:
        bad.append(f"the token is longer than {MAX_TOKEN_LEN} characters")
    elif not _TOKEN_CHARS.match(token):
        bad.append("the token may hold only visible ASCII characters "
                   "(no whitespace, control or non-ASCII characters)")
    if not isinstance(tenant, str):
        bad.append("the tenant is not a string (quote it)")
    elif not TENANT_RE.match(tenant):
        bad.append(f"the tenant name must be {TENANT_RULE}")
    return bad


def _file_entries(path: str, where: str, problems: list[str]) -> list[_Entry]:
    """The file's ``token: tenant`` pairs with their line numbers. The YAML is composed,
    not constructed: the line of each pair is known, a duplicate key is not silently
    dropped, and tags (``!!python/...``) and aliases are never expanded."""
    text = _read_text(path, where, problems)
    if text is None:
        return []
    try:
        root = yaml.compose(text, Loader=_YAML_LOADER)
    except yaml.MarkedYAMLError as err:
        # not str(err): PyYAML quotes the offending line, which may hold a token
        mark = err.problem_mark or err.context_mark
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problems.append(f"{where}: {path} is not valid YAML{at}")
        return []
    except (yaml.YAMLError, RecursionError):
        problems.append(f"{where}: {path} is not valid YAML")
        return []
    if root is None:
        problems.append(f"{where}: {path} is empty (expected a mapping of token: tenant)")
        return []
    if not isinstance(root, yaml.MappingNode):
        kind = "a list" if isinstance(root, yaml.SequenceNode) else "a single value"
        problems.append(f"{where}: {path} must be a mapping of token: tenant, got {kind}")
        return []
    return [_Entry("tokens_file", f"line {k.start_mark.line + 1}", _yaml_str(k), _yaml_str(v))
            for k, v in root.value]


def _yaml_str(node: yaml.Node) -> str | None:
    """A scalar that YAML reads as a string; ``None`` for ``1234``, ``yes``, ``~``, lists..."""
    if isinstance(node, yaml.ScalarNode) and node.tag == _STR_TAG:
        return str(node.value)
    return None


def _read_text(path: str, where: str, problems: list[str]) -> str | None:
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            problems.append(f"{where}: {path} is not a regular file")
            return None
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        problems.append(f"{where}: cannot read {path}: {err.strerror or type(err).__name__}")
        return None
    if len(data) > MAX_FILE_BYTES:
        problems.append(f"{where}: {path} is larger than {MAX_FILE_BYTES >> 20} MiB")
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        problems.append(f"{where}: {path} is not UTF-8 text (byte {err.start})")
        return None


class _Loaded(NamedTuple):
    tenants: dict[bytes, str]
    problems: list[str]
    stamp: tuple[int, ...]
    settled: bool  # False: the file changed while it was read; read it again later


class TokenAuth:
    """The ``tenantauth`` extension: tokens -> tenant, for the receivers that name it."""

    def __init__(self, cfg: AuthConfig, name: str, log: Any = None) -> None:
        self.cfg = cfg
        self.name = name
        self.log = (log if log is not None else structlog.get_logger()).bind(component=name)
        self.metrics: Counter[str] = Counter()
        self._where = f"extensions.{name}"
        self._key = os.urandom(32)  # per process: the digests mean nothing elsewhere
        self._tenants: dict[bytes, str] = {}
        self._stamp: tuple[int, ...] = ()
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return (f"<TokenAuth {self.name} tokens={len(self._tenants)} "
                f"tenants={len(set(self._tenants.values()))} {dict(self.metrics)}>")

    def _digest(self, token: str) -> bytes:
        return hmac.digest(self._key, token.encode(), "sha256")

    def _load(self) -> _Loaded:
        """Runs in a thread: the file may sit on a slow disk."""
        path = self.cfg.tokens_file
        before = file_stamp(path) if path else ()
        tenants, problems = collect_tokens(self.cfg, self._where, self._digest)
        after = file_stamp(path) if path else ()
        return _Loaded(tenants, problems, before, settled=before == after)

    async def start(self) -> None:
        """Load the tokens (``ConfigError`` if they are not valid) and start watching the
        file."""
        if self._task is not None:
            return
        loaded = await asyncio.to_thread(self._load)
        if loaded.problems:
            raise ConfigError(loaded.problems)
        self._tenants, self._stamp = loaded.tenants, loaded.stamp
        self.log.info("auth_tokens_loaded", tokens=len(self._tenants),
                      tenants=len(set(self._tenants.values())))
        if self.cfg.tokens_file:
            self._task = asyncio.create_task(self._watch(), name=f"{self.name}-reload")

    async def shutdown(self) -> None:
        """Stop watching the file. Idempotent, and safe without ``start()``."""
        task, self._task = self._task, None
        await stop_task(task)

    async def _watch(self) -> None:
        path = self.cfg.tokens_file
        while True:
            await asyncio.sleep(self.cfg.reload_interval)
            try:
                if await asyncio.to_thread(file_stamp, path) != self._stamp:
                    self._reload(await asyncio.to_thread(self._load))
            except Exception as err:  # a bug here must not end the watching
                self.metrics["tokens_reload_failed"] += 1
                # the type only: an exception's text might quote the file
                self.log.error("auth_tokens_reload_failed", reason=type(err).__name__)

    def _reload(self, loaded: _Loaded) -> None:
        if not loaded.settled:
            return  # being written: the next round reads it whole
        self._stamp = loaded.stamp  # a bad file is reported once, not every round
        if loaded.problems:
            self.metrics["tokens_reload_failed"] += 1
            self.log.warning("auth_tokens_reload_failed", reason="; ".join(loaded.problems),
                             tokens=len(self._tenants))
            return
        self._tenants = loaded.tenants
        self.metrics["tokens_reloaded"] += 1
        self.log.info("auth_tokens_reloaded", tokens=len(self._tenants),
                      tenants=len(set(self._tenants.values())))

    def is_admin(self, tenant: str) -> bool:
        """Whether the tenant's tokens have the admin role (``admin_tenants``)."""
        return tenant in self.cfg.admin_tenants

    def tenant_of_http(self, headers: Mapping[str, str]) -> str | None:
        """The tenant of an HTTP request's ``Authorization`` header (``Bearer TOKEN`` or
        ``Basic base64(user:TOKEN)``), or ``None``: missing, repeated, malformed, over
        4096 bytes or unknown. Never raises."""
        found = [v for k, v in headers.items()
                 if isinstance(k, str) and k.lower() == "authorization"]
        return self._counted(found)

    def tenant_of_grpc(self, metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
        """The same from gRPC metadata (``authorization``, sent as ``str`` or ``bytes``)."""
        found: list[object] = []
        for item in metadata or ():
            if isinstance(item, tuple | list) and len(item) == 2 \
                    and isinstance(item[0], str) and item[0].lower() == "authorization":
                found.append(item[1])
        return self._counted(found)

    def _counted(self, values: Sequence[object]) -> str | None:
        # two Authorization headers: which one a proxy in front checked is unknown
        token = _credential(values[0]) if len(values) == 1 else None
        tenant = self._tenants.get(self._digest(token)) if token is not None else None
        ok = tenant is not None
        self.metrics["authenticated_requests" if ok else "unauthenticated_requests"] += 1
        return tenant


def _credential(value: object) -> str | None:
    """The token in ``Bearer TOKEN`` / ``Basic base64(anything:TOKEN)``; ``None`` for
    anything else."""
    if isinstance(value, bytes):
        if len(value) > MAX_HEADER_BYTES or not value.isascii():
            return None
        value = value.decode("ascii")
    # a valid header is ASCII, so characters are bytes and the bound holds
    if not isinstance(value, str) or len(value) > MAX_HEADER_BYTES or not value.isascii():
        return None
    parts = value.split()
    if len(parts) != 2:
        return None
    scheme, credential = parts[0].lower(), parts[1]
    if scheme == "bearer":
        token = credential
    elif scheme == "basic":
        try:
            user_token = base64.b64decode(credential, validate=True).decode("utf-8")
        except (binascii.Error, ValueError):  # UnicodeDecodeError is a ValueError
            return None
        _user, sep, token = user_token.partition(":")
        if not sep:
            return None
    else:
        return None
    return token if MIN_TOKEN_LEN <= len(token) <= MAX_TOKEN_LEN else None


def tenant_from_header(value: str | None) -> str | None:
    """The tenant an ``X-Scope-OrgID`` header names where auth is off (Grafana's
    convention): ``None`` when absent; ``InvalidData`` when it is not a tenant name, so
    that nothing hostile reaches a table, a path or a log line."""
    if value is None:
        return None
    if isinstance(value, str) and TENANT_RE.match(value):
        return value
    got = "an empty value" if not value else f"{len(value)} characters"
    raise InvalidData(f"X-Scope-OrgID: a tenant name is {TENANT_RULE}; got {got} that is not")


def redact_token(token: str) -> str:
    """``abcd…(32 chars)``: enough to tell tokens apart in a log, not to use one. A token
    too short to be valid shows no characters at all."""
    shown = token[:4] if len(token) >= MIN_TOKEN_LEN else ""
    shown = "".join(c if c.isascii() and c.isprintable() else "?" for c in shown)
    return f"{shown}…({len(token)} chars)"


def _create(cfg: AuthConfig, ctx: Context) -> TokenAuth:
    return TokenAuth(cfg, ctx.id, ctx.log)


# the extension's type, as a config names it (``extensions: {tenantauth: {...}}``)
FACTORY = Factory(type="tenantauth", kind="extension", config=AuthConfig, create=_create,
                  signals=())
