"""The Triton kernels of ws64 (ws64_kernels.py drives them and says what each is for). They are
module-level functions because Triton finds a kernel's helpers among its module's globals; this
module imports Triton, so it is imported only where a GPU checksum is asked for. Their constants
come as constexpr arguments: a kernel reads no other globals."""

import triton
import triton.language as tl


@triton.jit
def terms(w, word, golden: tl.constexpr, mix0: tl.constexpr, mix1: tl.constexpr):
    """mix(w + (word + 1) * GOLDEN) of uint64 words at int64 positions."""
    z = w + (word.to(tl.uint64) + 1) * golden
    z = (z ^ (z >> 30)) * mix0
    z = (z ^ (z >> 27)) * mix1
    return z ^ (z >> 31)

@triton.jit
def byte_sums(raw, sums, first_word, end_word, n, block_words: tl.constexpr, golden: tl.constexpr,
              mix0: tl.constexpr, mix1: tl.constexpr):
    """Words [first_word, end_word) of the bytes at raw, those from byte n on taken as zero."""
    block = tl.program_id(0).to(tl.int64)
    word = first_word + block * block_words + tl.arange(0, block_words).to(tl.int64)
    byte = word[:, None] * 8 + tl.arange(0, 8).to(tl.int64)[None, :]
    b = tl.load(raw + byte, mask=byte < n, other=0).to(tl.uint64)
    w = tl.sum(b << (tl.arange(0, 8).to(tl.uint64) * 8)[None, :], axis=1)  # little-endian words
    z = terms(w, word, golden, mix0, mix1)
    z = tl.where(word < end_word, z, tl.zeros_like(z))
    tl.store(sums + block, tl.sum(z, axis=0).to(tl.int64, bitcast=True))

@triton.jit
def word_sums(words, sums, end_word, block_words: tl.constexpr, golden: tl.constexpr, mix0: tl.constexpr,
              mix1: tl.constexpr):
    """Words [0, end_word) of an 8-byte-aligned range, loaded as 64-bit words."""
    block = tl.program_id(0).to(tl.int64)
    word = block * block_words + tl.arange(0, block_words).to(tl.int64)
    w = tl.load(words + word, mask=word < end_word, other=0).to(tl.uint64, bitcast=True)
    z = terms(w, word, golden, mix0, mix1)
    z = tl.where(word < end_word, z, tl.zeros_like(z))
    tl.store(sums + block, tl.sum(z, axis=0).to(tl.int64, bitcast=True))

@triton.jit
def cast_sums(bits, dst, sums, a, b, first_word, owned_first, owned_end, block_words: tl.constexpr,
              golden: tl.constexpr, mix0: tl.constexpr, mix1: tl.constexpr):
    """float32 (their bits, int32) cast to bfloat16 into bucket bytes [a, b) (dst: the bucket
    as int16; a even), rounding to nearest even and every NaN made 0xFFFF (torch's CPU
    cast's bytes); the terms of words [owned_first, owned_end) added, their bytes before a
    read from dst, those from b on zero."""
    block = tl.program_id(0).to(tl.int64)
    word = first_word + block * block_words + tl.arange(0, block_words).to(tl.int64)
    lane = tl.arange(0, 4).to(tl.int64)
    at = word[:, None] * 8 + lane[None, :] * 2  # the bucket byte each 16-bit lane starts at
    inside = (at >= a) & (at < b)
    x = tl.load(bits + ((at - a) >> 1), mask=inside, other=0).to(tl.uint32, bitcast=True)
    rounded = (x + 0x7FFF + ((x >> 16) & 1)) >> 16
    half = tl.where((x & 0x7FFFFFFF) > 0x7F800000, 0xFFFF, rounded).to(tl.uint16)
    tl.store(dst + (at >> 1), half.to(tl.int16, bitcast=True), mask=inside)
    before = tl.load(dst + (at >> 1), mask=at < a, other=0).to(tl.uint16, bitcast=True)
    lanes = tl.where(inside, half, tl.where(at < a, before, tl.zeros_like(half))).to(tl.uint64)
    w = tl.sum(lanes << (lane.to(tl.uint64) * 16)[None, :], axis=1)
    z = terms(w, word, golden, mix0, mix1)
    z = tl.where((word >= owned_first) & (word < owned_end), z, tl.zeros_like(z))
    tl.store(sums + block, tl.sum(z, axis=0).to(tl.int64, bitcast=True))
