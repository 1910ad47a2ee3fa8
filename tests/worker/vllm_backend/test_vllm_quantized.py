"""Quantized versions into vLLM (spec.model.quantization): the trainers send a quantized
checkpoint's tensors (int8 weights with their per-channel weight_scale, vLLM's compressed-tensors
W8A8 layout), vLLM's layerwise reload loads them and processes them again for its int8 kernel
(oneDNN on this CPU), and after each version the server holds what a plain vLLM server holds that
loaded the same quantized checkpoint from disk (vLLM's weight checker), and generates the same
greedy tokens. One job and one plain server for the module: the plain server starts on version 1's
checkpoint (weights and greedy tokens compared) and then loads version 0's from disk through vLLM's
own reload (weights compared: that reload leaves vLLM's CPU int8 kernel reading freed scales, which
the job's servers do not, engine.keep_onednn_scales).

fp8 (DeepSeek-V3's 128x128 blocks) needs vLLM's FP8 linear kernel, which its CPU build has only on
CPUs with AMX tiles, or a GPU: the same check runs there and is skipped elsewhere, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.vllm import LLAMA, PlainServer, VllmRun, checker, completion, free_port, post, save_checkpoint, vllm_job
from support.vllm import vllm_python as find_vllm_python

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


def served_like_a_plain_server(tmp_path: Path, vllm_python: str, quantization: str) -> None:
    """A quantized job (versions 0..2, one trainer, one server): versions 0 and 1 checked against a
    plain server loading the same quantized checkpoints from disk; every version loaded."""
    job = vllm_job(f"vllm-{quantization}", trainers=1, servers=1, steps=4, quantization=quantization)
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
    folders = {v: save_checkpoint(sent[v], LLAMA, tmp_path / f"checkpoint-v{v}", quantization) for v in (0, 1)}
    plain = PlainServer(vllm_python, folders[1], free_port(), 1, tmp_path / "plain.log")
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


def test_int8_versions_load_into_vllm_as_its_own_checkpoint_load_would(tmp_path, vllm_python):
    served_like_a_plain_server(tmp_path, vllm_python, "int8")


def test_fp8_versions_load_into_vllm_as_its_own_checkpoint_load_would(tmp_path, vllm_python):
    why = fp8_runs_here()
    if why is not None:
        pytest.skip(why)
    served_like_a_plain_server(tmp_path, vllm_python, "fp8")
