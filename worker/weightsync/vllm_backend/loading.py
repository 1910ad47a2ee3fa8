"""The loading side of a vLLM worker: the staged version into the model vLLM serves, in vLLM's
engine core between two scheduler steps, when the job's controller asks (control.py drives the
update on every server; vLLM hands this worker the update info, which names the version and
proves the job token).

Every check is done before the model is touched: an update that does not prove the job token,
that names a version other than the staged one (staging.py), or that reaches a worker whose
receiving thread failed, changes nothing. Then one of three loads:
- the layerwise reload: vLLM's own reload machinery, each layer's checkpoint-format tensors
  loaded, then processed again as vLLM processes weights after loading (fused into qkv_proj and
  gate_up_proj, repacked for its kernels), and copied into the tensors the model runs on; a
  tensor-parallel worker hands vLLM's loaders the parts it received (shards.py, presharded);
- with spec.inference.vllm.loadAhead, the commit of the version already loaded into a shadow of the
  model (ahead.py): copied in, or on a CPU worker that runs eagerly its storages swapped;
- where versions are a LoRA adapter (spec.model.lora), the adapter the server serves under its
  name replaced (adapter.py); the base weights, loaded by vLLM from spec.model.path, stay.
A quantized job's versions are the quantized checkpoint's tensors, weights and scales, which the
same reload loads and processes for vLLM's quantized kernels (placement.py refused a server that
quantizes otherwise).

A load that fails part-way (vLLM's error, an exception in a loader) leaves the server with some
layers of the new version and the rest of the old: its API process's guard answers 503 from then
on (admission.py), and the receiving thread says so (runtime/inbound.LoadFailed): with
spec.inference.onLoadFailure rollBack the next version comes whole and loads whole, with failJob
the job fails. Loaded ahead, a failure touches only the shadow: the stage is discarded and the
server serves on the version it held.

The model is the one vLLM built the engine with: vLLM points an engine at another target only
for a draft model, which this engine does not take (supports_draft_weight_update).
"""

from __future__ import annotations

import time

import torch
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from weightsync.job import INFERENCE
from weightsync.job.token import same
from weightsync.rendezvous.protocol import update_proof
from weightsync.runtime.faults import dump, dumping, failing_half, pause_point
from weightsync.runtime.rank import log
from weightsync.vllm_backend.adapter import Adapters
from weightsync.vllm_backend.ahead import commit
from weightsync.vllm_backend.experts import pack_experts
from weightsync.vllm_backend.internals import keep_onednn_scales, presharded
from weightsync.vllm_backend.lora_shards import whole_adapter
from weightsync.vllm_backend.placement import Placement
from weightsync.vllm_backend.served import served_parameters
from weightsync.vllm_backend.staging import Stage


class Loader:
    """What loads a worker's staged versions into its model: set up once, at init, before the join."""

    def __init__(self, placement: Placement, model: torch.nn.Module, model_config, lora_config,
                 device: torch.device):
        self.placement, self.model, self.model_config, self.device = placement, model, model_config, device
        self.adapters = None if placement.lora is None else Adapters(model, placement.lora, lora_config)
        keep_onednn_scales(model, dumping)
        # a commit swaps storages where the model runs eagerly on the CPU, else copies (ahead.py)
        self.swap = device.type == "cpu" and bool(getattr(model_config, "enforce_eager", False))

    def receive(self, version: int, proof: str, stage: Stage) -> None:
        """Load the staged `version`, once `proof` is the job's (update_proof) and it is the one staged."""
        placement = self.placement
        ctx, me = placement.ctx, placement.me
        if not same(proof, update_proof(ctx.token, ctx.job.identity, version)):
            raise PermissionError(f"{me}: an update to version {version} without the job's proof was refused")
        taken = stage.take(version)
        pause_point(INFERENCE, placement.rank, "loading", version)
        start = time.monotonic()
        try:
            if taken.prepared is not None:
                commit(taken.prepared, self.model_config, swap=self.swap)
            elif self.adapters is not None:
                tensors = placement.tensors(taken.buffer)
                self.adapters.replace(tensors if placement.parts is None
                                      else whole_adapter(placement.local, placement.layout, tensors))
            else:
                self.load(taken.buffer, version)
        except BaseException as e:  # the receiving thread says so (runtime/inbound.LoadFailed); vLLM's answer fails
            stage.load_failed(e)
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.monotonic() - start
        if taken.prepared is not None:
            how = "storages swapped" if self.swap else "copied"
            log(me, f"committed version {version} into vLLM in {seconds:.3f}s ({how}; loaded ahead, while it "
                    f"served, in {taken.prepared.seconds:.3f}s)")
        else:
            what = f"the LoRA adapter {placement.lora.name} of " if self.adapters is not None else ""
            log(me, f"loaded {what}version {version} into vLLM in {seconds:.3f}s")
        if dumping():
            # an adapter: the tensors (or the worker's parts of them) it received and loaded
            served = dict(placement.tensors(taken.buffer)) if self.adapters is not None else served_parameters(self.model)
            dump(INFERENCE, placement.rank, version, served, None)
        stage.loaded_in(version, seconds)

    def load(self, buffer: torch.Tensor, version: int | None = None) -> None:
        """The staged version into the model through vLLM's layerwise reload (see above). Set up
        only once the update was checked, so a refused one leaves the model as it was."""
        initialize_layerwise_reload(self.model)
        with presharded(self.model):
            try:
                self.model.load_weights(failing_half(self.placement.tensors(buffer), self.placement.rank, version))
            finally:
                finalize_layerwise_reload(self.model, self.model_config)
        pack_experts(self.model)
