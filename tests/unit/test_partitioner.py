"""kvgate's partitioner puts a key where Kafka's default partitioner does: checked against
aiokafka's murmur2 (a port of the Java client's) and its ``DefaultPartitioner``."""

from __future__ import annotations

import random

from aiokafka.partitioner import DefaultPartitioner
from aiokafka.partitioner import murmur2 as aiokafka_murmur2

from streams.partitioner import murmur2, partition_of


def test_murmur2_matches_aiokafkas_for_every_length_and_tail() -> None:
    rng = random.Random(3)
    for length in range(0, 300):  # past the unpacked word table too
        for _ in range(10):
            data = bytes(rng.getrandbits(8) for _ in range(length))
            assert murmur2(data) == aiokafka_murmur2(data), length


def test_partition_of_matches_the_default_partitioner() -> None:
    rng = random.Random(4)
    partitioner = DefaultPartitioner()
    for n in (1, 2, 3, 4, 12, 64):
        parts = list(range(n))
        for _ in range(200):
            key = f"req-{rng.getrandbits(64):x}".encode()
            assert partition_of(key, n) == partitioner(key, parts, parts)


def test_a_key_seen_again_lands_where_the_default_partitioner_puts_it() -> None:
    """The hashes of recent keys are remembered: the same key asked for with other partition
    counts, and after the memory was emptied, still lands where Kafka's partitioner puts it."""
    partitioner = DefaultPartitioner()
    keys = [f"pool-{i}".encode() for i in range(5000)]  # more than the memory holds
    for _ in range(2):
        for key in keys:
            for n in (3, 4, 7):
                parts = list(range(n))
                assert partition_of(key, n) == partitioner(key, parts, parts)
