"""What a vLLM worker serves, read back from its kernels: the parameters as the model computes
with them, for the tests' dumps (runtime/faults.py) that compare them with the trainers' bytes.

vLLM's CPU build repacks weights for its kernels and often leaves the parameter empty or drops it:
a float linear layer's weight goes into oneDNN (or its small-GEMM kernel), fused experts into its
grouped-GEMM layout: each is read back through the kernel itself (an identity in, the weight out),
so that a check sees what vLLM serves, not what was handed to its loader. An int8 layer's weight
goes into a oneDNN handler that holds it (the parameter set to None): the int8 weight the handler
was made from, after vLLM's loaders and processing, stands for it. Where the CPU has AMX tiles, int8
weights go into its AMX kernels instead (a linear layer's small-GEMM path, fused experts'
CPUExpertsInt8), packed in place with each output row's compensation after them: they are read
back from that packing, and the compensation checked against them.
"""

from __future__ import annotations

import torch

from weightsync.vllm_backend.experts import cpu_packed, int8_packed
from weightsync.vllm_backend.internals import onednn_loaded, pack_int8, prepack_moe_weight

COMPENSATION = 4  # bytes after each packed int8 row: its int32 compensation, 128 x the row's sum


def unpacked(weight: torch.Tensor, experts) -> torch.Tensor:
    """Fused experts' weights as loaded, from the layout vLLM's CPU build packs them in (its
    grouped-GEMM kernel's; experts.pack_experts): the packing only moves elements, so packing their
    indices says where each went."""
    if weight.dtype != torch.float32 or weight.numel() >= 1 << 24:
        raise ValueError(f"reading packed experts back needs float32 weights of fewer than 2**24 elements, not "
                         f"{weight.dtype} {list(weight.shape)}")
    where = prepack_moe_weight(torch.arange(weight.numel(), dtype=torch.float32).view(weight.shape), experts.isa)
    out = torch.empty_like(weight).view(-1)
    out[where.view(-1).long()] = weight.reshape(-1)
    return out.view(weight.shape)


def unpacked_int8(packed: torch.Tensor) -> torch.Tensor:
    """int8 weights [..., out, in] from the layout vLLM's CPU build packs them in for its AMX int8
    kernels (convert_weight_packed: the weights moved into its tiles, each row's int32 compensation
    after them). Weights whose rows sum to zero pack with zero compensation, so where a packing of
    them is not zero is where the weights went; packing the bytes of each weight's index says which
    went where. Refused where that is no permutation or a row's compensation is not 128 x its sum."""
    pack = pack_int8
    *lead, rows, width = packed.shape
    shape = (*lead, rows, width - COMPENSATION)
    signs = torch.ones(shape, dtype=torch.int8)
    signs[..., 1::2] = -1
    moved = pack(signs).reshape(-1) != 0
    index = torch.arange(signs.numel(), dtype=torch.int64)
    where = torch.zeros(int(moved.sum()), dtype=torch.int64)
    for byte in range(-(-max(index.numel() - 1, 1).bit_length() // 8)):
        digit = ((index >> 8 * byte) & 0xFF).to(torch.uint8).view(torch.int8).view(shape)
        where |= pack(digit).reshape(-1)[moved].view(torch.uint8).long() << 8 * byte
    if where.numel() != index.numel() or where.unique().numel() != index.numel():
        raise ValueError(f"vLLM's int8 packing of {list(shape)} does not move each weight once")
    out = torch.empty(index.numel(), dtype=torch.int8)
    out[where] = packed.reshape(-1)[moved]
    out = out.view(shape)
    compensation = packed.reshape(-1)[~moved].contiguous().view(torch.int32).view(*lead, rows)
    if not torch.equal(compensation, 128 * out.sum(-1, dtype=torch.int32)):
        raise ValueError(f"vLLM's packed int8 weights {list(shape)} carry a compensation other than their rows' sums")
    return out


def served_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as the model computes with it, for the tests' dumps. vLLM's CPU build
    repacks a linear layer's weight for its GEMM kernel (oneDNN, or its own small-GEMM kernel) and
    leaves the parameter empty: such a weight is read back through the layer's own kernel, an
    identity in and the weight's transpose out; an int8 layer's weight (held by its oneDNN
    handler alone) is the one the handler was made from; and packed experts and int8 weights
    packed for the AMX kernels are unpacked."""
    modules = dict(model.named_modules())
    out = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = param.detach()
            module = modules.get(name.rpartition(".")[0])
            packed = cpu_packed(module) if name.endswith(("w13_weight", "w2_weight")) else None
            if packed is not None:
                tensor = unpacked(tensor, packed)
            elif tensor.dtype == torch.int8 and int8_packed(module, name.rpartition(".")[2]):
                tensor = unpacked_int8(tensor)
            if tensor.numel() == 0 and name.endswith(".weight") and hasattr(module, "cpu_linear"):
                # a replicated layer (a router's gate) has all of its input
                size = getattr(module, "input_size_per_partition", None) or module.input_size
                identity = torch.eye(size, dtype=tensor.dtype, device=tensor.device)
                tensor = module.cpu_linear(identity, tensor, None).t()
            out[name] = tensor.cpu().clone()
        for path, module in modules.items():
            weight = int8_weight(module)
            if weight is not None:
                out[f"{path}.weight" if path else "weight"] = weight
    return out


def int8_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The int8 weight [out, in] that vLLM's CPU int8 kernel (oneDNN, per-channel scales, dynamic
    per-token activations) was made from for a layer whose parameter it dropped (its handler holds
    it packed, where nothing reads it back: on CPUs without VNNI oneDNN's u8 x s8 products saturate
    in 16 bits, so an identity through the kernel does not give it back), as the engine kept it
    (internals.keep_onednn_scales); None for any other layer."""
    loaded = onednn_loaded(module)
    if loaded is None or getattr(module, "weight", None) is not None:
        return None
    return loaded.cpu().clone()
