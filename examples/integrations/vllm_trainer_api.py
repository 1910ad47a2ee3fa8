"""A trainer written only against vLLM's RL API (vllm.distributed.weight_transfer), with
weightsync as its weight-transfer backend: FSDP2 ranks that send their weights to vLLM servers
after every few steps. The backend is the init info's class and nothing else:

    WeightsyncTrainerInitInfo(rank=rank)                          # weightsync: every rank its own rows
    NCCLTrainerInitInfo(rank=rank, master_address=..., master_port=..., world_size=...)  # vLLM's, on GPUs

With weightsync there is no job file to write. The servers and the trainer share one secret in
their environment (WEIGHTSYNC_TOKEN, or WEIGHTSYNC_TOKEN_FILE naming a file that holds it), and each
server runs weightsync's backend behind its guard:

    export WEIGHTSYNC_TOKEN=$(openssl rand -hex 32)
    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --port 8000 --weight-transfer-config '{"backend": "weightsync"}' \
        --middleware weightsync.vllm_backend.guard.ControlGuard       # and another on 8001
    torchrun --standalone --nproc-per-node 2 vllm_trainer_api.py --config '{"model_type": "llama", ...}' \
        --server http://127.0.0.1:8000 --server http://127.0.0.1:8001

Servers that are Ray actors hosting vLLM's LLM (or AsyncLLM), built with
weight_transfer_config={"backend": "weightsync"} and the secret in their environment, are named
instead (--ray-actor NAME, each a named actor of the cluster at RAY_ADDRESS): the script passes
vLLM's RayVLLMWeightSyncClient(handle), and trainer rank 0 drives them through their handles.

Trainer rank 0 runs the job's controller; each server learns where to join from the trainer's
init. With a job of your own instead (`weightsync run job.yaml --join-env join.env`, its trainers
and servers external), source join.env in every process, and the script joins that job.

The model must be the one the servers serve. Every rank calls send_weights(); it returns once
every server serves the new version, whose number is the servers' weight_version.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a transformers config as JSON (random init, seeded)")
    parser.add_argument("--server", action="append", default=[], help="a vLLM server's URL (once per server)")
    parser.add_argument("--ray-actor", action="append", default=[], help="the name of a Ray actor hosting vLLM's LLM "
                        "or AsyncLLM (once per actor), in the Ray cluster RAY_ADDRESS names")
    parser.add_argument("--ray-namespace", default="vllm", help="the Ray namespace of the --ray-actor names")
    parser.add_argument("--backend", choices=["weightsync", "nccl"], default="weightsync")
    parser.add_argument("--master", default="127.0.0.1:29600", help="nccl: the trainer's NCCL rendezvous address")
    parser.add_argument("--workers", type=int, default=1, help="nccl: the server's workers (its tensor-parallel size)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--send-every", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--checkpoints", help="after each send, the weights sent as a Hugging Face checkpoint in "
                        "DIR/step-N (rank 0; gathered, for comparing with a server that loads it from disk)")
    parser.add_argument("--min-available", type=int, help="weightsync: the servers' workers the run needs (default all)")
    parser.add_argument("--away-grace", type=int, help="weightsync: seconds a server may be away before it is dropped "
                        "(or, below --min-available, the run fails)")
    args = parser.parse_args()
    if not args.server and not args.ray_actor:
        parser.error("name the servers: --server URL or --ray-actor NAME, once per server")
    return args


def init_info(args, rank: int, world: int):
    """The one line that picks the backend."""
    if args.backend == "weightsync":
        from weightsync.integrations.vllm import WeightsyncTrainerInitInfo  # registers the engine

        return WeightsyncTrainerInitInfo(rank=rank, world_size=world, min_available=args.min_available,
                                         away_grace_seconds=args.away_grace)
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    host, port = args.master.rsplit(":", 1)  # vLLM's nccl engine sends from rank 0 alone, to one server
    return NCCLTrainerInitInfo(rank=rank, master_address=host, master_port=int(port), world_size=1 + args.workers)


def main() -> None:
    args = arguments()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # env://, from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(args.config))).to(device)
    model.config.architectures = [type(model).__name__]  # what a server built from a checkpoint of it builds
    for module in model.modules():
        if type(module).__name__ in (model._no_split_modules or []):
            fully_shard(module)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    clients = [HTTPVLLMWeightSyncClient(url) for url in args.server] + ray_clients(args)
    engine = WeightTransferTrainerFactory.trainer_init(init_info(args, rank, world),
                                                       client=clients if len(clients) > 1 else clients[0],
                                                       source=ModuleSource(model))
    generator = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    for step in range(args.steps + 1):
        if step % args.send_every == 0 or step == args.steps:
            began = time.perf_counter()
            engine.send_weights()
            if rank == 0:
                print(f"step {step}: sent in {time.perf_counter() - began:.3f}s", flush=True)
            if args.checkpoints:
                save(model, Path(args.checkpoints) / f"step-{step}", rank)
        if step == args.steps:
            break
        tokens = torch.randint(vocab, (4, 32), generator=generator).to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    engine.shutdown()
    dist.barrier()
    dist.destroy_process_group()


def ray_clients(args) -> list:
    """vLLM's Ray client of each --ray-actor: every rank joins the Ray cluster to hold the handles;
    weightsync's rank 0 drives the actors through them, and each rank sends its rows to their workers."""
    if not args.ray_actor:
        return []
    import ray
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), namespace=args.ray_namespace, log_to_driver=False)
    return [RayVLLMWeightSyncClient(ray.get_actor(name)) for name in args.ray_actor]


def save(model, folder: Path, rank: int) -> None:
    """The model's weights as a Hugging Face checkpoint (config.json, model.safetensors), gathered
    from every rank's shards (a collective: every rank calls it), written by rank 0."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(folder)
        save_file({name: t.contiguous() for name, t in weights.items()}, str(folder / "model.safetensors"))
    dist.barrier()


if __name__ == "__main__":
    main()
