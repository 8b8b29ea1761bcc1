"""The partition of a trace id's message key, for one trace or for many at once.

A gateway request names tens to thousands of traces, each keyed by its id's hex (32
bytes): the partitioners of ``pipeline.kafka`` hash a key byte by byte in Python (about 3
us a key). ``Buckets.many`` hashes all of a request's keys together with numpy, one
vector step per key byte (FNV-1a) or 4-byte block (murmur2), the same numbers as the
scalar functions (tests/pipeline/test_kafka_buckets.py holds them to it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.kafka import PARTITIONERS, PartitionerName

_FNV_OFFSET, _FNV_PRIME = np.uint32(0x811C9DC5), np.uint32(0x01000193)
_MURMUR_M, _MURMUR_SEED = np.uint32(0x5BD1E995), 0x9747B28C
# below this many keys the scalar hash is as fast as numpy's fixed cost per call
_VECTOR_FROM = 8


def fnv1a_32_many(keys: np.ndarray) -> np.ndarray:
    """FNV-1a 32 of each row of ``keys`` (uint8, one key per row, all of one length)."""
    h = np.full(keys.shape[0], _FNV_OFFSET, dtype=np.uint32)
    for j in range(keys.shape[1]):
        h ^= keys[:, j]
        h *= _FNV_PRIME  # uint32: wraps as the scalar & 0xFFFFFFFF does
    return h


def murmur2_many(keys: np.ndarray) -> np.ndarray:
    """The Java client's murmur2 of each row of ``keys`` (uint8 rows of one length, a
    multiple of 4: whole blocks, no tail)."""
    n = keys.shape[1]
    blocks = np.ascontiguousarray(keys).view("<u4").astype(np.uint32)
    h = np.full(keys.shape[0], np.uint32((_MURMUR_SEED ^ n) & 0xFFFFFFFF), dtype=np.uint32)
    for j in range(blocks.shape[1]):
        k = blocks[:, j] * _MURMUR_M
        k ^= k >> np.uint32(24)
        k *= _MURMUR_M
        h *= _MURMUR_M
        h ^= k
    h ^= h >> np.uint32(13)
    h *= _MURMUR_M
    h ^= h >> np.uint32(15)
    return h


class Buckets:
    """``partitioner``'s partition (of ``partitions``) for a trace id's hex key: called
    with one hex key, or ``many`` raw trace ids at once."""

    __slots__ = ("name", "partitions", "_one")

    def __init__(self, name: PartitionerName, partitions: int) -> None:
        self.name, self.partitions = name, partitions
        self._one = PARTITIONERS[name]

    def __call__(self, trace_hex: str) -> int:
        return int(self._one(trace_hex.encode(), self.partitions))

    def many(self, trace_ids: Sequence[bytes]) -> list[int]:
        """The partition of each id's hex key, in order; ids of any length (those not 16
        bytes long, rare, are hashed one by one)."""
        if len(trace_ids) < _VECTOR_FROM or any(len(t) != 16 for t in trace_ids):
            return [self(t.hex()) for t in trace_ids]
        hexes = b"".join(trace_ids).hex().encode()
        keys = np.frombuffer(hexes, dtype=np.uint8).reshape(len(trace_ids), 32)
        n = np.int64(self.partitions)
        if self.name == "murmur2":
            h = murmur2_many(keys)
            out: list[int] = ((h & np.uint32(0x7FFFFFFF)).astype(np.int64) % n).tolist()
            return out
        # sarama_compat: the hash as int32, Go's truncating remainder made non-negative
        signed = fnv1a_32_many(keys).view(np.int32).astype(np.int64)
        out = (np.abs(signed) % n).tolist()
        return out
