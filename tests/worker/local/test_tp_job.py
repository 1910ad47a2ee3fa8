"""Tensor-parallel inference end to end under `weightsync run` (local processes on loopback): a user's
FSDP2 script over 4 trainer ranks (fsdp_publisher.py under torchrun, two pods of two ranks, uneven
shards) publishes to a model replica of TP degree 2 (two processes, transformers' own TP plan over
gloo) and, in the same job, one of TP degree 1 (one process holding the whole model). After every
version each TP rank's local shards equal the trainers' weights of that version, cast, sliced as
the TP plan slices them, bit for bit, and the TP1 rank's tensors equal them whole; and each
replica's logits on the fixed prompt equal those of one process running the whole model built
from the same weights in the same dtype, within a tolerance: TP changes the reduction order (the
row-parallel o_proj and down_proj each sum two partial products, rounded to the dtype, in an
all-reduce, where one process sums all terms in one matmul), so the logits differ by a few units
in the dtype's last place, carried through the layers. Llama with GQA and tied embeddings in
bfloat16, the TP2 replica over two pods and then the TP1 replica; Qwen2 (biases, untied) in
float16, the TP1 replica first and then the TP2 replica, all three ranks in one pod; a Qwen3
mixture of experts in float32 (its experts' stacks sharded by expert by FSDP2, by intermediate
dimension by TP), the TP2 replica first, all three ranks in one pod."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from support import SUPPORT
from support.jobs import as_bytes, summary_of

from weightsync.job import API_VERSION, INFERENCE, KIND, Model, load_job
from weightsync.local.runner import LocalJob
from weightsync.model.build import build, layout_of, logits, prompt
from weightsync.roles.tp_engine import needs_of
from weightsync.runtime.faults import DUMP_DIR_ENV

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`

SCRIPT = str(SUPPORT / "fsdp_publisher.py")
# sizes 4 trainer ranks and 2 TP ranks do not all divide: vocab 101, intermediate 70
LLAMA = {"model_type": "llama", "vocab_size": 101, "hidden_size": 48, "intermediate_size": 70, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": True}
QWEN2 = {"model_type": "qwen2", "vocab_size": 99, "hidden_size": 48, "intermediate_size": 70, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False}
# a few units in the last place of the dtype at the logits' size (about 1: bfloat16's unit there is
# 2^-8, float16's 2^-11), carried through two layers; measured: 0.0039 (bfloat16), 0.00037 (float16)
TOLERANCE = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-4}
# a mixture of experts: FSDP2 shards the stacks of 6 experts by expert (2 of them per trainer rank,
# none on the fourth), TP shards every expert's intermediate dimension; float32, so that a
# rounding in the reduction cannot change which experts a token is routed to
QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 99, "hidden_size": 48, "intermediate_size": 70,
             "moe_intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 64, "num_experts": 6, "num_experts_per_tok": 2}
STEPS, EVERY = 4, 2
VERSIONS = STEPS // EVERY + 1


def tp_job(name, config, dtype, out: Path, inference: dict):
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
        "spec": {"model": {"config": config, "dtype": dtype},
                 "trainer": {"replicas": 2, "procsPerPod": 2, "gpusPerProc": 0,
                             "command": [sys.executable, "-m", "torch.distributed.run", SCRIPT],
                             "args": [json.dumps(config), str(STEPS), str(EVERY), str(out)]},
                 "inference": {"gpusPerProc": 0, **inference},
                 "transfer": {"bucketMB": 1, "transport": "tcp", "timeoutSeconds": 60},
                 "network": {"mode": "tcp"}}})


@pytest.mark.parametrize("config,dtype,inference", [
    (LLAMA, "bfloat16", {"replicas": 3, "procsPerPod": 1, "tensorParallelSizes": [2, 1]}),
    (QWEN2, "float16", {"replicas": 1, "procsPerPod": 3, "tensorParallelSizes": [1, 2]}),
    (QWEN3_MOE, "float32", {"replicas": 1, "procsPerPod": 3, "tensorParallelSizes": [2, 1]}),
], ids=["llama-tied-gqa-bf16-tp2-tp1", "qwen2-f16-tp1-tp2", "qwen3-moe-f32-tp2-tp1"])
def test_fsdp2_trainers_to_tp2_and_tp1_replicas(tmp_path, config, dtype, inference):
    (tmp_path / "dump").mkdir()
    job = tp_job("tp-" + config["model_type"].replace("_", "-"), config, dtype, tmp_path, inference)
    local = LocalJob(job, tmp_path / "run", {DUMP_DIR_ENV: str(tmp_path / "dump")}, progress=io.StringIO())
    local.start()
    summary = summary_of(local, 500)
    assert summary["versions"] == VERSIONS and summary["failed_verifications"] == 0

    torch_dtype = getattr(torch, dtype)
    reference = build(Model(config=config, dtype=dtype), dtype=dtype, load_weights=False)
    layout = layout_of(reference, dtype)
    assert len(layout.slots) < len(reference.state_dict()) or not config.get("tie_word_embeddings")
    ranks = range(job.layout.world_size(INFERENCE))
    groups = {r: job.layout.tp_group(r) for r in ranks}
    assert sorted(len(g) for g in set(groups.values())) == [1, 2]
    needs = {}  # rank -> tensor -> the boxes it holds (two of a packed gate/up stack: its share of each)
    for r in ranks:
        if len(groups[r]) > 1:
            for sl in needs_of(reference, layout, groups[r], r).slices:
                needs.setdefault(r, {}).setdefault(sl.tensor, []).append(sl.box)
    first, second = (r for r in ranks if len(groups[r]) > 1)
    assert needs[first]["model.layers.0.self_attn.o_proj.weight"][0].start == (0, 0)  # row-parallel: strided slices
    assert needs[second]["model.layers.0.self_attn.o_proj.weight"][0].start == (0, 24)
    ids = prompt(reference)
    for v in range(VERSIONS):
        weights = torch.load(tmp_path / f"weights-v{v}.pt")
        reference.load_state_dict({n: t.to(torch_dtype) for n, t in weights.items()})
        want = logits(reference, ids)
        for r in ranks:
            got = torch.load(tmp_path / "dump" / f"inference-{r}-v{v}.pt")
            assert list(got["tensors"]) == layout.names
            for name, held in got["tensors"].items():
                full = weights[name].to(torch_dtype)
                if r in needs:
                    boxes = needs[r][name]
                    parts = [full[tuple(slice(a, b) for a, b in zip(box.start, box.stop))] for box in boxes]
                    differ = [d for d in range(full.dim()) if len({box.start[d] for box in boxes}) > 1]
                    full = torch.cat(parts, dim=differ[0]) if differ else parts[0]
                assert torch.equal(as_bytes(held), as_bytes(full)), \
                    f"version {v}: inference rank {r} (TP{len(groups[r])})'s {name} differs from the trainers' weights"
            assert got["logits"].dtype == torch_dtype
            torch.testing.assert_close(got["logits"], want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
            if v:
                assert not torch.equal(torch.load(tmp_path / "dump" / f"inference-{r}-v{v - 1}.pt")["logits"], got["logits"])
    controller = local.pods[0].log.read_text()
    assert "slices:" in controller and "4 trainer rank(s) -> 3 inference rank(s)" in controller
