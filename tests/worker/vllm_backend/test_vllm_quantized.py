"""Quantized versions into vLLM (spec.model.quantization): the trainers send a quantized
checkpoint's tensors (int8 weights with their per-channel weight_scale, vLLM's compressed-tensors
W8A8 layout), vLLM's layerwise reload loads them and processes them again for its int8 kernel
(oneDNN on this CPU), and after each version the server holds what a plain vLLM server holds that
loaded the same quantized checkpoint from disk (vLLM's weight checker), and generates the same
greedy tokens. One job and one plain server for the module: the plain server starts on version 1's
checkpoint (weights and greedy tokens compared) and then loads version 0's from disk through vLLM's
own reload (weights compared: that reload leaves vLLM's CPU int8 kernel reading freed scales, which
the job's servers do not, engine.keep_onednn_scales).

The int8 job's server, and the plain one, run vLLM's tensor parallelism (2 workers): each worker
receives only its slices of the int8 weights and of their scales (its rows of the fused qkv and
gate/up layers with their rows' scales; its columns of o_proj and down_proj with every row's
scales), and after every version holds the trainer's bytes of them as vLLM shards them, read back
from its int8 kernel.

fp8 (DeepSeek-V3's 128x128 blocks) needs vLLM's FP8 linear kernel, which its CPU build has only on
CPUs with AMX tiles, or a GPU: the same check runs there and is skipped elsewhere, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.vllm import (
    LLAMA,
    PlainServer,
    VllmRun,
    as_bytes,
    checker,
    completion,
    free_port,
    post,
    save_checkpoint,
    shards,
    vllm_job,
)
from support.vllm import vllm_python as find_vllm_python

from weightsync.model.build import meta_layout
from weightsync.model.flat import torch_dtype

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return find_vllm_python()


def fp8_runs_here() -> str | None:
    """Why vLLM cannot run FP8 linear layers here, or None where it can (AMX tiles, or CUDA)."""
    if torch.cuda.is_available():
        return None
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    if "amx_tile" in flags.split():
        return None
    return ("vLLM's CPU build runs FP8 linear layers only with AMX tiles (CPUFp8BlockScaledMMKernel), and this CPU "
            "has none (no amx_tile in /proc/cpuinfo) and there is no GPU")


def served_like_a_plain_server(tmp_path: Path, vllm_python: str, quantization: str, tp: int = 1) -> None:
    """A quantized job (versions 0..2, one trainer, one server of `tp` workers): versions 0 and 1
    checked against a plain server of as many workers loading the same quantized checkpoints from
    disk; every version loaded, and every worker holding the trainer's bytes of its slices."""
    # in float32 the int8 kernel's output gives its weights back exactly (vllm_backend/served.py)
    dtype = "float32" if quantization == "int8" else "bfloat16"
    job = vllm_job(f"vllm-{quantization}", trainers=1, servers=1, steps=4, quantization=quantization, tensorParallel=tp,
                   dtype=dtype)
    run = VllmRun(tmp_path, job, vllm_python, pauses=["trainer-0-before-go-v1", "trainer-0-before-go-v2"])
    held, tokens = {}, {}
    try:
        server = run.servers[0]
        for version in (0, 1):  # the trainer holds the next version back while the test asks
            run.reach(f"trainer-0-before-go-v{version + 1}")
            run.serving(server, version)
            held[version] = checker(server, "checksum", key=run.key)["checksums"]
            tokens[version] = completion(server, job.name)
            run.release(f"trainer-0-before-go-v{version + 1}")
        end = run.finish()
    finally:
        run.local.stop()
    assert end["state"] == "Succeeded" and end["versions"] == 3, end
    assert "version 2 into vLLM" in run.log(2)  # every version loaded
    assert held[0] != held[1], "version 1 changed no weight vLLM holds"
    sent = {v: torch.load(run.dump / f"trainer-0-v{v}.pt")["sent"] for v in (0, 1)}
    scale = "_scale" if quantization == "int8" else "_scale_inv"
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert sent[0][weight].dtype == (torch.int8 if quantization == "int8" else torch.float8_e4m3fn)
    assert sent[0][weight + scale].dtype == torch.float32
    dtypes = {s.name: torch_dtype(s.dtype) for s in meta_layout(job.model).slots}  # as sent: the rest cast
    for version, tensors in sent.items() if quantization == "int8" else ():  # read back from vLLM's CPU int8 kernel
        for rank in range(tp):  # each worker: the trainer's bytes of its slices, as vLLM shards and serves them
            want = shards({n: t.to(dtypes[n]) for n, t in tensors.items()}, LLAMA, tp, rank)
            got = torch.load(run.dump / f"inference-{rank}-v{version}.pt")["tensors"]
            # besides, what the int8 kernel makes of the weights when it processes them (oneDNN's azp_adj)
            made = {n for n in set(got) - set(want) if n.endswith(".azp_adj")}
            assert sorted(set(got) - made) == sorted(want), f"vLLM holds other tensors: {sorted(set(got) ^ set(want))}"
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, (name, got[name].shape)
                assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), f"version {version}: worker {rank} in {name}"
    if tp > 1:
        logs = run.log(2)  # the server's pod
        assert all(f"tensor-parallel rank {r} of {tp}" in logs for r in range(tp)), "a worker received the whole version"
    folders = {v: save_checkpoint(sent[v], LLAMA, tmp_path / f"checkpoint-v{v}", quantization) for v in (0, 1)}
    plain = PlainServer(vllm_python, folders[1], free_port(), tp, tmp_path / "plain.log", dtype=dtype)
    try:
        plain.wait_up()
        for version in (1, 0):
            if version == 0:  # vLLM's own reload, from the checkpoint on disk
                post(plain.url, "/collective_rpc", {"method": "reload_weights",
                                                    "kwargs": {"weights_path": str(folders[version])}})
            assert checker(plain.url, "compare", held[version]) == {"match": True, "mismatches": []}, \
                f"version {version}: the job's server holds other weights than a plain server on its checkpoint"
            # token for token only the version it loaded at its start: vLLM's own reload leaves its
            # CPU int8 kernel reading freed scales (engine.keep_onednn_scales)
            if version == 1:
                assert completion(plain.url, "plain") == tokens[version], f"version {version}: other greedy tokens"
    finally:
        plain.stop()


def test_int8_versions_load_into_tensor_parallel_vllm_as_its_own_checkpoint_load_would(tmp_path, vllm_python):
    served_like_a_plain_server(tmp_path, vllm_python, "int8", tp=2)


def test_fp8_versions_load_into_vllm_as_its_own_checkpoint_load_would(tmp_path, vllm_python):
    why = fp8_runs_here()
    if why is not None:
        pytest.skip(why)
    served_like_a_plain_server(tmp_path, vllm_python, "fp8")
