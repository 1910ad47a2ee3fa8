"""A receiver whose staging buffer holds the version before its base patches staging in place
(transfer/held.py): the new bytes are the same, the base is read only where the last version's
chunk came whole, staging written between versions makes the patch fail verification (it is
refused, and the base is untouched), and the last version's entries are used only where the
buffers and versions are the ones they were applied to."""

import numpy as np
import pytest
import torch
import xxhash

from weightsync.transfer import delta
from weightsync.transfer.delta import Patcher
from weightsync.transfer.held import Trail
from weightsync.transport.checksum import CHUNK

LENGTH = 3 * CHUNK + 4096  # three whole chunks and a short one


def a_patch(old: np.ndarray, new: np.ndarray, base_version: int) -> bytes:
    encoders, kept = delta.Encoders(), old.copy()
    parts = [delta.HEAD.pack(b"WSDP", delta.FORMAT, 2, base_version, len(new), CHUNK)]
    for a in range(0, len(new), CHUNK):
        parts += encoders.encode(kept[a:a + CHUNK], new[a:a + CHUNK], 2)[0]
    return b"".join(parts)


def kinds(patch: bytes) -> list[int]:
    out, at = [], delta.HEAD.size
    while at < len(patch):
        kind, _, stored = delta.RECORD.unpack_from(patch, at)
        out.append(kind)
        at += delta.RECORD.size + stored
    return out


def changed(old: np.ndarray, chunks: dict[int, float], seed: int) -> np.ndarray:
    """`old` with the share chunks[c] of chunk c's 2-byte elements changed."""
    g, new = np.random.default_rng(seed), old.copy()
    for c, share in chunks.items():
        elements = new[c * CHUNK:(c + 1) * CHUNK].view("<u2")
        where = g.choice(len(elements), size=max(1, int(len(elements) * share)), replace=False)
        elements[where] ^= g.integers(1, 255, size=len(where)).astype("<u2")
    return new


def three_versions():
    """Versions 1, 2, 3 of one range. 1 -> 2: chunk 0 sparse, 1 the same, 2 dense (RAW), 3 sparse
    with entries of more than a quarter of its bytes (not kept); 2 -> 3: chunks 0, 1, 2 sparse, 3
    the same."""
    v1 = np.random.default_rng(0).integers(0, 256, size=LENGTH, dtype=np.uint8)
    v2 = changed(v1, {0: 0.03, 2: 0.95, 3: 0.2}, 1)
    v3 = changed(v2, {0: 0.04, 1: 0.02, 2: 0.03}, 2)
    return v1, v2, v3


def receive(trail: Trail, version: int, staging: torch.Tensor, base: tuple, patch: bytes, want: np.ndarray) -> Patcher:
    patcher = Patcher(base[0], base[1], staging, redo=trail.redo(staging, base))
    if patcher.apply(0, LENGTH, memoryview(patch), xxhash.xxh3_64_intdigest(want)):
        trail.keep(version, staging, base, patcher.entries)
    return patcher


def version_two():
    """Version 2 received into b against version 1 in a: (trail, a, b, the versions)."""
    v1, v2, v3 = three_versions()
    a, b, trail = torch.from_numpy(v1.copy()), torch.zeros(LENGTH, dtype=torch.uint8), Trail()
    patch = a_patch(v1, v2, 1)
    assert kinds(patch) == [delta.SPARSE, delta.SAME, delta.RAW, delta.SPARSE]
    patcher = receive(trail, 2, b, (1, a), patch, v2)
    assert not patcher.refused and np.array_equal(b.numpy(), v2)
    kept = ["entries" if e else "same" if e == b"" else "copy" for e in patcher.entries[0].entries]
    assert kept == ["entries", "same", "copy", "copy"]
    return trail, a, b, (v1, v2, v3)


def test_staging_that_holds_the_version_before_the_base_is_patched_in_place():
    trail, a, b, (v1, v2, v3) = version_two()
    assert trail.redo(a, (2, b)), "a holds version 1, the base's version before it"
    trail, a, b, _ = version_two()
    # the base is read only for chunks 2 and 3 (the one came whole in version 2, the other's
    # entries were not kept): with the rest of it spoiled, version 3 still arrives bit for bit,
    # so a was patched in place
    b[:2 * CHUNK] = 0
    patcher = receive(trail, 3, a, (2, b), a_patch(v2, v3, 2), v3)
    assert not patcher.refused and np.array_equal(a.numpy(), v3)
    assert [None if e is None else len(e) > 0 for e in patcher.entries[0].entries] == [True, True, True, False]
    assert trail.redo(b, (3, a)), "version 3's entries are kept for version 4"


def test_staging_written_between_versions_is_refused_and_the_base_untouched():
    trail, a, b, (v1, v2, v3) = version_two()
    a[12345] ^= 0x10  # staging no longer holds version 1
    served = b.clone()
    patcher = receive(trail, 3, a, (2, b), a_patch(v2, v3, 2), v3)
    assert patcher.applied == 0 and patcher.entries == {} and "staging buffer" in patcher.refused[0]
    assert torch.equal(b, served), "the base, which the model may run on, is never written"
    assert trail.redo(b, (3, a)) == {}, "a version refused leaves no entries"


@pytest.mark.parametrize("case", ["staging is the base's own buffer", "another base version", "another base buffer",
                                  "the entries used once already"])
def test_the_last_versions_entries_only_where_the_buffers_and_versions_are_theirs(case):
    trail, a, b, (v1, v2, v3) = version_two()
    other = torch.from_numpy(v2.copy())
    if case == "the entries used once already":
        trail.redo(a, (2, b))  # a version that then failed: keep() never came
    staging, base = {"staging is the base's own buffer": (b, (2, a)), "another base version": (a, (5, b)),
                     "another base buffer": (a, (2, other))}.get(case, (a, (2, b)))
    assert trail.redo(staging, base) == {}
    # without them the base is copied: version 3 arrives as before
    patcher = receive(Trail(), 3, a, (2, b), a_patch(v2, v3, 2), v3)
    assert not patcher.refused and np.array_equal(a.numpy(), v3)
