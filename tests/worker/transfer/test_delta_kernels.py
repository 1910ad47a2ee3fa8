"""The native loops of delta versions (transfer/_delta.c) make exactly the entries numpy makes,
and read them back the same: every element size, long unchanged runs (fillers), entries that do
not fit the scratch, and an entry beyond the chunk's end."""

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
