"""weightsync as vLLM's trainer-side weight-transfer engine "weightsync": a trainer written
against vLLM's RL API (vllm.distributed.weight_transfer) adopts weightsync by changing its init
info alone:

    from weightsync.integrations.vllm import WeightsyncTrainerInitInfo
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightsyncTrainerInitInfo(rank=rank), client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights()  # on every rank, every step

Importing this module registers the engine with vLLM's WeightTransferTrainerFactory (the script
imports it for the init info anyway): vLLM loads its plugin entry point only in its own server
processes, never in a trainer's.

Where the trainer's job comes from:
- No job file (no join variables, no pod contract: a script started with torchrun, servers started
  with `vllm serve`): the run is its own job. Trainer rank 0 makes it from what the script gave
  vLLM's API (vllm_job.own_job: the model's config, one inference server per client, torchrun's
  world size) and runs its controller in process (ranks.LocalController); every rank learns where
  it listens over torch.distributed's default group (the one FSDP2 or DDP runs on), and each
  server learns it through vLLM's own handshake: rank 0's init (client.init_weight_transfer_engine)
  names the job, its controller and the server's URL, with a proof made with the secret the
  trainer and the servers share (WEIGHTSYNC_TOKEN or WEIGHTSYNC_TOKEN_FILE, never an argument).
  Each server's workers then join and claim their ranks as a job's external servers do.
- A job's (the join variables WEIGHTSYNC_CONTROLLER, WEIGHTSYNC_JOB_ID, WEIGHTSYNC_TOKEN, from
  `weightsync run --join-env` or the Secret <job>-join; or the trainer pod's own contract): every
  rank joins that job as its external trainers; its servers joined it as they started.

What differs from vLLM's own engines, and why:
- Every trainer rank sends its own rows to every server's workers (publisher.attach): FSDP2 shards
  without a gather, DDP replicas balanced by bytes. Nothing funnels through rank 0.
- The clients name the servers, and rank 0 calls them only for the init. A job's servers answer
  their update routes only to the job's controller (vllm_backend/guard.py), which pauses each
  server, loads the version after its digest is verified, labels it (vLLM's weight_version is the
  version number) and resumes it. Each client's server must be one of the job's.
- send_weights() returns once every server serves the new version, as vLLM's engines do, but
  those the job's rules count away (a server that went away: the version goes on with the rest;
  spec.inference.minAvailable and awayGraceSeconds, the init info's min_available and
  away_grace_seconds here, say when that fails the job instead, naming it).
- A RayVLLMWeightSyncClient's server, an LLM or AsyncLLM hosted by a Ray actor (one actor per
  client), has no URL: rank 0's process, which holds the client, drives its updates through the
  actor's methods at its in-process controller's request, with the same verification, digests and
  label (vllm_actor.py says what differs). So a Ray client needs the run to be its own job: with a
  job's, whose controller runs elsewhere, it is refused.
- Everything that cannot work is refused on one line in trainer_init, before any byte moves.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlsplit

import torch.distributed as dist
from transformers import AutoConfig
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from weightsync.integrations.ranks import Address, LocalController
from weightsync.integrations.vllm_actor import ActorServer, refusal, servers_of
from weightsync.integrations.vllm_job import (
    dtype_of,
    init_info,
    init_refusal,
    model_config,
    own_job,
    trainer_world,
    unguarded,
)
from weightsync.integrations.vllm_source import SourceTensors, weights_of
from weightsync.job import TRAINER, Env, Join, JoinEnv, SpecError
from weightsync.job.join import shared_token
from weightsync.publisher.sync import Sync, attach
from weightsync.rendezvous.protocol import who
from weightsync.runtime.life import Farewell
from weightsync.runtime.rank import log
from weightsync.vllm_backend import BACKEND, check_trainer_vllm
from weightsync.vllm_backend.control import Server, Unreachable
from weightsync.vllm_backend.internals import registered

END_WAIT = 120.0  # seconds rank 0 waits for its controller to end the job once every rank shut down


@dataclass(kw_only=True)
class WeightsyncTrainerInitInfo(TrainerInitInfo):
    """`rank`: this process's trainer rank; nothing else is needed on one machine. `world_size`:
    the trainer ranks the script starts, which must be torchrun's WORLD_SIZE (default: it).

    Without a job file, the job's settings, each with its default: `name` (the job's, in logs and
    the servers' joins), `dtype` (what the servers run: their --dtype; default the model config's
    16-bit dtype, else bfloat16), `tensor_parallel_size` (each server's workers), `host` (where the
    servers and the other ranks reach rank 0's controller: default WEIGHTSYNC_POD_IP, else this
    machine's address), `min_available` and `away_grace_seconds` (spec.inference's: how many
    servers' workers the run needs, and how long one may be away before it is dropped or the run
    fails), `timeout_seconds` and `transport` (spec.transfer's), and `config`: the model's Hugging
    Face config (a transformers config or its dict), where the source is no ModuleSource of a
    transformers model nor has a `config` of its own. With a job, the job's say."""

    backend: ClassVar[str] = BACKEND
    world_size: int | None = None
    name: str = "vllm-trainer"
    dtype: str | None = None
    tensor_parallel_size: int = 1
    host: str | None = None
    min_available: int | None = None
    away_grace_seconds: int | None = None
    timeout_seconds: int | None = None
    transport: str | None = None
    config: object = None


def _clients(client) -> list:
    return list(client) if isinstance(client, (list, tuple)) else [client]


def _servers_of(clients) -> list[str]:
    """The base URLs of the clients' servers (HTTPVLLMWeightSyncClient's base_url), one client or
    a list; a client that names no URL (a Ray client) adds none."""
    return [c.base_url for c in _clients(clients) if getattr(c, "base_url", None)]


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    host = parts.hostname or ""
    return ("127.0.0.1" if host == "localhost" else host), parts.port or (443 if parts.scheme == "https" else 80)


def _group() -> int | None:
    """The size of torch.distributed's default group, where it is initialized."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def _agree(problem: str | None, rank: int, world: int) -> None:
    """Every rank raises the first rank's problem where any rank has one (ValueError, one line),
    so that none waits for a rank that stopped."""
    problems = [problem]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    first = next(((r, p) for r, p in enumerate(problems) if p), None)
    if first is not None:
        raise ValueError(first[1] if first[0] == rank else f"{who(TRAINER, first[0])}: {first[1]}")


class WeightsyncTrainerEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):
    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True, sync: Sync | None = None,
                 controller: LocalController | None = None, tensors: SourceTensors | None = None):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sync, self.controller = sync, controller
        self.tensors = tensors  # a WeightSource's tensors, filled from it before each version

    @classmethod
    def trainer_init(cls, init_info: WeightsyncTrainerInitInfo, *, client, source=None) -> WeightsyncTrainerEngine:
        """Join the trainer's job as trainer rank `init_info.rank` (every rank calls this); without
        a job file, rank 0 runs the job's controller first."""
        if not isinstance(init_info, WeightsyncTrainerInitInfo):
            raise TypeError(f"weightsync's trainer engine takes WeightsyncTrainerInitInfo, not {type(init_info).__name__}")
        model, tensors = weights_of(source)
        controller = None
        if os.environ.get(Env.SPEC_FILE) or Join.from_environ(os.environ) is not None:
            try:
                trainer_world(init_info.world_size, os.environ, None)
            except SpecError as e:
                raise ValueError(e.problems[0]) from None
            unreachable = next((c for c in _clients(client) if not getattr(c, "base_url", None)), None)
            if unreachable is not None:
                raise ValueError(f"a {type(unreachable).__name__} names no server a job's controller could reach: with a "
                                 "job's join variables (or its pod contract) the job's controller drives every server, "
                                 f"over HTTP: pass HTTPVLLMWeightSyncClient(url) of the job's servers, or unset "
                                 f"{JoinEnv.CONTROLLER} so that this trainer runs its own job and drives its Ray actors")
            sync = attach(model, rank=init_info.rank)
        else:
            sync, controller = cls._own_job(init_info, model, _clients(client))
        try:
            cls._check_servers(sync, _servers_of(client))
        except BaseException as e:
            sync.fail(e)
            raise
        return cls(client=client, source=source, is_sender=init_info.rank == 0, sync=sync, controller=controller,
                   tensors=tensors)

    @classmethod
    def _own_job(cls, info: WeightsyncTrainerInitInfo, model, clients: list) -> tuple[Sync, LocalController | None]:
        """The run as its own job (the module's docstring): rank 0 runs its controller and tells
        every server where to join; every rank then joins it."""
        rank, group = info.rank, _group()
        problem, token, world = None, None, group or 1
        try:
            world = trainer_world(info.world_size, os.environ, group)
            token = shared_token()
            if token is None:
                problem = (f"no secret for the servers: set {JoinEnv.TOKEN} (or {JoinEnv.TOKEN_FILE}, a file holding it) "
                           "in every trainer rank's and every vLLM server's environment, the same long random value "
                           "(openssl rand -hex 32): vLLM's HTTP client sends no credentials, so a server takes only an "
                           "init proven with it")
            elif world > 1 and group is None:
                problem = (f"{world} trainer ranks and no torch.distributed group: call init_process_group (as FSDP2 "
                           "or DDP needs) before trainer_init, which finds rank 0's controller through it")
            elif not 0 <= rank < world:
                problem = f"WeightsyncTrainerInitInfo(rank={rank}) is not one of the {world} trainer ranks 0..{world - 1}"
        except SpecError as e:
            problem = e.problems[0]
        _agree(problem, rank, world if group else 1)
        controller, address, made, names = None, None, None, []
        if rank == 0:
            try:
                names, actors = servers_of(clients)
                controller = cls._start(info, model, names, actors, token, world)
                address = controller.address
            except Exception as e:  # noqa: BLE001 - said on every rank, which would wait for rank 0 otherwise
                made = e.problems[0] if isinstance(e, SpecError) else str(e)
        address = address if address is not None else made  # what rank 0 says: where its controller is, or why not
        if world > 1:
            box = [address]
            dist.broadcast_object_list(box, src=0)
            address = box[0]
        if not isinstance(address, Address):
            raise ValueError(address if rank == 0 else f"{who(TRAINER, 0)}: {address}")
        ctx = address.context(token, TRAINER, rank)
        failures: dict[str, str] = {}
        threads = []
        if rank == 0:
            controller_at = f"{address.host}:{address.port}"
            for name, client in zip(names, clients):
                info_for = init_info(token, ctx.job, controller_at, name)
                thread = threading.Thread(target=cls._init, name="weightsync-init", daemon=True,
                                          args=(ctx, client, name, name in controller.driven, info_for, failures))
                thread.start()
                threads.append(thread)
        try:
            sync = attach(model, rank=rank, context=ctx)
        except BaseException:
            for thread in threads:
                thread.join(5.0)
            if failures:  # the server's own words, not the job's end they caused
                raise ValueError(next(iter(failures.values()))) from None
            raise
        for thread in threads:
            thread.join()
        return sync, controller

    @staticmethod
    def _start(info: WeightsyncTrainerInitInfo, model, names: list[str], actors: dict[str, ActorServer], token: bytes,
               world: int) -> LocalController:
        """Rank 0: the job made and its controller started, once every HTTP server is seen guarded
        (`names`: each client's server's, its URL or an actor's name; `actors`: those driven
        through their Ray actor)."""
        urls = [n for n in names if n not in actors]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a server is named twice among the clients ({', '.join(urls)}): one client per server")
        config = info.config if info.config is not None else getattr(model, "config", None)
        if isinstance(config, dict):
            config = AutoConfig.for_model(**config)
        if config is None or not hasattr(config, "to_diff_dict"):
            raise ValueError(f"{type(model).__name__} has no transformers config (model.config): give "
                             "WeightsyncTrainerInitInfo(config=...), the model's Hugging Face config: weightsync makes "
                             "the job's model from it, the one the servers serve")
        device = next(p for _, p in model.named_parameters()).device  # a module's, or a source's held tensors'
        job = own_job(name=info.name, config=model_config(config), dtype=dtype_of(config, info.dtype), trainers=world,
                      servers=len(names), tensor_parallel=info.tensor_parallel_size, on_gpu=device.type == "cuda",
                      min_available=info.min_available, away_grace_seconds=info.away_grace_seconds,
                      timeout_seconds=info.timeout_seconds, transport=info.transport)
        for url in urls:
            try:
                if Server(url).open_to_clients():
                    raise ValueError(unguarded(url))
            except Unreachable as e:
                raise ValueError(f"the vLLM server at {url} does not answer: {e}") from None
        controller = LocalController(job, token, host=info.host or os.environ.get(JoinEnv.POD_IP), check=None,
                                     driven=actors)
        log(who(TRAINER, 0), f"runs job {job.identity}'s controller at {controller.address.host}:"
                             f"{controller.address.port}: {world} trainer ranks, {len(names)} vLLM servers"
                             + (f" ({len(actors)} of them Ray actors, driven from this process)" if actors else ""))
        return controller

    @staticmethod
    def _init(ctx, client, name: str, actor: bool, info: dict, failures: dict) -> None:
        """Rank 0's init of one server (vLLM's handshake), its URL or its actor's `name`; a refusal
        fails the job, in one line."""
        try:
            client.init_weight_transfer_engine(info)
        except Exception as e:  # noqa: BLE001 - the server's answer, said on one line
            response = getattr(e, "response", None)
            line = refusal(name, e) if actor else init_refusal(name, getattr(response, "status_code", None),
                                                               getattr(response, "text", None) or str(e))
            failures[name] = line
            Farewell(ctx, TRAINER, (0,), who(TRAINER, 0)).report(line)

    @staticmethod
    def _check_servers(sync: Sync, urls: list[str]) -> None:
        """Each client's server is one of the job's (ValueError, one line, otherwise)."""
        job = sync.ctx.job.identity
        servers = sync.servers()
        known = {_address(s) for s in servers}
        strangers = [u for u in urls if _address(u) not in known]
        if strangers:
            raise ValueError(f"{', '.join(strangers)}: not a vLLM server of job {job} (its servers: "
                             f"{', '.join(servers) or 'none: its inference engine is not vllm'}); pass clients of the "
                             "job's servers, which join it with the job's join variables")

    def send_weights(self, step: int | None = None, loss: float | None = None) -> None:
        """Publish the module's weights as they are now as the next version, on every rank, and
        return once every server the job still counts serves it (its weight_version the version's
        number)."""
        if self.sync is None:
            raise RuntimeError("send_weights() before trainer_init(): make the engine with "
                               "WeightTransferTrainerFactory.trainer_init(WeightsyncTrainerInitInfo(rank=...), client=..., "
                               "source=ModuleSource(model)) on every rank")
        if self.tensors is not None:
            self.tensors.fill()
        published = self.sync.publish(step, loss)
        done = self.sync.wait_done(published.version)
        plan = self.sync.plan  # the record's bytes are what the workers that hold the version received
        need = sum(plan.bytes_for(r) for r in range(plan.inferences))
        if self.is_sender and done["bytes"] < need:
            held = [r for r in range(plan.inferences) if plan.bytes_for(r)]
            told = (f"{done['bytes'] // plan.version_bytes} of {len(held)} servers' workers" if not plan.sliced
                    else f"{done['bytes']} of the {need} bytes its servers' workers take")
            log(self.sync.me, f"version {published.version} went to {told}: the others are away (the job's log names "
                              "them)")

    def shutdown(self) -> None:
        """This rank sends no more versions: waits for the job's end (Sync.close); rank 0 then for
        its controller's."""
        if self.sync is None:
            return
        try:
            self.sync.close()
        finally:
            if self.controller is not None:
                self.controller.wait(END_WAIT)


check_trainer_vllm()  # a vLLM without an internal the engine relies on is refused here, on one line
if not registered(WeightTransferTrainerFactory, BACKEND):  # imported again under another name: registered once
    WeightTransferTrainerFactory.register_engine(BACKEND, WeightsyncTrainerEngine)
