"""The flat layout of one weight version.

A version is one contiguous run of bytes: every tensor, cast to the job's dtype, at an offset
aligned to ALIGN bytes, in the order the model lists its parameters (tied weights once). Padding
between tensors is zero. The plan cuts this run into byte ranges; senders fill a range straight
from the parameters (cast where needed), receivers land it straight in a staging buffer whose
typed views become the inference model's parameters. A quantized version (model/quant.py) holds
int8 or float8 weights and their float32 scales beside the rest in the job's dtype: each slot says
its own dtype.

torch is imported lazily: the layout itself (and the plan built on it) needs no torch.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Iterable, Sequence

from weightsync.job import reasons
from weightsync.job.errors import JobFailed

if TYPE_CHECKING:
    import torch

ALIGN = 64
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1, "int8": 1,
            "float8_e4m3fn": 1}


class LayoutMismatch(JobFailed, ValueError):
    """Two ranks disagree about the tensors of a version."""

    reason = reasons.RANKS_DISAGREE


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    if name not in ITEMSIZE:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(ITEMSIZE)}")
    return getattr(torch, name)


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple
    dtype: str
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return self.nbytes // ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class FlatLayout:
    slots: list
    total_bytes: int
    dtype: str
    """The version's dtype (spec.model.dtype): every slot's but a quantized version's weights and scales."""

    @classmethod
    def from_shapes(cls, named_shapes: Iterable[tuple], dtype: str, align: int = ALIGN) -> "FlatLayout":
        """The layout of (name, shape) entries in `dtype`, or (name, shape, its own dtype)."""
        slots, offset, seen = [], 0, set()
        for name, shape, *own in named_shapes:
            slot_dtype = own[0] if own else dtype
            if slot_dtype not in ITEMSIZE:
                raise ValueError(f"unsupported dtype {slot_dtype!r}; use one of {', '.join(ITEMSIZE)}")
            if align <= 0 or align % ITEMSIZE[slot_dtype]:
                raise ValueError(f"alignment {align} must be a positive multiple of the {slot_dtype} item size")
            if name in seen:
                raise ValueError(f"tensor {name!r} is listed twice")
            seen.add(name)
            shape = tuple(int(d) for d in shape)
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * ITEMSIZE[slot_dtype]
            slots.append(TensorSlot(name, shape, slot_dtype, offset, nbytes))
            offset = _round_up(offset + nbytes, align)
        if dtype not in ITEMSIZE:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(ITEMSIZE)}")
        return cls(slots, offset, dtype)

    @classmethod
    def from_named_tensors(cls, named: Iterable[tuple[str, "torch.Tensor"]], dtype: str, align: int = ALIGN) -> "FlatLayout":
        """The layout of `named` (for example model.named_parameters(), which lists a tied weight
        once) cast to `dtype`. The same tensor under a second name is kept once as well."""
        seen_storage, shapes = set(), []
        for name, tensor in named:
            key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())) if tensor.device.type != "meta" else None
            if key is not None and key in seen_storage:
                continue
            if key is not None:
                seen_storage.add(key)
            shapes.append((name, tuple(tensor.shape)))
        return cls.from_shapes(shapes, dtype, align)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    @property
    def itemsize(self) -> int:
        """The smallest element of any slot: every slot's bytes are whole elements of it (the unit
        cuts and delta encodings of the version's bytes take)."""
        return min((ITEMSIZE[s.dtype] for s in self.slots), default=ITEMSIZE[self.dtype])

    @property
    def mixed(self) -> bool:
        """Whether some slot has a dtype other than the version's (a quantized version)."""
        return any(s.dtype != self.dtype for s in self.slots)

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data, without padding."""
        return sum(s.nbytes for s in self.slots)

    def to_json(self) -> str:
        return json.dumps({"dtype": self.dtype, "total_bytes": self.total_bytes,
                           "slots": [[s.name, list(s.shape), s.offset, s.nbytes, *([s.dtype] if s.dtype != self.dtype else [])]
                                     for s in self.slots]})

    @classmethod
    def from_json(cls, text: str) -> "FlatLayout":
        obj = json.loads(text)
        dtype = obj["dtype"]
        slots = [TensorSlot(name, tuple(shape), own[0] if own else dtype, offset, nbytes)
                 for name, shape, offset, nbytes, *own in obj["slots"]]
        return cls(slots, obj["total_bytes"], dtype)

    def check_matches(self, other: "FlatLayout", what: str = "the other rank", here: str = "here") -> None:
        """Raise LayoutMismatch naming the first tensor where `other` differs from this layout
        (`here` names this one in the message)."""
        if self.dtype != other.dtype:
            raise LayoutMismatch(f"dtype differs: {self.dtype} {here}, {other.dtype} on {what}")
        for mine, theirs in zip(self.slots, other.slots):
            if mine != theirs:
                raise LayoutMismatch(f"tensor #{self.slots.index(mine)} differs: {here} {_describe(mine)}, "
                                     f"on {what} {_describe(theirs)}")
        if len(self.slots) != len(other.slots):
            longer, where = (self, here) if len(self.slots) > len(other.slots) else (other, f"on {what}")
            extra = longer.slots[min(len(self.slots), len(other.slots))]
            raise LayoutMismatch(f"tensor count differs ({len(self.slots)} {here}, {len(other.slots)} on {what}); "
                                 f"first extra one {where}: {_describe(extra)}")
        if self.total_bytes != other.total_bytes:
            raise LayoutMismatch(f"total bytes differ: {self.total_bytes} {here}, {other.total_bytes} on {what}")

    @cached_property
    def slot_ends(self) -> list[int]:
        """The end byte of every slot, in order (for finding the slots of a range by bisection)."""
        return [s.offset + s.nbytes for s in self.slots]

    def overlapping(self, start: int, end: int):
        """(slot index, slot, first byte, end byte) within the slot, for every slot overlapping
        the version's byte range [start, end)."""
        for i in range(bisect.bisect_right(self.slot_ends, start), len(self.slots)):
            s = self.slots[i]
            if s.offset >= end:
                break
            a, b = max(start, s.offset), min(end, s.offset + s.nbytes)
            if a < b:
                yield i, s, a - s.offset, b - s.offset


def _describe(s: TensorSlot) -> str:
    return f"{s.name} shape={list(s.shape)} dtype={s.dtype} offset={s.offset} bytes={s.nbytes}"


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


# ---------------------------------------------------------------- buffers and ranges (torch)


def byte_view(tensor: "torch.Tensor") -> "torch.Tensor":
    """The bytes of a contiguous tensor as a flat uint8 tensor sharing its memory."""
    import torch

    if not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    return tensor.detach().reshape(-1).view(torch.uint8)


def views(buffer: "torch.Tensor", layout: FlatLayout) -> list["torch.Tensor"]:
    """Typed views of each slot inside a flat uint8 buffer of layout.total_bytes (no copies)."""
    import torch

    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < layout.total_bytes:
        raise ValueError(f"the buffer must be a 1-d uint8 tensor of at least {layout.total_bytes} bytes, "
                         f"got {buffer.dtype} {list(buffer.shape)}")
    return [buffer[s.offset:s.offset + s.nbytes].view(torch_dtype(s.dtype)).view(s.shape) for s in layout.slots]


def check_sources(layout: FlatLayout, sources: Sequence["torch.Tensor"], starts: Sequence[int] | None = None) -> None:
    """Refuse source tensors that do not match the layout, naming the first one that differs.
    With `starts` (shards), source i holds the elements of slot i from starts[i] on: whole rows
    of the slot's tensor (every dimension but the first as the layout says), inside it."""
    if len(sources) != len(layout.slots):
        raise LayoutMismatch(f"{len(sources)} tensors given for a layout of {len(layout.slots)}")
    for i, (s, t) in enumerate(zip(layout.slots, sources)):
        if starts is None:
            if tuple(t.shape) != s.shape:
                raise LayoutMismatch(f"tensor {s.name}: shape {list(t.shape)} given, layout says {list(s.shape)}")
        elif tuple(t.shape[1:]) != s.shape[1:] or starts[i] + t.numel() > s.numel:
            raise LayoutMismatch(f"tensor {s.name}: a shard of shape {list(t.shape)} from element {starts[i]} does not "
                                 f"fit the layout's {list(s.shape)}")


def can_send_in_place(layout: FlatLayout, sources: Sequence["torch.Tensor"]) -> bool:
    """True when every source already holds the layout's bytes (same dtype, contiguous, in host
    memory): ranges are then sent straight from the parameters with no copy at all."""
    return all(t.dtype == torch_dtype(s.dtype) and t.is_contiguous() and t.device.type == "cpu"
               for s, t in zip(layout.slots, sources))


_ZEROS = memoryview(bytes(ALIGN))


def range_views(layout: FlatLayout, sources: Sequence["torch.Tensor"], start: int, end: int,
                starts: Sequence[int] | None = None) -> list[memoryview]:
    """The version's bytes [start, end) as memoryviews straight into the source tensors' memory
    (padding from a shared zero block). Only valid when can_send_in_place(layout, sources).
    `starts`: as for check_sources (a shard's bytes are only those it holds)."""
    out, pos = [], start
    for i, slot, a, b in layout.overlapping(start, end):
        gap = slot.offset + a - pos
        out.extend(_zero_views(gap))
        skip = starts[i] * ITEMSIZE[slot.dtype] if starts is not None else 0
        out.append(memoryview(byte_view(sources[i]).numpy())[a - skip:b - skip])
        pos = slot.offset + b
    out.extend(_zero_views(end - pos))
    return out


def _zero_views(n: int) -> list[memoryview]:
    if n < 0:
        raise AssertionError("overlapping slots")
    return [_ZEROS[: min(ALIGN, n - k)] for k in range(0, n, ALIGN)]


def _native_bf16():
    try:
        from weightsync.model import _cast
    except ImportError:  # not built (an operator-only install); `make setup` and the worker image require it
        return None
    return _cast if _cast.supported() else None


NATIVE_BF16 = _native_bf16()


def cast_name() -> str:
    """Which code casts float32 host tensors to bfloat16 here (benchmarks print it)."""
    return "AVX512-BF16" if NATIVE_BF16 is not None else "torch"


def cast_into(dest: "torch.Tensor", src: "torch.Tensor", dtype: "torch.dtype") -> None:
    """Cast the contiguous tensor `src` to `dtype` into the uint8 tensor `dest`, which holds exactly
    its bytes. float32 -> bfloat16 in host memory runs in one native pass where the CPU has
    AVX512-BF16 (torch's cast of that takes 30% longer, and a trainer casts every element of
    every version); all else is torch's copy_, on the device of `src` (a GPU's parameters are cast
    there, and only the cast bytes cross to a host buffer).

    The bytes are torch's CPU cast's, on every device, NaNs included (a GPU's cast makes other
    NaNs): float32 -> bfloat16 makes every NaN 0xFFFF; float32 -> float16 makes a NaN its sign,
    0x7E00 and the top 10 bits of its mantissa (F16C's conversion). So the same weights give the
    same bytes, and checksums, whichever device cast them."""
    import torch

    if (NATIVE_BF16 is not None and dtype == torch.bfloat16 and src.dtype == torch.float32
            and src.device.type == "cpu" and dest.device.type == "cpu"):
        NATIVE_BF16.float32_to_bfloat16(src.numpy(), dest.numpy())
        return
    if src.device.type != "cpu" and src.dtype != dtype:
        cast = src.to(dtype)
        if src.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16):
            cast = cast.view(torch.int16)
            torch.where(src.isnan(), _host_nan(src, dtype), cast, out=cast)
        dest.view(torch.int16 if cast.dtype == torch.int16 else dtype).copy_(cast)
        return
    dest.view(dtype).copy_(src)


def _host_nan(src: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
    """The 16-bit NaN torch's CPU cast makes of each float32 of `src` (int16, where src is NaN)."""
    import torch

    if dtype == torch.bfloat16:
        return torch.full((), -1, dtype=torch.int16, device=src.device)  # 0xFFFF
    bits = src.view(torch.int32)
    return ((bits >> 16) & 0x8000 | 0x7E00 | (bits >> 13) & 0x3FF).to(torch.int16)


def fill_range(layout: FlatLayout, sources: Sequence["torch.Tensor"], start: int, end: int, dest: "torch.Tensor",
               starts: Sequence[int] | None = None) -> None:
    """Write the version's bytes [start, end) into the uint8 tensor `dest` (len end - start),
    casting each overlapped slice of a source straight into place; padding becomes zero.
    `starts`: as for check_sources (a shard is read only where it holds the range)."""
    if dest.numel() != end - start:
        raise ValueError(f"destination holds {dest.numel()} bytes for a range of {end - start}")
    pos = 0
    for at, nbytes, src, dtype in range_parts(layout, sources, start, end, starts):
        if at > pos:
            dest[pos:at].zero_()
        cast_into(dest[at:at + nbytes], src, dtype)
        pos = at + nbytes
    if pos < end - start:
        dest[pos:].zero_()


def range_parts(layout: FlatLayout, sources: Sequence["torch.Tensor"], start: int, end: int,
                starts: Sequence[int] | None = None):
    """(byte in the range, bytes, the source's elements there as a 1-d view, the slot's dtype) of
    every slot the version's bytes [start, end) overlap, in order: what fill_range casts into
    place (the GPU's fused cast and checksum takes the same parts); the bytes between are padding.
    `starts`: as for check_sources."""
    for i, slot, a, b in layout.overlapping(start, end):
        item = ITEMSIZE[slot.dtype]
        if a % item or b % item:
            raise ValueError(f"range [{start}, {end}) cuts tensor {slot.name} inside an element")
        skip = starts[i] if starts is not None else 0
        yield (slot.offset + a - start, b - a, sources[i].detach().reshape(-1)[a // item - skip:b // item - skip],
               torch_dtype(slot.dtype))
