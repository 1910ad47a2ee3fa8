"""A job whose versions are a LoRA adapter (spec.model.lora) served by vLLM (its CPU build), for
real: one job, one server on a Llama checkpoint, the built-in trainer training the adapter alone.

What is checked, after versions 1 and 2 (the trainers holding the next one back): requests that
name the adapter run on the version just delivered (their greedy tokens are those of the
checkpoint's model with the trainer's adapter of that version, computed by transformers in float32:
W + alpha / rank B A, as PEFT runs it) and vLLM's generate route names that version; requests on the
base model give the checkpoint's own tokens, version after version; the adapter changes the greedy
tokens; the adapter the server holds is the trainer's bit for bit; and every version carries the
adapter's bytes alone.
"""

from __future__ import annotations

import pytest
import torch
from support.vllm import LLAMA, PROMPT, VllmRun, completion, generate, post, save_checkpoint, vllm_job
from support.vllm import vllm_python as find_vllm_python

from weightsync import job as contract
from weightsync.model.build import build, greedy, meta_layout
from weightsync.model.lora import PREFIX, adapter_layout, add_adapters

pytestmark = pytest.mark.slow  # a whole job with a vLLM server: not in `make unit`

LORA = {"rank": 8, "alpha": 32, "targetModules": ["q_proj", "v_proj", "o_proj", "down_proj"], "name": "tuned"}


def tokens_with(model: torch.nn.Module, tensors: dict[str, torch.Tensor] | None = None) -> list[int]:
    if tensors is not None:
        model.load_state_dict({n: t.float() for n, t in tensors.items()})
    return greedy(model, torch.tensor([PROMPT]), 8)


def test_lora_versions_replace_the_adapter_vllm_serves_and_leave_the_base_model_alone(tmp_path):
    python = find_vllm_python()
    base = build(contract.Model(config=LLAMA, dtype="float32"), dtype="float32", seed=3)
    checkpoint = save_checkpoint(dict(base.state_dict()), LLAMA, tmp_path / "base")
    obj = vllm_job("vllm-lora", trainers=1, servers=1, steps=6, dtype="float32", checkpoint=checkpoint,
                   lora=LORA).to_object()  # versions 0..3
    obj["spec"]["training"]["learningRate"] = 3e-2
    job = contract.load_job(obj)
    run = VllmRun(tmp_path, job, python, pauses=["trainer-0-before-go-v2", "trainer-0-before-go-v3"])
    base_tokens = tokens_with(base)
    merged = add_adapters(build(contract.Model(path=str(checkpoint), dtype="float32"), dtype="float32"), job.model.lora)
    served: list[list[int]] = []
    try:
        for version in (1, 2):
            run.reach(f"trainer-0-before-go-v{version + 1}")
            server = run.servers[0]
            run.serving(server, version)
            trainer = torch.load(tmp_path / "dump" / f"trainer-0-v{version}.pt")["tensors"]
            tokens = completion(server, "tuned")
            assert tokens == tokens_with(merged, trainer), f"version {version}: the adapter vLLM serves is not the trainer's"
            assert generate(server, "tuned")["weight_versions"] == [{"version": str(version), "start": 0, "end": 8}]
            assert completion(server, job.name) == base_tokens, f"version {version}: the base model's tokens changed"
            held = torch.load(tmp_path / "dump" / f"inference-0-v{version}.pt")["tensors"]
            for name, tensor in held.items():  # PEFT's saved names: the module's own, its adapter key dropped
                want = trainer[name[len(PREFIX):].replace(".weight", ".default.weight")]
                assert torch.equal(tensor, want), f"version {version}: {name} is not the trainer's"
            served.append(tokens)
            run.release(f"trainer-0-before-go-v{version + 1}")
        end = run.finish()
    finally:
        run.local.stop()
    assert end["state"] == "Succeeded", end
    assert any(tokens != base_tokens for tokens in served), "the adapter never changed the greedy tokens"
    adapter = adapter_layout(job.model).total_bytes
    assert {t["bytes"] for t in run.local.transfers} == {adapter}
    assert adapter * 20 < meta_layout(job.model).total_bytes
    with pytest.raises(OSError):  # the server is gone with its job
        post(run.servers[0], "/v1/completions", {"model": "tuned", "prompt": PROMPT}, timeout=5)
