"""The flat layout of a version: offsets, JSON, mismatch messages, views, and the sender-side
fill of byte ranges (cast into a buffer, or straight from the parameters)."""

import pytest
import torch

from weightsync.model import flat
from weightsync.model.flat import ALIGN, FlatLayout, LayoutMismatch


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 3), (1,), (33,), (5, 5, 5), (2, 64)]  # odd element counts on purpose
    return [torch.randn(s, generator=g) for s in shapes]


def layout_of(params, dtype):
    return FlatLayout.from_named_tensors([(f"t{i}", p) for i, p in enumerate(params)], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offsets_are_aligned_and_in_order(dtype):
    params = tensors()
    layout = layout_of(params, dtype)
    item = flat.ITEMSIZE[dtype]
    prev_end = 0
    for slot, p in zip(layout.slots, params):
        assert slot.offset % ALIGN == 0 and slot.offset >= prev_end
        assert slot.nbytes == p.numel() * item and slot.shape == tuple(p.shape) and slot.dtype == dtype
        prev_end = slot.offset + slot.nbytes
    assert layout.total_bytes % ALIGN == 0 and layout.total_bytes >= prev_end
    assert layout.payload_bytes == sum(p.numel() for p in params) * item


def test_the_same_tensor_under_two_names_is_kept_once():
    shared = torch.zeros(4, 8)
    layout = FlatLayout.from_named_tensors([("emb", shared), ("head", shared), ("bias", torch.zeros(3))], "float32")
    assert layout.names == ["emb", "bias"]


def test_json_round_trip_and_mismatch_names_the_tensor():
    layout = layout_of(tensors(), "bfloat16")
    assert FlatLayout.from_json(layout.to_json()) == layout
    layout.check_matches(FlatLayout.from_json(layout.to_json()))
    other = FlatLayout.from_shapes([("t0", (7, 3)), ("t1", (1,)), ("t2", (34,)), ("t3", (5, 5, 5)), ("t4", (2, 64))], "bfloat16")
    with pytest.raises(LayoutMismatch, match="t2 shape=\\[33\\]"):
        layout.check_matches(other, "trainer rank 1")
    with pytest.raises(LayoutMismatch, match="dtype differs"):
        layout.check_matches(layout_of(tensors(), "float32"))
    shorter = FlatLayout.from_shapes([("t0", (7, 3))], "bfloat16")
    with pytest.raises(LayoutMismatch, match="first extra one here: t1"):
        layout.check_matches(shorter)


def test_views_point_into_the_buffer():
    params = tensors()
    layout = layout_of(params, "float32")
    buf = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    vs = flat.views(buf, layout)
    for v, p in zip(vs, params):
        v.copy_(p)
    again = flat.views(buf, layout)
    assert all(torch.equal(a, p) for a, p in zip(again, params))
    assert vs[0].data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError, match="uint8"):
        flat.views(torch.zeros(layout.total_bytes // 4), layout)


def whole_version(layout, params):
    """Reference bytes: every tensor cast on its own, placed at its offset, zero padding."""
    out = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for slot, p in zip(layout.slots, params):
        out[slot.offset:slot.offset + slot.nbytes] = flat.byte_view(p.to(flat.torch_dtype(layout.dtype)).contiguous())
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fill_range_casts_every_slice_into_place(dtype):
    params = tensors(1)
    layout = layout_of(params, dtype)
    want = whole_version(layout, params)
    cuts = list(range(0, layout.total_bytes, ALIGN)) + [layout.total_bytes]
    for a, b in [(0, layout.total_bytes), (cuts[1], cuts[4]), (cuts[3], cuts[-1]), (cuts[2], cuts[3])]:
        dest = torch.full((b - a,), 0xAB, dtype=torch.uint8)  # stale bytes must not survive in padding
        flat.fill_range(layout, params, a, b, dest)
        assert torch.equal(dest, want[a:b]), (a, b)


def test_in_place_views_equal_the_filled_bytes():
    params = tensors(2)
    layout = layout_of(params, "float32")
    assert flat.can_send_in_place(layout, params)
    assert not flat.can_send_in_place(layout_of(params, "bfloat16"), params)
    assert not flat.can_send_in_place(layout, [p.t() if p.dim() == 2 else p for p in params])
    want = whole_version(layout, params)
    for a, b in [(0, layout.total_bytes), (ALIGN, 5 * ALIGN), (2 * ALIGN, layout.total_bytes)]:
        views = flat.range_views(layout, params, a, b)
        assert b"".join(bytes(v) for v in views) == bytes(want[a:b].numpy())
        # no copies: the slices point into the parameters' memory
        ptrs = {p.data_ptr() for p in params}
        assert any(torch.frombuffer(v, dtype=torch.uint8).data_ptr() in {x + k for x in ptrs for k in range(0, 4096, 4)}
                   for v in views if len(v) > ALIGN)


def test_fill_range_refuses_wrong_sources():
    params = tensors()
    layout = layout_of(params, "float32")
    with pytest.raises(LayoutMismatch, match="t1: shape \\[2\\]"):
        flat.check_sources(layout, [params[0], torch.zeros(2)] + params[2:])
    with pytest.raises(LayoutMismatch, match="4 tensors given"):
        flat.check_sources(layout, params[:4])


def cast_inputs() -> torch.Tensor:
    """float32 values across every exponent, the rounding ties, denormals, signed zeros and the
    infinities (as raw bits, so that every case is exactly what it says)."""
    g = torch.Generator().manual_seed(3)
    random_bits = torch.randint(-2**31, 2**31, (100_003,), generator=g, dtype=torch.int64)
    special = torch.tensor([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF,
                            0x3F808000, 0x3F818000, 0x3F808001, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F7FFFFF])
    bits = torch.cat([special, random_bits]).to(torch.int64) & 0xFFFFFFFF
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)


def shipped_nans(nans: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 16-bit NaNs cast_into's docstring defines for float32 NaNs, one Python integer at a time."""
    out = []
    for bits in nans.view(torch.int32).tolist():
        u = bits & 0xFFFFFFFF
        half = 0xFFFF if dtype == torch.bfloat16 else (u >> 16) & 0x8000 | 0x7E00 | (u >> 13) & 0x3FF
        out.append(half - 0x10000 if half >= 0x8000 else half)
    return torch.tensor(out, dtype=torch.int16)


def nan_inputs() -> torch.Tensor:
    values = cast_inputs()
    nans = values[values.isnan()]
    assert nans.numel() > 100
    return nans


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_nan_ships_as_the_one_nan_defined_for_it(dtype):
    nans = nan_inputs()
    dest = torch.empty(2 * nans.numel(), dtype=torch.uint8)
    flat.cast_into(dest, nans, dtype)
    assert torch.equal(dest.view(torch.int16), shipped_nans(nans, dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none on this machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("where", ["cuda", "cpu"])
def test_a_gpu_cast_gives_the_bytes_of_the_cpu_cast_nans_included(dtype, where):
    """Into GPU memory (nccl, uccl, ipc) and into host memory (tcp's pinned send buffers)."""
    values = cast_inputs()
    want = torch.empty(2 * values.numel(), dtype=torch.uint8)
    flat.cast_into(want, values, dtype)
    got = torch.empty(2 * values.numel(), dtype=torch.uint8, device=where)
    flat.cast_into(got, values.cuda(), dtype)
    assert torch.equal(got.cpu(), want)


needs_native_cast = pytest.mark.skipif(flat.NATIVE_BF16 is None, reason="this CPU has no AVX512-BF16: bfloat16 "
                                       "casts run in torch here, which the fill tests above cover")


@needs_native_cast
def test_native_bfloat16_cast_has_torchs_bytes():
    values = cast_inputs()
    numbers = values[~values.isnan()]
    # every length up to a few vectors (the tail is cast separately) at odd starting elements
    for start in (0, 1, 7):
        for n in list(range(0, 70)) + [numbers.numel() - start]:
            src = numbers[start:start + n]
            dest = torch.full((2 * n,), 0xAB, dtype=torch.uint8)
            flat.cast_into(dest, src, torch.bfloat16)
            assert torch.equal(dest, flat.byte_view(src.to(torch.bfloat16))), (start, n)
    # every NaN ships as the one NaN cast_into defines, whatever its sign or payload
    nans = nan_inputs()
    dest = torch.empty(2 * nans.numel(), dtype=torch.uint8)
    flat.cast_into(dest, nans, torch.bfloat16)
    assert torch.equal(dest.view(torch.int16), shipped_nans(nans, torch.bfloat16))


@needs_native_cast
def test_native_bfloat16_cast_refuses_mismatched_buffers():
    with pytest.raises(ValueError, match="40 source bytes do not fill 10 destination bytes"):
        flat.NATIVE_BF16.float32_to_bfloat16(torch.zeros(10).numpy(), torch.zeros(10, dtype=torch.uint8).numpy())
