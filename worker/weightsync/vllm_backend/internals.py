"""vLLM's internals that weightsync relies on, behind one door.

The backend works through vLLM's public weight-transfer API and its layers' own loaders; where
vLLM offers no public way, it reads some of vLLM's private attributes, patches some of its objects
for a while, and relies on the layout of its layers and of its reload's records. Each of those is
named here and nowhere else in vllm_backend/ or integrations/ (tests/worker/test_layers.py checks
that no other module of them reads a private attribute, writes an attribute of an object not its
own, or uses setattr, __dict__ or the heap), so that a vLLM upgrade is checked in one place. torch's
module tables (_parameters, _buffers, _modules) and its AMX request are here too: torch's
internals, reached into on vLLM's layers.

INTERNALS lists the server's, each with a probe of the installed vLLM; register() runs them when
vLLM loads the plugin (missing()), so that a vLLM that lacks one refuses to start on one line
naming it and the release weightsync is tested with, and never fails a job mid-way. TRAINER lists
the trainer engine's (integrations/vllm.py), probed likewise as it is imported.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# what a module keeps in tables of its own; a shadow's other attributes are the live module's
# until processing replaces them (ahead.py)
TABLES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
TENSOR_TABLES = ("_parameters", "_buffers")
GONE = object()  # an attribute a module does not have
ONLINE_LOADER = "online_process_loader"  # the name of the wrapper vLLM's reload puts around a loader


@dataclass(frozen=True)
class Internal:
    """One internal of vLLM (or torch) that weightsync relies on, and how to tell it is there."""

    name: str
    use: str  # what weightsync does with it
    present: Callable[[], bool]


def _attr(module: str, path: str) -> Callable[[], bool]:
    def present() -> bool:
        obj = importlib.import_module(module)
        for part in path.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return present


def _sets(module: str, cls: str, *attrs: str) -> Callable[[], bool]:
    """An instance attribute its class's own code sets (no class attribute to look for)."""
    def present() -> bool:
        source = inspect.getsource(getattr(importlib.import_module(module), cls))
        return all(re.search(rf"self\.{a}\s*[:=]", source) for a in attrs)
    return present


def _fields(module: str, cls: str, *names: str) -> Callable[[], bool]:
    def present() -> bool:
        have = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), cls))}
        return set(names) <= have
    return present


def _source(module: str, text: str) -> Callable[[], bool]:
    return lambda: text in inspect.getsource(importlib.import_module(module))


def _module_tables() -> bool:
    return all(hasattr(torch.nn.Module(), t) for t in TABLES)


def _cpu_op() -> bool:
    """vLLM's CPU build's own op, read only by the tests' dumps of what it serves (served.py)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return True
    importlib.import_module("vllm._custom_ops")
    return hasattr(torch.ops._C, "convert_weight_packed")


LORA, LINEAR = "vllm.lora.worker_manager", "vllm.model_executor.layers.linear"
MOE, CPU_MOE = "vllm.model_executor.layers.fused_moe", "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
RELOAD, INT8 = "vllm.model_executor.model_loader.reload", "vllm.model_executor.kernels.linear.scaled_mm.cpu"
INTERNALS = (
    Internal("WeightTransferEngineFactory._registry", "the engine registered once per process",
             _attr("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory._registry")),
    Internal("torch.cpu._is_amx_tile_supported and torch.cpu._init_amx", "the AMX tiles asked for (allow_amx_tiles)",
             lambda: hasattr(torch.cpu, "_is_amx_tile_supported") and hasattr(torch.cpu, "_init_amx")),
    Internal("torch.nn.Module's tables (_parameters, _buffers, _modules)", "a model's shadow (ahead.py), its parameters",
             _module_tables),
    Internal("WorkerLoRAManager._load_adapter", "an adapter loaded from the versions (adapter.py)",
             _attr(LORA, "WorkerLoRAManager._load_adapter")),
    Internal("WorkerLoRAManager._adapter_manager", "the adapters a worker holds (adapter.py)",
             _sets(LORA, "WorkerLoRAManager", "_adapter_manager")),
    Internal("LoRAModelManager sets model.lora_manager", "the worker's LoRA manager found beside its model",
             _source("vllm.lora.model_manager", "self.model.lora_manager = self")),
    Internal("WeightsMapper._map_name_with_shard", "the parameter and shard of a checkpoint tensor (shards.py)",
             _attr("vllm.model_executor.models.utils", "WeightsMapper._map_name_with_shard")),
    Internal("RoutedExperts._map_global_expert_id_to_local_expert_id", "the slots of a worker's experts (experts.py)",
             _attr(MOE + ".routed_experts", "RoutedExperts._map_global_expert_id_to_local_expert_id")),
    Internal("RoutedExperts.moe_config and FusedMoEParallelConfig's tp_size, tp_rank",
             "a worker's experts loaded as given (presharded)",
             lambda: _sets(MOE + ".routed_experts", "RoutedExperts", "moe_config")()
             and _fields(MOE + ".config", "FusedMoEParallelConfig", "tp_size", "tp_rank")()),
    Internal("CPUUnquantizedExperts._use_zentorch and _padded_intermediate_size",
             "fused experts packed again after a load (experts.py)",
             lambda: _sets(CPU_MOE, "CPUUnquantizedExperts", "_use_zentorch")()
             and _attr(CPU_MOE, "CPUUnquantizedExperts._padded_intermediate_size")()),
    Internal("CPUInt8ScaledMMLinearKernel.process_weights_for_onednn and _apply_weights_sgl",
             "the int8 kernel's scales kept (keep_onednn_scales), its packing read",
             lambda: _attr(INT8, "CPUInt8ScaledMMLinearKernel.process_weights_for_onednn")()
             and _attr(INT8, "CPUInt8ScaledMMLinearKernel._apply_weights_sgl")()),
    Internal("LinearBase.tp_rank, VocabParallelEmbedding's shard_indices, org_vocab_size and tp_rank, "
             "BasevLLMParameter.tp_rank", "a worker's parts loaded as given (presharded)",
             lambda: _sets(LINEAR, "LinearBase", "tp_rank")()
             and _sets("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding",
                       "tp_rank", "shard_indices", "org_vocab_size")()
             and _sets("vllm.model_executor.parameter", "BasevLLMParameter", "tp_rank")()),
    Internal("LayerReloadingInfo's restore_metadata, restore_device, load_numel_total and reset",
             "a layer's checkpoint format read, a shadow's reload (ahead.py)",
             lambda: _fields(RELOAD + ".types", "LayerReloadingInfo", "restore_metadata", "restore_device",
                             "load_numel_total")()
             and _attr(RELOAD + ".types", "LayerReloadingInfo.reset")()),
    Internal(f"the reload's {ONLINE_LOADER} wrapper", "a shadow's loaders unwrapped (ahead.py)",
             _source(RELOAD + ".layerwise", f"def {ONLINE_LOADER}(")),
    Internal("vllm._custom_ops.cpu_prepack_moe_weight and torch.ops._C.convert_weight_packed",
             "the tests' dumps of packed weights (served.py)",
             lambda: _attr("vllm._custom_ops", "cpu_prepack_moe_weight")() and _cpu_op()),
    Internal("ParallelConfig._api_process_count", "a keep pause refused by a server of several API processes "
             "(inflight.py)", _fields("vllm.config.parallel", "ParallelConfig", "_api_process_count")),
    Internal("AsyncLLM.engine_core's pause_scheduler_async", "a keep pause straight to the engine (inflight.py)",
             lambda: _sets("vllm.v1.engine.async_llm", "AsyncLLM", "engine_core")()
             and _attr("vllm.v1.engine.core_client", "AsyncMPClient.pause_scheduler_async")()),
)
TRAINER = (
    Internal("WeightTransferTrainerFactory._registry", "the trainer engine registered once per process",
             _attr("vllm.distributed.weight_transfer.factory", "WeightTransferTrainerFactory._registry")),
    Internal("ModuleSource._module", "a ModuleSource's module read as it is, never gathered (vllm_source.py)",
             _sets("vllm.distributed.weight_transfer.base", "ModuleSource", "_module")),
)


def missing(internals: tuple[Internal, ...] = INTERNALS) -> list[Internal]:
    """The `internals` the installed vLLM lacks (an import that fails counts as lacking)."""
    out = []
    for internal in internals:
        try:
            ok = internal.present()
        except (ImportError, AttributeError, TypeError, OSError):
            ok = False
        if not ok:
            out.append(internal)
    return out


def api_process_count(parallel_config) -> int:
    """How many API processes vLLM's server runs (its --api-server-count), from its ParallelConfig."""
    return parallel_config._api_process_count


async def pause_engine(engine_client, mode: str) -> None:
    """vLLM's pause as its AsyncLLM.pause_generation makes it, less the 20 ms it then sleeps."""
    await engine_client.engine_core.pause_scheduler_async(mode=mode, clear_cache=False)


# the plugin (__init__.py) and the trainer engine (integrations/vllm.py)
def registered(factory, name: str) -> bool:
    return name in factory._registry


def source_module(source) -> torch.nn.Module:
    """The module a vLLM ModuleSource reads (it keeps it, and names no way to it)."""
    return source._module


def amx_tiles_supported() -> bool:
    return torch.cpu._is_amx_tile_supported()


def request_amx_tiles() -> bool:
    return torch.cpu._init_amx()


# parameters, as vLLM's layers hold them
def parameters_of(module: torch.nn.Module) -> dict:
    """A module's own parameter table (names to tensors, None where vLLM dropped one)."""
    return module._parameters


def recorded_parameters(module: torch.nn.Module) -> dict:
    """The parameters vLLM recorded for its layerwise reload, in checkpoint format."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return get_layerwise_info(module).restore_metadata[0]


def shard_mapper(model) -> Callable | None:
    """The model's mapping of a checkpoint name onto (its parameter, the shard), or None."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return mapper._map_name_with_shard if mapper is not None and hasattr(mapper, "_map_name_with_shard") else None


# fused experts (experts.py)
def local_expert(layer, expert: int) -> int:
    """The slot of global expert `expert` on this worker, negative where another holds it."""
    return layer._map_global_expert_id_to_local_expert_id(expert)


def uses_zentorch(experts) -> bool:
    return experts._use_zentorch


def padded_intermediate_size(experts, moe_config) -> int:
    return experts._padded_intermediate_size(moe_config)


def int8_small_gemm(kernel) -> bool:
    """Whether vLLM's CPU int8 kernel runs a layer on its small-GEMM path (its weight packed)."""
    return getattr(getattr(kernel, "linear_method", None), "__name__", "") == "_apply_weights_sgl"


# the tests' dumps (served.py)
def prepack_moe_weight(weight: torch.Tensor, isa) -> torch.Tensor:
    from vllm._custom_ops import cpu_prepack_moe_weight

    return cpu_prepack_moe_weight(weight, isa)


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops._C.convert_weight_packed(weight)


def onednn_loaded(module: torch.nn.Module) -> torch.Tensor | None:
    """The int8 weight a layer's oneDNN handler was last made from, where the tests dump (keep_onednn_scales)."""
    kernel = getattr(getattr(module, "scheme", None), "kernel", None)
    return getattr(kernel, "weightsync_loaded", None)


def keep_onednn_scales(model: torch.nn.Module, dumping: Callable[[], bool]) -> int:
    """vLLM's CPU int8 kernel (oneDNN, CPUInt8ScaledMMLinearKernel) prepacks a layer's weight into a
    handler that reads the weight's scales by address from the tensor it was made with. A layerwise
    reload makes it from the reload's own tensors, copies them into the layer's and drops them, so the
    handler reads freed memory (vLLM's reload_weights from disk too: its greedy tokens change while its
    weight checker sees no difference). Each such kernel keeps the tensors its handler was last made
    with; where `dumping()` (the tests dump what a worker serves, runtime/faults.py), also a copy of the
    int8 weight, which the handler holds packed and the layer no longer has (served.int8_weight).
    Returns the kernels it keeps tensors for."""
    count = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "scheme", None), "kernel", None)
        make = getattr(kernel, "process_weights_for_onednn", None)
        if make is None or getattr(make, "keeps_tensors", False):
            continue

        def keeping(layer, make=make, kernel=kernel):
            loaded = layer.weight.detach().clone() if dumping() else None
            make(layer)
            kernel.weightsync_kept = {n: t for n, t in layer.named_parameters(recurse=False)}
            kernel.weightsync_loaded = loaded

        keeping.keeps_tensors = True
        kernel.process_weights_for_onednn = keeping
        count += 1
    return count


# LoRA (adapter.py)
def worker_lora_manager(model: torch.nn.Module):
    """The worker's LoRA manager (its model runner's): the one whose adapter manager is the
    model's (vLLM sets model.lora_manager when it adds LoRA layers). vLLM 0.32 creates the engine
    with the model alone, and the model's adapter manager holds no way back to the runner's
    WorkerLoRAManager: so it is found among the process's objects, once, at init."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    held = getattr(model, "lora_manager", None)
    if held is None:
        raise ValueError("this vLLM server's model has no LoRA layers: start it with --enable-lora")
    for obj in gc.get_objects():
        if isinstance(obj, WorkerLoRAManager) and getattr(obj, "_adapter_manager", None) is held:
            return obj
    raise ValueError("this vLLM worker's LoRA manager was not found beside its model")


def adapter_manager(manager):
    """The adapters a worker's LoRA manager holds (vLLM's LoRAModelManager)."""
    return manager._adapter_manager


def load_adapters_with(manager, load: Callable) -> None:
    """This manager alone loads an adapter it does not hold with `load(request, vllm_load)`."""
    vllm_load = manager._load_adapter
    manager._load_adapter = lambda request: load(request, vllm_load)


# a reload's patch of the layers' tensor-parallel state (shards.py)
def sharded_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers whose loaders narrow by tensor-parallel rank."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return [m for m in model.modules()
            if isinstance(m, (LinearBase, VocabParallelEmbedding)) and getattr(m, "tp_size", 1) > 1]


@contextlib.contextmanager
def presharded(model: torch.nn.Module):
    """For a reload set up by initialize_layerwise_reload: vLLM's loaders take the worker's part
    as given (shards.py's docstring). Everything changed is put back on the way out."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    undo = []
    for module in model.modules():
        if isinstance(module, RoutedExperts) and module.moe_config.moe_parallel_config.tp_size > 1:
            # a copy of the module's own: the config object is shared with the kernels and other layers
            config = module.moe_config
            module.moe_config = copy.copy(config)
            module.moe_config.moe_parallel_config = dataclasses.replace(config.moe_parallel_config, tp_size=1, tp_rank=0)
            undo.append(lambda m=module, c=config: setattr(m, "moe_config", c))
    for module in sharded_modules(model):
        if isinstance(module, VocabParallelEmbedding):
            indices, size = module.shard_indices, module.org_vocab_size
            rows = indices.org_vocab_end_index - indices.org_vocab_start_index
            module.shard_indices = dataclasses.replace(indices, org_vocab_start_index=0, org_vocab_end_index=rows)
            module.org_vocab_size = rows
            undo.append(lambda m=module, i=indices, s=size: (setattr(m, "shard_indices", i), setattr(m, "org_vocab_size", s)))
            continue
        undo.append(lambda m=module, r=module.tp_rank: setattr(m, "tp_rank", r))
        module.tp_rank = 0
        # the parameters the reload materializes carry the recorded ones' attributes: v2 loaders
        # narrow by the parameter's own tp_rank
        for param in list(module._parameters.values()):
            if param is not None and "tp_rank" in param.__dict__:
                undo.append(lambda p=param, r=param.tp_rank: setattr(p, "tp_rank", r))
                param.tp_rank = 0
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


# a shadow of the model (ahead.py)
def twin_of(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of `module` with tables of its own (its children still the live ones)."""
    twin = copy.copy(module)
    for table in TABLES:
        twin.__dict__[table] = copy.copy(module.__dict__[table])
    return twin


def children(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module | None]]:
    return list(module._modules.items())


def set_child(module: torch.nn.Module, name: str, child: torch.nn.Module | None) -> None:
    module._modules[name] = child


def tensors_of(module: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor | None]]:
    """(table, name, tensor) of a module's own parameters and buffers."""
    for table in TENSOR_TABLES:
        for name, tensor in list(module.__dict__[table].items()):
            yield table, name, tensor


def tensor_in(module: torch.nn.Module, table: str, name: str) -> torch.Tensor | None:
    return module.__dict__[table].get(name)


def put_tensor(module: torch.nn.Module, table: str, name: str, tensor: torch.Tensor) -> None:
    module.__dict__[table][name] = tensor


def own_reload_record(live: torch.nn.Module, twin: torch.nn.Module) -> None:
    """The twin's reload record, a copy of what vLLM recorded of the live module at start-up (to
    restore the checkpoint format from), with meta tensors of its own: the reload binds a recorded
    tensor's loader to the layer it restores, and wraps it to buffer the layer's loads; done on
    the live model's record, the next shadow's loads would go to the last one."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    recorded, mine = get_layerwise_info(live), get_layerwise_info(twin)
    params, buffers = recorded.restore_metadata
    mine.restore_metadata = ({n: _meta_copy(t) for n, t in params.items()},
                             {n: _meta_copy(t) for n, t in buffers.items()})
    mine.restore_device = recorded.restore_device


def _meta_copy(meta: torch.Tensor) -> torch.Tensor:
    from vllm.model_executor.model_loader.reload.meta import to_meta_tensor

    twin = to_meta_tensor(meta)
    loader = twin.__dict__.get("weight_loader")
    while loader is not None and getattr(loader, "__name__", "") == ONLINE_LOADER:
        loader = loader.__wrapped__
    if loader is not None:
        twin.__dict__["weight_loader"] = loader
    return twin


def defer_processing(layer: torch.nn.Module) -> None:
    """The reload neither loads nor processes this layer (an attention layer, processed live)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    get_layerwise_info(layer).reset()
    get_layerwise_info(layer).load_numel_total = None


def as_kind_of(twin: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`twin` with `tensor`'s class and attributes (vLLM's parameters carry their loaders and
    sharding as attributes)."""
    twin.__class__ = tensor.__class__
    twin.__dict__.update(tensor.__dict__)
    return twin


def changed_attributes(live: torch.nn.Module, twin: torch.nn.Module) -> list[tuple[str, object]]:
    """(name, the twin's value or GONE) of each attribute, besides the tables, that processing
    changed on the twin (torchao's own bookkeeping left alone)."""
    out = []
    for key in live.__dict__.keys() | twin.__dict__.keys():
        if key in TABLES or key.startswith("_do_torchao") or key.startswith("_original_do_torchao"):
            continue
        if live.__dict__.get(key, GONE) is not twin.__dict__.get(key, GONE):
            out.append((key, twin.__dict__.get(key, GONE)))
    return out


def set_attributes(live: torch.nn.Module, changes: list[tuple[str, object]]) -> None:
    for key, value in changes:
        if value is GONE:
            del live.__dict__[key]
        else:
            live.__dict__[key] = value


def swap_storage(tensor: torch.Tensor, other: torch.Tensor) -> None:
    tensor.data, other.data = other.data, tensor.data
