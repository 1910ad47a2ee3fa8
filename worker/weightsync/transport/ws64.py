"""ws64, the checksum of ranges in GPU memory, as its definition reads: in torch's elementwise
operations on any device (the CPU in the tests and wherever a host tensor is asked for it). The
GPU computes it in fused Triton kernels (ws64_kernels.py), which give this value; keeping the
definition and its finalization here, apart from the kernels and from the xxh3 of host ranges
(checksum.py), lets the kernels and the definition share one finalization without importing each
other.

ws64 of n bytes: pad them with zeros to whole little-endian 64-bit words w_0..w_k-1; then
  h = sum over i of mix(w_i + (i + 1) * GOLDEN)   (mod 2^64)
  ws64 = mix(h + n * GOLDEN)
where mix is splitmix64's finalizer (xor-shift, multiply, xor-shift, multiply, xor-shift). Each
word goes through a bijection keyed by its position, so a changed, moved or swapped word changes
the sum, and the sum is the same in any order of addition (a GPU reduction's order is not fixed).
Since the words' terms are added, any split of a range into runs of words can be summed apart
and added: that is what lets a bucket's pieces each add their share (ws64_kernels.bucket_ws64).
"""

from __future__ import annotations

U64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
# words hashed at a time: bounds the temporaries (a few times 8 bytes per word) on the device
WORDS_AT_ONCE = 1 << 24


def signed64(u: int) -> int:
    """An unsigned 64-bit value (any int, taken mod 2^64) as the int64 that holds its bits."""
    u &= U64
    return u - (1 << 64) if u >= 1 << 63 else u


def mix(z):
    """splitmix64's finalizer on int64 tensors, in place; int64 arithmetic wraps like uint64 and
    a logical right shift is an arithmetic one masked to the bits that stay."""
    for shift, multiplier in ((30, MIX[0]), (27, MIX[1]), (31, None)):
        z ^= (z >> shift) & ((1 << (64 - shift)) - 1)
        if multiplier is not None:
            z *= signed64(multiplier)
    return z


def definition(data):
    """ws64 of a tensor's bytes, as the definition reads, on its device and current stream: a
    0-dim int64 tensor (& U64 makes it the unsigned value that ranges carry)."""
    import torch

    raw = data.detach().reshape(-1).view(torch.uint8)
    n = raw.numel()
    whole = n // 8 * 8
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    words = raw[:whole].view(torch.int64) if whole else raw.new_empty(0).view(torch.int64)
    if whole < n:  # the last partial word, zero-padded
        tail = torch.zeros(8, dtype=torch.uint8, device=raw.device)
        tail[:n - whole] = raw[whole:]
        words = torch.cat([words, tail.view(torch.int64)])
    for first in range(0, words.numel(), WORDS_AT_ONCE):
        total += word_terms(words[first:first + WORDS_AT_ONCE], first).sum()
    return finish(total, n)


def word_terms(words, first):
    """mix(w_i + (i + 1) * GOLDEN) of int64 words at positions first, first + 1, ... (a tensor);
    or, where `first` is an int64 tensor, at the positions it holds."""
    import torch

    if isinstance(first, int):
        position = torch.arange(first + 1, first + 1 + words.numel(), dtype=torch.int64, device=words.device)
    else:
        position = first + 1
    position *= signed64(GOLDEN)
    return mix(position.add_(words))


def finish(total, n: int):
    """ws64 from the sum of the mixed words (an int64 tensor) and the length in bytes."""
    return mix((total + signed64(n * GOLDEN)).view(1)).view(())
