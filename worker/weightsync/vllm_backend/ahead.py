"""Loading a version ahead of the pause (spec.inference.vllm.loadAhead): vLLM's layerwise reload
run into a shadow of the model while the server serves, so that the pause holds only a copy.

vLLM's reload (loading.py's load) does all its work on the live model between two scheduler steps:
each layer's checkpoint-format tensors are loaded into fresh tensors, processed as vLLM processes
weights after loading (fused, repacked for the CPU's GEMM kernels, and on GPUs whatever the
kernels need), and copied into the tensors the model runs on. The server serves nothing for all of
it. Here the same machinery runs on a shadow: every module of the model copied shallowly, with
parameter, buffer and child tables of its own, so that what the reload puts on a shadow module
never reaches the live one. The shadow's kernel tensors are clones of the live ones (what vLLM
copies processed values into), and what processing sets on a layer besides tensors (the CPU
build's packed-GEMM closure) lands in the shadow's own attributes. `commit`, in the pause, copies
every shadow tensor into the live tensor of the same name (in place, so that CUDA graphs and
compiled code keep their references) and sets the attributes processing changed, then runs the
attention layers' own processing on the live model as vLLM's reload finishes with it (an
attention layer's processing may reach state its shadow shares with the live layer, so it never
runs on the shadow). Where the model runs eagerly on the CPU (nothing captured a tensor's address,
and a copy of the version costs as much as loading it), `commit` swaps each pair's storage instead
of copying: the live tensor takes the prepared one's, and the shadow's clone the version before's,
which the next prepare loads into.

The price is memory: one more copy of the worker's weights (on a GPU, outside what
--gpu-memory-utilization leaves to vLLM), kept from one version to the next: the clones are
loaded into again, not allocated, since fresh memory costs a page fault per page. Nothing
unverified is prepared: the engine prepares a version only once it was verified in staging, and
the live model is untouched until the update call, checked as for any load, commits it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.attention import is_deferred_attention_layer
from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, initialize_layerwise_reload

from weightsync.vllm_backend.internals import (
    as_kind_of,
    changed_attributes,
    children,
    defer_processing,
    own_reload_record,
    put_tensor,
    set_attributes,
    set_child,
    swap_storage,
    tensor_in,
    tensors_of,
    twin_of,
)


class CommitError(RuntimeError):
    """A prepared version does not fit the live model (a tensor's shape or type changed)."""


@dataclass
class Prepared:
    """A version loaded and processed into a shadow of the model, waiting for the pause."""

    pairs: list[tuple[torch.nn.Module, torch.nn.Module]]  # (live, shadow) for every module
    attention: list[torch.nn.Module]  # the live attention layers, processed at the commit
    clones: dict[int, torch.Tensor]  # id(live kernel tensor): the shadow's, spares for the next prepare
    seconds: float  # how long the prepare took


def shadow_of(model: torch.nn.Module) -> tuple[torch.nn.Module, list[tuple[torch.nn.Module, torch.nn.Module]]]:
    """A copy of the module tree that shares every tensor and attribute with `model` until one is
    replaced on it; returns its root and the (live, shadow) pairs."""
    made: dict[int, torch.nn.Module] = {}
    pairs = []

    def shadow(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in made:  # a module reached twice (tied) stays one module
            return made[id(module)]
        twin = twin_of(module)
        made[id(module)] = twin
        pairs.append((module, twin))
        for name, child in children(module):
            set_child(twin, name, None if child is None else shadow(child))
        return twin

    root = shadow(model)
    for live, twin in pairs:  # what vLLM recorded at start-up, to restore the checkpoint format from
        own_reload_record(live, twin)
    return root, pairs


@torch.no_grad()
def prepare(model: torch.nn.Module, model_config, tensors, sharded,
            spares: dict[int, torch.Tensor] | None = None) -> Prepared:
    """Load `tensors` ((checkpoint name, tensor), the verified version) through vLLM's layerwise
    reload into a shadow of `model`; `sharded(root)` is the context the loaders run in (a
    tensor-parallel worker's parts: internals.presharded). `spares` are the clones of the version
    prepared before (its `clones`): used again, not allocated (fresh memory costs a page fault
    per page, most of a prepare's time on a busy machine), and not refilled from the live tensors
    either: the reload writes every part of them that any version writes, and the parts no version
    writes (padding, buffers such as the rotary tables) hold what the first clone copied, as the
    live tensors do."""
    began = time.monotonic()
    root, pairs = shadow_of(model)
    attention = []
    spare = spares or {}
    clones: dict[int, torch.Tensor] = {}  # a tensor two modules share (tied embeddings) gets one clone
    for live, twin in pairs:
        for table, name, tensor in tensors_of(twin):  # the kernel tensors vLLM copies the processed values into
            if tensor is not None:
                if id(tensor) not in clones:
                    clones[id(tensor)] = _clone(tensor, spare.get(id(tensor)))
                put_tensor(twin, table, name, clones[id(tensor)])
    initialize_layerwise_reload(root)
    for live, twin in pairs:
        if is_deferred_attention_layer(twin):  # processed on the live layer at the commit, never here
            defer_processing(twin)
            attention.append(live)
    with sharded(root):
        try:
            root.load_weights(tensors)
        finally:
            finalize_layerwise_reload(root, model_config)
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()
    return Prepared(pairs, attention, clones, time.monotonic() - began)


def _clone(tensor: torch.Tensor, spare: torch.Tensor | None) -> torch.Tensor:
    """A copy of a kernel tensor that keeps its class and attributes (vLLM's parameters carry their
    loaders and sharding as attributes), or `spare` where it fits (see prepare)."""
    if (spare is not None and spare.shape == tensor.shape and spare.dtype == tensor.dtype
            and spare.device == tensor.device and spare.stride() == tensor.stride()):
        return spare
    twin = tensor.detach().clone()
    if isinstance(tensor, torch.nn.Parameter):
        twin = torch.nn.Parameter(twin, requires_grad=False)
    return as_kind_of(twin, tensor)


@torch.no_grad()
def commit(prepared: Prepared, model_config, swap: bool = False) -> None:
    """In the pause: the prepared version into the live model, copied, or with `swap` its storage
    exchanged with the live tensors' (see above: only where nothing holds their addresses). Every
    check runs before the first change, so a version that does not fit changes nothing."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    settings = []
    attention = {id(layer) for layer in prepared.attention}
    for live, twin in prepared.pairs:
        if id(live) in attention:
            continue
        for table, name, tensor in tensors_of(live):
            new = tensor_in(twin, table, name)
            if tensor is None or new is None or new is tensor:
                continue
            if new.shape != tensor.shape or new.dtype != tensor.dtype or new.device != tensor.device:
                raise CommitError(f"{type(live).__name__}.{name}: vLLM processed it to {tuple(new.shape)} "
                                  f"{new.dtype} on {new.device}, and the model runs on {tuple(tensor.shape)} "
                                  f"{tensor.dtype} on {tensor.device}: nothing was loaded")
            if swap and new.stride() != tensor.stride():  # a swap would hand the model another layout
                raise CommitError(f"{type(live).__name__}.{name}: vLLM processed it to strides {new.stride()}, "
                                  f"and the model runs on strides {tensor.stride()}: nothing was loaded")
            if copies.setdefault(id(tensor), (tensor, new))[1] is not new:
                raise CommitError(f"{type(live).__name__}.{name}: a tensor the model shares between layers was "
                                  "processed into two different ones: nothing was loaded")
        settings.append((live, changed_attributes(live, twin)))
    for tensor, new in copies.values():
        if swap:
            swap_storage(tensor, new)
        else:
            tensor.data.copy_(new)
    for live, changes in settings:
        set_attributes(live, changes)
    for layer in prepared.attention:  # as vLLM's reload ends with every attention layer
        layer.process_weights_after_loading(model_config.dtype)

