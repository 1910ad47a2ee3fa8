"""weightsync as a vLLM weight-transfer engine: each vLLM worker process is an inference rank
(a tensor-parallel server's every worker, each receiving only its own slices: shards.py).

vLLM creates the engine in every worker once the model is loaded (`--weight-transfer-config
'{"backend": "weightsync"}'`). WeightsyncEngine is the class it creates, vLLM's
WeightTransferEngine interface and nothing more; the work is in three parts, each with one
concern, that it builds in order at init and delegates to:
- placement.py: which inference rank the worker is (place.py: from the pod's contract, the join
  variables or its trainer's init), what a version is to it (its layout, built once) and what it
  needs of one, and every check that refuses a server the job cannot use: decided once, a frozen
  record (Placement) the other two read;
- loading.py: the staged version into the model when the controller asks (receive_weights): the
  checks before the reload, vLLM's layerwise reload, a version loaded ahead committed, a LoRA
  adapter replaced, a load that fails part-way;
- staging.py: the buffer every version is received into while vLLM serves the one before, and
  the hand-over between the receiving thread and vLLM's engine core (Stage): verified, staged,
  loaded ahead, loaded or failed.
The staging buffer is allocated and the loading side set up before the worker joins the job, so
that a server that cannot take the job is refused before the controller counts it.

The worker's life as a rank of the job, the same as any inference rank's (runtime/life.py), is
here, in join_rank and run_rounds: its join, with its layout and needs; then on a thread of its
own the plan, every round (runtime/inbound.py, the built-in engine's code, handing each verified
version to the Stage), and its end: a failure reported to the controller, or a server the user
started saying goodbye. The controller drives each update on every server (control.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from weightsync.job import INFERENCE
from weightsync.plan.sliced_plan import needs_to_json
from weightsync.runtime.inbound import StartAgain, receive_rounds
from weightsync.runtime.life import RankLife
from weightsync.runtime.rank import log
from weightsync.transfer.receive import VersionReceiver
from weightsync.transport.base import Receiver
from weightsync.vllm_backend import end_server, follow_server
from weightsync.vllm_backend.loading import Loader
from weightsync.vllm_backend.place import joining, waits_for_init
from weightsync.vllm_backend.placement import Placement, placement_of
from weightsync.vllm_backend.staging import Stage, staging_buffers


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
        self.placement: Placement | None = None  # set once the worker joined a job
        self.thread: threading.Thread | None = None  # the receiving thread
        # vLLM's update session: opened by start_weight_update, kept open from one version to the
        # next (control.py), closed by finish_weight_update or by a failed update (vLLM's worker
        # closes it then); a LoRA server's is closed after every load (placement.keep_session)
        self.session = False
        follow_server()  # this worker, which beats for its rank, ends with its server
        if joining() is not None:  # a server the user started joins as vLLM constructs it (place.py)
            self.init_transfer_engine(WeightsyncInitInfo())
        else:
            waits_for_init()  # a server of no job yet: refused here without the secret its trainer's init proves

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        held = self.placement
        if held is not None and held.place.external and not held.place.by_init:  # joined as vLLM built it
            raise RuntimeError(f"{held.me} joined job {held.ctx.job.identity} when its server started: there is "
                               "nothing to initialize")
        if held is not None and held.place.by_init and self.thread.is_alive():
            raise RuntimeError(f"{held.me} is a rank of job {held.ctx.job.identity} until that job ends: a server takes "
                               "one trainer's job at a time")
        placement = placement_of(self.vllm_config, self.model, init_info)
        loader = Loader(placement, self.model, self.model_config, getattr(self.vllm_config, "lora_config", None),
                        self.device)
        buffers = staging_buffers(placement, self.device)
        self.session = False
        life, receiver = join_rank(placement, self.device, self.parallel_config.rank)
        stage = Stage(placement, buffers, life.member, self.model, self.model_config, lambda: self.session)
        self.placement, self.loader, self.stage = placement, loader, stage
        self.thread = threading.Thread(target=run_rounds, args=(placement, life, receiver, stage),
                                       name="weightsync-receive", daemon=True)
        self.thread.start()

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
        if self.placement is None:
            raise RuntimeError("this vLLM worker is a rank of no job yet: its trainer's init comes before any update")
        self.loader.receive(update_info.version, update_info.proof, self.stage)

    def finish_weight_update(self) -> None:
        self.session = False  # nothing else: the reload is finished in receive_weights

    def shutdown(self) -> None:
        pass  # the receiving thread ends with the job


# The worker's life as a rank of its job (runtime/life.py): every call into it is here.
def join_rank(placement: Placement, device: torch.device, worker: int) -> tuple[RankLife, Receiver]:
    """Join the job as `placement` says, proving the job token, declaring the version's layout and
    what the worker needs of it; returns its life as a rank and its end of the transport,
    listening (on the data port plus vLLM's worker rank, where the job sets one)."""
    ctx, rank = placement.ctx, placement.rank
    life = RankLife(ctx, INFERENCE, rank)
    life.arrive()
    extra = {} if placement.needs is None else {"needs": needs_to_json(placement.needs)}
    joined = life.join(device, placement.layout.to_json(), port=ctx.data_port + worker if ctx.data_port else 0,
                       engine="vllm", server=placement.place.server, **extra)
    log(placement.me, f"vLLM worker on {device}, {joined.transport} transport ({joined.why}); listening on "
                      f"{joined.endpoint}")
    return life, joined.end


def run_rounds(placement: Placement, life: RankLife, receiver: Receiver, stage: Stage) -> None:
    """The receiving thread: the plan, then every round until the job ends."""
    try:
        life.heartbeat()
        plan, _ = life.plan()
        placement.check_plan(plan)
        life.settle()
        end = receive_rounds(life.member, VersionReceiver(receiver, plan, placement.rank), placement.ctx.job, stage)
        log(placement.me, f"the job ended: {end.message}")
        if placement.place.external:  # a pod's server process says goodbye for it; here nobody else does
            life.bye()
    except BaseException as e:  # noqa: BLE001 - the controller fails the job naming this rank
        stage.fail(e)
        if isinstance(e, StartAgain) and end_server(str(e)):  # counted away (frozen, cut off): rejoin
            return
        life.fail(e, trace=False, wait=False)
    finally:
        life.stop()
