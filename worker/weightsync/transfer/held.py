"""What a receiver's staging buffer holds between delta versions, so that the next patch is
applied to it in place instead of to a copy of the base.

A receiver of delta versions has two buffers that trade places after every load (the engines'
staging and base): version v lands in one, patched against v - 1 in the other, which the model may
run on and is only read. When v + 1 comes, its staging buffer is the one that held v - 1, and
still does. Copying the base into it before patching each chunk was the largest part of a
receiver's CPU (docs/benchmarks.md, "Where a delta's time goes"): the base read, staging read and
written back. Instead the receiver keeps the entries it applied for v (each chunk's decompressed
byte planes, 2 + element size bytes per changed element) and XORs them into staging, which
makes it v, the base, then applies v + 1's entries on top: staging is read and written once, the
base not at all. A chunk that came whole (RAW), and a range that did, is copied from the base.

Nothing rests on this being right: the new bytes of every bucket are hashed and checked against
the sender's checksum as before, so a staging buffer that held anything else (written between
versions) fails that check and its buckets come whole. Only a version received to the end leaves
its entries, and the next one uses them only where its staging buffer is that version's base and
its base is that version in that version's staging buffer: after a version that failed, was not
loaded or came whole, the next one copies the base.
"""

from __future__ import annotations

from dataclasses import dataclass

# A chunk's entries are kept where they take at most this share of its bytes (else the next
# version copies that chunk from the base), so that they never take more than this share of a
# version in a receiver's memory (local/memory.py counts it); bfloat16 keeps up to 12.5% changed.
KEPT_SHARE = 0.25


@dataclass(frozen=True)
class Applied:
    """The entries a range's patch applied: (chunk bytes, element size, each chunk's entries as
    byte planes, b"" where the chunk was the same, None where it came whole)."""

    chunk: int
    itemsize: int
    entries: list


class Trail:
    """The entries of the last version a VersionReceiver received to the end, and where: kept
    from one version to the next."""

    def __init__(self):
        self.last: tuple | None = None  # (version, its buffer's address, its base's address, {offset: Applied})

    def redo(self, staging, base) -> dict:
        """{range offset: Applied} that turns `staging` into the base's bytes, for a version
        received into `staging` against `base` ((version, buffer) or None): the last version's,
        where it was the base's version, received into the base's buffer against this staging
        buffer; else {}. The last version's are forgotten either way: until keep(), staging is
        being written."""
        last, self.last = self.last, None
        if last is None or base is None:
            return {}
        version, into, against, applied = last
        if base[0] != version or base[1].data_ptr() != into or staging.data_ptr() != against:
            return {}
        return applied

    def keep(self, version: int, staging, base, applied: dict) -> None:
        """`version` is in `staging`, received to the end against `base` ((version, buffer) or
        None), its patched ranges' entries in `applied`."""
        if base is not None and applied:
            self.last = (version, staging.data_ptr(), base[1].data_ptr(), applied)
