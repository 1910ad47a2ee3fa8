"""The native loops of delta versions (transfer/_delta.c) make exactly the entries numpy makes,
and read them back the same, into a copy of the base or in place: every element size, long
unchanged runs (fillers), entries that do not fit the scratch, and an entry beyond the chunk's
end."""

import numpy as np
import pytest

from weightsync.transfer import delta_kernels as kernels

pytestmark = pytest.mark.skipif(kernels.native is None, reason="transfer/_delta.c was not built")


def both(fn, *args):
    """fn(*args) natively and with numpy, each on its own copies of the arrays."""
    out = []
    for native in (kernels.native, None):
        copies = [a.copy() if isinstance(a, np.ndarray) else bytearray(a) if isinstance(a, bytearray) else a
                  for a in args]
        saved, kernels.native = kernels.native, native
        try:
            out.append((fn(*copies), copies))
        finally:
            kernels.native = saved
    return out


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("share", [0.0, 0.001, 0.05, 0.9])
def test_native_diff_and_patch_are_numpys(itemsize, share):
    g = np.random.default_rng(itemsize)
    length = (1 << 20) + 8 * 3 + itemsize  # a tail shorter than a word
    kept = g.integers(0, 256, size=length, dtype=np.uint8)
    new = kept.copy()
    n = length // itemsize
    where = np.flatnonzero(g.random(n) < share)
    new.view(kernels.ELEMENT[itemsize])[where] ^= g.integers(1, 255, size=len(where)).astype(kernels.ELEMENT[itemsize])
    scratch = bytearray(kernels.scratch_bytes(length, itemsize))
    (native, (kept_n, _, _, scratch_n)), (numpy, (kept_p, _, _, scratch_p)) = both(kernels.diff, kept, new, itemsize,
                                                                                   scratch)
    assert native == numpy and native[1] == len(where)
    assert np.array_equal(kept_n, new) and np.array_equal(kept_p, new)
    entries = native[0]
    if entries < 0:
        return
    size = entries * (2 + itemsize)
    assert scratch_n[:size] == scratch_p[:size]
    raw = bytes(scratch_n[:size])
    for ok, (_, out, _, _, _) in both(kernels.patch, kept, np.zeros_like(kept), raw, entries, itemsize):
        assert ok and np.array_equal(out, new)
    for ok, (_, out, _, _, _) in both(kernels.patch, None, kept, raw, entries, itemsize):  # in place
        assert ok and np.array_equal(out, new)


def test_fillers_where_a_gap_is_longer_than_a_u16():
    kept = np.zeros(1 << 20, dtype=np.uint8)
    new = kept.copy()
    new.view("<u2")[[0, 200_000, (1 << 19) - 1]] = 1
    scratch = bytearray(kernels.scratch_bytes(len(new), 2))
    (native, (_, _, _, raw_n)), (numpy, (_, _, _, raw_p)) = both(kernels.diff, kept, new, 2, scratch)
    assert native == numpy == (3 + 3 + 4, 3)  # 200_000 needs 3 fillers, the last one 4 more
    assert raw_n[:40] == raw_p[:40]


def test_an_entry_beyond_the_end_is_refused():
    base = np.zeros(64, dtype=np.uint8)
    raw = np.array([40, 0], dtype="<u2").tobytes()  # element 39 of 32
    for ok, _ in both(kernels.patch, base, np.zeros_like(base), raw, 1, 2):
        assert ok is False
    for ok, _ in both(kernels.patch, None, base, raw, 1, 2):
        assert ok is False


@pytest.mark.parametrize("bad", [0, 5, 15, 16, 39])
def test_an_entry_beyond_the_end_is_refused_among_many(bad):
    """An entry out of range anywhere among many is refused, and a first gap of 0 (element -1)
    too; in range, every one is applied."""
    base = np.zeros(256, dtype=np.uint8)  # 128 elements
    gaps = np.ones(40, dtype="<u2")
    gaps[bad] = 0 if bad == 0 else 200
    values = np.full(40, 0x0101, dtype="<u2")
    raw = (gaps.view(np.uint8).reshape(40, 2).T.tobytes() + values.view(np.uint8).reshape(40, 2).T.tobytes())
    for ok, _ in both(kernels.patch, base, np.zeros_like(base), raw, 40, 2):
        assert ok is False
    gaps[bad] = 1  # all in range: element 39 is the last
    raw = (gaps.view(np.uint8).reshape(40, 2).T.tobytes() + values.view(np.uint8).reshape(40, 2).T.tobytes())
    for ok, (_, out, _, _, _) in both(kernels.patch, base, np.zeros_like(base), raw, 40, 2):
        assert ok and np.array_equal(out.view("<u2")[:40], values) and not out[80:].any()


@pytest.mark.parametrize("where", ["every element", "one block full, then a long run", "first of blocks"])
def test_two_byte_entries_in_whole_blocks_are_numpys(where):
    """The 2-byte diff packs a 64-byte block's entries at once: full blocks, blocks after a run
    longer than a gap may be (fillers first), and entries that stop fitting the scratch midway."""
    n = 1 << 19  # elements: 1 MiB
    kept = np.zeros(2 * n, dtype=np.uint8)
    new = kept.copy()
    elements = new.view("<u2")
    if where == "every element":
        elements[:] = np.arange(n, dtype=np.uint32).astype("<u2") | 1
    elif where == "one block full, then a long run":
        elements[64:96] = 7
        elements[96 + 70_000:96 + 70_000 + 32] = 0x8001
        elements[-32:] = 3
    else:
        elements[::32] = 0xFFFF
    for scratch_bytes in (kernels.scratch_bytes(len(new), 2), 4 * 1000 + 2):
        scratch = bytearray(scratch_bytes)
        (native, (kept_n, _, _, raw_n)), (numpy, (kept_p, _, _, raw_p)) = both(kernels.diff, kept, new, 2, scratch)
        assert native == numpy and np.array_equal(kept_n, new) and np.array_equal(kept_p, new)
        if native[0] >= 0:
            assert raw_n[:native[0] * 4] == raw_p[:native[0] * 4]
            for ok, (_, out, _, _, _) in both(kernels.patch, kept, np.zeros_like(kept), bytes(raw_n[:native[0] * 4]),
                                              native[0], 2):
                assert ok and np.array_equal(out, new)
