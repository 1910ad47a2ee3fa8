"""A training script of your own that publishes its weights to the inference ranks with weightsync.

A plain PyTorch loop over a transformers causal LM, data-parallel with DDP (the default) or
sharded with FSDP2 (--fsdp: torch.distributed.fsdp.fully_shard; each rank then sends only its
own shard, nothing is gathered for the transfer). weightsync adds four lines: import, attach,
publish, close (the `with`), and the script takes no weightsync arguments: attach() finds the job
in its environment, either way it is started:

- as the job's external trainers (spec.trainer.external: true), by your own torchrun, with the
  job's three join variables in the environment (`weightsync run job.yaml --join-env join.env`
  writes them; in a cluster, envFrom the Secret <job>-join):

    set -a; . join.env; set +a
    torchrun --standalone --nproc-per-node 2 train_with_weightsync.py --config '{"model_type": "qwen2", ...}' --fsdp

- or as a WeightTransferJob's spec.trainer.command (user-trainer-job.yaml), in the trainer pods
  weightsync starts, whose environment holds torchrun's variables and the job's contract:

    torchrun train_with_weightsync.py --config '{"model_type": "qwen2", ...}' --steps 40 --publish-every 10 [--fsdp]

The model must be the one the job's spec.model describes (the inference ranks build theirs from
it): the same config, or the same checkpoint directory (--model PATH, spec.model.path).

With --checkpoint DIR (a directory every rank shares) every rank saves the model and the optimizer
(torch.distributed.checkpoint, sharded as they are) after each publish, and a start that finds a
checkpoint there resumes from it: as the job's spec.trainer.command, a trainer pod that restarts
(its node lost, an OOM kill) takes every trainer rank back to the last checkpoint, and the job goes
on with the next version number (sync.resumed says which version was delivered last).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import weightsync


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--config", help="a transformers config as JSON (random init, seeded: nothing is downloaded)")
    model.add_argument("--model", help="a checkpoint directory (from_pretrained, local files only)")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of replicating with DDP")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--publish-every", type=int, default=10, help="publish a version every this many steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="write the final weights here (one file, rank 0, gathered once at the end)")
    parser.add_argument("--checkpoint", help="save model and optimizer here at each publish; resume from it if present")
    return parser.parse_args()


def batch(vocab: int, size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Counting sequences with a random start and stride: learnable, so the loss falls."""
    start = torch.randint(vocab, (size, 1), generator=generator)
    stride = torch.randint(1, 4, (size, 1), generator=generator)
    return (start + stride * torch.arange(length)) % vocab


def save_checkpoint(directory: str, step: int, model, optimizer) -> None:
    """Every rank writes its part of model and optimizer; then rank 0 names it the latest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(directory, f"step-{step}"))
    dist.barrier()  # every rank's part written
    if dist.get_rank() == 0:
        with open(os.path.join(directory, "latest.tmp"), "w") as f:
            f.write(str(step))
        os.replace(os.path.join(directory, "latest.tmp"), os.path.join(directory, "latest"))


def load_checkpoint(directory: str, model, optimizer) -> int | None:
    """The step of the latest checkpoint, loaded into model and optimizer; None if there is none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    latest = os.path.join(directory, "latest")
    if not os.path.exists(latest):
        os.makedirs(directory, exist_ok=True)
        return None
    with open(latest) as f:
        step = int(f.read())
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=os.path.join(directory, f"step-{step}"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step


def main() -> None:
    args = arguments()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # env://: MASTER_ADDR, RANK, WORLD_SIZE from torchrun or the pod
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    if args.config:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(args.config)))
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    model.to(device).train()
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():  # each decoder layer its own shard group, then the rest
            if type(module).__name__ in (model._no_split_modules or []):
                fully_shard(module)
        fully_shard(model)
        trained = model
    else:
        trained = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = model.config.vocab_size
    first = load_checkpoint(args.checkpoint, trained, optimizer) if args.checkpoint else None

    loss = None
    with weightsync.attach(trained) as sync:  # joins the job; close() at the end of the block
        if first is not None and rank == 0:
            print(f"resumed from the checkpoint of step {first}; {sync.resumed}", flush=True)
        for step in range(first or 0, args.steps + 1):
            # the checkpoint's own step was published before it was saved, unless the job says otherwise
            published = first is not None and step == first and (sync.resumed is None or sync.resumed.step == first)
            if (step % args.publish_every == 0 or step == args.steps) and not published:
                figures = sync.publish(step=step, loss=None if loss is None else loss.item())
                if rank == 0:
                    print(f"step {step}: version {figures.version}, sent {figures.bytes} bytes to {figures.receivers} "
                          f"inference ranks in {figures.seconds:.3f}s", flush=True)
                if args.checkpoint:
                    save_checkpoint(args.checkpoint, step, trained, optimizer)
            if step == args.steps:
                break
            generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1000 + rank)  # resumable data
            tokens = batch(vocab, args.batch_size, args.seq_len, generator).to(device)
            loss = trained(input_ids=tokens, labels=tokens).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    if args.save:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(weights, args.save)
    # every rank done with the group before any tears it down: a rank that destroys its gloo group
    # while a peer still uses it can abort at exit ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
