"""Kafka transport shared by the exporter and the receiver: partitioners, client settings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import msgspec
from aiokafka.partitioner import murmur2

from pipeline.config import Duration

PartitionerName = Literal["murmur2", "sarama_compat"]


def fnv1a_32(data: bytes) -> int:
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def sarama_partition(key: bytes, n: int) -> int:
    """Sarama's hash partitioner (the Collector's ``sarama_compat``): FNV-1a 32, taken as a
    signed int32, Go's truncating remainder, then made non-negative."""
    h = fnv1a_32(key)
    signed = h - (1 << 32) if h & 0x80000000 else h
    return abs(signed) % n


def murmur2_partition(key: bytes, n: int) -> int:
    """The Java client's default: ``toPositive(murmur2(key)) % n``."""
    return int(murmur2(key) & 0x7FFFFFFF) % n


def partitioner(name: PartitionerName) -> Callable[[bytes | None, Sequence[int], Sequence[int]],
                                                   int]:
    """An aiokafka ``partitioner=`` callable. Keyless messages go to any available partition."""
    import random

    fn = sarama_partition if name == "sarama_compat" else murmur2_partition

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
