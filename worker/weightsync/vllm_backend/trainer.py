"""weightsync as vLLM's trainer-side weight-transfer engine "weightsync": a trainer written
against vLLM's RL API (vllm.distributed.weight_transfer) adopts weightsync by changing its init
info alone:

    from weightsync.vllm_backend.trainer import WeightsyncTrainerInitInfo
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightsyncTrainerInitInfo(rank=rank), client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights()  # on every rank, every step

Importing this module registers the engine with vLLM's WeightTransferTrainerFactory (the script
imports it for the init info anyway): vLLM loads its plugin entry point only in its own server
processes, never in a trainer's.

What differs from vLLM's own engines, and why:
- Every trainer rank sends its own rows to every server's workers (publisher.attach): FSDP2 shards
  without a gather, DDP replicas balanced by bytes. Nothing funnels through rank 0.
- The clients name the servers; the engine never calls them. A job's servers answer their update
  routes only to the job's controller (guard.py), which pauses each server, loads the version
  after its digest is verified, labels it (vLLM's weight_version is the version number) and
  resumes it; vLLM's HTTP client sends no credentials. Each client's server must be one of the
  job's, checked once the trainer joined.
- send_weights() returns once every server serves the new version, as vLLM's engines do.

The job is the one the join variables name (job/join.py: WEIGHTSYNC_CONTROLLER, WEIGHTSYNC_JOB_ID,
WEIGHTSYNC_TOKEN, from `weightsync run --join-env` or the Secret <job>-join), or the trainer pod's
own contract where the script is spec.trainer.command.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlsplit

from vllm.distributed.weight_transfer.base import ModuleSource, TrainerInitInfo, TrainerWeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from weightsync.publisher.sync import Sync, attach
from weightsync.vllm_backend import BACKEND


@dataclass(kw_only=True)
class WeightsyncTrainerInitInfo(TrainerInitInfo):
    """`rank`: this process's trainer rank. `world_size`, where given: the trainer ranks the
    script starts, which must be torchrun's WORLD_SIZE (itself checked against the job's trainer
    ranks). Everything else comes from the job."""

    backend: ClassVar[str] = BACKEND
    world_size: int | None = None


def _module_of(source) -> object:
    """The module behind vLLM's ModuleSource: weightsync reads each rank's own parameters (an
    FSDP2 rank's shards as they are, never gathered), where vLLM's sources yield full tensors."""
    if not isinstance(source, ModuleSource):
        raise TypeError(f"weightsync's trainer engine sends a module's own parameters: pass source=ModuleSource(model), "
                        f"not {type(source).__name__}")
    return source._module


def _servers_of(clients) -> list[str]:
    """The base URLs of the clients' servers (HTTPVLLMWeightSyncClient's base_url), one client or
    a list; a client that names no URL (a Ray client) adds none."""
    listed = clients if isinstance(clients, (list, tuple)) else [clients]
    return [c.base_url for c in listed if getattr(c, "base_url", None)]


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    host = parts.hostname or ""
    return ("127.0.0.1" if host == "localhost" else host), parts.port or (443 if parts.scheme == "https" else 80)


class WeightsyncTrainerEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):
    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(self, *, client, source, sync: Sync, rank: int):
        super().__init__(client=client, source=source, is_sender=rank == 0)
        self.sync = sync

    @classmethod
    def trainer_init(cls, init_info: WeightsyncTrainerInitInfo, *, client, source=None) -> WeightsyncTrainerEngine:
        """Join the job as trainer rank `init_info.rank`: every rank calls this."""
        if not isinstance(init_info, WeightsyncTrainerInitInfo):
            raise TypeError(f"weightsync's trainer engine takes WeightsyncTrainerInitInfo, not {type(init_info).__name__}")
        model = _module_of(source)
        if init_info.world_size is not None:
            said = os.environ.get("WORLD_SIZE")
            if said not in (None, str(init_info.world_size)):
                raise ValueError(f"WeightsyncTrainerInitInfo(world_size={init_info.world_size}), but torchrun's "
                                 f"WORLD_SIZE={said}: give the init info the world size this script runs at")
        sync = attach(model, rank=init_info.rank)
        try:
            cls._check_servers(sync, _servers_of(client))
        except BaseException as e:
            sync.fail(e)
            raise
        return cls(client=client, source=source, sync=sync, rank=init_info.rank)

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
        return once every server serves it (its weight_version the version's number)."""
        published = self.sync.publish(step, loss)
        self.sync.wait_done(published.version)

    def shutdown(self) -> None:
        """This rank sends no more versions: waits for the job's end (Sync.close)."""
        self.sync.close()


if BACKEND not in WeightTransferTrainerFactory._registry:  # imported again under another name: registered once
    WeightTransferTrainerFactory.register_engine(BACKEND, WeightsyncTrainerEngine)
