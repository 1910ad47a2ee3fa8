"""Bucket checksums as arrays (transfer/sums.py): the digest is the definition's, whatever form
the checksums come in, and a trainer's report carries them through the store unchanged."""

import hashlib
import random
import struct

import pytest

from weightsync.rendezvous.messages import SentReport
from weightsync.transfer.sums import Sums, digest_of, version_digest


def definition(checksums: dict[int, int]) -> str:
    """sha256 over (offset, checksum) pairs in the order of the offsets, each two little-endian uint64."""
    h = hashlib.sha256()
    for offset in sorted(checksums):
        h.update(struct.pack("<QQ", offset, checksums[offset]))
    return h.hexdigest()


def random_sums(rng: random.Random, n: int) -> dict[int, int]:
    return {rng.randrange(1 << 40): rng.randrange(1 << 64) for _ in range(n)}


def test_the_digest_is_the_definitions_for_dicts_arrays_and_parts_merged():
    rng = random.Random(7)
    for n in (0, 1, 5, 1000):
        sums = random_sums(rng, n)
        assert version_digest(sums) == definition(sums)
        assert version_digest(Sums.of(sums)) == definition(sums)
    parts = [random_sums(rng, 50) for _ in range(4)]
    parts[3][next(iter(parts[0]))] = 12345  # one offset named twice: the later part's checksum counts, as in a merged dict
    merged = {o: c for p in parts for o, c in p.items()}
    assert digest_of([parts[0], Sums.of(parts[1]), parts[2], Sums.of(parts[3])]) == definition(merged)
    assert digest_of([]) == definition({})


def test_a_report_carries_its_checksums_through_json_as_they_were():
    rng = random.Random(3)
    whole, by_receiver = random_sums(rng, 20), {r: random_sums(rng, 30) for r in range(3)}
    report = SentReport(100, 0.5, whole, by_receiver, step=4, lost={2: "gone"})
    read = SentReport.from_json(report.to_json())
    assert isinstance(read.checksums, Sums) and dict(read.checksums) == whole
    assert {r: dict(s) for r, s in read.receiver_checksums.items()} == by_receiver
    assert read == SentReport.from_json(read.to_json()) and read.lost == {2: "gone"}
    assert read.checksums[next(iter(whole))] == whole[next(iter(whole))] and len(read.checksums) == 20


def test_checksums_that_are_not_whole_pairs_are_refused():
    with pytest.raises(ValueError, match="not whole"):
        Sums.from_text(Sums.of({1: 2}).to_text()[:-4] + "AAA=")
