"""Per-tenant limits and counters (issue #17): one gateway, many teams, none starving the
others.

    service:
      tenants:
        max_tenants: 1000             # distinct tenants tracked; a new one beyond: refused
        limits:                       # every tenant's, unless overridden; 0: no limit
          requests_per_second: 0      # requests at every receiver door together
          bytes_per_second: 0         # request bodies, as sent
          max_spans_held: 0           # the correlator's held entries (0: its max_entries)
        overrides:
          team-a: {requests_per_second: 200, bytes_per_second: 16777216}

Rates are token buckets holding one second of the rate (at least one request), checked
when a request's tenant is known, before its body is read: over the rate, the request is
refused retryably with the delay after which the bucket has room again (HTTP ``429`` with
``Retry-After``; gRPC ``RESOURCE_EXHAUSTED`` with a ``RetryInfo``). Bytes are charged once
the body is read, so a bucket may go below zero: the next requests then wait until it is
back above (a large request is never refused for its size alone: the receivers' own
``max_request_bytes`` bounds that).

Counters per tenant (requests accepted and throttled, bytes, items) are exported on
``/metrics`` with a ``tenant`` label (``pipeline/admin/server.py``). Tenants are names
already checked against ``pipeline.auth.TENANT_RE``: a label value never needs escaping.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from pipeline.errors import ConfigError
from pipeline.records import DEFAULT_TENANT


class TenantLimits(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    requests_per_second: float = 0.0
    bytes_per_second: int = 0
    max_spans_held: int = 0

    def problems(self, key: str) -> list[str]:
        out = []
        for name in ("requests_per_second", "bytes_per_second", "max_spans_held"):
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):
                out.append(f"{key}.{name}: must be a finite number, 0 or more (0: no limit)")
        return out


class TenantsConfig(msgspec.Struct, forbid_unknown_fields=True):
    max_tenants: int = 1000
    limits: TenantLimits = msgspec.field(default_factory=TenantLimits)
    overrides: dict[str, TenantLimits] = {}

    def validate(self) -> None:
        """Problems name keys below ``service.tenants`` (``validate_at`` prefixes it)."""
        from pipeline.auth import TENANT_RE, TENANT_RULE

        problems = []
        if self.max_tenants < 1:
            problems.append("max_tenants: must be at least 1")
        problems += self.limits.problems("limits")
        for tenant, limits in self.overrides.items():
            if not TENANT_RE.match(tenant):
                problems.append(f"overrides: {tenant[:80]!r} is not a tenant name "
                                f"({TENANT_RULE})")
                continue
            problems += limits.problems(f"overrides.{tenant}")
        if problems:
            raise ConfigError(problems)

    def of(self, tenant: str) -> TenantLimits:
        return self.overrides.get(tenant, self.limits)


@dataclass
class _Bucket:
    rate: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(max(self.rate, 1.0), self.level + (now - self.at) * self.rate)
        self.at = now

    def wait(self, need: float) -> float:
        """Seconds until the level is at ``need`` (0: it is)."""
        return 0.0 if self.level >= need else (need - self.level) / self.rate


@dataclass
class _Tenant:
    limits: TenantLimits
    requests: _Bucket | None
    bytes: _Bucket | None
    counts: Counter[str] = field(default_factory=Counter)


class Refused(Exception):
    """A tenant's request is over its limits: retry after ``retry_after`` seconds, or
    never (``retry_after`` None: ``max_tenants`` is reached)."""

    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Tenants:
    """The tenants seen since start: their limits' buckets and their counters."""

    def __init__(self, cfg: TenantsConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg or TenantsConfig()
        self.clock = clock
        self._tenants: dict[str, _Tenant] = {}

    def __repr__(self) -> str:
        return f"<Tenants {len(self._tenants)} of at most {self.cfg.max_tenants}>"

    def _get(self, tenant: str) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            if len(self._tenants) >= self.cfg.max_tenants and tenant != DEFAULT_TENANT:
                raise Refused(f"service.tenants.max_tenants: {self.cfg.max_tenants} tenants "
                              "already send here; another is refused", None)
            limits = self.cfg.of(tenant)
            now = self.clock()
            t = self._tenants[tenant] = _Tenant(
                limits,
                _Bucket(limits.requests_per_second, max(limits.requests_per_second, 1.0), now)
                if limits.requests_per_second else None,
                _Bucket(float(limits.bytes_per_second), float(limits.bytes_per_second), now)
                if limits.bytes_per_second else None)
        return t

    def admit(self, tenant: str) -> None:
        """Take one request of ``tenant`` in, or raise ``Refused``."""
        t = self._get(tenant)
        now = self.clock()
        wait, which = 0.0, ""
        # a request takes one token; bytes are paid after the body, so it is enough that
        # no debt is left
        for name, bucket, need in (("requests_per_second", t.requests, 1.0),
                                   ("bytes_per_second", t.bytes, 0.0)):
            if bucket is not None:
                bucket.refill(now)
                if (w := bucket.wait(need)) > 0 and not which:
                    which = name  # named after the first limit it is over
                wait = max(wait, w)
        if wait > 0:
            t.counts["throttled_requests"] += 1
            rate = getattr(t.limits, which)
            raise Refused(f"tenant {tenant} is over its {which} ({rate:g}): retry later",
                          max(wait, 0.05))
        if t.requests is not None:
            t.requests.level -= 1
        t.counts["requests"] += 1

    def charge(self, tenant: str, body_bytes: int) -> None:
        """Count a request's body against the tenant's ``bytes_per_second``."""
        t = self._tenants.get(tenant)
        if t is None:
            return
        t.counts["bytes"] += body_bytes
        if t.bytes is not None:
            t.bytes.level -= body_bytes

    def count(self, tenant: str, what: str, n: int) -> None:
        """Add ``n`` to a tenant's counter ``what`` (``accepted_spans``, ...)."""
        t = self._tenants.get(tenant)
        if t is not None:
            t.counts[what] += n

    def max_spans_held(self, tenant: str, default: int) -> int:
        return self.cfg.of(tenant).max_spans_held or default

    def counters(self) -> dict[str, Counter[str]]:
        """Per tenant, its counters (a copy)."""
        return {name: Counter(t.counts) for name, t in self._tenants.items()}
