"""What a vLLM worker serves, read back from its kernels: the parameters as the model computes
with them, for the tests' dumps (runtime/faults.py) that compare them with the trainers' bytes.

vLLM's CPU build repacks weights for its kernels and often leaves the parameter empty or drops it:
a float linear layer's weight goes into oneDNN (or its small-GEMM kernel), fused experts into its
grouped-GEMM layout: each is read back through the kernel itself (an identity in, the weight out),
so that a check sees what vLLM serves, not what was handed to its loader. An int8 layer's weight
goes into a oneDNN handler that holds it (the parameter set to None): the int8 weight the handler
was made from, after vLLM's loaders and processing, stands for it; on CPUs with AMX tiles vLLM
packs an int8 weight for its AMX kernel instead (blocks of rows, four bytes of a row together,
each block's row sums after it), which is unpacked by packing matrices of known values the same
way (sgl_unpacked).
"""

from __future__ import annotations

import torch

from weightsync.vllm_backend.experts import cpu_packed


def unpacked(weight: torch.Tensor, experts) -> torch.Tensor:
    """Fused experts' weights as loaded, from the layout vLLM's CPU build packs them in (its
    grouped-GEMM kernel's; shards.pack_experts): the packing only moves elements, so packing their
    indices says where each went."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    if weight.dtype != torch.float32 or weight.numel() >= 1 << 24:
        raise ValueError(f"reading packed experts back needs float32 weights of fewer than 2**24 elements, not "
                         f"{weight.dtype} {list(weight.shape)}")
    where = cpu_prepack_moe_weight(torch.arange(weight.numel(), dtype=torch.float32).view(weight.shape), experts.isa)
    out = torch.empty_like(weight).view(-1)
    out[where.view(-1).long()] = weight.reshape(-1)
    return out.view(weight.shape)


def served_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as the model computes with it, for the tests' dumps. vLLM's CPU build
    repacks a linear layer's weight for its GEMM kernel (oneDNN, or its own small-GEMM kernel) and
    leaves the parameter empty: such a weight is read back through the layer's own kernel, an
    identity in and the weight's transpose out; an int8 layer's weight (held by its oneDNN
    handler alone) is the one the handler was made from; and packed experts are unpacked."""
    modules = dict(model.named_modules())
    out = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = param.detach()
            module = modules.get(name.rpartition(".")[0])
            packed = cpu_packed(module) if name.endswith(("w13_weight", "w2_weight")) else None
            if packed is not None:
                tensor = unpacked(tensor, packed)
            if tensor.numel() == 0 and name.endswith(".weight") and hasattr(module, "cpu_linear"):
                # a replicated layer (a router's gate) has all of its input
                size = getattr(module, "input_size_per_partition", None) or module.input_size
                identity = torch.eye(size, dtype=tensor.dtype, device=tensor.device)
                tensor = module.cpu_linear(identity, tensor, None).t()
            out[name] = tensor.cpu().clone()
        for path, module in modules.items():
            weight = int8_weight(module)
            if weight is None and amx_int8(module):
                weight = sgl_unpacked(module.weight)
            if weight is not None:
                out[f"{path}.weight" if path else "weight"] = weight
    return out


def amx_int8(module: torch.nn.Module) -> bool:
    """Whether vLLM's CPU int8 kernel of this layer runs its AMX path (the weight packed for it)."""
    kernel = getattr(getattr(module, "scheme", None), "kernel", None)
    method = getattr(kernel, "linear_method", None)
    return getattr(method, "__name__", "") == "_apply_weights_sgl"


PLANE_BITS = 7  # bits of an element's index each probe carries (an int8 holds 0..127)


def sgl_unpacked(packed: torch.Tensor) -> torch.Tensor:
    """The int8 weight [out, in] that vLLM's convert_weight_packed made `packed` ([out, in + 4]:
    the row sums it appends are not the weight's). Where each element went is read from the same
    packing of probes: one whose rows sum to zero (1, -1, 1, ...: its row sums are zero bytes)
    finds the weight's bytes among the sums, and the elements' indices, seven bits a probe, find
    where each went. ValueError where the packing is not a permutation of the weight's bytes plus
    the sums."""
    convert = torch.ops._C.convert_weight_packed
    rows, cols = packed.shape[0], packed.shape[1] - 4
    count = rows * cols
    signs = (1 - 2 * (torch.arange(cols) % 2)).to(torch.int8).expand(rows, cols).contiguous()
    data = convert(signs).reshape(-1).nonzero().reshape(-1)
    index = torch.arange(count)
    planes = -(-max(count - 1, 1).bit_length() // PLANE_BITS)
    where = torch.zeros(data.numel(), dtype=torch.long)
    for p in range(planes):
        plane = ((index >> (PLANE_BITS * p)) & ((1 << PLANE_BITS) - 1)).to(torch.int8).view(rows, cols)
        where |= convert(plane).reshape(-1)[data].long() << (PLANE_BITS * p)
    if data.numel() != count or where.unique().numel() != count or int(where.max()) >= count:
        raise ValueError(f"vLLM's AMX int8 packing of a [{rows}, {cols}] weight is not the layout read back here "
                         f"({data.numel()} of its {packed.numel()} bytes look like the weight's)")
    out = torch.empty(count, dtype=torch.int8)
    out[where] = packed.reshape(-1)[data]
    return out.view(rows, cols)


def int8_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The int8 weight [out, in] that vLLM's CPU int8 kernel (oneDNN, per-channel scales, dynamic
    per-token activations) was made from for a layer whose parameter it dropped (its handler holds
    it packed, where nothing reads it back: on CPUs without VNNI oneDNN's u8 x s8 products saturate
    in 16 bits, so an identity through the kernel does not give it back), as the engine kept it
    (engine.keep_onednn_scales); None for any other layer."""
    kernel = getattr(getattr(module, "scheme", None), "kernel", None)
    loaded = getattr(kernel, "weightsync_loaded", None)
    if loaded is None or getattr(module, "weight", None) is not None:
        return None
    return loaded.cpu().clone()
