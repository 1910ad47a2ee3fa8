"""Quantized versions into vLLM (spec.model.quantization): the trainers send a quantized
checkpoint's tensors (int8 weights with their per-channel weight_scale, vLLM's compressed-tensors
W8A8 layout), vLLM's layerwise reload loads them and processes them again for its int8 kernel
(oneDNN on this CPU), and the server holds what vLLM's own load of the same quantized checkpoint
from disk holds (vLLM's weight checker), and generates its greedy tokens.

The int8 job's model is an int8 checkpoint (spec.model.path; the trainer dequantizes it, and
quantizing those weights again gives the checkpoint's bytes, so that version 0 is its weights): its
server of vLLM's tensor parallelism (2 workers) starts on it as a plain vLLM server would, loading
it from disk, and is checksummed, asked its greedy tokens and reset before any version; version 0,
loaded over the zeroed weights, holds what that load held (weights compared) and answers its
tokens; version 1 holds what vLLM's own reload of version 1's checkpoint from disk holds, reloaded
in the same server once the last version was delivered (weights compared; vLLM's own reload leaves
its CPU int8 kernel reading freed scales, which weightsync's loads do not, internals.keep_onednn_scales,
so only a server's load at its start is asked for tokens). Each worker receives only its slices of
the int8 weights and of their scales (its rows of the fused qkv and gate/up layers with their rows'
scales; its columns of o_proj and down_proj with every row's scales), and after every version holds
the trainer's bytes of them as vLLM shards them, read back from its int8 kernel.

fp8 (DeepSeek-V3's 128x128 blocks) needs vLLM's FP8 linear kernel, which its CPU build has only on
CPUs with AMX tiles, or a GPU: there a job of one server, of one worker and of two (each worker
receiving its rows of the weights with their 128x128 blocks' scales), is compared with a plain
server of as many workers that loads the same fp8 checkpoints from disk (weights of versions 0 and
1, tokens of version 1, which it starts on); it is skipped elsewhere, saying why."""

from __future__ import annotations

import pytest
import torch
from support.vllm import (
    LLAMA,
    REACH_TIMEOUT,
    PlainServer,
    VllmRun,
    amx_tiles,
    assert_int8_slices,
    checker,
    checksums_then_reset,
    completion,
    free_port,
    int8_checkpoint,
    post,
    save_checkpoint,
    vllm_job,
)
from support.vllm import vllm_python as find_vllm_python

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return find_vllm_python()


def fp8_runs_here() -> str | None:
    """Why vLLM cannot run FP8 linear layers here, or None where it can (AMX tiles, or CUDA)."""
    if torch.cuda.is_available() or amx_tiles():
        return None
    return ("vLLM's CPU build runs FP8 linear layers only with AMX tiles (CPUFp8BlockScaledMMKernel), and this CPU "
            "has none (no amx_tile in /proc/cpuinfo) and there is no GPU")


def test_int8_versions_load_into_tensor_parallel_vllm_as_its_own_checkpoint_load_would(tmp_path, vllm_python):
    tp, hold, last = 2, "trainer-0-before-ready-v0", "controller-0-delivered-v2"
    # vLLM's CPU int8 kernel: oneDNN's, in float32 here, or where the CPU has AMX tiles its AMX
    # kernel, which takes 16-bit activations only (a float32 server fails its first completion);
    # either's weights are read back (vllm_backend/served.py)
    dtype = "bfloat16" if amx_tiles() else "float32"
    job = vllm_job("vllm-int8", trainers=1, servers=1, steps=4, quantization="int8", tensorParallel=tp,
                   dtype=dtype, checkpoint=int8_checkpoint(tmp_path / "checkpoint"))  # versions 0..2
    # the trainer holds version 0 while the server starts; the last version delivered, the server is held
    run = VllmRun(tmp_path, job, vllm_python, pauses=[hold, "trainer-0-before-go-v1", "trainer-0-before-go-v2", last],
                  pause_limit=REACH_TIMEOUT)
    held, tokens = {}, {}
    try:
        server = run.servers[0]
        run.reach(hold)
        run.up(server)
        own_tokens = completion(server, job.name, key=run.key)  # vLLM's own load of the checkpoint, at its start
        own = checksums_then_reset(run, [server])[0][server]
        run.release(hold)
        for version in (0, 1):  # the trainer holds the next version back while the test asks
            run.reach(f"trainer-0-before-go-v{version + 1}")
            run.serving(server, version)
            held[version] = checker(server, "checksum", key=run.key)["checksums"]
            tokens[version] = completion(server, job.name)
            if version == 0:
                assert checker(server, "compare", own, key=run.key) == {"match": True, "mismatches": []}, \
                    "version 0, loaded over the reset weights, differs from vLLM's own load of its checkpoint"
            run.release(f"trainer-0-before-go-v{version + 1}")
        run.reach(last)
        sent = assert_int8_slices(run.dump, job, LLAMA, tp, (0, 1))
        post(server, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(
            save_checkpoint(sent[1], LLAMA, tmp_path / "checkpoint-v1", "int8"))}}, key=run.key)
        assert checker(server, "compare", held[1], key=run.key) == {"match": True, "mismatches": []}, \
            "version 1: the job's server held other weights than vLLM's own load of its checkpoint from disk"
        run.release(last)
        end = run.finish()
    finally:
        run.local.stop()
    assert end["state"] == "Succeeded" and end["versions"] == 3, end
    assert "version 2 into vLLM" in run.log(2)  # every version loaded
    assert held[0] != held[1], "version 1 changed no weight vLLM holds"
    assert tokens[0] == own_tokens, "version 0 answers other greedy tokens than vLLM's own load of its checkpoint"
    logs = run.log(2)  # the server's pod
    assert all(f"tensor-parallel rank {r} of {tp}" in logs for r in range(tp)), "a worker received the whole version"


# vLLM's FP8 layers take no tensor-parallel slice that cuts a 128x128 block: at TP 2 each worker's
# q, k and v rows (and o_proj's and down_proj's columns) are whole blocks of this model
FP8_TP2 = {**LLAMA, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4}


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_versions_load_into_vllm_as_its_own_checkpoint_load_would(tmp_path, vllm_python, tp):
    """A job of one server (versions 0..2), of one worker and of two: versions 0 and 1 checked
    against a plain server of as many workers loading the same fp8 checkpoints from disk, which
    starts on version 1's (weights and greedy tokens) and then reloads version 0's (weights)."""
    why = fp8_runs_here()
    if why is not None:
        pytest.skip(why)
    config = LLAMA if tp == 1 else FP8_TP2
    job = vllm_job(f"vllm-fp8-tp{tp}", trainers=1, servers=1, steps=4, quantization="fp8", config=config,
                   tensorParallel=tp)
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
    logs = run.log(2)  # the server's pod
    assert "version 2 into vLLM" in logs  # every version loaded
    assert tp == 1 or all(f"tensor-parallel rank {r} of {tp}" in logs for r in range(tp)), \
        "a worker received the whole version"
    assert held[0] != held[1], "version 1 changed no weight vLLM holds"
    sent = {v: torch.load(run.dump / f"trainer-0-v{v}.pt")["sent"] for v in (0, 1)}
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert sent[0][weight].dtype == torch.float8_e4m3fn and sent[0][weight + "_scale_inv"].dtype == torch.float32
    folders = {v: save_checkpoint(sent[v], config, tmp_path / f"checkpoint-v{v}", "fp8") for v in (0, 1)}
    plain = PlainServer(vllm_python, folders[1], free_port(), tp, tmp_path / "plain.log")
    try:
        plain.wait_up()
        for version in (1, 0):
            if version == 0:  # vLLM's own reload, from the checkpoint on disk
                post(plain.url, "/collective_rpc", {"method": "reload_weights",
                                                    "kwargs": {"weights_path": str(folders[version])}})
            assert checker(plain.url, "compare", held[version]) == {"match": True, "mismatches": []}, \
                f"version {version}: the job's server holds other weights than a plain server on its checkpoint"
            if version == 1:  # token for token only the version it loaded at its start
                assert completion(plain.url, "plain") == tokens[version], f"version {version}: other greedy tokens"
    finally:
        plain.stop()
