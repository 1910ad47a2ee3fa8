"""A patch applied while it arrives (delta.Applying, as the tcp receiver feeds it) makes the same
bytes and checksum as one applied whole, however its bytes are cut; a damaged or short one fed so
is refused at the end like one applied whole."""

import numpy as np
import pytest
import xxhash

from weightsync.transfer import delta
from weightsync.transfer.delta import Applying, PatchError
from weightsync.transport.checksum import CHUNK


def a_patch(old: np.ndarray, new: np.ndarray) -> bytes:
    """The patch of `new` against `old` (version 7), chunk by chunk."""
    encoders, kept = delta.Encoders(), old.copy()
    parts = [delta.HEAD.pack(b"WSDP", delta.FORMAT, 2, 7, len(new), CHUNK)]
    for a in range(0, len(new), CHUNK):
        parts += encoders.encode(kept[a:a + CHUNK], new[a:a + CHUNK], 2)[0]
    return b"".join(parts)


def pair():
    g = np.random.default_rng(5)
    old = g.integers(0, 256, size=3 * CHUNK + 1000, dtype=np.uint8)
    new = old.copy()
    n = len(new) // 2
    new.view("<u2")[g.choice(n, size=n // 25, replace=False)] ^= 3
    return old, new


def fed(patch: bytes, old: np.ndarray, step: int) -> tuple[Applying, np.ndarray]:
    out = np.zeros_like(old)
    applying = Applying(old, out, 7)
    payload = bytearray(len(patch))
    for got in range(step, len(patch) + step, step):
        got = min(got, len(patch))
        payload[:got] = patch[:got]
        applying.feed(memoryview(payload), got)
    return applying, out


@pytest.mark.parametrize("step", [1000, 4096, 65537, 1 << 30])
def test_a_patch_fed_piece_by_piece_makes_the_new_bytes(step):
    old, new = pair()
    patch = a_patch(old, new)
    applying, out = fed(patch, old, step)
    assert applying.result(patch) == xxhash.xxh3_64_intdigest(new) and np.array_equal(out, new)


def test_a_damaged_patch_fed_piece_by_piece_is_refused_at_the_end():
    old, new = pair()
    patch = bytearray(a_patch(old, new))
    patch[delta.HEAD.size + delta.RECORD.size + 40] ^= 0xFF
    applying, _ = fed(bytes(patch), old, 5000)
    with pytest.raises(PatchError):
        applying.result(bytes(patch))
    short = a_patch(old, new)[:-100]
    applying, _ = fed(short, old, 5000)
    with pytest.raises(PatchError, match="claims"):
        applying.result(short)
