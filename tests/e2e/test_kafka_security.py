"""The Kafka tier over TLS and SASL (issue #17): a broker whose second listener takes only
SASL_SSL (PLAIN), a gateway and a correlator given the CA and their credentials: spans
from the OpenTelemetry SDK go through and are stored. The same broker refuses a client
with a wrong password and one that speaks plain text to that listener, so the passing
case is not passing by accident; no password appears in the processes' logs."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from pipeline.config.tls import ClientTls
from pipeline.kafka.security import KafkaAuth, Sasl, client_settings
from tests.certs import CertAuthority
from tests.conftest import SpanprofProcess, side_by_side, wait_until
from tests.e2e.otlp_clients import sdk_spans
from tests.e2e.test_kafka_tier import CORRELATOR, GATEWAY
from tests.kafka_broker import KafkaBroker

pytestmark = pytest.mark.e2e
PASSWORD = "kafka-pw-7e1d9c3a5b"

SECURITY = """
    tls: {{ca_file: %(ca)s}}
    auth: {{sasl: {{mechanism: PLAIN, username: spanprof, password: "%(password)s"}}}}
"""


def secured(template: str) -> str:
    """A tier's config with TLS and SASL added to its kafka section."""
    return template.replace('    brokers: ["%(brokers)s"]\n',
                            '    brokers: ["%(brokers)s"]\n' + SECURITY.lstrip("\n"), 1)


async def can_produce(bootstrap: str, **settings: object) -> bool:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=5000,
                                **settings)
    try:
        await asyncio.wait_for(producer.start(), timeout=15)
        await producer.send_and_wait("security-probe", b"x")
        return True
    except (KafkaError, TimeoutError, OSError):
        return False
    finally:
        await producer.stop()


def test_tiers_through_sasl_ssl(tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path / "pki")
    server = ca.issue("broker")
    broker = KafkaBroker(tmp_path / "kafka", secure=(server.cert, server.key,
                                                     {"spanprof": PASSWORD}))
    broker.start()
    try:
        secure = f"127.0.0.1:{broker.secure_port}"
        tls = ClientTls(ca_file=str(ca.path))
        good = client_settings(tls, KafkaAuth(Sasl("spanprof", PASSWORD)))
        wrong = client_settings(tls, KafkaAuth(Sasl("spanprof", "not-the-password")))

        async def probes() -> list[bool]:
            return list(await asyncio.gather(
                can_produce(secure, **good), can_produce(secure, **wrong),
                can_produce(secure)))  # the last: plain text to the SASL_SSL listener

        names = {"brokers": secure, "group": f"g{uuid.uuid4().hex[:6]}",
                 "spans": f"s{uuid.uuid4().hex[:6]}", "profiles": f"p{uuid.uuid4().hex[:6]}",
                 "ca": ca.path, "password": PASSWORD}
        gateway = SpanprofProcess(tmp_path / "gw", config_text=secured(GATEWAY) % names)
        correlator = SpanprofProcess(tmp_path / "co", config_text=secured(CORRELATOR) % names)
        # the probes (their own topic) while both tiers start
        probed, _, _ = side_by_side(lambda: asyncio.run(probes()), gateway.start,
                                     correlator.start)
        assert probed == [True, False, False]  # good, wrong password, plain text
        keys = sdk_spans(gateway.grpc_target, "checkout", 10)
        want = {(t.hex(), s.hex()) for t, s in keys}
        wait_until(lambda: {(s["trace_id"], s["span_id"]) for s in
                            correlator.get("/api/v1/spans?limit=1000")["spans"]} == want,
                   timeout=60)
        assert side_by_side(gateway.stop, correlator.stop) == [0, 0]
        for p in (gateway, correlator):
            assert PASSWORD not in p.logs()
    finally:
        broker.stop()
