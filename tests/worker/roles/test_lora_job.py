"""A job whose versions are a LoRA adapter (spec.model.lora) with the built-in trainer and engine:
each version carries the adapter's bytes alone, every inference rank holds it bit for bit over the
same base weights, and its logits are the trainer's."""

from __future__ import annotations

import pytest
from support.jobs import check_every_version, make_job, run_to_end

from weightsync.job import load_job
from weightsync.model.build import meta_layout
from weightsync.model.lora import adapter_layout

pytestmark = pytest.mark.slow  # a whole job as processes: not in `make unit`

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 64,
         "bos_token_id": 0, "eos_token_id": 0}


def test_lora_versions_carry_the_adapter_alone_and_inference_runs_the_trainers_adapter(tmp_path):
    obj = make_job("lora-builtin", config=LLAMA, inferences=(2, 1)).to_object()
    obj["spec"]["model"]["lora"] = {"rank": 4, "alpha": 16, "targetModules": ["q_proj", "v_proj", "down_proj"]}
    job = load_job(obj)
    summary, transfers = run_to_end(tmp_path, job)
    adapter = adapter_layout(job.model).total_bytes
    assert summary["failed_verifications"] == 0 and summary["versions"] == 3
    assert {t["bytes"] for t in transfers} == {2 * adapter}, transfers  # delivered: the adapter to each of 2 ranks
    assert adapter < meta_layout(job.model).total_bytes / 10
    assert check_every_version(tmp_path / "dump", job) == 3 * 2
