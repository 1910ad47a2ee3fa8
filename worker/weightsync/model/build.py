"""The causal LM every role holds: built from spec.model.config (seeded random init, nothing
downloaded) or loaded from the checkpoint directory spec.model.path. Token ids only, no tokenizer.

The parameters, in the order model.named_parameters() lists them (a tied weight once), are the
tensors of a weight version; flat.FlatLayout turns them into byte offsets.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from weightsync.job import Model, SpecError
from weightsync.model.config import config_of
from weightsync.model.flat import FlatLayout, torch_dtype
from weightsync.model.quant import (
    check_quantizable,
    dequantize,
    format_of,
    quantize,
    quantize_layout,
    quantized_names,
    scales_of,
)

# The fixed input inference ranks generate from, and that tests compare logits on.
PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)


def check_fits(model: Model, seq_len: int) -> None:
    """Refuse training sequences (spec.training.seqLen) longer than the model has positions for."""
    config = config_of(model)
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and seq_len > positions:
        raise SpecError([f"spec.training.seqLen: {seq_len} is longer than the model's {positions} "
                         "positions (max_position_embeddings / n_positions of spec.model)"])


def build(model: Model, *, dtype: str = "float32", device: str | torch.device = "cpu", seed: int = 0,
          load_weights: bool = True) -> torch.nn.Module:
    """The causal LM in `dtype` on `device`. From a config: weights drawn from torch's generator
    seeded with `seed`, so every rank that builds it gets the same ones. From a path: the
    checkpoint's weights, unless load_weights is False (inference ranks, which receive them); of a
    quantized checkpoint (spec.model.quantization), its weights dequantized."""
    from transformers import AutoModelForCausalLM

    config = config_of(model)
    try:
        if model.path is not None and load_weights and model.quantization is not None:
            return _dequantized(model, config, dtype, device)
        if model.path is not None and load_weights:
            loaded = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch_dtype(dtype), local_files_only=True)
            return loaded.to(device)
        torch.manual_seed(seed)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    except (ValueError, OSError) as e:
        raise SpecError([f"spec.model: transformers cannot build a causal LM from it: {e}"]) from None


def _dequantized(model: Model, config, dtype: str, device) -> torch.nn.Module:
    """The model of a quantized checkpoint (spec.model.path holding spec.model.quantization's
    format: its linear weights quantized, each with its scales), each quantized weight dequantized
    with its scales (quant.dequantize): the weights a server of that checkpoint computes with, which
    a LoRA adapter over them (spec.model.lora) trains on, the base fixed. transformers reads such a
    checkpoint only through the format's own package (compressed-tensors), which a trainer need
    not have."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    fmt = format_of(model.quantization)
    stored = {}
    for file in sorted(Path(model.path).glob("*.safetensors")):
        stored.update(load_file(str(file)))
    config = copy.deepcopy(config)
    config.quantization_config = None  # the model is built unquantized, its weights dequantized below
    with torch.device(device):
        built = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    missing = []
    with torch.no_grad():
        for name, param in parameters(built):
            weights = _stored(stored, name, fmt, param.dtype)
            if weights is None or tuple(weights.shape) != tuple(param.shape):
                missing.append(name)
            else:
                param.copy_(weights)
    if missing:
        raise SpecError([f"spec.model.path ({model.path}): its safetensors files hold no {missing[0]}"
                         f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} of the model its config.json "
                         "describes"])
    return built


# transformers' stack of every expert -> the projections of one expert that published checkpoints
# store instead, one tensor each, concatenated on the output dim (gate's rows, then up's)
EXPERT_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _stored(stored: dict, name: str, fmt, dtype: torch.dtype) -> torch.Tensor | None:
    """Parameter `name`'s weights from a quantized checkpoint's tensors, each quantized one
    dequantized with its scales (None: the checkpoint holds none). A stack of every expert
    (transformers' experts.gate_up_proj, experts.down_proj) comes from one tensor per expert where
    the checkpoint holds them so (experts.<e>.gate_proj.weight with its weight_scale, and so on, as
    published quantized mixtures of experts do), each expert dequantized with its own scales."""
    if name in stored:
        scales = stored.get(fmt.scale_name(name))
        return stored[name] if scales is None else dequantize(stored[name], scales, fmt, dtype)
    stem, _, stack = name.rpartition(".experts.")
    projections = EXPERT_PROJECTIONS.get(stack) if stem else None
    experts = []
    while projections:
        parts = [_stored(stored, f"{stem}.experts.{len(experts)}.{p}.weight", fmt, dtype) for p in projections]
        if any(p is None for p in parts):
            break
        experts.append(torch.cat(parts))
    return torch.stack(experts) if experts else None


def parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The tensors of a weight version, in version order (tied weights once)."""
    return list(model.named_parameters())


def layout_of(model: torch.nn.Module, dtype: str, quantization: str | None = None) -> FlatLayout:
    """The version layout of `model`'s parameters in `dtype`, quantized as `quantization` says
    (spec.model.quantization: the linear layers' weights and their scales, quant.py)."""
    layout = FlatLayout.from_named_tensors(parameters(model), dtype)
    fmt = format_of(quantization)
    if fmt is None:
        return layout
    check_quantizable(model, fmt)
    return quantize_layout(layout, quantized_names(model), fmt)


def meta_layout(model: Model) -> FlatLayout:
    """The version layout of spec.model without allocating any weights (meta device)."""
    return layout_of(build(model, dtype="float32", device="meta", load_weights=False), model.dtype, model.quantization)


def point_at(params: list[torch.nn.Parameter], views: list[torch.Tensor], layout: FlatLayout | None = None,
             quantization: str | None = None) -> None:
    """Make the parameters of a version (a model's, or its LoRA adapter's) the given views (typed
    slices of one flat buffer, in version order). Assigning .data keeps every Parameter object, so
    tied modules follow along. Of a quantized version (`layout` quantized as `quantization`), each
    quantized weight becomes its weights dequantized (quant.dequantize) in its parameter's dtype;
    the rest are views as ever."""
    fmt = format_of(quantization)
    if fmt is not None:
        views = dequantized(layout, fmt, views, [p.dtype for p in params])
    if len(params) != len(views):
        raise ValueError(f"{len(views)} views for {len(params)} parameters")
    with torch.no_grad():
        for p, v in zip(params, views):
            if p.shape != v.shape or p.dtype != v.dtype:
                raise ValueError(f"view {list(v.shape)} {v.dtype} does not fit parameter {list(p.shape)} {p.dtype}")
            p.data = v


def dequantized(layout: FlatLayout, fmt, views: list[torch.Tensor], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """The unquantized tensors of a quantized version's views: each quantized weight dequantized
    with its scales into its parameter's dtype (`dtypes`, in the unquantized order), the rest as
    they are."""
    scales = scales_of(layout, fmt)
    by_name = dict(zip(layout.names, views))
    skip = set(scales.values())
    out = []
    for slot, view in zip(layout.slots, views):
        if slot.name in skip:
            continue
        if slot.name in scales:
            view = dequantize(view, by_name[scales[slot.name]], fmt, dtypes[len(out)])
        out.append(view)
    return out


def as_served(model: torch.nn.Module, dtype: str, quantization: str | None = None) -> torch.nn.Module:
    """A copy of `model` as inference ranks serve a version of it: cast to `dtype`, its quantized
    weights (spec.model.quantization) quantized from `model`'s own and dequantized as the
    built-in engine loads them (the tests' dumps compare with it)."""
    cast = copy.deepcopy(model).to(torch_dtype(dtype))
    fmt = format_of(quantization)
    if fmt is not None:
        names = quantized_names(model)
        own = dict(parameters(model))
        with torch.no_grad():
            for name, param in parameters(cast):
                if name in names:
                    param.data = dequantize(*quantize(own[name], fmt), fmt, param.dtype)
    return cast


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    """One optimizer step of next-token prediction on `tokens` (a (batch, seq) tensor of ids;
    `model` may be wrapped in DDP); returns the loss, detached. The trainer role and the
    benchmark's training both take their steps here."""
    loss = model(input_ids=tokens, labels=tokens).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def vocab_size(model: torch.nn.Module) -> int:
    return int(model.config.vocab_size)


def prompt(model: torch.nn.Module, device: str | torch.device = "cpu") -> torch.Tensor:
    """PROMPT as a (1, len) batch of valid token ids for this model."""
    return torch.tensor([[t % vocab_size(model) for t in PROMPT]], device=device)


@torch.no_grad()
def logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with _eval(model):
        return model(input_ids=input_ids, use_cache=False).logits


@torch.no_grad()
def greedy(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy decoding without a cache: a few tokens from a short prompt."""
    ids = input_ids
    with _eval(model):
        for _ in range(new_tokens):
            nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids[0, input_ids.shape[1]:].tolist()


@contextlib.contextmanager
def _eval(model: torch.nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
