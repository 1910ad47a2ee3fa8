"""A quantized job (spec.model.quantization fp8) as local processes into the built-in engine: two
DDP trainer ranks quantize their own weights into 128x128 blocks and send them with their scales
(about half of bfloat16's bytes), as deltas after the first version; after every version the
inference rank serves exactly the trainers' weights quantized and dequantized, bit for bit (its
logits within bfloat16's rounding of the trainer's); a scale corrupted on the way fails the
bucket's checksum like any byte, and nothing of that version is loaded."""

import io
import json

import pytest
import torch
from support.jobs import as_bytes, make_job, outcome_of

from weightsync.job import Model, load_job
from weightsync.local.runner import LocalJob
from weightsync.model.build import meta_layout
from weightsync.runtime.faults import CORRUPT_ENV, DUMP_DIR_ENV

pytestmark = pytest.mark.slow  # a whole job as processes: not in `make unit`

# rows of 200 (intermediate) and 64 (the KV projections): the format pads their last blocks
LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 200, "num_attention_heads": 2,
         "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 64,
         "bos_token_id": 0, "eos_token_id": 0}
SCALE = "model.layers.1.mlp.down_proj.weight_scale_inv"


def test_fp8_versions_reach_the_builtin_engine_dequantized_bit_for_bit_and_a_corrupted_scale_is_never_loaded(tmp_path):
    obj = make_job("fp8", config=LLAMA, trainers=(2, 1), steps=6, every=2,
                   delta={"enabled": True, "fullEvery": 10}).to_object()
    obj["spec"]["model"]["quantization"] = "fp8"
    job = load_job(obj)
    layout = meta_layout(job.model)
    plain = meta_layout(Model(config=LLAMA))
    assert 0.5 < layout.payload_bytes / plain.payload_bytes < 0.8  # the embeddings and norms stay bfloat16
    scale = next(s for s in layout.slots if s.name == SCALE)
    dump = tmp_path / "dump"
    dump.mkdir()
    # versions 0..3; a byte of version 3's scale flipped after the trainer hashed it
    local = LocalJob(job, tmp_path / "run", {DUMP_DIR_ENV: str(dump), CORRUPT_ENV: f"3@{scale.offset + 2}"},
                     progress=io.StringIO())
    local.start()
    end = outcome_of(local, 300)
    assert "ChecksumMismatch" in str(end) and "inference rank 0" in str(end), end
    completion = json.loads((local.workdir / "status.json").read_text())["completion"]
    assert completion["reason"] == "ChecksumMismatch", completion  # the rank's own reason, not a generic one
    assert not (dump / "inference-0-v3.pt").exists()  # nothing of it was loaded
    for version in range(3):
        want = torch.load(dump / f"trainer-0-v{version}.pt")
        got = torch.load(dump / f"inference-0-v{version}.pt")
        for name, tensor in want["tensors"].items():
            assert torch.equal(as_bytes(got["tensors"][name]), as_bytes(tensor)), f"version {version}: {name}"
        # within bfloat16's rounding: the trainer's copy cast to bfloat16 casts Llama's rotary
        # inv_freq buffer too, which the inference model, built in bfloat16, keeps in float32
        torch.testing.assert_close(got["logits"], want["logits"], atol=0.02, rtol=0.02)
    delivered = [(t["version"], t["deltaRanks"]) for t in local.transfers if t.get("inference_ranks", 1)]
    assert delivered == [(0, 0), (1, 1), (2, 1)]  # deltas of the quantized bytes; version 3 reached no rank
    # (the controller may close version 3's round, with no rank, before the failure reaches it)
