"""weightsync as a vLLM weight-transfer engine: each vLLM worker process is an inference rank
(a tensor-parallel server's every worker, each receiving only its own slices: shards.py).

vLLM creates the engine in every worker once the model is loaded (`--weight-transfer-config
'{"backend": "weightsync"}'`). At init the worker joins the job's rendezvous like any inference
rank, from the pod's contract in its environment: the layout it declares is the Hugging Face
names and shapes of spec.model (what `model.load_weights` takes), and its staging buffer is
allocated and registered with the transport once. From then on a thread of its own takes every
round (inbound.py, the built-in engine's code): it receives the version into staging while vLLM
serves the previous one, verifies it, and tells the controller it is staged. The controller then
drives the update on every server (control.py): between two scheduler steps, receive_weights loads
the staged version through vLLM's own reload machinery (its layerwise reload: each layer's
checkpoint-format tensors loaded, then processed again as vLLM processes weights after loading,
fused into qkv_proj and gate_up_proj and repacked for its kernels, and copied into the tensors the
model runs on). With spec.inference.vllm.loadAhead the same reload runs once the version is verified,
into a shadow of the model while vLLM serves on, and the update only copies it in (ahead.py). A
version that failed verification is never staged, so it cannot be loaded; an
update call that names a version other than the staged one, or that does not prove the job token,
changes nothing: every check is done before the reload starts. A load that fails part-way (vLLM's
error, an exception in a loader) leaves the server with some layers of the new version and the
rest of the old: its API process's guard answers 503 from then on (admission.py), and this worker
says so (runtime/inbound.LoadFailed): with spec.inference.onLoadFailure rollBack the next version
comes whole and loads whole, with failJob the job fails. Loaded ahead, a failure touches only the
second copy: the stage is discarded and the server serves on the version it held.
A quantized job's versions (spec.model.quantization) are the quantized checkpoint's tensors, weights
and scales, which the same reload loads and processes for vLLM's quantized kernels; a server that
quantizes otherwise (or online) than the job says is refused at init.
Where versions are a LoRA adapter (spec.model.lora) a version replaces the adapter the server
serves under its name (adapter.py), and the base weights, loaded by vLLM from spec.model.path,
stay as they are.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from weightsync.job import INFERENCE, Env
from weightsync.job.token import same
from weightsync.model.build import meta_layout
from weightsync.model.config import config_of, expert_count
from weightsync.model.flat import torch_dtype, views
from weightsync.model.lora import adapter_layout
from weightsync.model.quant import format_of
from weightsync.plan.sliced_plan import LocalLayout, needs_everything, needs_to_json
from weightsync.rendezvous.messages import Staged
from weightsync.rendezvous.protocol import Member, update_proof, who
from weightsync.runtime.faults import dump, dumping, failing_half, pause_point
from weightsync.runtime.inbound import LoadFailed, StartAgain, receive_rounds
from weightsync.runtime.rank import JOIN_TIMEOUT, join_job, log, report_failure
from weightsync.transfer.receive import ReceivedVersion, VersionReceiver, settle_heap
from weightsync.vllm_backend import end_server, follow_server, lora_problem
from weightsync.vllm_backend.adapter import Adapters
from weightsync.vllm_backend.ahead import Prepared, commit, prepare
from weightsync.vllm_backend.experts import check_experts, cpu_packed, int8_packed, pack_experts, split_experts
from weightsync.vllm_backend.internals import keep_onednn_scales, presharded
from weightsync.vllm_backend.lora_shards import adapter_parts, whole_adapter
from weightsync.vllm_backend.parts import UnsupportedLayer
from weightsync.vllm_backend.place import joining, place_of, waits_for_init
from weightsync.vllm_backend.served import served_parameters
from weightsync.vllm_backend.shards import worker_needs, worker_parts

STAGED_CHECK = 1.0  # seconds between a staged rank's looks for the end of the job while it waits to be loaded


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """Empty for a job's own server and one that joined as it started: the pod's contract or the
    join variables say everything. A trainer that runs its job's controller itself names its job
    here, proven with the secret trainer and server share (place.init_join, guard.sign_init)."""

    job_id: str = ""
    controller: str = ""  # host:port of the job's store
    server: str = ""  # this server's URL as the controller reaches it
    proof: str = ""


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    version: int
    proof: str  # update_proof(token, job, version): only the job's controller can ask for a load


class WeightsyncEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        follow_server()  # this worker, which beats for its rank, ends with its server
        if joining() is not None:  # a server the user started joins as vLLM constructs it (place.py)
            self.init_transfer_engine(WeightsyncInitInfo())
        else:
            waits_for_init()  # a server of no job yet: refused here without the secret its trainer's init proves

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        joined = getattr(self, "place", None)
        if joined is not None and joined.external and not joined.by_init:  # joined as vLLM built it
            raise RuntimeError(f"{self.me} joined job {self.ctx.job.identity} when its server started: there is "
                               "nothing to initialize")
        if joined is not None and joined.by_init and self.thread.is_alive():
            raise RuntimeError(f"{self.me} is a rank of job {self.ctx.job.identity} until that job ends: a server takes "
                               "one trainer's job at a time")
        self.place = place_of(self.parallel_config, self.model_config, init_info)
        ctx = self.ctx = self.place.ctx
        local_rank = self.parallel_config.rank
        self.rank = self.place.rank
        self.me = who(INFERENCE, self.rank)
        lora = ctx.job.model.lora
        self.group = ctx.job.layout.tp_group(self.rank)
        if lora is None:
            built = self.place.model_layout  # where joining checked the server against it; built once
            self.layout, self.adapters = meta_layout(ctx.job.model) if built is None else built, None
        else:  # versions are the adapter alone: the base weights are the checkpoint's, loaded by vLLM
            self.layout, self.adapters = adapter_layout(ctx.job.model), self._adapters(lora)
        needs = self._needs()
        keep_onednn_scales(self.model, dumping)
        self.local = None if needs is None else LocalLayout.of(self.layout, needs)
        # one staging buffer; with delta versions a second, holding the version loaded (the base);
        # a worker of a job whose receivers hold slices gets every version whole, into its local layout
        delta = ctx.job.transfer.delta.enabled and self.local is None
        staging = self.layout.total_bytes if self.local is None else self.local.total_bytes
        self.buffers = [torch.zeros(staging, dtype=torch.uint8, device=self.device) for _ in range(2 if delta else 1)]
        self.staging_index, self.loaded, self.staged = 0, None, None
        # an adapter's version replaces the one before in place: there is nothing to load ahead
        self.ahead = ctx.job.inference.vllm.load_ahead and self.adapters is None
        self.prepared: Prepared | None = None  # with loadAhead: the staged version, loaded into a shadow
        self.spares: dict = {}  # the last prepared version's kernel tensors, the next prepare's
        # a commit swaps storages where the model runs eagerly on the CPU, else copies (ahead.py)
        self.swap = self.device.type == "cpu" and bool(getattr(self.model_config, "enforce_eager", False))
        self.load_seconds = 0.0  # how long the last load took (the controller's round record shows it)
        # vLLM's update session: opened by start_weight_update, kept open from one version to the
        # next (control.py), closed by finish_weight_update or by a failed update (vLLM's worker
        # closes it then); a LoRA server's is closed after every load: that is where vLLM
        # invalidates its LoRA state after the base weights changed (adapter versions leave them be)
        self.session = False
        self.keep_session = getattr(self.vllm_config, "lora_config", None) is None or self.adapters is not None
        self.failed: BaseException | None = None
        self.load_error: BaseException | None = None  # the staged version's load failed part-way
        self.cond = threading.Condition()
        member = Member(ctx.controller_host, ctx.store_port, ctx.token, INFERENCE, self.rank, JOIN_TIMEOUT,
                        job=ctx.job.identity)
        member.arrive()
        extra = {} if needs is None else {"needs": needs_to_json(needs)}
        joined = join_job(ctx, member, INFERENCE, self.rank, self.device, self.layout.to_json(),
                          port=ctx.data_port + local_rank if ctx.data_port else 0, engine="vllm",
                          server=self.place.server, **extra)
        self.member, self.receiver = member, joined.end
        log(self.me, f"vLLM worker on {self.device}, {joined.transport} transport ({joined.why}); listening on "
                     f"{joined.endpoint}")
        self.thread = threading.Thread(target=self._rounds, name="weightsync-receive", daemon=True)
        self.thread.start()

    def _rounds(self) -> None:
        """The receiving thread: the plan, then every round until the job ends."""
        member = self.member
        try:
            member.start_heartbeat()
            plan, _ = member.plan(JOIN_TIMEOUT)
            self._check_plan(plan)
            settle_heap()
            end = receive_rounds(member, VersionReceiver(self.receiver, plan, self.rank), self.ctx.job, self)
            log(self.me, f"the job ended: {end.message}")
            if self.place.external:  # a pod's server process says goodbye for it; here nobody else does
                member.bye()
        except BaseException as e:  # noqa: BLE001 - the controller fails the job naming this rank
            with self.cond:
                self.failed = e
                self.cond.notify_all()
            if isinstance(e, StartAgain) and end_server(str(e)):  # counted away (frozen, cut off): rejoin
                return
            log(self.me, f"failed: {e}")
            report_failure(self.ctx, INFERENCE, self.rank, e)
        finally:
            member.stop_heartbeat()
            self.receiver.close()

    # inbound.Handover: the receiving thread's side
    def staging(self):
        return self.buffers[self.staging_index]

    def base(self, version: int | None):
        with self.cond:
            if len(self.buffers) < 2 or version is None or version != self.loaded:
                return None
            return version, self.buffers[1 - self.staging_index]

    def offer(self, version: int, got: ReceivedVersion) -> float:
        """A verified version is in staging: say so, and wait until the controller had it loaded;
        returns the seconds the load took. With loadAhead the version is loaded into a shadow of
        the model first, while vLLM serves on (the staged record says how long that took)."""
        # a session closed after every load is reported closed: its finish may still be on its way
        opened = bool(self.session and self.keep_session)
        first = self.loaded is None  # only this thread's offers lead to loads
        prepared = None
        if self.ahead:
            try:
                prepared = prepare(self.model, self.model_config,
                                   failing_half(self._tensors(self.staging()), self.rank, version), presharded, self.spares)
            except Exception as e:  # noqa: BLE001 - the served copy was never touched: the stage is discarded
                raise LoadFailed(f"version {version} failed part-way as it was loaded ahead ({type(e).__name__}: {e}); "
                                 f"the copy vLLM serves was never touched: the stage is discarded, and the server "
                                 f"serves {self._holding()}", self.loaded) from None
        staged = Staged(got.digest, session_open=opened, keep_session=self.keep_session,
                        prepare_seconds=None if prepared is None else round(prepared.seconds, 6))
        with self.cond:
            self.staged, self.prepared = version, prepared
        self.member.say_staged(version, staged)
        while True:
            with self.cond:
                if self.cond.wait_for(lambda: self.loaded == version or self.load_error is not None, STAGED_CHECK):
                    if self.load_error is not None:
                        error, self.load_error, self.staged, self.prepared = self.load_error, None, None, None
                        raise LoadFailed(f"vLLM failed part-way through loading version {version} "
                                         f"({type(error).__name__}: {error}): the server holds no whole version and "
                                         "answers its clients 503 until the next version loads whole", None)
                    seconds = self.load_seconds
                    break
            self.member.check_end()  # the job may end (failed elsewhere) before the load
            if (why := self.member.away()) is not None:  # frozen or cut off meanwhile: never loaded now
                with self.cond:
                    self.staged, self.prepared = None, None
                raise StartAgain(f"the controller counted this rank away while version {version} waited to be loaded "
                                 f"({why}); ending this process so that it starts again and rejoins")
            if self.member.unloaded(version):
                with self.cond:
                    self.staged, self.prepared = None, None
                raise LoadFailed(f"another worker of this server failed to load version {version} ahead, so the "
                                 f"server does not load it: the stage is discarded, and it serves {self._holding()}",
                                 self.loaded)
        if first:
            # vLLM serves (it loaded a version): what it made after this engine joined (its
            # profile, KV cache, warm-up) out of the collector's reach too, once. Left in reach,
            # a full collection walks it every few versions (the prepares' objects add up): 0.4 s
            # in this process on a 2-core VM, in which the worker answers no call.
            settle_heap()
        return seconds

    # vLLM's side: the engine core, between two scheduler steps
    def start_weight_update(self) -> None:
        self.session = True  # nothing else: the reload is set up in receive_weights, once the update was checked

    def update_weights(self, update_info: dict) -> None:
        try:
            super().update_weights(update_info)
        except BaseException:
            self.session = False  # vLLM's worker closes the session when an update fails
            raise

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        version = update_info.version
        if not same(update_info.proof, update_proof(self.ctx.token, self.ctx.job.identity, version)):
            raise PermissionError(f"{self.me}: an update to version {version} without the job's proof was refused")
        with self.cond:
            if self.failed is not None:
                raise RuntimeError(f"{self.me} failed and loads nothing: {self.failed}")
            if self.staged != version:
                raise ValueError(f"{self.me} has version {self.staged} staged, not {version}: nothing was loaded")
            buffer, prepared = self.buffers[self.staging_index], self.prepared
        pause_point(INFERENCE, self.rank, "loading", version)
        start = time.monotonic()
        try:
            if prepared is not None:
                commit(prepared, self.model_config, swap=self.swap)
            elif self.adapters is not None:
                tensors = self._tensors(buffer)
                self.adapters.replace(tensors if self.parts is None else whole_adapter(self.local, self.layout, tensors))
            else:
                self.load(buffer, version)
        except BaseException as e:  # the receiving thread says so (runtime/inbound.LoadFailed); vLLM's answer fails
            with self.cond:
                self.load_error = e
                self.cond.notify_all()
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.monotonic() - start
        if prepared is not None:
            how = "storages swapped" if self.swap else "copied"
            log(self.me, f"committed version {version} into vLLM in {seconds:.3f}s ({how}; loaded ahead, while it "
                         f"served, in {prepared.seconds:.3f}s)")
        else:
            what = f"the LoRA adapter {self.ctx.job.model.lora.name} of " if self.adapters is not None else ""
            log(self.me, f"loaded {what}version {version} into vLLM in {seconds:.3f}s")
        if dumping():
            # an adapter: the tensors (or the worker's parts of them) it received and loaded
            served = dict(self._tensors(buffer)) if self.adapters is not None else served_parameters(self.model)
            dump(INFERENCE, self.rank, version, served, None)
        with self.cond:
            self.loaded, self.staged, self.load_seconds = version, None, seconds
            if self.prepared is not None:
                self.spares, self.prepared = self.prepared.clones, None
            if len(self.buffers) == 2:  # the loaded version stays as the next one's base
                self.staging_index = 1 - self.staging_index
            self.cond.notify_all()

    def _holding(self) -> str:
        return f"version {self.loaded}" if self.loaded is not None else "no version of the job's yet"

    def finish_weight_update(self) -> None:
        self.session = False  # nothing else: the reload is finished in receive_weights

    def _adapters(self, lora) -> Adapters:
        """The adapter this server serves, refused on one line where the server cannot serve it."""
        config = getattr(self.vllm_config, "lora_config", None)
        problem = lora_problem(lora, config is not None, getattr(config, "max_lora_rank", None))
        if problem is None and os.environ.get(Env.VLLM_LORA) != lora.name:
            problem = (f"this job serves its LoRA adapter as {lora.name} (spec.model.lora.name): start the vLLM server "
                       f"with {Env.VLLM_LORA}={lora.name} and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment")
        if problem is not None:
            raise ValueError(f"{self.me}: {problem}")
        return Adapters(self.model, lora, config)

    def _needs(self):
        """What this worker needs of a version (plan.boxes.RankSlices), or None where every
        inference rank of the job gets whole versions; refuses a server whose parallelism is not
        the job's."""
        parallel = self.parallel_config
        tp = parallel.tensor_parallel_size
        try:
            check_experts(self.model)
        except UnsupportedLayer as e:
            raise ValueError(f"{self.me}: {e}") from None
        if self.ctx.job.inference.vllm.load_ahead and any(cpu_packed(m) or int8_packed(m, "w13_weight")
                                                          for m in self.model.modules()):
            # the packing (experts.pack_experts; the int8 kernel's, made anew) replaces what a commit fills
            raise ValueError(f"{self.me}: spec.inference.vllm.loadAhead: vLLM's CPU build packs a mixture of experts' "
                             "weights again after each load, which a version loaded ahead cannot take: drop loadAhead")
        served = expert_count(getattr(self.model_config, "hf_text_config", None) or self.model_config.hf_config)
        wanted = expert_count(config_of(self.ctx.job.model))
        if served != wanted:  # a server the user started on another model
            raise ValueError(f"{self.me}: this vLLM server's model has {served} routed experts per layer, and the job's "
                             f"spec.model {wanted}: serve the job's model")
        if parallel.pipeline_parallel_size != 1 or parallel.data_parallel_size != 1:
            raise ValueError(f"{self.me}: the weightsync backend takes vLLM's tensor parallelism only; this server "
                             f"runs pipeline-parallel size {parallel.pipeline_parallel_size} and data-parallel size "
                             f"{parallel.data_parallel_size}: start it without them")
        if tp != len(self.group):
            raise ValueError(f"{self.me}: this vLLM server runs {tp} tensor-parallel worker(s), and the job's model replica "
                             f"of inference ranks {self.group.start}..{self.group.stop - 1} has {len(self.group)}: start it "
                             f"with --tensor-parallel-size {len(self.group)} (spec.inference.tensorParallel)")
        self.loads_as: dict = {}  # (tensor, box) -> checkpoint names vLLM loads the part as (shards.Part)
        if not self.ctx.job.layout.sliced:
            self.parts = None
            return None
        if tp == 1:
            self.parts = None
            return needs_everything(self.layout, self.rank)
        try:
            if self.adapters is not None:
                self.parts = adapter_parts(self.model, self.layout, self.vllm_config.lora_config)
            else:
                self.parts = worker_parts(self.model, self.layout, format_of(self.ctx.job.model.quantization))
        except UnsupportedLayer as e:
            raise ValueError(f"{self.me}: tensor-parallel size {tp}: {e}") from None
        self.loads_as = {(p.tensor, p.box): p.loads_as for p in self.parts if p.loads_as}
        split = split_experts(self.model)
        if split and self.ctx.job.inference.vllm.load_ahead:
            # the experts' loaders read the layer's parallel config, which the live layers share
            # with the shadow a version is loaded ahead into (ahead.py)
            raise ValueError(f"{self.me}: spec.inference.vllm.loadAhead loads a mixture of experts ahead only where each "
                             f"worker holds whole experts; this server splits the experts of {split[0]} over "
                             f"{tp} tensor-parallel workers: set spec.inference.vllm.expertParallel, or drop loadAhead")
        return worker_needs(self.parts, self.rank)

    def _check_plan(self, plan) -> None:
        """The controller planned what this worker declared; say what it receives of a version."""
        if self.local is None:
            if getattr(plan, "sliced", False):
                raise ValueError("the controller planned slices for a job whose inference ranks need whole versions")
            log(self.me, f"{plan.version_bytes} bytes per version from {len(plan.expected_for(self.rank))} trainer ranks")
            return
        if not getattr(plan, "sliced", False) or plan.bytes_for(self.rank) != self.local.total_bytes:
            raise ValueError(f"the controller's plan gives this worker {plan.bytes_for(self.rank)} bytes per version; "
                             f"the slices it declared take {self.local.total_bytes}")
        share = self.local.total_bytes / plan.version_bytes
        log(self.me, f"tensor-parallel rank {self.rank - self.group.start} of {len(self.group)} (inference ranks "
                     f"{self.group.start}..{self.group.stop - 1}): receives {self.local.total_bytes} of "
                     f"{plan.version_bytes} bytes per version ({share:.4f} of a whole version) from "
                     f"{len(plan.expected_for(self.rank))} trainer ranks")

    def load(self, buffer, version: int | None = None) -> None:
        """The staged version into the model through vLLM's own reload machinery: each layer is
        loaded from the checkpoint-format tensors and processed again as vLLM processes weights
        after loading (fused, repacked for its kernels), then copied into the tensors the model
        runs on. Set up only once the update was checked, so a refused one leaves the model as it
        was. A tensor-parallel worker hands vLLM's loaders the parts it received (shards.py)."""
        initialize_layerwise_reload(self.model)
        with presharded(self.model):
            try:
                self.model.load_weights(failing_half(self._tensors(buffer), self.rank, version))
            finally:
                finalize_layerwise_reload(self.model, self.model_config)
        pack_experts(self.model)

    def _tensors(self, buffer):
        """(checkpoint name, tensor) of everything staged: the whole version, or this worker's parts."""
        if self.local is None:
            return zip(self.layout.names, views(buffer, self.layout))
        return self._parts(buffer)

    def _parts(self, buffer):
        for slot in self.local.slots:
            part = buffer[slot.offset:slot.offset + slot.nbytes].view(torch_dtype(slot.dtype)).view(slot.shape)
            names = self.loads_as.get((slot.name, slot.box))
            if names:  # experts of one tensor of every expert, loaded as one expert's tensors each (shards.py)
                yield from zip(names, part.unbind(0))
            else:
                yield slot.name, part

    def shutdown(self) -> None:
        pass  # the receiving thread ends with the job

