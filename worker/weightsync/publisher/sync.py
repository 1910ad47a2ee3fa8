"""Publishing weights from any PyTorch training loop: the trainer side of weightsync.

    import weightsync

    sync = weightsync.attach(model)        # a plain module, DDP-wrapped, or FSDP2 (fully_shard)
    for step in range(steps):
        loss = train_step(model, batch)
        if step % 10 == 0:
            figures = sync.publish(step=step, loss=loss.item())   # every trainer rank, same versions
    sync.close()                           # or: with weightsync.attach(model) as sync: ...

Every trainer rank of the job calls these, in a process of a trainer pod: the operator (or
`weightsync run`) puts the job's contract in the pod's environment, and attach() reads it there
(job.pod.WorkerContext.from_environ), so the script takes no weightsync arguments. Its trainer
rank is the pod's only one, or the one torchrun's LOCAL_RANK picks of the pod's procsPerPod.

attach() joins the job: it publishes the version's layout (the model's parameter names, as its
Hugging Face checkpoint names them, and global shapes, cast to spec.model.dtype: they must be the
model the inference ranks build from spec.model; with spec.model.lora, the names and shapes of the
model's LoRA adapter alone, checked against the spec: model/lora.py) and, for FSDP2, the rows this
rank holds; then it waits for the controller's plan. publish() says this rank is ready with the next version, waits
for the controller's go (which comes once every trainer rank is ready), sends this rank's share
straight from its parameters or its local shards (never a gathered tensor) and returns the
figures. close() says this rank publishes no more: the controller ends the job once every trainer
rank closed, after sending the last version again to inference ranks that came back after it went
out. A failure inside any of these, or an exception that leaves the `with` block or reaches the
top of the script, is reported to the controller, which fails the job naming this rank.

A script run as the job's spec.trainer.command resumes instead: when a trainer rank stops between
two versions (its pod restarted, its node lost), every trainer rank starts again, and attach()
in the new process waits until all are back, then says where they resume (Sync.resumed: the last
version delivered and its step, for the script to check its checkpoint against); the version
numbers go on from the controller's. A process of an earlier start that still waits on weightsync
meanwhile ends (Resuming), so that it starts again with the others (rendezvous/resume.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Mapping

from weightsync.job import TRAINER, Env, Job, Join, JoinEnv, SpecError, WorkerContext, states
from weightsync.model.lora import Adapter
from weightsync.plan.job import delta_in_effect
from weightsync.publisher.peers import Connections
from weightsync.publisher.sources import Sources, local_tensors, sources_of
from weightsync.rendezvous.external_rank import JoinError, joined_context
from weightsync.rendezvous.messages import Round, SentReport
from weightsync.rendezvous.protocol import JobEnded, Keys, Restarted, Resuming
from weightsync.runtime import health
from weightsync.runtime.faults import pause_point, tamper_hook
from weightsync.runtime.life import RankLife
from weightsync.runtime.metrics import rank_counters
from weightsync.runtime.rank import Expected, log
from weightsync.transfer.send import SentVersion, VersionSender


@dataclass(frozen=True)
class Published:
    """What publish() did: this rank's share of one version."""

    version: int
    step: int | None
    bytes: int  # this rank's share of the version (every receiver got all of it)
    seconds: float  # sending it, from its first byte to the receivers' last acknowledgement
    wire_bytes: int  # what it put on the wire for all receivers (less than bytes x receivers with deltas)
    receivers: int  # inference ranks it went to
    lost: Mapping[int, str] = field(default_factory=dict)  # {inference rank: why} those it could not reach


@dataclass(frozen=True)
class Resumed:
    """Where the trainers resumed after a trainer rank started again (Sync.resumed)."""

    delivered: int | None  # the last version delivered to the inference ranks (None: none yet)
    step: int | None  # the training step it was published at
    version: int  # the version the next publish() sends


class Sync:
    """One trainer rank's link to its job (attach() makes it; the built-in trainer, whose rank
    process lives its `life` already, makes it with that)."""

    def __init__(self, model, ctx: WorkerContext, rank: int, life: RankLife | None = None):
        self.model, self.ctx, self.rank = model, ctx, rank
        self.life = life or RankLife(ctx, TRAINER, rank, resumes=ctx.job.trainer.resumes)
        self.member, self.me = self.life.member, self.life.me
        self.version = -1  # the last one published
        self.step: int | None = None  # its training step
        self.closed = False
        self.resumed: Resumed | None = None  # set where this process started again and the trainers resumed
        transfer = ctx.job.transfer
        self.timeout = transfer.timeout
        self.sender = None
        try:
            adapter = Adapter.of(ctx.job.model) if ctx.job.model.lora is not None else None
            self.sources: Sources = sources_of(model, ctx.job.model.dtype, adapter, ctx.job.model.quantization)
            device = self.sources.device
            holds = {"holds": self.sources.holdings.to_json()} if self.sources.holdings is not None else {}
            # its start counted (Restarted: a trainer's process that started again and does not
            # resume), its heartbeat, its join, the plan: the life every rank lives (runtime/life.py)
            started = self.life.start(device, self.sources.layout.to_json(), **holds)
            name, why, self.sender = started.joined.transport, started.joined.why, started.joined.end
            plan, endpoints = started.plan, started.endpoints
            if self.member.attempt > 1:
                self._resume(ctx.job.trainer.attach_timeout_seconds)
            health.ready()
            self.links = Connections(self.sender, self.member, endpoints, self.timeout)
            self.links.follow(Round(0, receivers=tuple(endpoints)))
            # over slices (the inference ranks hold tensor-parallel slices) each gets only its own
            delta, _ = delta_in_effect(transfer.delta, name, self.sender.capabilities.patches, plan.sliced)
            self.mover = VersionSender(self.sender, plan, rank, transfer.bucket_bytes, delta=delta,
                                       starts=self.sources.starts, tamper=tamper_hook())
        except Restarted as e:
            self._restarted(e)
        except BaseException as e:
            self._fail(e)
            raise
        held = "its shards" if self.sources.holdings is not None else "its replica"
        if adapter is not None:
            held += f" (the LoRA adapter alone, rank {adapter.lora.rank} on {len(adapter.layers)} layers)"
        kept = self.mover.kept_bytes
        kept = f"; keeps the last {kept} sent for delta versions" if kept else ""
        log(self.me, f"attached on {device}, {name} transport ({why}); sends {sum(b.length for b in self.mover.buckets)} "
                     f"of {plan.version_bytes} bytes per version, from {held}, to {len(endpoints)} inference ranks{kept}")
        _open.append(self)

    # ------------------------------------------------------------ the API

    def publish(self, step: int | None = None, loss: float | None = None, timeout: float | None = None) -> Published:
        """Publish the model's weights as they are now as the next version: every trainer rank
        calls this for the same versions. Waits for the controller's go (at most `timeout`
        seconds, spec.transfer.timeoutSeconds by default, once the previous version is done),
        sends this rank's share and returns the figures. `step` and `loss` go into the job's
        status (trainer rank 0's). Raises weightsync.JobEnded if the job ended meanwhile."""
        self._check_open()
        version = self.version + 1
        try:
            pause_point(TRAINER, self.rank, "before-ready", version)
            self.member.ready(version, step)
            pause_point(TRAINER, self.rank, "before-go", version)
            # the go comes once the previous version is done (its deadline is the controller's), or
            # after a resume, whose previous version may have been dropped on its way
            if version and not (self.resumed is not None and self.resumed.version == version):
                self.member.wait_for(Keys.done(version - 1), f"the controller to finish version {version - 1}")
            wait = self.timeout if timeout is None else timeout
            try:
                rnd = self.member.round(version, timeout=wait)
            except TimeoutError:
                raise Expected(f"the controller's go for version {version} did not come within {wait:.0f}s of the "
                               "previous version's end: every trainer rank must publish the same versions (the "
                               "go comes once all of them are ready)") from None
            sent = self._send(rnd, step, loss)
        except JobEnded:
            self._leave()
            raise
        except BaseException as e:
            self._fail(e)
            raise
        self.version, self.step = version, step
        return Published(version, step, sent.bytes, sent.seconds, sent.wire_bytes,
                         len(rnd.receivers) - len(sent.lost), dict(sent.lost))

    def wait_done(self, version: int, timeout: float | None = None) -> dict:
        """Wait until the controller finished `version`: every inference rank holds it, verified
        (every vLLM server serves it), but those that were away or failed meanwhile; returns the
        controller's record of it (status.transfer's fields: its `bytes` are what the inference
        ranks that hold it received). Raises weightsync.JobEnded if the job ended meanwhile."""
        self.member.wait_for(Keys.done(version), f"every inference rank to hold version {version}",
                             self.timeout if timeout is None else timeout)
        return self.member.done_record(version)

    def fail(self, error: BaseException) -> None:
        """This rank cannot go on: report `error` as its failure, which ends the job."""
        self._fail(error)

    def close(self) -> None:
        """This rank publishes no more versions. Waits for the end of the job, sending the last
        version again to inference ranks that come back for it meanwhile; raises
        weightsync.JobEnded if the job failed."""
        if self.closed:
            return
        try:
            self.member.closing(self.version)
            end = self._send_final_again()
        except BaseException as e:
            if not isinstance(e, JobEnded):
                self._fail(e)
                raise
            end = e
        self._leave()
        if end.state != states.SUCCEEDED:
            raise end

    def __enter__(self) -> "Sync":
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if error is None:
            self.close()
        elif not self.closed:
            if isinstance(error, JobEnded):
                self._leave()
            else:
                self._fail(error)
        return False

    @property
    def buffer_bytes(self) -> int:
        """Host or device memory this rank's sending holds: its send buffers (allocated by the
        first version that needs them), plus the last version kept for delta versions."""
        return self.mover.buffer_bytes + self.mover.kept_bytes

    @property
    def plan(self):
        """The job's plan as the controller made it (plan/interface.TransferPlan): which bytes of
        each version this rank sends, to which inference ranks."""
        return self.mover.plan

    def servers(self) -> tuple[str, ...]:
        """The base URLs of the job's vLLM servers (spec.inference.engine vllm), each once, in
        inference rank order, as of the last version published: where a script sends its own
        requests (rollouts). Each is the address the server's worker gave when it joined, the one
        the controller reaches it at. Empty for the built-in engine, which serves no HTTP."""
        self._check_open()
        return self.links.servers()

    def store(self, prefix: str = "user/"):
        """A torch.distributed Store on the job's own rendezvous (only the job's ranks, proving its
        token, reach it), its keys under `prefix`: for init_process_group(store=..., rank=...,
        world_size=...) among the trainer ranks where torchrun's store is not wanted."""
        return self.member.c10d_store(prefix)

    # ------------------------------------------------------------ sending

    def _params(self) -> list:
        return local_tensors(self.model, self.sources)

    def _send(self, rnd: Round, step: int | None, loss: float | None) -> SentVersion:
        """Send a round to its receivers; the ones lost on the way are reported, not fatal: the
        controller counts them away until they rejoin."""
        lost = self.links.follow(rnd)
        with self.member.cuts(rnd, self.sender.cut):  # receivers the controller counts away meanwhile
            sent = self.mover.send(rnd.version, self._params(), [r for r in rnd.receivers if r not in lost], lose_peers=True,
                                   after_bucket=lambda k: k == 0 and pause_point(TRAINER, self.rank, "mid-send", rnd.version),
                                   bases=rnd.bases)
        lost.update(sent.lost)
        for r, why in lost.items():
            self.sender.drop(r)
            log(self.me, f"lost inference rank {r} while sending {rnd.name}: {why}")
        report = SentReport(sent.bytes, sent.seconds, sent.checksums, sent.receiver_checksums, step=step, loss=loss,
                            lost=lost, wire_bytes=sent.wire_bytes, changed=sent.changed, compared=sent.compared)
        rank_counters(self.rank).sent(sent.wire_bytes)  # its pod's /metrics
        self.member.say_sent(rnd, report)
        return sent

    def _send_final_again(self) -> JobEnded:
        """After the last version: send it again whenever the controller says so, until the end."""
        if self.version < 0:
            end = self.member.wait_for_end()
            return JobEnded(end.state, end.message)
        again = 1
        while True:
            try:
                rnd = self.member.round(self.version, again)
            except JobEnded as e:
                return e
            sent = self._send(rnd, self.step, None)
            log(self.me, f"{rnd.name} to inference ranks {list(rnd.receivers)}: sent {sent.bytes} bytes in {sent.seconds:.4f}s")
            again += 1

    # ------------------------------------------------------------ the end

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self.me} is closed (close() was called, or it failed): it publishes no more")

    def _leave(self) -> None:
        """Stop the heartbeat and the transport, tell the controller this rank saw the end."""
        self._stop()
        self.life.bye()

    def _stop(self) -> None:
        """Stop the heartbeat and the transport (a process of an earlier start, as the trainers
        resume, says no goodbye: its rank's next start does, at the end)."""
        self.closed = True
        if self in _open:
            _open.remove(self)
        self.life.stop()

    def _resume(self, timeout: float) -> None:
        """This process started again: wait until every trainer rank is back, then go on from the
        version the controller says comes next."""
        where = self.member.resumed(timeout)
        self.version = where.version - 1
        self.resumed = Resumed(where.delivered, where.step, where.version)
        last = f"version {where.delivered} (step {where.step})" if where.delivered is not None else "none"
        log(self.me, f"resumed (start {self.member.attempt}): the last version delivered is {last}; the next is "
                     f"version {where.version}")

    def _fail(self, error: BaseException, trace: bool = True) -> None:
        """Report the failure naming this rank, and wait (a bounded time) for the controller to end
        the job, heartbeats going: the rank that failed first is the one it names. Where the
        trainers resume meanwhile (or the error is that they do), this process only ends."""
        if self.closed:
            return
        if not isinstance(error, Resuming):
            try:
                self.life.fail(error, trace=trace, check=self.member.check_resuming)
            except Resuming as e:
                error = e
        if isinstance(error, Resuming):
            log(self.me, str(error))
            self._stop()
            return
        self._leave()

    def _restarted(self, error: Restarted) -> None:
        end = self.member.end()
        if end is not None:  # a pod started again after its job ended: nothing to do
            raise JobEnded(end.state, f"{self.me} started again after the job ended: {end.message}")
        if self.ctx.job.trainer.external:  # refused at once: the job goes on with the process that holds the rank
            world = self.ctx.job.layout.world_size(TRAINER)
            raise Restarted(f"{self.me} of job {self.ctx.job.identity} is taken (this is its start {self.member.attempt}): "
                            f"another process joined with RANK={self.rank}, or this rank's process started again; "
                            f"each trainer process needs its own RANK (0..{world - 1}), and trainers do not rejoin a "
                            "running job") from None
        log(self.me, f"{error}; waiting for the controller to end the job")
        self.life.wait_for_end()
        self.life.bye()
        raise error


def attach(model, *, rank: int | None = None, context: WorkerContext | None = None) -> Sync:
    """Join this process's trainer rank to the job, with `model`'s weights as the versions it
    publishes. `rank` and `context` default to what the environment says: a trainer pod's
    contract (WEIGHTSYNC_SPEC_FILE, as weightsync's pods have it), or else the join variables of
    an external trainer (job/join.py) with torch.distributed's RANK and WORLD_SIZE."""
    if context is None and not os.environ.get(Env.SPEC_FILE):
        join = Join.from_environ(os.environ)
        if join is None:
            raise JoinError(f"weightsync.attach() finds no job in this process's environment: set "
                            f"{', '.join(JoinEnv.REQUIRED)} (an external trainer: the Secret <job>-join in a cluster, "
                            "the file `weightsync run --join-env FILE` writes on one machine), or run the script as "
                            "spec.trainer.command in the job's own trainer pods")
        context, channel = joined_context(join, TRAINER, lambda job, _: external_rank(job, os.environ, rank))
        channel.close()
        rank = external_rank(context.job, os.environ, rank)
    ctx = context or WorkerContext.from_environ()
    if ctx.role != TRAINER:
        raise SpecError([f"weightsync.attach() runs in trainer pods; this is the {ctx.role} pod {ctx.job.pod_name(ctx.ordinal)}"])
    sync = Sync(model, ctx, rank_of(ctx) if rank is None else rank)
    _hook_uncaught()
    return sync


def external_rank(job: Job, environ: Mapping[str, str], rank: int | None = None) -> int:
    """An external trainer's rank: `rank`, or torch.distributed's RANK; WORLD_SIZE must be the
    job's trainer world size (replicas x procsPerPod), so that every rank is some process's."""
    world = job.layout.world_size(TRAINER)
    size = environ.get("WORLD_SIZE")
    if size is None and world > 1:
        raise SpecError([f"WORLD_SIZE is not set, but job {job.identity} has {world} trainer ranks: start {world} "
                         "processes with torchrun (it sets RANK and WORLD_SIZE)"])
    if size is not None and size != str(world):
        raise SpecError([f"WORLD_SIZE={size}, but job {job.identity} has {world} trainer ranks (spec.trainer: "
                         f"replicas {job.trainer.replicas} x procsPerPod {job.trainer.procs_per_pod}): start exactly "
                         f"{world} trainer processes"])
    if rank is not None:
        return rank
    value = environ.get("RANK")
    if value is None and world == 1:
        return 0
    if value is None or not value.isdigit():
        said = "RANK is not set" if value is None else f"RANK={value}"
        raise SpecError([f"{said}: an external trainer of job {job.identity} needs its rank, 0..{world - 1}, in RANK "
                         "(torchrun sets it)"])
    return int(value)


def rank_of(ctx: WorkerContext, environ: Mapping[str, str] | None = None) -> int:
    """This process's trainer rank: the pod's only one, or LOCAL_RANK's of the pod's ranks (one
    process per rank, as torchrun starts them); checked against torchrun's RANK and WORLD_SIZE."""
    environ = os.environ if environ is None else environ
    ranks, world = ctx.ranks, ctx.job.layout.world_size(TRAINER)
    local = environ.get("LOCAL_RANK")
    if local is None and len(ranks) > 1:
        raise SpecError([f"this pod runs {len(ranks)} trainer ranks (spec.trainer.procsPerPod): start one process per "
                         "rank with torchrun (it sets LOCAL_RANK), or pass rank= to weightsync.attach()"])
    index = int(local or 0)
    if not 0 <= index < len(ranks):
        raise SpecError([f"LOCAL_RANK={index}, but this pod runs {len(ranks)} trainer ranks (spec.trainer.procsPerPod)"])
    rank = ranks[index]
    for name, want in (("RANK", rank), ("WORLD_SIZE", world)):
        if environ.get(name) not in (None, str(want)):
            raise SpecError([f"{name}={environ[name]}, but this process is trainer rank {rank} of {world}: start "
                             f"{len(ranks)} process(es) per pod (spec.trainer.procsPerPod), e.g. with plain torchrun"])
    return rank


# ---------------------------------------------------------------- an exception nobody caught

_open: list[Sync] = []
_previous_hook = None


def _hook_uncaught() -> None:
    """An exception that ends the script while a Sync is open is reported as that rank's failure."""
    global _previous_hook
    if _previous_hook is not None:
        return
    _previous_hook = sys.excepthook

    def hook(kind, error, tb):
        _previous_hook(kind, error, tb)
        for sync in list(_open):
            if isinstance(error, JobEnded):
                sync._leave()
            elif isinstance(error, Resuming):
                sync._stop()
            else:
                sync._fail(error, trace=False)

    sys.excepthook = hook
