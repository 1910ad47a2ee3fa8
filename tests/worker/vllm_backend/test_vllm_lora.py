"""A job whose versions are a LoRA adapter (spec.model.lora) served by vLLM (its CPU build), for
real: one job, the built-in trainer training the adapter alone over a Llama checkpoint, and a
server of vLLM's tensor parallelism (2 workers) on that checkpoint, loading the adapter ahead
(spec.inference.vllm.loadAhead, which leaves an adapter's versions as they are: they replace it in
place). A server of one worker receives the whole adapter as any version (the RL example's LoRA
variant, test_rl_example.py, learns through one).

What is checked, after versions 1 and 2 (the trainers holding the next one back): every worker
received exactly its part of the adapter as vLLM's LoRA layers shard it (of a column-parallel layer
B's rows, A whole; of a row-parallel one A's columns, B whole), the trainer's bytes; requests
that name the adapter run on the version just delivered (vLLM's generate route names it) and
change the greedy tokens; requests on the base model give the checkpoint's own tokens, version
after version; every version carries the adapter's bytes alone.

Over float32 base weights the server answers the greedy tokens of the checkpoint's model with the
trainer's adapter of that version, computed by transformers in float32 (W + alpha / rank B A, as
PEFT runs it). Over int8 base weights (an int8 checkpoint, compressed-tensors W8A8, which the
trainer dequantizes; in bfloat16, as vLLM's AMX int8 kernel takes no float32 activations) the
reference is vLLM itself: a plain server of 2 workers on that checkpoint,
loading each version's adapter from disk, answers the TP-2 server's tokens and holds its base
weights (weight checker). vLLM's CPU build serves LoRA over int8 layers only with AMX tiles: its
oneDNN int8 kernel drops the weight parameter that its LoRA layers read (AttributeError when the
server starts), so that case runs where the CPU has them (or on a GPU) and is skipped elsewhere,
saying why.
"""

from __future__ import annotations

import re

import pytest
import torch
from support.vllm import (
    LLAMA,
    PROMPT,
    PlainServer,
    VllmRun,
    amx_tiles,
    boxes,
    checker,
    completion,
    free_port,
    generate,
    int8_checkpoint,
    post,
    save_adapter,
    save_checkpoint,
    vllm_job,
)
from support.vllm import vllm_python as find_vllm_python

from weightsync.job import Model, load_job
from weightsync.model.build import build, greedy, meta_layout
from weightsync.model.lora import PREFIX, adapter_layout, add_adapters

pytestmark = pytest.mark.slow  # a whole job with vLLM servers: not in `make unit`

LORA = {"rank": 8, "alpha": 32, "targetModules": ["q_proj", "v_proj", "o_proj", "down_proj"], "name": "tuned"}
WORKERS = [(2, 0), (2, 1)]  # (tp size, tp rank) of inference ranks 0 and 1, the server's workers


def tokens_with(model: torch.nn.Module, tensors: dict[str, torch.Tensor] | None = None) -> list[int]:
    if tensors is not None:
        model.load_state_dict({n: t.float() for n, t in tensors.items()})
    return greedy(model, torch.tensor([PROMPT]), 8)


def part_of(name: str, adapter: dict[str, torch.Tensor], tp: int, rank: int) -> torch.Tensor:
    """What worker `rank` of `tp` holds of adapter tensor `name`: A takes its base weight's columns
    on this worker, B its rows (the tests' statement of vLLM's base layout, support.vllm.boxes)."""
    layer = name[len(PREFIX):].rpartition(".lora_")[0]
    a, b = adapter[f"{PREFIX}{layer}.lora_A.weight"], adapter[f"{PREFIX}{layer}.lora_B.weight"]
    weight = f"{layer}.weight"
    dim, start, stop = boxes({weight: (b.shape[0], a.shape[1])}, LLAMA, tp, rank)[weight]
    if name.endswith(".lora_A.weight"):
        return a[:, start:stop] if dim == 1 else a
    return b[start:stop] if dim == 0 else b


def int8_lora_runs_here() -> str | None:
    """Why vLLM cannot serve LoRA over int8 layers here, or None where it can (AMX tiles, or CUDA)."""
    if torch.cuda.is_available() or amx_tiles():
        return None
    return ("vLLM's CPU build keeps an int8 layer's weight parameter, which its LoRA layers read, only with AMX tiles "
            "(its oneDNN int8 kernel drops it), and this CPU has none (no amx_tile in /proc/cpuinfo) and there is no GPU")


@pytest.mark.parametrize("base", ["float32", "int8"])
def test_lora_versions_reach_tensor_parallel_vllm_servers_as_vllm_shards_them(tmp_path, base):
    why = int8_lora_runs_here() if base == "int8" else None
    if why is not None:
        pytest.skip(why)
    python = find_vllm_python()
    plain_model = build(Model(config=LLAMA, dtype="float32"), dtype="float32", seed=3)
    if base == "int8":
        checkpoint = int8_checkpoint(tmp_path / "base")
    else:
        checkpoint = save_checkpoint(dict(plain_model.state_dict()), LLAMA, tmp_path / "base")
    dtype = "bfloat16" if base == "int8" else "float32"  # vLLM's AMX int8 kernel takes 16-bit activations only
    obj = vllm_job("vllm-lora", trainers=1, servers=1, steps=6, dtype=dtype, checkpoint=checkpoint, lora=LORA,
                   quantization="int8" if base == "int8" else None, ahead=True,
                   tensorParallelSizes=[2]).to_object()  # versions 0..3
    obj["spec"]["training"]["learningRate"] = 3e-2
    job = load_job(obj)
    run = VllmRun(tmp_path, job, python, pauses=["trainer-0-before-go-v2", "trainer-0-before-go-v3"])
    merged = add_adapters(build(Model(path=str(checkpoint), dtype="float32"), dtype="float32"), job.model.lora) \
        if base == "float32" else None
    base_tokens: dict[str, list[int]] = {}
    tuned: dict[int, list[list[int]]] = {}
    checksums = {}
    try:
        for version in (1, 2):
            run.reach(f"trainer-0-before-go-v{version + 1}")
            for server in run.servers:
                run.serving(server, version)
                base_tokens.setdefault(server, completion(server, job.name))
                assert completion(server, job.name) == base_tokens[server], f"version {version}: the base model changed"
                assert generate(server, "tuned")["weight_versions"] == [{"version": str(version), "start": 0, "end": 8}]
            tuned[version] = [completion(server, "tuned") for server in run.servers]
            if merged is not None:
                trainer = torch.load(tmp_path / "dump" / f"trainer-0-v{version}.pt")["tensors"]
                want = tokens_with(merged, trainer)
                assert tuned[version] == [want], f"version {version}: the adapter vLLM serves is not the trainer's"
            checksums[version] = checker(run.servers[0], "checksum", key=run.key)["checksums"]
            run.release(f"trainer-0-before-go-v{version + 1}")
        end = run.finish()
    finally:
        run.local.stop()
    assert end["state"] == "Succeeded", end
    if merged is not None:
        checkpoints = tokens_with(plain_model)
        assert all(tokens == checkpoints for tokens in base_tokens.values()), "the base model is not the checkpoint's"
    for s, server in enumerate(run.servers):
        assert any(tuned[v][s] != base_tokens[server] for v in (1, 2)), f"{server}: the adapter never changed the tokens"
    adapters = {}
    for version in (1, 2):
        trainer = torch.load(tmp_path / "dump" / f"trainer-0-v{version}.pt")["tensors"]
        adapters[version] = {n: trainer[n[len(PREFIX):].replace(".weight", ".default.weight")]
                             for n in adapter_layout(job.model).names}  # PEFT's saved names
        for rank, (tp, tp_rank) in enumerate(WORKERS):
            held = torch.load(tmp_path / "dump" / f"inference-{rank}-v{version}.pt")["tensors"]
            assert sorted(held) == sorted(adapters[version]), f"inference rank {rank} holds other tensors"
            for name in adapters[version]:
                assert torch.equal(held[name], part_of(name, adapters[version], tp, tp_rank)), \
                    f"version {version}: inference rank {rank} (TP rank {tp_rank} of {tp}) differs in {name}"
    logs = run.log(2)  # the server's pod (ordinal 2)
    assert "loaded ahead" not in logs
    adapter = adapter_layout(job.model).total_bytes
    shares = [int(n) for n in re.findall(rf"tensor-parallel rank \d of 2 .*?: receives (\d+) of {adapter} bytes", logs)]
    assert len(shares) == 2 and all(n < adapter for n in shares), logs[-2000:]
    # every version: the adapter's bytes alone, each worker its part
    assert {(t["version_bytes"], t["bytes"]) for t in run.local.transfers} == {(adapter, sum(shares))}
    assert adapter * 20 < meta_layout(job.model).total_bytes
    with pytest.raises(OSError):  # the servers are gone with their job
        post(run.servers[0], "/v1/completions", {"model": "tuned", "prompt": PROMPT}, timeout=5)
    if base == "int8":
        served_like_vllms_own_adapter_load(python, checkpoint, tmp_path, job, adapters, tuned, checksums)


def served_like_vllms_own_adapter_load(python, checkpoint, tmp_path, job, adapters, tuned, checksums) -> None:
    """A plain server of 2 workers on the checkpoint, each version's adapter loaded from disk by
    vLLM itself: the TP-2 server's tokens, and its base weights."""
    plain = PlainServer(python, checkpoint, free_port(), 2, tmp_path / "plain.log", dtype=job.model.dtype,
                        quantization="int8", lora=job.model.lora)
    try:
        plain.wait_up()
        for version in (1, 2):
            plain.load_adapter(f"v{version}", save_adapter(adapters[version], LORA, tmp_path / f"adapter-v{version}"))
            assert completion(plain.url, f"v{version}") == tuned[version][0], \
                f"version {version}: the TP-2 server's adapter runs otherwise than vLLM's own load of it"
            assert checker(plain.url, "compare", checksums[version]) == {"match": True, "mismatches": []}, \
                f"version {version}: the base weights differ from vLLM's own load of the checkpoint"
    finally:
        plain.stop()
