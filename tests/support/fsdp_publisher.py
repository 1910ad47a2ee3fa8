"""A user's FSDP2 training script in the style of examples/train_with_weightsync.py, which also saves
the full weights of every version it publishes (test_tp_job.py checks every inference rank's slices
against them). The saving gathers the model once per version after the publish, for the test's
eyes only: the transfer itself sends each rank's own shard.

    torchrun fsdp_publisher.py CONFIG_JSON STEPS PUBLISH_EVERY OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

import weightsync


def main() -> None:
    config, steps, every, out = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    for module in model.modules():
        if type(module).__name__ in (model._no_split_modules or []):
            fully_shard(module)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(rank)
    with weightsync.attach(model) as sync:
        for step in range(steps + 1):
            if step % every == 0:
                version = sync.publish(step=step).version
                weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                if rank == 0:
                    torch.save(weights, out / f"weights-v{version}.pt")
            if step == steps:
                break
            tokens = torch.randint(config["vocab_size"], (4, 16), generator=generator)
            loss = model(input_ids=tokens, labels=tokens).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
