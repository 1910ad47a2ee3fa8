"""A trainer written only against vLLM's RL API (vllm.distributed.weight_transfer), with
weightsync as its weight-transfer backend: FSDP2 ranks that send their weights to vLLM servers
after every few steps. The backend is the init info's class and nothing else:

    WeightsyncTrainerInitInfo(rank=rank)                          # weightsync: every rank its own rows
    NCCLTrainerInitInfo(rank=rank, master_address=..., master_port=..., world_size=...)  # vLLM's, on GPUs

With weightsync the servers are a job's inference ranks and this script its trainers (both
external), joined through the job's three variables in the environment:

    weightsync run job.yaml --join-env join.env      # the job: spec.trainer.external, spec.inference.engine vllm
    set -a; . join.env; set +a
    torchrun --standalone --nproc-per-node 2 vllm_trainer_api.py --config '{"model_type": "llama", ...}' \\
        --server http://127.0.0.1:8000 --server http://127.0.0.1:8001

The model must be the one the job's spec.model describes. Every rank calls send_weights(); it
returns once every server serves the new version, whose number is the servers' weight_version.
"""

from __future__ import annotations

import argparse
import json
import os

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
    parser.add_argument("--server", action="append", required=True, help="a vLLM server's URL (once per server)")
    parser.add_argument("--backend", choices=["weightsync", "nccl"], default="weightsync")
    parser.add_argument("--master", default="127.0.0.1:29600", help="nccl: the trainer's NCCL rendezvous address")
    parser.add_argument("--workers", type=int, default=1, help="nccl: the server's workers (its tensor-parallel size)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--send-every", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--save", help="write the final weights here (rank 0, gathered once at the end)")
    return parser.parse_args()


def init_info(args, rank: int, world: int):
    """The one line that picks the backend."""
    if args.backend == "weightsync":
        from weightsync.vllm_backend.trainer import WeightsyncTrainerInitInfo  # registers the engine

        return WeightsyncTrainerInitInfo(rank=rank, world_size=world)
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
    for module in model.modules():
        if type(module).__name__ in (model._no_split_modules or []):
            fully_shard(module)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    clients = [HTTPVLLMWeightSyncClient(url) for url in args.server]
    engine = WeightTransferTrainerFactory.trainer_init(init_info(args, rank, world),
                                                       client=clients if len(clients) > 1 else clients[0],
                                                       source=ModuleSource(model))
    generator = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    for step in range(args.steps + 1):
        if step % args.send_every == 0 or step == args.steps:
            engine.send_weights()
            if rank == 0:
                print(f"step {step}: sent", flush=True)
        if step == args.steps:
            break
        tokens = torch.randint(vocab, (4, 32), generator=generator).to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    engine.shutdown()

    if args.save:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(weights, args.save)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
