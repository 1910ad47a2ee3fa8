"""Quantized versions (spec.model.quantization): the format inference serves, made by each trainer
rank from its own rows on its own device after each step, never gathered.

A quantized version holds, for every weight of a linear layer, the quantized weight and its scales
under the names a quantized checkpoint of the format gives them; every other tensor (embeddings,
the output head, norms, a mixture of experts' routers) stays in spec.model.dtype. The planner, the
checksums, the digest and the delta path see only bytes (model/flat.py: each slot its own dtype), so
a corrupted scale fails verification as any byte does, and nothing of that version is loaded.

- int8: per-channel symmetric W8A8 as vLLM's compressed-tensors reads it: `weight` int8 and
  `weight_scale` float32 of shape [out, 1], scale = max|row| / 127 (1 for a row of zeros),
  weight = round(row / scale) (half to even) within [-127, 127]. Row-local: any run of whole rows
  quantizes alone.
- fp8: DeepSeek-V3's block format: `weight` float8_e4m3fn and `weight_scale_inv` float32 of shape
  [ceil(out / 128), ceil(in / 128)], one per 128 x 128 block, scale_inv = max|block| / 448 (1 for a
  block of zeros), weight = e4m3(block / scale_inv) (round to nearest even, within +-448). The
  format pads the last blocks of a dimension that 128 does not divide (the scale grid rounds up,
  the edge blocks are smaller), so any whole weight quantizes; a trainer's shard must hold whole
  row blocks (its first row a multiple of 128), else it is refused naming the tensor.

Stacked experts ([experts, out, in], one tensor of every expert) are quantized expert by expert
(their scales [experts, out, 1] or [experts, ceil(out/128), ceil(in/128)]). W = q * scale, or
q * scale_inv per block, gives the weights back (dequantize: the built-in engine's load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

from weightsync.job import SpecError
from weightsync.model.flat import FlatLayout

if TYPE_CHECKING:
    import torch

BLOCK = 128
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT8_MAX = 127


class BlockCut(ValueError):
    """A shard or slice of an fp8 weight that cuts its 128x128 blocks (its scales cannot follow it)."""


@dataclass(frozen=True)
class Format:
    """A quantized format: the dtype of its weights, the suffix of its scales' names, its block."""

    name: str
    dtype: str
    scale_suffix: str
    block: int | None = None
    """Rows and columns of a block sharing one scale (None: one scale per output channel)."""

    def scale_name(self, name: str) -> str:
        return name + self.scale_suffix

    def weight_of(self, name: str) -> str | None:
        """The weight whose scales `name` names, or None where it names no scales."""
        return name[:-len(self.scale_suffix)] if name.endswith(self.scale_suffix) else None

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        if len(shape) < 2:
            raise ValueError(f"{self.name} quantizes matrices, not a tensor of shape {list(shape)}")
        if self.block is None:
            return (*shape[:-1], 1)
        return (*shape[:-2], -(-shape[-2] // self.block), -(-shape[-1] // self.block))

    def scale_rows(self, name: str, shape: Sequence[int], first: int, end: int) -> tuple[int, int]:
        """The dim-0 rows of the scales that rows [first, end) of weight `name` quantize with (a
        trainer rank's shard); a shard that cuts a block of rows is refused."""
        if first == end or not shape:
            return first, end
        start, stop = self.scale_bounds(name, shape, (first, *[0] * (len(shape) - 1)), (end, *shape[1:]))
        return start[0], stop[0]

    def scale_bounds(self, name: str, shape: Sequence[int], start: Sequence[int], stop: Sequence[int],
                     holder: str = "a trainer rank", fix: str | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The box ([start, stop) per dim) of the scales that quantize the box [start, stop) of
        weight `name` of `shape`: a scale follows its weight. int8: the same rows (and experts), the
        one column of per-row scales. fp8: the 128x128 blocks the box covers (the last block of a
        dimension 128 does not divide is the format's padded one). A box that cuts a block is
        refused on one line naming the weight: `holder` says who would hold it, `fix` what to do
        (a trainer's default: shard in whole blocks of rows)."""
        start, stop = tuple(start), tuple(stop)
        if len(shape) < 2:
            raise ValueError(f"{name} {list(shape)}: {self.name} quantizes matrices")
        if self.block is None:
            return (*start[:-1], 0), (*stop[:-1], 1)
        out_start, out_stop = list(start), list(stop)
        for d, what in ((len(shape) - 2, "rows"), (len(shape) - 1, "columns")):
            a, b = start[d], stop[d]
            if a % self.block or (b % self.block and b != shape[d]):
                advice = fix or f"shard the weights in multiples of {self.block} rows (or quantize int8)"
                raise BlockCut(f"spec.model.quantization {self.name}: {holder} holds {what} [{a}, {b}) of {name} "
                                 f"{list(shape)}, which cut its {self.block}x{self.block} blocks: {advice}")
            out_start[d], out_stop[d] = a // self.block, -(-b // self.block)
        return tuple(out_start), tuple(out_stop)


FORMATS = {"int8": Format("int8", "int8", "_scale"), "fp8": Format("fp8", "float8_e4m3fn", "_scale_inv", BLOCK)}


def quantization_config(fmt: Format) -> dict:
    """The quantization_config of a checkpoint in this format, as vLLM reads it from config.json."""
    if fmt.block is None:
        int8 = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "group_size": None}
        return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**int8, "strategy": "channel"},
                                              "input_activations": {**int8, "strategy": "token", "dynamic": True}}},
                "ignore": ["lm_head", "re:.*\\.gate$"]}
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [fmt.block, fmt.block]}


# what vLLM calls each format (its model config's `quantization`)
VLLM_METHOD = {"int8": "compressed-tensors", "fp8": "fp8"}


def format_of(quantization: str | None) -> Format | None:
    if quantization is None:
        return None
    if quantization not in FORMATS:
        raise ValueError(f"spec.model.quantization {quantization!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[quantization]


def quantized_names(model: "torch.nn.Module") -> set[str]:
    """The parameters a quantized checkpoint stores quantized: the weights of linear layers (and
    stacked experts' 3-d weights), not the output head (tied to the embeddings, or kept in the
    model's dtype as quantized checkpoints keep it) and not a mixture of experts' router (`gate`)."""
    import torch

    # a wrapper (DDP, torch.compile) holds the model: its output head is the head
    heads = {id(m.get_output_embeddings()) for _, m in model.named_modules() if hasattr(m, "get_output_embeddings")}
    out = set()
    for path, module in model.named_modules():
        if id(module) in heads or path.rpartition(".")[2] == "gate":
            continue
        for attr, param in module.named_parameters(recurse=False):
            name = f"{path}.{attr}" if path else attr
            linear = isinstance(module, torch.nn.Linear) and attr == "weight"
            if linear or (param.dim() == 3 and ".experts" in f".{path}" and not attr.endswith("bias")):
                out.add(name)
    return out


def check_quantizable(model: "torch.nn.Module", fmt: Format) -> None:
    """Refuse, on one line, a model whose quantized checkpoint vLLM cannot load as this format: one
    whose projections are transformers' Conv1D (GPT-2's [in, out] weights, which vLLM's quantized
    linear layers do not take), or one with no linear layer to quantize."""
    conv = next((path for path, m in model.named_modules() if type(m).__name__ == "Conv1D"), None)
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if conv is not None:
        raise SpecError([f"spec.model.quantization {fmt.name}: {kind} keeps its projections ({conv}) in transformers' "
                         "Conv1D, [in, out], which vLLM's quantized linear layers cannot load: quantize a model whose "
                         "linear layers are nn.Linear (llama, qwen2, mistral, deepseek_v3) or drop quantization"])
    if not quantized_names(model):
        raise SpecError([f"spec.model.quantization {fmt.name}: {kind} has no linear layer to quantize: drop quantization"])


def quantize_layout(layout: FlatLayout, names: Iterable[str], fmt: Format) -> FlatLayout:
    """The layout of the quantized version: each of `names` in the format's dtype, followed by its
    scales (float32); the rest as in `layout`."""
    names = set(names)
    entries = []
    for s in layout.slots:
        if s.name in names:
            entries += [(s.name, s.shape, fmt.dtype), (fmt.scale_name(s.name), fmt.scale_shape(s.shape), "float32")]
        else:
            entries.append((s.name, s.shape, s.dtype))
    return FlatLayout.from_shapes(entries, layout.dtype)


def scales_of(layout: FlatLayout, fmt: Format) -> dict[str, str]:
    """{weight: its scales} of a quantized layout."""
    present = set(layout.names)
    return {s.name: fmt.scale_name(s.name) for s in layout.slots
            if s.dtype == fmt.dtype and fmt.scale_name(s.name) in present}


def quantize(weight: "torch.Tensor", fmt: Format) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(quantized weight, float32 scales) of `weight` (2-d, or 3-d stacked experts), computed in
    float32 on its own device."""
    import torch

    w = weight.detach().float()
    if fmt.block is None:
        amax = w.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
        return torch.round(w / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    b = fmt.block
    *lead, rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % b, 0, -rows % b))
    blocks = padded.reshape(*lead, padded.shape[-2] // b, b, padded.shape[-1] // b, b)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(padded.shape)[..., :rows, :cols].contiguous()
    return q, scale.reshape(*lead, padded.shape[-2] // b, padded.shape[-1] // b).contiguous()


def dequantize(q: "torch.Tensor", scale: "torch.Tensor", fmt: Format, dtype: "torch.dtype") -> "torch.Tensor":
    """The weights a quantized weight stands for, in `dtype`: q * scale per row, or q * scale_inv
    per block."""
    w = q.float()
    if fmt.block is None:
        return (w * scale.float()).to(dtype)
    b = fmt.block
    rows, cols = w.shape[-2], w.shape[-1]
    grid = scale.float().repeat_interleave(b, dim=-2).repeat_interleave(b, dim=-1)[..., :rows, :cols]
    return (w * grid).to(dtype)


def quantized_tensors(layout: FlatLayout, fmt: Format, tensors: Sequence["torch.Tensor"]) -> list["torch.Tensor"]:
    """The tensors of the quantized `layout` from the unquantized ones (the model's, or a rank's
    rows of them, in the order of the unquantized layout): each quantized weight followed by its
    scales, on the tensors' own device."""
    scales = scales_of(layout, fmt)
    out, it = [], iter(tensors)
    for s in layout.slots:
        if s.name in scales:
            out.extend(quantize(next(it), fmt))
        elif s.dtype == "float32" and s.name.endswith(fmt.scale_suffix) and s.name.removesuffix(fmt.scale_suffix) in scales:
            continue
        else:
            out.append(next(it))
    return out
