"""ws64 (ws64.py) on a GPU in fused Triton kernels, each byte read once, on the current stream.

The definition's torch form runs a dozen elementwise kernels over the words and one reduction,
each reading and writing the whole range. Here each program reads its block once, makes the
little-endian words in registers, mixes each with its position and sums the block; the per-block
sums are added and finalized (ws64.finish). Addition mod 2^64 is the same in any order, so the
value is the definition's.

- ws64_fused: a whole range. Where its start is 8-byte aligned its words are loaded as 64-bit
  words (word_sums; two at a time where it is 16-byte aligned), the last under 128 bytes byte by
  byte; elsewhere every word is made of byte loads (byte_sums), which take any start address.
- bucket_ws64: a trainer's bucket, filled and hashed in one pass. A bucket packs its pieces
  (runs of tensors) at any byte offset, so a piece's words straddle its neighbours'. Each piece
  is one launch at its byte offset in the bucket: a float32 piece is cast to bfloat16 by the
  kernel (cast_sums), which writes the bytes and adds the words' terms while the values are in
  registers; any other piece, already written, is read back (byte_sums). A word shared by pieces
  is the share of the last piece on it, which folds in the bytes before its own (written earlier
  on the same stream) and takes those after its end as zero, as the bytes between pieces are;
  words no piece touches are zero and their terms are added on the host.

Triton compiles the kernels for the GPU a tensor is on; on CPU tensors they run in Triton's
interpreter (in a process where TRITON_INTERPRET=1 was set before Triton's first import), which
is how the tests check them where no GPU is. Triton is imported at the first kernel asked for.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

from weightsync.transport.ws64 import GOLDEN, MIX, finish, signed64, word_terms

BLOCK_WORDS = 2048  # words a program reads (16 KiB)
CAST_WORDS = 1024  # words a casting program writes (4 Ki elements)
CONSTANTS = {"golden": GOLDEN, "mix0": MIX[0], "mix1": MIX[1]}


@functools.cache
def kernels() -> dict[str, Any]:
    """The kernels by name, made at the first use (Triton loads with them)."""
    from weightsync.transport import ws64_triton

    return {"byte_sums": ws64_triton.byte_sums, "word_sums": ws64_triton.word_sums, "cast_sums": ws64_triton.cast_sums}


def _blocks(words: int, per: int) -> int:
    return -(-words // per)


def ws64_fused(data):
    """ws64 of a tensor's bytes as a 0-dim int64 tensor on its device (as ws64.definition), in one
    read of them on the current stream: whole words loaded as words where the start is 8-byte
    aligned, else bytes."""
    import torch

    raw = data.detach().reshape(-1).view(torch.uint8)
    n = raw.numel()
    # whole words in runs of 16 (Triton then knows the bound divides by 16 and loads two words at
    # once where the start is 16-byte aligned); the last few words and the partial one by bytes
    whole = n // 128 * 16 if raw.data_ptr() % 8 == 0 else 0
    word_blocks = _blocks(whole, BLOCK_WORDS)
    byte_blocks = _blocks(-(-n // 8) - whole, BLOCK_WORDS)
    sums = torch.empty(max(word_blocks + byte_blocks, 1), dtype=torch.int64, device=raw.device)
    if word_blocks:
        kernels()["word_sums"][(word_blocks,)](raw[:whole * 8].view(torch.int64), sums, whole,
                                               block_words=BLOCK_WORDS, **CONSTANTS)
    if byte_blocks:
        kernels()["byte_sums"][(byte_blocks,)](raw, sums[word_blocks:], whole, -(-n // 8), n,
                                               block_words=BLOCK_WORDS, **CONSTANTS)
    if not word_blocks + byte_blocks:
        sums.zero_()
    return finish(sums.sum(), n)


@dataclass(frozen=True)
class Piece:
    """Bytes [at, at + nbytes) of a bucket: `source`, float32 elements (contiguous, on the
    bucket's device) that the kernel casts to bfloat16 there (nbytes = 2 per element); or None,
    bytes the caller wrote there already."""

    at: int
    nbytes: int
    source: Any = None


def castable(bucket, at: int, source) -> bool:
    """Whether cast_sums can cast `source` into the bucket at byte `at`: float32 to 16-bit lanes,
    which start at even addresses."""
    import torch

    return (source.dtype == torch.float32 and source.is_contiguous() and source.device == bucket.device
            and at % 2 == 0 and bucket.data_ptr() % 2 == 0)


def bucket_ws64(bucket, pieces: Sequence[Piece]):
    """ws64 of the uint8 tensor `bucket` as a 0-dim int64 tensor on its device, with its float32
    pieces cast into it on the way (each launch on the current stream, in the pieces' order).
    `pieces` are in order and do not overlap; the bytes between them (and after the last) must
    be zero already."""
    import torch

    n = bucket.numel()
    spans = [(p.at, p.at + p.nbytes, p.source) for p in pieces if p.nbytes]
    if any(a < 0 or b > n for a, b, _ in spans) or any(x[1] > y[0] for x, y in zip(spans, spans[1:])):
        raise ValueError(f"the pieces do not lie in order inside the {n}-byte bucket")
    launches, touched, blocks = [], [], 0
    for k, (a, b, source) in enumerate(spans):
        first, end = a // 8, -(-b // 8)
        touched.append((first, end))
        # the last word belongs to the next piece where that piece starts inside it
        owned_end = end - 1 if k + 1 < len(spans) and spans[k + 1][0] < 8 * end else end
        if source is not None:
            if not castable(bucket, a, source) or b - a != 2 * source.numel():
                raise ValueError(f"the piece at byte {a} is no float32 run the kernel can cast there")
            count = _blocks(end - first, CAST_WORDS)
        else:
            count = _blocks(max(owned_end - first, 0), BLOCK_WORDS)
        launches.append((a, b, source, first, max(owned_end, first), end, blocks, count))
        blocks += count
    sums = torch.zeros(max(blocks, 1), dtype=torch.int64, device=bucket.device)
    halves = bucket[:n - n % 2].view(torch.int16) if bucket.data_ptr() % 2 == 0 else None
    for a, b, source, first, owned_end, end, at, count in launches:
        if not count:
            continue
        if source is not None:
            kernels()["cast_sums"][(count,)](source.view(torch.int32), halves, sums[at:], a, b, first, first,
                                             owned_end, block_words=CAST_WORDS, **CONSTANTS)
        else:
            limit = b if owned_end == end else 8 * owned_end
            kernels()["byte_sums"][(count,)](bucket, sums[at:], first, owned_end, limit,
                                             block_words=BLOCK_WORDS, **CONSTANTS)
    total = sums.sum()
    zero = [w for first, end in _untouched(touched, -(-n // 8)) for w in range(first, end)]
    if zero:  # words of zeros alone (padding): their terms, at once on the host
        total += signed64(int(word_terms(torch.zeros(len(zero), dtype=torch.int64), torch.tensor(zero)).sum()))
    return finish(total, n)


def _untouched(touched: list[tuple[int, int]], words: int) -> list[tuple[int, int]]:
    """The runs of words [0, words) that none of the (sorted) runs `touched` overlaps."""
    out, pos = [], 0
    for first, end in touched:
        if first > pos:
            out.append((pos, first))
        pos = max(pos, end)
    if pos < words:
        out.append((pos, words))
    return out
