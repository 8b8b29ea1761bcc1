"""pipeline/kafka/buckets.py: the vectorised partitioners give the scalar ones' partitions
(``pipeline.kafka``: Sarama's FNV-1a and the Java client's murmur2, themselves held to
published values in test_kafka.py), for every id, in order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.kafka import PARTITIONERS, fnv1a_32, murmur2
from pipeline.kafka.buckets import Buckets, fnv1a_32_many, murmur2_many


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.binary(min_size=16, max_size=16), max_size=300),
       name=st.sampled_from(sorted(PARTITIONERS)), partitions=st.integers(1, 1000))
def test_many_is_one_by_one(ids: list[bytes], name: str, partitions: int) -> None:
    b = Buckets(name, partitions)  # type: ignore[arg-type]
    want = [PARTITIONERS[name](t.hex().encode(), partitions) for t in ids]  # type: ignore[index]
    assert b.many(ids) == want
    assert [b(t.hex()) for t in ids] == want


@given(ids=st.lists(st.binary(max_size=20), max_size=20))
def test_ids_of_other_lengths_are_hashed_one_by_one(ids: list[bytes]) -> None:
    b = Buckets("sarama_compat", 7)
    assert b.many(ids) == [b(t.hex()) for t in ids]


def test_the_hashes_themselves() -> None:
    """Keys whose hashes have the top bit set (negative as int32: Sarama's abs) among
    them, and the raw hashes equal to the scalar ones."""
    keys = [bytes(range(i, i + 32)) for i in range(0, 200, 3)]
    arr = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 32)
    assert fnv1a_32_many(arr).tolist() == [fnv1a_32(k) for k in keys]
    assert murmur2_many(arr).tolist() == [murmur2(k) for k in keys]
    assert any(fnv1a_32(k) & 0x80000000 for k in keys)
