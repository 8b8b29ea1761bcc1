"""TLS and SASL for the Kafka client, in the Collector's Kafka config shape::

    tls:                          # TLS to the brokers (absent: plain text)
      ca_file: ca.crt             # the brokers' CA (default: the system's store)
      cert_file: client.crt       # a client certificate, for brokers that ask for one
      key_file: client.key
      insecure_skip_verify: false
    auth:
      sasl:
        mechanism: PLAIN          # or SCRAM-SHA-256, SCRAM-SHA-512
        username: spanprof
        password: ${env:KAFKA_PASSWORD}

Turned into aiokafka's ``security_protocol`` (``SSL``, ``SASL_PLAINTEXT``, ``SASL_SSL``)
and its SSL context and SASL settings, for the producer and the consumer alike. The
password is a secret: it is never logged (``pipeline.log`` redacts it by its key).
"""

from __future__ import annotations

import os
import ssl
from typing import Any, Literal

import msgspec

from pipeline.errors import ConfigError


class KafkaTls(msgspec.Struct, forbid_unknown_fields=True):
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    insecure_skip_verify: bool = False

    def validate(self, key: str) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError(f"{key}: cert_file and key_file go together")
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"{key}.{name}: cannot read {path}")
        try:
            context(self)
        except (OSError, ssl.SSLError, ValueError) as err:
            raise ConfigError(f"{key}: {err}") from None


class Sasl(msgspec.Struct, forbid_unknown_fields=True):
    username: str
    password: str
    mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"

    def validate(self, key: str) -> None:
        if not self.username or not self.password:
            raise ConfigError(f"{key}: username and password are required")


class KafkaAuth(msgspec.Struct, forbid_unknown_fields=True):
    sasl: Sasl | None = None


def context(tls: KafkaTls) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=tls.ca_file or None)
    if tls.cert_file:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def client_settings(tls: KafkaTls | None, auth: KafkaAuth | None) -> dict[str, Any]:
    """aiokafka's keyword arguments for this security (empty: plain text)."""
    sasl = auth.sasl if auth is not None else None
    out: dict[str, Any] = {}
    if tls is not None:
        out["ssl_context"] = context(tls)
    if sasl is not None:
        out.update(sasl_mechanism=sasl.mechanism, sasl_plain_username=sasl.username,
                   sasl_plain_password=sasl.password)
        out["security_protocol"] = "SASL_SSL" if tls is not None else "SASL_PLAINTEXT"
    elif tls is not None:
        out["security_protocol"] = "SSL"
    return out
