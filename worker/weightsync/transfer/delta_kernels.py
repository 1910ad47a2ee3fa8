"""The two inner loops of delta versions (delta.py defines the patch they make and read).

diff() compares a chunk of new bytes with the kept ones, writes the chunk's entries (u16 gaps and
XOR values, as byte planes) and makes the kept bytes the new ones; patch() makes a chunk's new
bytes of the base and its entries. Both run in one pass in C (_delta.c, built with the package, without the
GIL) where it was built, and in numpy otherwise: numpy needs a dozen passes and temporary arrays
for either, about 4x the time (docs/benchmarks.md, "Where a delta's time goes").
"""

from __future__ import annotations

import numpy as np

try:
    from weightsync.transfer import _delta as native
except ImportError:  # not built (no C compiler where the package was installed): numpy does it
    native = None

MAX_GAP = 0xFFFF
GAP = np.dtype("<u2")
ELEMENT = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def elements(itemsize: int) -> np.dtype:
    try:
        return ELEMENT[itemsize]
    except KeyError:
        raise ValueError(f"no delta encoding for {itemsize}-byte elements") from None


def scratch_bytes(length: int, itemsize: int) -> int:
    """Bytes diff() needs for the entries of a `length`-byte chunk whose patch is smaller than
    the chunk: fewer changed elements than fit in it, and the fillers of its longest gaps."""
    return ((length - 1) // (GAP.itemsize + itemsize) + length // itemsize // MAX_GAP + 1) * (GAP.itemsize + itemsize)


def diff(kept: np.ndarray, new: np.ndarray, itemsize: int, scratch) -> tuple[int, int]:
    """(entries, changed elements) of the chunk `new` against `kept` (uint8 arrays of one length,
    whole elements), the entries in scratch[:entries * (2 + itemsize)]: the u16 gap of each from
    the one before (the first from -1; a filler entry of value 0 wherever a gap would exceed
    MAX_GAP) and its XOR value, as byte planes: byte 0 of every gap, byte 1 of every gap, then
    byte k of every value for k = 0 .. itemsize - 1 (the high planes are nearly all zeros, which
    zstd compresses to almost nothing, and fast). entries is -1 where they do not fit `scratch`.
    `kept` holds the new bytes afterwards."""
    if native is not None:
        return native.diff(kept, new, itemsize, scratch)
    dt = elements(itemsize)
    kv, nv = kept.view(dt), new.view(dt)
    idx = np.flatnonzero(np.not_equal(kv, nv))
    changed = len(idx)
    gaps = np.diff(idx, prepend=-1)
    if changed and gaps.max() > MAX_GAP:
        idx = _with_fillers(idx, len(kv))
        gaps = np.diff(idx, prepend=-1)
    size = len(idx) * (GAP.itemsize + itemsize)
    fits = size <= len(scratch)
    if fits:
        out = np.frombuffer(scratch, dtype=np.uint8, count=size).reshape(GAP.itemsize + itemsize, len(idx))
        out[:GAP.itemsize] = gaps.astype(GAP).view(np.uint8).reshape(len(idx), GAP.itemsize).T
        values = np.bitwise_xor(kv[idx], nv[idx])
        out[GAP.itemsize:] = values.view(np.uint8).reshape(len(idx), itemsize).T
    np.copyto(kept, new)
    return (len(idx) if fits else -1), changed


def _with_fillers(idx: np.ndarray, n: int) -> np.ndarray:
    """`idx` (sorted element indices) with a filler index MAX_GAP after the one before wherever
    the gap is longer, as the native loop makes them."""
    out, last = [], -1
    for i in idx.tolist():
        while i - last > MAX_GAP:
            last += MAX_GAP
            out.append(last)
        out.append(i)
        last = i
    return np.array(out, dtype=np.int64)


def patch(base: np.ndarray | None, out: np.ndarray, raw, entries: int, itemsize: int) -> bool:
    """out = base (uint8 arrays of one length, whole elements) with the `entries` in `raw` (byte
    planes, as diff() writes them) applied; with base None, the entries applied to `out` in place.
    False where one names an element beyond the end."""
    if native is not None:
        return native.patch(base, out, raw, entries, itemsize)
    dt = elements(itemsize)
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(GAP.itemsize + itemsize, entries)
    gaps = np.ascontiguousarray(planes[:GAP.itemsize].T).view(GAP).ravel()
    idx = np.cumsum(gaps, dtype=np.int64) - 1
    if entries and (idx[-1] >= len(out) // itemsize or idx[0] < 0):
        return False
    if base is not None:
        np.copyto(out, base)
    out.view(dt)[idx] ^= np.ascontiguousarray(planes[GAP.itemsize:].T).view(dt).ravel()
    return True
