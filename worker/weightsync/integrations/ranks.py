"""A job and its ranks as another RL stack's weight-sync plug point holds them (verl.py), free of
that stack. Each piece is weightsync's own machinery put where a framework calls it:

- The controller in process (LocalController). A framework's run has no operator and no
  `weightsync run` beside it, so the job's controller, the one a controller pod runs
  (roles/controller.run), runs on a thread of one of its processes, its store on a leased port.
  Every rank then joins it as a pod of the job does: it reads the job from the store once it proved
  the token there (rendezvous/external_rank.fetch_job) and is admitted under the rank the
  framework's topology gave it.
- The token (job_token): WEIGHTSYNC_TOKEN, the join variable's name and meaning, in every process,
  or a file every process reads, created (mode 0600) by the process that runs the controller where
  it does not exist yet. Never an argument, a topology entry or a log line.
- Trainer ranks (TrainerRank) are handed each version as (name, tensor) pairs of whole tensors, as
  frameworks gather them, one at a time. Each is checked as it comes and put in spec.model's layout
  order by name (Version: a tied weight's other name and the model's buffers are no tensors of a
  version; any other name, a tensor missing or of another shape is refused, named), then published
  through weightsync.attach over a module whose parameters they are (NamedTensors). Every trainer
  rank is handed the whole version, so the plan by holder balances its bytes over all of them:
  each sends its share to every rollout at once, and keeps of each version only the tensors that
  share overlaps (the plan is made when the ranks join, before the first version: a rank holds
  about 1/M of a version, not all of it).
- Rollout ranks (RolloutRank) are inference ranks whose engine is the framework's: each version is
  received into staging and verified against the trainers' digest by the code every inference rank
  runs (runtime/inbound.py), and only then handed over, as (name, view) pairs; it counts as applied
  once the framework took all of it, so the trainers' send returns once every rollout holds it.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from weightsync.job import BUILTIN, CONTROLLER, INFERENCE, TRAINER, Job, SpecError, WorkerContext
from weightsync.job.join import Join, JoinEnv
from weightsync.job.token import MIN_BYTES, read_token
from weightsync.local import ports
from weightsync.model.build import build, layout_of
from weightsync.model.flat import FlatLayout, torch_dtype, views
from weightsync.publisher.sync import Published, Sync, attach
from weightsync.rendezvous.external_rank import fetch_job
from weightsync.rendezvous.messages import End
from weightsync.rendezvous.protocol import JobEnded, who
from weightsync.roles.controller import run as run_controller
from weightsync.runtime.inbound import receive_rounds
from weightsync.runtime.life import RankLife
from weightsync.runtime.rank import log
from weightsync.transfer.receive import ReceivedVersion, VersionReceiver
from weightsync.vllm_backend.control import Steps

START_WAIT = 60.0  # seconds for the controller's store to accept connections once its thread started
TAKE_CHECK = 1.0  # seconds between a staged version's looks for the end of the job while it waits to be taken


@dataclass(frozen=True)
class Address:
    """Where a rank finds its job: the controller's store, the job's identity and network mode
    (nothing secret: what a framework's topology may carry to every rank)."""

    host: str
    port: int
    job_id: str
    network_mode: str

    def context(self, token: bytes, role: str, rank: int) -> WorkerContext:
        """The WorkerContext of `role` rank `rank`, with the job read from the controller's store
        after proving `token` there (JoinError, one line, where that cannot be)."""
        join = Join(self.host, self.port, self.job_id, token, pod_ip=os.environ.get(JoinEnv.POD_IP) or None)
        job, channel = fetch_job(join)
        channel.close()
        return WorkerContext.from_join(join, job, role, rank, network_mode=self.network_mode)


def current(device: torch.device) -> None:
    """Make a CUDA `device` this thread's current one: CUDA's current device (and with it the
    current stream) is per thread, and a new thread's is device 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def job_token(token_file: str | None, create: bool = False) -> bytes:
    """The job's token: WEIGHTSYNC_TOKEN's, or the file `token_file`'s, which `create` makes (mode
    0600, a new token) where it does not exist yet. ValueError, one line, where there is none."""
    text = os.environ.get(JoinEnv.TOKEN, "").strip()
    if text:
        if len(text) < MIN_BYTES:
            raise ValueError(f"{JoinEnv.TOKEN} is shorter than {MIN_BYTES} bytes: give every process the same long "
                             "random token (for example `openssl rand -hex 32`)")
        return text.encode()
    if not token_file:
        raise ValueError(f"no job token here: set {JoinEnv.TOKEN} in every worker's environment (the same long random "
                         "value), or token_file to a path every worker can read")
    path = Path(token_file)
    if create:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
    if not path.is_file():
        raise ValueError(f"token_file {path} does not exist here: it must be a path every worker reads (shared storage), "
                         f"or set {JoinEnv.TOKEN} in every worker's environment instead")
    try:
        return read_token(path)
    except SpecError as e:
        raise ValueError(f"{e.problems[0]}: it must hold the job's token (delete it, and the controller's process "
                         "writes a new one)") from None


def check_job(job: Job) -> None:
    """A job whose ranks are a framework's trainers and rollouts: SpecError naming every field
    that cannot be, with what to set instead."""
    problems = [f"spec.{role}.external: the framework's processes are this job's {role} ranks; leave it unset"
                for role in (TRAINER, INFERENCE) if job.pods(role).external]
    if job.inference.engine != BUILTIN:
        problems.append(f"spec.inference.engine {job.inference.engine}: the framework loads each version into its own "
                        f"rollout engine; leave it {BUILTIN}")
    if job.inference.tensor_parallel != 1 or job.inference.tensor_parallel_sizes:
        problems.append("spec.inference.tensorParallel: every rollout worker receives the whole model (the framework's "
                        "engine shards it as it loads); leave it 1")
    for field, value in (("spec.model.lora", job.model.lora), ("spec.model.quantization", job.model.quantization)):
        if value is not None:
            problems.append(f"{field}: a version through a framework's plug point is the whole model; leave it unset")
    if job.transfer.delta.enabled:
        problems.append("spec.transfer.delta.enabled: a rollout worker keeps no earlier version to patch; set it false")
    if problems:
        raise SpecError(problems)


class LocalController:
    """The job's controller on a thread of this process, as a controller pod runs it."""

    def __init__(self, job: Job, token: bytes, host: str | None = None, check=check_job,
                 driven: Mapping[str, Steps] | None = None):
        """`check`: what refuses a job its ranks cannot hold (None: a job made to fit them);
        `driven`: the vLLM servers this process drives, by name, where not over HTTP (a Ray actor's
        owner drives it: vllm_actor.py)."""
        self.driven = dict(driven or {})
        if check is not None:
            check(job)
        host = host or os.environ.get(JoinEnv.POD_IP) or socket.gethostbyname(socket.gethostname())
        port = ports.lease([1])[0]  # free here, and leased as `weightsync run` leases its pods' ports
        # no operator here looks at the nodes for RDMA devices: `auto` is tcp, rdma is the spec's word
        mode = "rdma" if job.network.mode == "rdma" else "tcp"
        self.address = Address(host, port, job.identity, mode)
        self.ctx = WorkerContext(job=job, ordinal=0, role=CONTROLLER, pod_ip=host, controller_host=host, store_port=port,
                                 data_port=0, network_mode=mode, token=token, report_to_kubernetes=False, health_port=0)
        self.exit: int | None = None
        self.thread = threading.Thread(target=self._run, name="weightsync-controller", daemon=True)
        self.thread.start()
        self._wait_listening()

    def _run(self) -> None:
        try:
            self.exit = run_controller(self.ctx, driven=self.driven)
        finally:
            ports.release([self.address.port])

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + START_WAIT
        while True:
            if not self.thread.is_alive():
                raise RuntimeError(f"the controller of job {self.address.job_id} ended as it started (its lines above "
                                   "say why)")
            try:
                socket.create_connection((self.address.host, self.address.port), timeout=1.0).close()
                return
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"the controller of job {self.address.job_id} does not listen at "
                                       f"{self.address.host}:{self.address.port} after {START_WAIT:.0f}s ({e})") from None
                time.sleep(0.05)

    def wait(self, timeout: float) -> int | None:
        """Wait up to `timeout` seconds for the job's end; its exit status (None: still running)."""
        self.thread.join(timeout)
        return self.exit


@dataclass(frozen=True)
class Names:
    """spec.model's version layout, and the names a framework may hand besides its tensors': a
    tied weight's other names and the model's buffers, which no version carries."""

    layout: FlatLayout
    tied: Mapping[str, str]  # another name of a tied weight -> the name the layout has it under
    buffers: frozenset[str]

    @classmethod
    def of(cls, job: Job) -> "Names":
        model = build(job.model, dtype="float32", device="meta", load_weights=False)
        first: dict[int, str] = {}
        tied = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied[name] = first[id(p)]
            else:
                first[id(p)] = name
        return cls(layout_of(model, job.model.dtype), tied, frozenset(n for n, _ in model.named_buffers()))

    def order(self, named: Iterable[tuple[str, torch.Tensor]],
              stand_ins: Mapping[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
        """`named` in layout order, each tensor checked against its slot (Version.add)."""
        version = Version(self, stand_ins or {})
        for name, tensor in named:
            version.add(name, tensor)
        return version.tensors()

    def stand_ins(self, device) -> list[tuple[str, torch.Tensor]]:
        """A tensor of each slot's shape on `device` that holds one element (zero strides): what a
        rank passes for the tensors none of whose bytes it sends, which are never read."""
        one = torch.empty(1, dtype=torch_dtype(self.layout.dtype), device=device)
        return [(s.name, one.expand(s.shape)) for s in self.layout.slots]

    def touched(self, runs: Iterable[tuple[int, int]]) -> frozenset[str]:
        """The tensors that the version's byte runs (offset, length) overlap."""
        runs = list(runs)
        return frozenset(s.name for s in self.layout.slots
                         if any(offset < s.offset + s.nbytes and s.offset < offset + length for offset, length in runs))


class Version:
    """One version's tensors as a framework hands them over, one at a time, each checked against
    its slot as it comes (ValueError naming it: a name spec.model has not, another shape, a tensor
    given twice; then one missing). A tensor with a stand-in (one none of whose bytes this rank
    sends) is dropped once checked, the stand-in taking its place: the rank holds only its share."""

    def __init__(self, names: Names, stand_ins: Mapping[str, torch.Tensor]):
        self.names, self.stand_ins = names, stand_ins
        self.slots = {s.name: s for s in names.layout.slots}
        self.got: dict[str, torch.Tensor] = {}
        self.given_as: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        names = self.names
        if name in names.buffers:
            return
        own = names.tied.get(name, name)
        slot = self.slots.get(own)
        if slot is None:
            raise ValueError(f"{name}: spec.model has no such tensor (it has {len(self.slots)}, the first "
                             f"{names.layout.names[0]}): the job's spec.model must be the model the trainers train")
        if own in self.got:
            if self.given_as[own] == name:
                raise ValueError(f"{name} was given twice in one version: give each tensor once")
            return  # the same tied weight under its other name
        if tuple(tensor.shape) != tuple(slot.shape):
            raise ValueError(f"{name} is {list(tensor.shape)}, and spec.model's is {list(slot.shape)}: the job's "
                             "spec.model must be the model the trainers train")
        self.got[own], self.given_as[own] = self.stand_ins.get(own, tensor), name

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the version, in layout order."""
        missing = [n for n in self.names.layout.names if n not in self.got]
        if missing:
            raise ValueError(f"{len(missing)} tensor(s) of spec.model were not given, the first {missing[0]}: give every "
                             "tensor of the model in each version")
        return [(n, self.got[n]) for n in self.names.layout.names]


class NamedTensors(torch.nn.Module):
    """A version given as (name, tensor) pairs, as a module whose parameters are those tensors
    under those names (the trainer API reads a module's named_parameters), held until the next."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        super().__init__()
        self.named = named
        self.device = named[0][1].device

    def hold(self, named: list[tuple[str, torch.Tensor]]) -> None:
        elsewhere = next((n for n, t in named if t.device != self.device), None)
        if elsewhere is not None:
            raise ValueError(f"{elsewhere} is on {dict(named)[elsewhere].device}, and this rank sends from {self.device}: "
                             "give the tensors on the device the engine was made for (its `device` argument)")
        self.named = named

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return iter(self.named)


class TrainerRank:
    """A trainer rank publishing versions given as (name, tensor) pairs of whole tensors. It joins
    the job at once, on `device`, and then holds of each version only the tensors its share of
    the plan overlaps (about 1/M of a version); the others are checked and dropped as they come."""

    def __init__(self, ctx: WorkerContext, rank: int, device: torch.device):
        self.ctx, self.rank, self.me = ctx, rank, who(TRAINER, rank)
        self.device = torch.device(device)
        self.names = Names.of(ctx.job)
        placeholders = self.names.stand_ins(self.device)
        self.module = NamedTensors(placeholders)
        self.sync: Sync = attach(self.module, rank=self.rank, context=self.ctx)  # returns once every rank joined
        runs = self.sync.plan.expected_for(0).get(rank, [])  # every inference rank gets the whole version
        share = self.names.touched(runs)
        self.stand_ins = {n: t for n, t in placeholders if n not in share}
        log(self.me, f"holds {len(share)} of {len(placeholders)} tensors of each version (the ones its share overlaps)")

    def version(self) -> Version:
        """The next version, to add its tensors to as the framework hands them over."""
        return Version(self.names, self.stand_ins)

    def publish(self, version: Version, step: int | None) -> Published:
        """Send `version` as the next one, at `step`, and return once every inference rank holds it.
        Any thread may call it: a CUDA device is made this thread's current one first."""
        current(self.device)
        self.module.hold(version.tensors())
        published = self.sync.publish(step)
        done = self.sync.wait_done(published.version)
        plan = self.sync.plan
        held = done["bytes"] // plan.version_bytes  # every inference rank receives the whole version
        if held != plan.inferences:
            raise RuntimeError(f"version {published.version} (step {step}) is held by {held} of {plan.inferences} "
                               "inference ranks: the others failed or left while it was on its way (the job's log "
                               "names them)")
        return published

    def close(self) -> None:
        """No more versions from this rank: waits for the job's end (Sync.close); a job that failed
        meanwhile was said where it failed (send_weights raised its JobEnded), and is logged here."""
        try:
            self.sync.close()
        except JobEnded as e:
            log(self.me, f"closed: {e}")


class RolloutRank:
    """An inference rank whose engine is a framework's rollout (inbound.Handover): verified versions
    wait in staging until the framework takes them."""

    def __init__(self, ctx: WorkerContext, rank: int, device: torch.device):
        self.ctx, self.rank, self.me = ctx, rank, who(INFERENCE, rank)
        self.layout = Names.of(ctx.job).layout
        self.buffer = torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=device)
        self.cond = threading.Condition()
        self.staged: tuple[int, int | None] | None = None  # (version, its step) verified and not taken yet
        self.taken: int | None = None
        self.refused: BaseException | None = None  # why the framework will not take the staged version
        self.end: End | None = None
        self.failed: BaseException | None = None
        self.life = RankLife(ctx, INFERENCE, rank)
        self.member = self.life.member
        self.life.arrive()
        joined = self.life.join(self.buffer.device, self.layout.to_json())
        self.receiver = joined.end
        log(self.me, f"rollout worker on {self.buffer.device}, {joined.transport} transport ({joined.why}); listening on "
                     f"{joined.endpoint}")
        self.thread = threading.Thread(target=self._rounds, name="weightsync-receive", daemon=True)
        self.thread.start()

    def _rounds(self) -> None:
        """The receiving thread: the plan, then every round until the job ends. A failure here is
        handed to the framework at once, and reported: the controller fails the job naming this rank."""
        life = self.life
        try:
            current(self.buffer.device)
            life.heartbeat()
            plan, _ = life.plan()
            end = receive_rounds(life.member, VersionReceiver(self.receiver, plan, self.rank), self.ctx.job, self)
        except JobEnded as e:
            end = End(e.state, str(e))
        except BaseException as e:  # noqa: BLE001 - the controller fails the job naming this rank
            with self.cond:
                self.failed = e
                self.cond.notify_all()
            life.fail(e, trace=False, wait=False, said=f"{type(e).__name__}: {e}")
            end = life.wait_for_end()
        if end is not None:
            log(self.me, f"the job ended: {end.message}")
        life.bye()
        with self.cond:
            self.end = end
            self.cond.notify_all()

    # inbound.Handover: the receiving thread's side
    def staging(self):
        return self.buffer

    def base(self, version: int | None):
        return None  # no delta versions (check_job): each is received whole

    def offer(self, version: int, got: ReceivedVersion) -> float:
        """A verified version is in staging: wait until the framework took it (or the job ended);
        returns the seconds from its staging to its taking."""
        step = self.member.ready_of(version, 0).step
        staged = time.monotonic()
        with self.cond:
            self.staged = (version, step)
            self.cond.notify_all()
        while True:
            with self.cond:
                if self.cond.wait_for(lambda: self.taken == version or self.refused is not None, TAKE_CHECK):
                    if self.refused is not None:
                        raise self.refused
                    return time.monotonic() - staged
            self.member.check_end()

    # the framework's side
    def next_version(self, timeout: float) -> tuple[int, int | None]:
        """The next verified version and its step, once it is staged (TimeoutError past `timeout`)."""
        with self.cond:
            came = self.cond.wait_for(lambda: self.staged is not None or self.end is not None or self.failed is not None,
                                      timeout)
            if self.failed is not None:
                raise RuntimeError(f"{self.me} failed and holds no new version: {type(self.failed).__name__}: "
                                   f"{self.failed}")
            if self.end is not None:
                raise JobEnded(self.end.state, self.end.message)
            if not came:
                raise TimeoutError(f"{self.me}: no verified version within {timeout:.0f}s (spec.transfer.timeoutSeconds): "
                                   "every trainer rank must send each version the rollouts are asked to receive")
            return self.staged

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The staged version's tensors: views of staging, valid until the next version is taken."""
        return zip(self.layout.names, views(self.buffer, self.layout))

    def took(self, version: int) -> None:
        with self.cond:
            self.taken, self.staged = version, None
            self.cond.notify_all()

    def refuse(self, error: BaseException) -> None:
        """The framework will not take the staged version: the job fails, naming this rank and `error`."""
        with self.cond:
            self.refused = error
            self.cond.notify_all()

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the job's end (the receiving thread's goodbye)."""
        self.thread.join(timeout)
