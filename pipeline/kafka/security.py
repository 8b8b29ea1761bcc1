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

from typing import Any, Literal

import msgspec

from pipeline.config.tls import ClientTls, client_context
from pipeline.errors import ConfigError


class Sasl(msgspec.Struct, forbid_unknown_fields=True):
    username: str
    password: str
    mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"

    def validate(self, key: str) -> None:
        if not self.username or not self.password:
            raise ConfigError(f"{key}: username and password are required")


class KafkaAuth(msgspec.Struct, forbid_unknown_fields=True):
    sasl: Sasl | None = None


def client_settings(tls: ClientTls | None, auth: KafkaAuth | None) -> dict[str, Any]:
    """aiokafka's keyword arguments for this security (empty: plain text)."""
    sasl = auth.sasl if auth is not None else None
    out: dict[str, Any] = {}
    if tls is not None:
        out["ssl_context"] = client_context(tls)
    if sasl is not None:
        out.update(sasl_mechanism=sasl.mechanism, sasl_plain_username=sasl.username,
                   sasl_plain_password=sasl.password)
        out["security_protocol"] = "SASL_SSL" if tls is not None else "SASL_PLAINTEXT"
    elif tls is not None:
        out["security_protocol"] = "SSL"
    return out
