"""A user's own training script (examples/train_with_weightsync.py) as the tests run it, in the
job's pods (spec.trainer.command) or as external trainers: its model, its arguments, and the check
that every version reached every inference rank and the last one equals, bit for bit, the final
weights the script saved."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from support.jobs import as_bytes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "train_with_weightsync.py")
# Qwen2 with GQA and tied embeddings, in sizes 2 and 4 ranks do not divide (vocab 101, intermediate 70)
CONFIG = {"model_type": "qwen2", "vocab_size": 101, "hidden_size": 48, "intermediate_size": 70, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": True}


def example_args(tmp_path: Path, *more: str) -> list[str]:
    return ["--config", json.dumps(CONFIG), "--steps", "6", "--publish-every", "3", "--save", str(tmp_path / "final.pt"), *more]


def check_final_version(tmp_path: Path, job, versions: int | list[int]) -> None:
    """Every inference rank switched to each of `versions` (a count: 0 to count - 1), and the
    last of them holds the weights the script saved at its end."""
    versions = list(range(versions)) if isinstance(versions, int) else versions
    saved = torch.load(tmp_path / "final.pt")
    dtype = getattr(torch, job.model.dtype)
    for rank in range(job.layout.world_size("inference")):
        for v in versions:
            assert (tmp_path / "dump" / f"inference-{rank}-v{v}.pt").exists(), f"inference rank {rank} missed version {v}"
        got = torch.load(tmp_path / "dump" / f"inference-{rank}-v{versions[-1]}.pt")["tensors"]
        assert "lm_head.weight" not in got  # tied: sent once, as the embedding
        for name, tensor in got.items():
            assert torch.equal(as_bytes(tensor), as_bytes(saved[name].to(dtype))), f"inference rank {rank}: {name}"
