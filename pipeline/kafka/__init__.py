"""Kafka transport shared by the exporter and the receiver: partitioners, client settings.

The join needs every span and sample of a trace on the same partition number of both topics,
whoever wrote them. The OpenTelemetry Collector's Kafka exporter (contrib; now on franz-go,
v0.165.1 read) defaults to ``record_partitioner: {sticky_key: {hasher: sarama_compat}}``:
franz-go's ``StickyKeyPartitioner(SaramaCompatHasher(fnv32a))`` (``kafkaexporter/factory.go``,
``partitioner.go``, ``internal/kafka/franz_client.go``, franz-go ``pkg/kgo/partitioner.go``),
which reproduces the partitions of Sarama's default hash partitioner that its Sarama-based
releases used: FNV-1a 32 of the key taken as int32, Go's truncating remainder, negated if
negative. ``sarama_compat`` is that, and spanprof's default; ``murmur2`` (the Java client's
default, the Collector's ``hasher: murmur2``) is the alternative. The Collector keys a trace
message by the trace id's lowercase hex only with ``partition_traces_by_id: true``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

from pipeline.config import Duration
from pipeline.config.tls import ClientTls
from pipeline.kafka.security import KafkaAuth, client_settings

PartitionerName = Literal["sarama_compat", "murmur2"]

# the record header naming whose spans or samples a message holds (issue #17): written by
# the exporter on every message, read by the receiver; a message without it (another
# producer's, or one written before tenants) is the default tenant's
TENANT_HEADER = "tenant"


_M32 = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """MurmurHash2 as the Java client computes it (seed 0x9747b28c), unsigned 32-bit;
    4-byte blocks read at once (a trace id's hex key is 8 blocks, no tail)."""
    m = 0x5BD1E995
    n = len(data)
    h = (0x9747B28C ^ n) & _M32
    blocks = n >> 2
    for k in struct.unpack_from(f"<{blocks}I", data):
        k = (k * m) & _M32
        k ^= k >> 24
        h = ((h * m) & _M32) ^ ((k * m) & _M32)
    tail = n & 3
    if tail:
        at = blocks << 2
        if tail == 3:
            h ^= data[at + 2] << 16
        if tail >= 2:
            h ^= data[at + 1] << 8
        h ^= data[at]
        h = (h * m) & _M32
    h ^= h >> 13
    h = (h * m) & _M32
    h ^= h >> 15
    return h


def fnv1a_32(data: bytes) -> int:
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def sarama_partition(key: bytes, n: int) -> int:
    """Sarama's hash partitioner, the Collector's default (``sticky_key`` with the
    ``sarama_compat`` hasher): FNV-1a 32, taken as a signed int32, Go's truncating
    remainder, then made non-negative (``-(h % n)`` in Go is ``abs(h) % n``)."""
    h = fnv1a_32(key)
    signed = h - (1 << 32) if h & 0x80000000 else h
    return abs(signed) % n


def murmur2_partition(key: bytes, n: int) -> int:
    """The Java client's default: ``toPositive(murmur2(key)) % n`` (franz-go's
    ``KafkaHasher(murmur2)``, the Collector's ``hasher: murmur2``)."""
    return int(murmur2(key) & 0x7FFFFFFF) % n


# name -> (key, partition count) -> partition; the first is the default
PARTITIONERS: dict[PartitionerName, Callable[[bytes, int], int]] = {
    "sarama_compat": sarama_partition,
    "murmur2": murmur2_partition,
}


def partitioner(name: PartitionerName) -> Callable[[bytes | None, Sequence[int], Sequence[int]],
                                                   int]:
    """An aiokafka ``partitioner=`` callable. Keyless messages go to any available partition."""
    import random

    fn = PARTITIONERS[name]

    def choose(key: bytes | None, all_partitions: Sequence[int],
               available: Sequence[int]) -> int:
        if key is None:
            return random.choice(list(available) or list(all_partitions))
        return all_partitions[fn(key, len(all_partitions))]

    return choose


class TopicConfig(msgspec.Struct, forbid_unknown_fields=True):
    topic: str
    encoding: Literal["otlp_proto"] = "otlp_proto"


class ClientConfig(msgspec.Struct, forbid_unknown_fields=True):
    brokers: list[str] = msgspec.field(default_factory=lambda: ["127.0.0.1:9092"])
    client_id: str = "spanprof"
    traces: TopicConfig = msgspec.field(default_factory=lambda: TopicConfig("otlp_spans"))
    profiles: TopicConfig = msgspec.field(default_factory=lambda: TopicConfig("otlp_profiles"))
    timeout: Duration = Duration(10.0)
    tls: ClientTls | None = None      # pipeline/kafka/security.py
    auth: KafkaAuth | None = None    # SASL

    def validate_security(self) -> None:
        if self.tls is not None:
            self.tls.validate("tls")
        if self.auth is not None and self.auth.sasl is not None:
            self.auth.sasl.validate("auth.sasl")

    def security(self) -> dict[str, Any]:
        """aiokafka's keyword arguments for ``tls`` and ``auth``."""
        return client_settings(self.tls, self.auth)
