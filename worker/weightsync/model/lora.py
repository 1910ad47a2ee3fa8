"""LoRA adapters as weight versions (spec.model.lora): what a version carries is the adapter
alone, over base weights every rank loads itself (spec.model.path, or spec.model.config built
from spec.training.seed).

The adapter's tensors are named as PEFT saves them (`get_peft_model_state_dict`, the names of an
adapter_model.safetensors that vLLM loads): `base_model.model.<module>.lora_A.weight` of shape
(rank, in) and `...lora_B.weight` of shape (out, rank), for every linear layer whose last name is
one of spec.model.lora.targetModules, in the base model's module order. Trainer and receivers
derive that layout from the spec alone (adapter_layout), so the plan is made as for any version.

A LoRA layer is read as PEFT lays it out (peft.tuners.lora.LoraLayer: `base_layer`, the
ModuleDicts `lora_A` and `lora_B` keyed by adapter name, the dicts `r`, `lora_alpha` and
`scaling`), so a model that PEFT wrapped (as TRL wraps it: get_peft_model) and one that
add_adapters() wrapped here (the built-in trainer and engine, which need no PEFT) are read alike;
its forward is PEFT's: base_layer(x) + lora_B(lora_A(x)) * alpha / rank, that is the weight
W + (alpha / rank) B A. A model whose adapters are not the spec's (another rank, alpha or set of
layers; none at all; several adapters; DoRA) is refused on one line before any byte moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from weightsync.job import Lora, Model, SpecError
from weightsync.model.build import build
from weightsync.model.flat import FlatLayout

PREFIX = "base_model.model."  # the prefix of the names PEFT saves an adapter's tensors under
ADAPTER = "default"  # PEFT's name of a model's first adapter


def tensor_names(module: str) -> tuple[str, str]:
    """The names of a LoRA layer's A and B tensors, as PEFT saves them."""
    return f"{PREFIX}{module}.lora_A.weight", f"{PREFIX}{module}.lora_B.weight"


def target_layers(model: torch.nn.Module, lora: Lora) -> list[tuple[str, int, int]]:
    """(module name, in features, out features) of every linear layer of a base model (no
    adapters) that carries the adapter, in module order."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and lora.targets(name):
            out.append((name, module.in_features, module.out_features))
    return out


def check_targets(model: torch.nn.Module, lora: Lora) -> None:
    """Refuse, on one line, a target module (spec.model.lora.targetModules) that names no linear
    layer of the base `model` (built on the meta device, this costs no weights), naming the
    linear layers there are: found here, not by the trainer once every process has started."""
    linear = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    missing = [t for t in lora.target_modules if t not in linear]
    if missing:
        which = f"{', '.join(missing)} name{'s' if len(missing) == 1 else ''}"
        raise SpecError([f"spec.model.lora.targetModules: {which} no linear layer of the model "
                         f"({type(model).__name__}); its linear layers are named {', '.join(linear) or '(none)'}: "
                         "name only those"])


def adapter_shapes(model: torch.nn.Module, lora: Lora) -> list[tuple[str, tuple[int, int]]]:
    """The adapter's tensors over a base model: (name, shape), in version order."""
    check_targets(model, lora)
    shapes = []
    for name, fan_in, fan_out in target_layers(model, lora):
        a, b = tensor_names(name)
        shapes += [(a, (lora.rank, fan_in)), (b, (fan_out, lora.rank))]
    return shapes


def adapter_layout(model: Model) -> FlatLayout:
    """The version layout of spec.model.lora's adapter over spec.model, in spec.model.dtype (no
    weights allocated)."""
    base = build(model, dtype="float32", device="meta", load_weights=False)
    return FlatLayout.from_shapes(adapter_shapes(base, model.lora), model.dtype)


# ---------------------------------------------------------------- adapters on a model


class LoraLinear(torch.nn.Module):
    """A linear layer with one LoRA adapter, laid out as PEFT's lora.Linear (the same attribute
    and parameter names, the same forward, the same initialization: A as nn.Linear draws it, B
    zero), for the built-in trainer and engine, which do not need PEFT."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base_layer = base
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = torch.nn.ModuleDict({ADAPTER: torch.nn.Linear(base.in_features, rank, bias=False, device=device,
                                                                   dtype=dtype)})
        self.lora_B = torch.nn.ModuleDict({ADAPTER: torch.nn.Linear(rank, base.out_features, bias=False, device=device,
                                                                   dtype=dtype)})
        if device.type != "meta":
            torch.nn.init.kaiming_uniform_(self.lora_A[ADAPTER].weight, a=math.sqrt(5))
            torch.nn.init.zeros_(self.lora_B[ADAPTER].weight)
        self.r, self.lora_alpha = {ADAPTER: rank}, {ADAPTER: alpha}
        self.scaling = {ADAPTER: alpha / rank}
        self.active_adapters = [ADAPTER]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        a, b = self.lora_A[ADAPTER], self.lora_B[ADAPTER]
        return out + b(a(x.to(a.weight.dtype))).to(out.dtype) * self.scaling[ADAPTER]


def add_adapters(model: torch.nn.Module, lora: Lora) -> torch.nn.Module:
    """Wrap every target linear layer of `model` in a LoraLinear (A drawn from torch's generator
    as it is now: seed it for the same adapter on every rank) and freeze every other parameter:
    what PEFT's get_peft_model does to a model, as the built-in trainer and engine need it."""
    for p in model.parameters():
        p.requires_grad_(False)
    modules = dict(model.named_modules())
    for name, _, _ in target_layers(model, lora):
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, LoraLinear(modules[name], lora.rank, lora.alpha))
    return model


@dataclass(frozen=True)
class Adapter:
    """The adapter a job's versions carry (spec.model.lora) and the names of its layers in the
    base model: reads the adapter's tensors off a model that carries it, checked against the spec."""

    lora: Lora
    layers: tuple[str, ...]  # the base model's names of the layers that carry it, in version order

    @classmethod
    def of(cls, model: Model) -> "Adapter":
        layout = adapter_layout(model)
        names = [s.name[len(PREFIX):-len(".lora_A.weight")] for s in layout.slots[::2]]
        return cls(model.lora, tuple(names))

    def tensors(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        """(version name, parameter) of the adapter `model` carries, in version order; refuses, on
        one line, a model without it or whose adapter is not spec.model.lora's."""
        lora = self.lora
        found = [(n, m) for n, m in model.named_modules() if _is_lora_layer(m)]
        if not found:
            raise SpecError([f"spec.model.lora: the model carries no LoRA adapter, and this job's versions are one: wrap "
                             f"it as PEFT does (get_peft_model(model, LoraConfig(r={lora.rank}, "
                             f"lora_alpha={lora.alpha:g}, target_modules={list(lora.target_modules)})))"])
        by_layer: dict[str, torch.nn.Module] = {}
        for name, module in found:
            layer = next((t for t in self.layers if name == t or name.endswith("." + t)), None)
            if layer is None:
                raise SpecError([f"spec.model.lora: the model's layer {name} carries an adapter, but targetModules "
                                 f"({', '.join(lora.target_modules)}) does not name it: adapt the same layers"])
            by_layer[layer] = module
        missing = [t for t in self.layers if t not in by_layer]
        if missing:
            raise SpecError([f"spec.model.lora: the model's layer {missing[0]} carries no adapter ({len(missing)} of "
                             f"{len(self.layers)} target layers lack one), but targetModules "
                             f"({', '.join(lora.target_modules)}) names it: adapt the same layers"])
        out = []
        for layer in self.layers:
            module = by_layer[layer]
            key = _adapter_key(layer, module)
            rank, alpha, scaling = module.r[key], module.lora_alpha[key], module.scaling[key]
            if rank != lora.rank:
                raise SpecError([f"spec.model.lora.rank: {lora.rank}, but the model's adapter on {layer} has rank "
                                 f"{rank}: set them alike"])
            if not math.isclose(alpha, lora.alpha) or not math.isclose(scaling, lora.scaling):
                raise SpecError([f"spec.model.lora.alpha: {lora.alpha:g} (scaling {lora.scaling:g}), but the model's "
                                 f"adapter on {layer} has lora_alpha {alpha:g} (scaling {scaling:g}; rsLoRA scales by "
                                 "alpha / sqrt(rank), which vLLM and this spec do not): set them alike"])
            a, b = tensor_names(layer)
            out += [(a, module.lora_A[key].weight), (b, module.lora_B[key].weight)]
        return out


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict) and \
        isinstance(getattr(module, "lora_B", None), torch.nn.ModuleDict) and hasattr(module, "base_layer")


def _adapter_key(layer: str, module: torch.nn.Module) -> str:
    """The one adapter a LoRA layer carries (PEFT keys them by adapter name)."""
    keys = list(module.lora_A.keys())
    if len(keys) != 1:
        raise SpecError([f"spec.model.lora: the model's layer {layer} carries {len(keys)} adapters "
                         f"({', '.join(keys) or 'none'}); weightsync publishes one: delete the others "
                         "(PeftModel.delete_adapter)"])
    magnitude = getattr(module, "lora_magnitude_vector", None)
    if magnitude is not None and len(magnitude):
        raise SpecError([f"spec.model.lora: the model's adapter on {layer} is DoRA (use_dora), which vLLM does not "
                         "serve: train a plain LoRA adapter"])
    return keys[0]


def merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lora: Lora) -> torch.Tensor:
    """The weight a LoRA layer runs as: W + (alpha / rank) B A, computed in float32."""
    return (base.float() + (b.float() @ a.float()) * lora.scaling).to(base.dtype)

