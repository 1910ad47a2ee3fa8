"""vLLM as the inference engine, for real: jobs whose inference pods run vLLM's OpenAI-compatible
server (its CPU build, in the environment `make vllm-env` makes) with weightsync as the weight
transfer backend, as local processes (`weightsync run`'s LocalJob).

What is checked: after every version the parameters vLLM computes with, read in its worker (fused
qkv_proj and gate_up_proj included, read back through the CPU build's repacked GEMM kernels where
it leaves the parameter empty), equal the trainer's weights bit for bit; a greedy completion through
the OpenAI API changes with the version, and vLLM's generate route names the version of every
token; a request in flight while a version is loaded completes on one version, and no request
after a load uses KV blocks cached before it; delta versions arrive bit for bit; a version whose
bytes were corrupted on the way is never loaded, the server goes on serving the one before, and
the job fails naming the rank.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from weightsync import job as contract
from weightsync.runtime.faults import CORRUPT_ENV, DUMP_DIR_ENV, PAUSE_DIR_ENV
from weightsync.local.runner import CannotRunHere, LocalJob, check_vllm_python

from support.jobs import assert_nothing_left

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`

DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "weightsync" / "vllm" / "bin" / "python"
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256,
         "bos_token_id": 0, "eos_token_id": 0}
# vLLM's CPU backend: head size 64 (above), a small share of memory, a small KV cache (the env below)
SERVER_ARGS = ["--enforce-eager", "--gpu-memory-utilization", "0.05", "--max-model-len", "256", "--max-num-seqs", "4"]
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
LONG_PROMPT = [(7 * i) % 500 + 1 for i in range(80)]  # several KV blocks: what vLLM's prefix cache keeps
REACH_TIMEOUT = 600.0  # seconds: two vLLM servers start in about 1-2 minutes each on 2 busy cores
RUN_TIMEOUT = 900.0


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get("WEIGHTSYNC_TEST_VLLM_PYTHON") or str(DEFAULT_VLLM_PYTHON)
    try:
        return check_vllm_python(python)
    except CannotRunHere as e:
        if os.environ.get("CI"):
            pytest.fail(f"vLLM cannot run here: {e}")
        pytest.skip(f"vLLM cannot run here ({e}); `make vllm-env` makes its environment")


def vllm_job(name: str, trainers: int, servers: int, steps: int, every: int = 2):
    return contract.load_job({
        "apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": name},
        "spec": {"model": {"config": LLAMA, "dtype": "bfloat16"},
                 "trainer": {"replicas": trainers, "gpusPerProc": 0},
                 "inference": {"replicas": servers, "gpusPerProc": 0, "engine": "vllm", "vllm": {"args": SERVER_ARGS}},
                 "training": {"steps": steps, "batchSize": 4, "seqLen": 32, "learningRate": 1e-2},
                 "transfer": {"everySteps": every, "bucketMB": 1, "transport": "tcp", "timeoutSeconds": 120},
                 "network": {"mode": "tcp"}}})


class VllmRun:
    def __init__(self, tmp_path: Path, job, python: str, pauses=(), corrupt: int | None = None):
        self.dump, self.pause = tmp_path / "dump", tmp_path / "pause"
        self.dump.mkdir()
        self.pause.mkdir()
        for point in pauses:
            (self.pause / f"{point}.arm").touch()
        env = {DUMP_DIR_ENV: str(self.dump), PAUSE_DIR_ENV: str(self.pause), contract.Env.VLLM_PYTHON: python,
               "VLLM_CPU_KVCACHE_SPACE": "1"}
        if corrupt is not None:
            env[CORRUPT_ENV] = str(corrupt)
        self.job = job
        self.local = LocalJob(job, tmp_path / "run", env, progress=io.StringIO())
        self.servers = [f"http://127.0.0.1:{p.env[contract.Env.VLLM_PORT]}" for p in self.local.pods if p.role == "inference"]
        self.end: dict | None = None
        self.local.start()
        self.follower = threading.Thread(target=self._follow, daemon=True)
        self.follower.start()

    def _follow(self) -> None:
        try:
            self.end = self.local.follow(RUN_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.end = {"state": "RunFailed", "message": str(e)}

    def reach(self, point: str) -> None:
        deadline = time.monotonic() + REACH_TIMEOUT
        while not (self.pause / f"{point}.reached").exists():
            assert self.end is None, f"the job ended before {point}: {self.end}"
            assert time.monotonic() < deadline, f"{point} was not reached within {REACH_TIMEOUT:.0f}s"
            time.sleep(0.05)

    def release(self, point: str) -> None:
        (self.pause / f"{point}.release").touch()

    def serving(self, server: str, version: int) -> None:
        """Wait until the server says it serves `version` (its loads follow the trainers' sends)."""
        deadline = time.monotonic() + REACH_TIMEOUT
        while weight_version(server) != str(version):
            assert time.monotonic() < deadline, f"{server} serves {weight_version(server)}, not {version}"
            time.sleep(0.05)

    def finish(self) -> dict:
        self.follower.join(RUN_TIMEOUT)
        try:
            self.local.wait(60.0) if self.end and self.end.get("state") == "Succeeded" else None
        except Exception:  # noqa: BLE001 - the end is what the test checks
            pass
        finally:
            self.local.stop()
        assert_nothing_left(self.local)
        return self.end

    def log(self, ordinal: int) -> str:
        return self.local.pods[ordinal].log.read_text(errors="replace")


def post(server: str, route: str, body: dict, timeout: float = 120.0) -> dict:
    request = urllib.request.Request(server + route, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def weight_version(server: str) -> str | None:
    try:
        with urllib.request.urlopen(server + "/weight_info", timeout=10) as response:
            return json.loads(response.read())["weight_version"]
    except OSError:
        return None


def completion(server: str, job_name: str, prompt: list[int] = PROMPT) -> list[int]:
    """A greedy completion through the OpenAI API (token ids in and out: the job's model has no tokenizer)."""
    got = post(server, "/v1/completions", {"model": job_name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                           "return_token_ids": True})
    return got["choices"][0]["token_ids"]


def generate(server: str, job_name: str, tokens: int = 8) -> dict:
    """vLLM's generate route: its choices name the weight version of every token."""
    got = post(server, "/inference/v1/generate", {"model": job_name, "token_ids": PROMPT,
                                                  "sampling_params": {"max_tokens": tokens, "temperature": 0,
                                                                      "ignore_eos": True}})
    return got["choices"][0]


def fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Llama checkpoint's tensors as vLLM's Llama holds them: q, k, v in one qkv_proj, gate and up
    in one gate_up_proj (each concatenated on the output dim)."""
    out = {}
    for name, t in tensors.items():
        if ".self_attn.q_proj." in name:
            parts = [tensors[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
        elif ".mlp.gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, tensors[name.replace("gate_proj", "up_proj")]])
        elif not any(f".{p}." in name for p in ("k_proj", "v_proj", "up_proj")):
            out[name] = t
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_vllm_servers_serve_every_version_bit_for_bit(tmp_path, vllm_python):
    job = vllm_job("vllm-job", trainers=2, servers=2, steps=6)  # versions 0..3
    run = VllmRun(tmp_path, job, vllm_python, pauses=["trainer-0-before-go-v2", "trainer-0-before-go-v3"])
    seen: dict[int, list[list[int]]] = {}
    try:
        for version in (1, 2):  # the trainers hold the next version back while the test asks
            run.reach(f"trainer-0-before-go-v{version + 1}")
            for server in run.servers:
                run.serving(server, version)
                tokens = completion(server, job.name)
                choice = generate(server, job.name)
                assert choice["token_ids"] == tokens, "the generate route and the OpenAI route disagree"
                assert choice["weight_versions"] == [{"version": str(version), "start": 0, "end": 8}]
                seen.setdefault(version, []).append(tokens)
            if version == 1:  # server 0 caches the long prompt's blocks on version 1
                completion(run.servers[0], job.name, LONG_PROMPT)
            else:  # a load clears them: server 0 answers on version 2 as server 1, which never saw the prompt
                assert completion(run.servers[0], job.name, LONG_PROMPT) == completion(run.servers[1], job.name, LONG_PROMPT), \
                    "a server answered from KV blocks cached before the load"
            if version == 1:  # a long request is in flight when version 2 is loaded
                long = {}
                flight = threading.Thread(target=lambda: long.update(generate(run.servers[0], job.name, 200)))
                flight.start()
                deadline = time.monotonic() + 60
                while "vllm:num_requests_running" not in running_metrics(run.servers[0]):
                    assert time.monotonic() < deadline, "the long request did not start"
                    time.sleep(0.01)
            run.release(f"trainer-0-before-go-v{version + 1}")
        flight.join(REACH_TIMEOUT)
        assert len(long["token_ids"]) == 200
        assert long["weight_versions"] == [{"version": "1", "start": 0, "end": 200}], \
            "a request in flight during an update ran on more than one version"
        end = run.finish()
    finally:
        run.local.stop()
    assert end["state"] == "Succeeded", end
    assert end["versions"] == 4 and end["failed_verifications"] == 0, end
    for version in range(4):
        want = fused(torch.load(run.dump / f"trainer-0-v{version}.pt")["tensors"])
        for rank in range(2):
            got = torch.load(run.dump / f"inference-{rank}-v{version}.pt")["tensors"]
            assert sorted(got) == sorted(want), f"vLLM holds other tensors: {sorted(set(got) ^ set(want))}"
            for name, tensor in want.items():
                assert got[name].dtype == torch.bfloat16 and got[name].shape == tensor.shape, name
                assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), \
                    f"version {version}: vLLM server {rank} holds other bytes than the trainer in {name}"
    assert seen[1][0] == seen[1][1] and seen[2][0] == seen[2][1], "two servers of one version answered differently"
    assert seen[1][0] != seen[2][0], "the greedy completion did not change with the version"


def test_delta_versions_are_loaded_into_vllm_bit_for_bit(tmp_path, vllm_python):
    """transfer.delta with the vLLM engine: the worker applies each delta to the version it holds,
    staged beside the one vLLM serves, and vLLM loads the result."""
    obj = vllm_job("vllm-delta", trainers=1, servers=1, steps=3, every=1).to_object()
    obj["spec"]["training"]["learningRate"] = 1e-6  # as in RL fine-tuning: a few percent of the elements change
    obj["spec"]["transfer"]["delta"] = {"enabled": True, "fullEvery": 10}
    run = VllmRun(tmp_path, contract.load_job(obj), vllm_python)
    end = run.finish()
    assert end["state"] == "Succeeded" and end["versions"] == 4, end
    transfers = run.local.transfers
    assert [t["version"] for t in transfers] == [0, 1, 2, 3]
    assert [t["deltaRanks"] for t in transfers] == [0, 1, 1, 1], transfers
    for t in transfers[1:]:
        assert t["wireBytes"] < t["bytes"] / 2, t
    for version in range(4):
        want = fused(torch.load(run.dump / f"trainer-0-v{version}.pt")["tensors"])
        got = torch.load(run.dump / f"inference-0-v{version}.pt")["tensors"]
        for name, tensor in want.items():
            assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), \
                f"version {version}: the vLLM server holds other bytes than the trainer in {name}"


def running_metrics(server: str) -> str:
    """The lines of the server's Prometheus metrics that count running requests, when one runs."""
    with urllib.request.urlopen(server + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return "\n".join(line for line in lines if line.startswith("vllm:num_requests_running") and not line.endswith(" 0.0"))


def test_a_corrupted_version_is_never_loaded_and_the_job_fails_naming_the_rank(tmp_path, vllm_python):
    job = vllm_job("vllm-corrupt", trainers=1, servers=1, steps=4)  # versions 0..2; 1 corrupted on the way
    run = VllmRun(tmp_path, job, vllm_python, corrupt=1)
    end = run.finish()
    # the bucket's checksum, which travels with it, already refuses it (before the version's digest)
    assert end["state"] == "Failed", end
    assert end["message"].startswith("inference rank 0 failed: TransferError"), end
    assert "checksum mismatch" in end["message"] and "of version 1" in end["message"], end
    assert end["versions"] == 1, end  # version 0 only: the rounds after the failure reached no one
    log = run.log(2)
    assert "loaded version 0 into vLLM" in log and "loaded version 1" not in log
    assert "the vLLM server serves version 0" in log, log[-3000:]
    assert (run.dump / "inference-0-v0.pt").exists() and not (run.dump / "inference-0-v1.pt").exists()
