"""A listener's security keys: ``tls:`` (its meaning, and how certificates are served and
reloaded: ``pipeline/tls.py``) and ``auth:`` (``pipeline/auth.py``)."""

from __future__ import annotations

import os
import ssl
from typing import Literal

import msgspec

from pipeline.config.ranges import Duration
from pipeline.errors import ConfigError


class ReceiverAuth(msgspec.Struct, forbid_unknown_fields=True):
    """A listener's ``auth:`` key: which extension checks its requests
    (``pipeline/auth.py``)."""

    authenticator: str


class TlsConfig(msgspec.Struct, forbid_unknown_fields=True):
    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    min_version: Literal["1.2", "1.3"] = "1.2"
    reload_interval: Duration = 10.0  # type: ignore[assignment]

    def validate(self, key: str, grpc_listener: bool = False) -> None:
        for name in ("cert_file", "key_file"):
            if not getattr(self, name):
                raise ConfigError(f"{key}.{name}: required when tls is set")
        _check_readable(self, key, ("cert_file", "key_file", "client_ca_file"))
        if grpc_listener and self.min_version != "1.2":
            raise ConfigError(f"{key}.min_version: the gRPC listener cannot refuse TLS 1.2 "
                              "(grpc's Python API offers 1.2 and 1.3): leave it at 1.2")
        if self.reload_interval <= 0:
            raise ConfigError(f"{key}.reload_interval: must be positive")
        try:
            server_context(self)
        except (OSError, ssl.SSLError, ValueError) as err:
            raise ConfigError(f"{key}: cannot use {self.cert_file} / {self.key_file}"
                              f"{' / ' + self.client_ca_file if self.client_ca_file else ''}"
                              f": {err}") from None


def _check_readable(cfg: msgspec.Struct, key: str, names: tuple[str, ...]) -> None:
    """Each file ``cfg`` names under ``names`` (where set) can be read."""
    for name in names:
        path = getattr(cfg, name)
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{key}.{name}: cannot read {path}")


def server_context(cfg: TlsConfig) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3 if cfg.min_version == "1.3" \
        else ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    if cfg.client_ca_file:
        ctx.load_verify_locations(cafile=cfg.client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class ClientTls(msgspec.Struct, forbid_unknown_fields=True):
    """TLS of a client spanprof opens (to Kafka, to a ClickHouse server)."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    insecure_skip_verify: bool = False

    def validate(self, key: str) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError(f"{key}: cert_file and key_file go together")
        _check_readable(self, key, ("ca_file", "cert_file", "key_file"))
        try:
            client_context(self)
        except (OSError, ssl.SSLError, ValueError) as err:
            raise ConfigError(f"{key}: {err}") from None


def client_context(tls: ClientTls) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=tls.ca_file or None)
    if tls.cert_file:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx
