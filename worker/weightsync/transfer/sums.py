"""A version's bucket checksums as arrays, and the digest over them.

Every inference rank computes a digest of the version it received from its buckets' checksums
({offset: xxh3_64}), and the controller computes the same digest from what the trainers report
they sent; the two must be equal. Over slices every trainer sends to every receiver, so a round's
reports carry trainers x receivers x buckets checksums: a quarter of a million at 1,024 ranks. Read
into Python dicts of Python ints, and hashed one pair at a time, they cost the controller more CPU
each version than everything else it does. Held as one array of (offset, checksum) pairs, packed
as bytes on the wire, they are read and hashed in numpy at once (Sums, digest_of).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Iterable, Iterator, Mapping

import numpy as np

PAIR = np.dtype("<u8")  # an offset and a checksum, each a little-endian uint64, as the digest packs them


class Sums(Mapping[int, int]):
    """{offset: xxh3_64} of buckets, held as an (n, 2) array of (offset, checksum) pairs; as a
    Mapping it builds its dict only when read as one."""

    __slots__ = ("pairs", "_dict")

    def __init__(self, pairs: np.ndarray):
        self.pairs = pairs
        self._dict: dict[int, int] | None = None

    @classmethod
    def of(cls, sums: Mapping[int, int]) -> Sums:
        if isinstance(sums, Sums):
            return sums
        pairs = np.fromiter((v for kv in sums.items() for v in kv), dtype=PAIR, count=2 * len(sums))
        return cls(pairs.reshape(-1, 2))

    def to_text(self) -> str:
        """The pairs as base64 of their little-endian bytes (a JSON string)."""
        return base64.b64encode(np.ascontiguousarray(self.pairs, dtype=PAIR).tobytes()).decode()

    @classmethod
    def from_text(cls, text: str) -> Sums:
        raw = base64.b64decode(text, validate=True)
        if len(raw) % (2 * PAIR.itemsize):
            raise ValueError(f"bucket checksums of {len(raw)} bytes are not whole (offset, checksum) pairs")
        return cls(np.frombuffer(raw, dtype=PAIR).reshape(-1, 2))

    def _items(self) -> dict[int, int]:
        if self._dict is None:
            self._dict = dict(zip(self.pairs[:, 0].tolist(), self.pairs[:, 1].tolist()))
        return self._dict

    def __getitem__(self, offset: int) -> int:
        return self._items()[offset]

    def __iter__(self) -> Iterator[int]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self.pairs)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    __hash__ = None


def digest_of(parts: Iterable[Mapping[int, int]]) -> str:
    """The digest of the buckets that `parts` ({offset: xxh3_64} each, dicts or Sums) name
    together: sha256 over every (offset, checksum) pair in the order of the offsets, each packed as
    two little-endian uint64. Where two parts name one offset, the later part's checksum counts, as
    where they were merged into one dict."""
    arrays = [Sums.of(p).pairs for p in parts if len(p)]
    if not arrays:
        return hashlib.sha256().hexdigest()
    pairs = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
    pairs = pairs[np.argsort(pairs[:, 0], kind="stable")]
    last = np.ones(len(pairs), dtype=bool)
    last[:-1] = pairs[1:, 0] != pairs[:-1, 0]
    return hashlib.sha256(np.ascontiguousarray(pairs[last], dtype=PAIR).tobytes()).hexdigest()


def version_digest(checksums: Mapping[int, int]) -> str:
    """The digest of a whole version from its per-bucket checksums ({offset: xxh3_64}); the
    controller computes it from what the trainers report, every inference rank from what it
    received, and the two must be equal."""
    return digest_of([checksums])
