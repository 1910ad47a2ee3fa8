"""The range checksums (transport/checksum.py): ws64, the GPU transports' checksum, is the value
its definition gives, in plain Python integers, on host tensors here and on a GPU where there is
one; it sees a changed, moved or swapped word."""

import pytest
import torch
from support import ws64_cases

from weightsync.model.flat import FlatLayout
from weightsync.transfer.pack import RangePacker
from weightsync.transport.checksum import GOLDEN, MIX, bucket_checksum, checksum_of, device_checksum

M = (1 << 64) - 1


def mix(z: int) -> int:
    z ^= z >> 30
    z = z * MIX[0] & M
    z ^= z >> 27
    z = z * MIX[1] & M
    return z ^ z >> 31


def ws64(data: bytes) -> int:
    """ws64 as the module's docstring defines it, one word at a time."""
    n = len(data)
    padded = data + b"\0" * (-n % 8)
    h = 0
    for i in range(len(padded) // 8):
        h = (h + mix(int.from_bytes(padded[8 * i:8 * i + 8], "little") + (i + 1) * GOLDEN & M)) & M
    return mix(h + n * GOLDEN & M)


def value(t: torch.Tensor) -> int:
    return int(device_checksum(t)) & M


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 1000, 4097])
def test_ws64_is_its_definition(n):
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert value(t) == ws64(bytes(t.numpy()))


def test_ws64_reads_any_dtype_as_its_bytes_and_sees_every_kind_of_change():
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    raw = x.view(torch.uint8)
    assert value(x) == value(raw) == ws64(bytes(raw.numpy()))
    seen = {value(raw)}
    flipped = raw.clone()
    flipped[777] ^= 1
    swapped = raw.clone()
    swapped[:8], swapped[8:16] = raw[8:16].clone(), raw[:8].clone()
    longer = torch.cat([raw, torch.zeros(1, dtype=torch.uint8)])  # a zero byte more: the length counts
    for other in (flipped, swapped, longer):
        seen.add(value(other))
    assert len(seen) == 4


def test_host_ranges_keep_xxh3_and_device_ranges_get_ws64():
    t = torch.arange(256, dtype=torch.uint8)
    assert bucket_checksum(t) == checksum_of([memoryview(t.numpy())])
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: ws64 on a GPU is checked where there is one")
    assert bucket_checksum(t.cuda()) & M == ws64(bytes(t.numpy()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none on this machine)")
@pytest.mark.parametrize("n", [1, 4097, (64 << 20) + 3, (300 << 20) + 5])
def test_ws64_on_a_gpu_equals_ws64_on_the_host(n):
    """Larger than one batch of words (WORDS_AT_ONCE) in the last case."""
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert int(device_checksum(t.cuda())) == int(device_checksum(t))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none on this machine)")
@pytest.mark.parametrize("start", [0, 3, 8])
def test_ws64_on_a_gpu_by_words_and_by_bytes_equals_the_host(start):
    """Start 0: 64-bit word loads, two at a time; 8: one at a time; 3: bytes."""
    n = (16 << 20) + 77
    t = torch.randint(0, 256, (start + n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(start))
    assert int(device_checksum(t.cuda()[start:])) == int(device_checksum(t[start:].clone()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none on this machine)")
@pytest.mark.parametrize("scale", [1, 4096])
def test_a_bucket_cast_and_hashed_on_a_gpu_holds_the_host_casts_bytes_and_their_ws64(scale):
    """The packer's one pass on the GPU (the fused cast and checksum) against its fill on the
    host: the same bytes, and their ws64; at scale 4096 its runs span many programs."""
    small = ws64_cases.layout()
    layout = FlatLayout.from_shapes([(s.name, (s.shape[0] * scale,), s.dtype) for s in small.slots], "bfloat16", align=4)
    params = ws64_cases.params(layout)
    host, gpu = RangePacker(layout, params), RangePacker(layout, [p.cuda() for p in params])
    for bucket in ws64_cases.buckets(layout):
        expected = torch.full((bucket.length,), 0xA5, dtype=torch.uint8)
        host.fill(bucket, expected)
        got = torch.full((bucket.length,), 0xA5, dtype=torch.uint8, device="cuda")
        checksum = int(gpu.fill_checksummed(bucket, got))
        assert torch.equal(got.cpu(), expected), bucket
        assert checksum == int(device_checksum(expected)), bucket
