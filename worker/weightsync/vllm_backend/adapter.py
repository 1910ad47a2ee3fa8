"""A LoRA adapter as a vLLM server's versions (spec.model.lora): served under one name, each
version replacing it in place through vLLM's own adapter loading, from the tensors received,
never through a file on disk.

vLLM serves an adapter that a request names when its API process knows the name: the resolver
here (registered by the plugin's entry point where WEIGHTSYNC_VLLM_LORA names the adapter, with
VLLM_ALLOW_RUNTIME_LORA_UPDATING, which has vLLM consult resolvers) answers that name with a
LoRARequest whose path is no directory but LORA_PATH. vLLM's API process then numbers the request
and has every worker add it; a worker's LoRA manager loads an adapter it does not hold through
its `_load_adapter`, which reads a directory: on the worker's manager (this instance alone) the
Adapters below answer that path with a LoRAModel made by vLLM's LoRAModel.from_lora_tensors from
the version loaded last, and refuse it while no version has arrived (the request fails with
vLLM's 400, and the next one asks again). Each version loaded (receive_weights, between two
scheduler steps) replaces the LoRAModel of every number vLLM gave the adapter in its manager
(remove, then add: vLLM copies it into its kernels' slots at the next step that runs it), so
requests naming the adapter run on the new version from the next step, and requests on the base
model, whose weights no version touches, are untouched.
"""

from __future__ import annotations

import threading

import torch
from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

from weightsync.job import Lora
from weightsync.vllm_backend.internals import adapter_manager, load_adapters_with, worker_lora_manager

LORA_PATH = "weightsync:versions"  # a LoRARequest's path: loaded from the versions weightsync delivered
RESOLVER = "weightsync"


class VersionResolver(LoRAResolver):
    """The API process's side: the adapter's name is a LoRARequest loaded from the versions."""

    def __init__(self, name: str):
        self.name = name

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        if lora_name != self.name:
            return None
        return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=LORA_PATH)  # vLLM numbers it anew


def register_resolver(name: str) -> None:
    LoRAResolverRegistry.register_resolver(RESOLVER, VersionResolver(name))


class Adapters:
    """A worker's side: the adapter of the version loaded last, as vLLM's LoRA manager of this
    worker holds it under every number vLLM gave it."""

    def __init__(self, model: torch.nn.Module, lora: Lora, lora_config):
        self.lora, self.lora_config = lora, lora_config
        self.manager = worker_lora_manager(model)
        self.tensors: dict[str, torch.Tensor] | None = None  # the version loaded last, in PEFT's names
        self.ids: set[int] = set()  # the numbers vLLM gave the adapter
        self.lock = threading.Lock()

        def load_adapter(request: LoRARequest, load) -> LoRAModel:
            return self._model(request.lora_int_id) if request.lora_path == LORA_PATH else load(request)

        load_adapters_with(self.manager, load_adapter)  # this worker's manager alone; others' paths as vLLM loads them

    def replace(self, tensors) -> None:
        """The adapter of a version (name, tensor) in place of the one before, under every number."""
        copies = {name: t.detach().clone() for name, t in tensors}  # the staging buffer receives the next one
        with self.lock:
            self.tensors = copies
            ids = sorted(self.ids)
        held = adapter_manager(self.manager)
        for lora_id in ids:
            if lora_id in held.list_adapters():
                model = self._model(lora_id)
                held.remove_adapter(lora_id)
                held.add_adapter(model)

    def _model(self, lora_id: int) -> LoRAModel:
        """vLLM's LoRAModel of the version loaded last, numbered `lora_id`: what vLLM's own loading
        makes of an adapter directory's tensors and config, from the tensors in memory."""
        with self.lock:
            tensors = self.tensors
            if tensors is None:
                raise ValueError(f"the LoRA adapter {self.lora.name} has no version yet: weightsync delivers its first "
                                 "version to this server soon; ask again then")
            self.ids.add(lora_id)
        lora = self.lora
        helper = PEFTHelper.from_dict({"r": lora.rank, "lora_alpha": lora.alpha,
                                       "target_modules": list(lora.target_modules)})
        helper.validate_legal(self.lora_config)
        manager = self.manager
        model = adapter_manager(manager).model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        # copies: vLLM scales B by alpha / rank in place as it makes the model (LoRAModel.optimize)
        copies = {n: t.clone() for n, t in tensors.items()}
        return LoRAModel.from_lora_tensors(lora_id, copies, helper, device="cpu", dtype=self.lora_config.lora_dtype,
                                           model_vocab_size=manager.vocab_size,
                                           weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
                                           skip_prefixes=getattr(model, "lora_skip_prefixes", None))

