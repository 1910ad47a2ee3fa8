"""vLLM jobs for the tests: a job whose inference pods run vLLM's OpenAI-compatible server (its CPU
build, in the environment `make vllm-env` makes) with weightsync as the weight-transfer backend,
run as local processes (`weightsync run`'s LocalJob) with pause points and parameter dumps; the
servers' HTTP routes; a Llama checkpoint's tensors as vLLM holds them, whole or as one
tensor-parallel worker's shards (the tests' own statement of vLLM's layout, checked against what
vLLM's workers hold); checkpoints on disk (the tests' Llama in int8 among them); a plain vLLM
server (no weightsync) on a checkpoint. A client that asks a server over time: vllm_asker.py."""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from support.checkpoint_tensors import quantized
from support.jobs import assert_nothing_left
from weightsync.job import API_VERSION, KIND, Env, load_job
from weightsync.job.token import read_token
from weightsync.local import ports
from weightsync.local.preflight import CannotRunHere, check_vllm_python
from weightsync.local.runner import LocalJob
from weightsync.model.quant import FORMATS, quantization_config
from weightsync.rendezvous.proofs import control_key
from weightsync.runtime.faults import CORRUPT_ENV, DUMP_DIR_ENV, FAIL_LOAD_ENV, PAUSE_DIR_ENV, PAUSE_LIMIT_ENV
from weightsync.vllm_backend.guard import sign

DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "weightsync" / "vllm" / "bin" / "python"
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256,
         "bos_token_id": 0, "eos_token_id": 0}
# vLLM's CPU backend: head size 64 (above), a small share of memory, a small KV cache (the env below)
SERVER_ARGS = ["--enforce-eager", "--gpu-memory-utilization", "0.05", "--max-model-len", "256", "--max-num-seqs", "4"]
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
# a full KV block of the CPU build's 128 tokens and part of another: what its prefix cache keeps
LONG_PROMPT = [(7 * i) % 500 + 1 for i in range(200)]
REACH_TIMEOUT = 600.0  # seconds: two vLLM servers start in about 1-2 minutes each on 2 busy cores
RUN_TIMEOUT = 900.0
VOCAB_PADDING = 64  # vLLM pads an embedding's vocabulary to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE)


@functools.cache  # once per test process (a skip is not kept): each asking imports vLLM in a process
def vllm_python() -> str:
    """The Python that runs vLLM, or the test skips (fails under CI) saying why."""
    python = os.environ.get("WEIGHTSYNC_TEST_VLLM_PYTHON") or str(DEFAULT_VLLM_PYTHON)
    try:
        return check_vllm_python(python)
    except CannotRunHere as e:
        if os.environ.get("CI"):
            pytest.fail(f"vLLM cannot run here: {e}")
        pytest.skip(f"vLLM cannot run here ({e}); `make vllm-env` makes its environment")


def vllm_job(name: str, trainers: int, servers: int, steps: int, every: int = 2, config: dict = LLAMA,
             ahead: bool = False, dtype: str = "bfloat16", expert_parallel: bool = False, quantization: str | None = None,
             checkpoint: Path | None = None, lora: dict | None = None, args: tuple[str, ...] = (), **inference):
    """The job's model is `config`, or the checkpoint's folder (save_checkpoint's, without a
    tokenizer): its servers then start as plain vLLM servers on it, vLLM's own load from disk.
    `args`: more of vLLM's own arguments for its servers."""
    model = {"path": str(checkpoint)} if checkpoint else {"config": config}
    model.update(dtype=dtype, **({"quantization": quantization} if quantization else {}), **({"lora": lora} if lora else {}))
    args = SERVER_ARGS + (["--skip-tokenizer-init"] if checkpoint else []) + list(args)
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
        "spec": {"model": model,
                 "trainer": {"replicas": trainers, "gpusPerProc": 0},
                 "inference": {"replicas": servers, "gpusPerProc": 0, "engine": "vllm",
                               "vllm": {"args": args, "loadAhead": ahead, "expertParallel": expert_parallel},
                               **inference},
                 "training": {"steps": steps, "batchSize": 4, "seqLen": 32, "learningRate": 1e-2},
                 "transfer": {"everySteps": every, "bucketMB": 1, "transport": "tcp", "timeoutSeconds": 120},
                 "network": {"mode": "tcp"}}})


class VllmRun:
    """A vLLM job running as local processes, followed in a thread, with pause points armed."""

    def __init__(self, tmp_path: Path, job, python: str, pauses=(), corrupt: int | None = None,
                 pause_limit: float | None = None, fail_load: str | None = None):
        """`pause_limit`: how long a rank holds at a point the test has not released (faults.PAUSE_LIMIT
        by default), for a test that holds one while vLLM servers start; `fail_load`: the loads that
        fail after half of their layers ("RANK@VERSION,...", faults.FAIL_LOAD_ENV)."""
        self.dump, self.pause = tmp_path / "dump", tmp_path / "pause"
        self.dump.mkdir()
        self.pause.mkdir()
        for point in pauses:
            (self.pause / f"{point}.arm").touch()
        env = {DUMP_DIR_ENV: str(self.dump), PAUSE_DIR_ENV: str(self.pause), Env.VLLM_PYTHON: python,
               **SERVER_ENV, **({PAUSE_LIMIT_ENV: str(pause_limit)} if pause_limit else {})}
        if corrupt is not None:
            env[CORRUPT_ENV] = str(corrupt)
        if fail_load is not None:
            env[FAIL_LOAD_ENV] = fail_load
        self.job = job
        self.local = LocalJob(job, tmp_path / "run", env, progress=io.StringIO())
        self.servers = [f"http://127.0.0.1:{p.env[Env.VLLM_PORT]}" for p in self.local.pods if p.role == "inference"]
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

    def up(self, server: str) -> None:
        """Wait until the server answers (it names the version it serves: vLLM's "default" before any)."""
        deadline = time.monotonic() + REACH_TIMEOUT
        while weight_version(server) is None:
            assert self.end is None, f"the job ended before {server} answered: {self.end}"
            assert time.monotonic() < deadline, f"{server} did not answer within {REACH_TIMEOUT:.0f}s"
            time.sleep(0.1)

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

    @property
    def key(self) -> str:
        """The job's control key: what its servers' control routes ask of a caller."""
        return control_key(read_token(self.local.token_file), self.job.identity)


def post(server: str, route: str, body: dict, timeout: float = 120.0, key: str | None = None) -> dict:
    """`key`: the job's control key, which signs a request to a job's server's control routes (VllmRun.key)."""
    signed = {"Authorization": "Bearer " + sign(key, "POST", urlsplit(server).path + route)} if key else {}
    request = urllib.request.Request(server + route, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                                 **signed})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def weight_version(server: str) -> str | None:
    try:
        with urllib.request.urlopen(server + "/weight_info", timeout=10) as response:
            return json.loads(response.read())["weight_version"]
    except OSError:
        return None


def completion(server: str, job_name: str, prompt: list[int] = PROMPT, key: str | None = None) -> list[int]:
    """A greedy completion through the OpenAI API (token ids in and out: the job's model has no tokenizer);
    `key`, the job's control key, signs it: served whatever the server holds (a client's request is
    served only while the server holds the fleet's version: vllm_backend/admission.py)."""
    got = post(server, "/v1/completions", {"model": job_name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                           "return_token_ids": True}, key=key)
    return got["choices"][0]["token_ids"]


def refused_before_version_0(server: str, job_name: str) -> None:
    """A job's server that holds no version of the job's yet answers a client 503, saying so."""
    try:
        completion(server, job_name)
    except urllib.error.HTTPError as e:
        said = e.read().decode(errors="replace")
        assert e.code == 503 and e.headers.get("X-Weightsync-Version") == "none", (e.code, said)
        assert "holds no version of the job yet" in said, said
    else:
        raise AssertionError(f"{server} served a client before it held a version of the job's")


def generate(server: str, job_name: str, tokens: int = 8, prompt: list[int] = PROMPT) -> dict:
    """vLLM's generate route: its choices name the weight version of every token."""
    got = post(server, "/inference/v1/generate", {"model": job_name, "token_ids": prompt,
                                                  "sampling_params": {"max_tokens": tokens, "temperature": 0,
                                                                      "ignore_eos": True}})
    return got["choices"][0]


def answer(server: str, job_name: str) -> tuple[str, list[int]] | tuple[int, str | None]:
    """What a client gets of vLLM's generate route: (the one weight version its tokens name, the
    tokens), or where the server refuses it (its status, the X-Weightsync-Version it names)."""
    try:
        choice = generate(server, job_name)
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("X-Weightsync-Version")
    (span,) = choice["weight_versions"]
    return span["version"], choice["token_ids"]


def admission(server: str) -> tuple[int, dict]:
    """The server's GET /weightsync/admission: (status, what it says)."""
    try:
        with urllib.request.urlopen(server + "/weightsync/admission", timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def checker(server: str, action: str, baseline: dict | None = None, key: str | None = None) -> dict:
    """vLLM's weight checker (VLLM_SERVER_DEV_MODE): checksum, reset or compare every worker's
    parameters; a job's server answers it only with the job's control key."""
    return post(server, "/weight_checker", {"action": action, **({"baseline": baseline} if baseline else {})},
                key=key)


def checksums_then_reset(run: VllmRun, servers: list[str]) -> tuple[dict[str, dict], dict[str, dict]]:
    """Each server's checksums as they are (what it loaded), then after vLLM's reset of its weights:
    what the next version loaded must restore, and a proof that the reset changed them."""
    held = {s: checker(s, "checksum", key=run.key)["checksums"] for s in servers}
    for s in servers:
        assert checker(s, "reset", key=run.key) == {"status": "reset"}
    zeroed = {s: checker(s, "checksum", key=run.key)["checksums"] for s in servers}
    for s in servers:
        assert zeroed[s] != held[s], f"{s}: the reset changed no checksum"
    return held, zeroed


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (amx_tile in /proc/cpuinfo), without which vLLM's CPU build has
    neither its FP8 linear kernel nor, on x86, an int8 fused-experts kernel."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return "amx_tile" in flags.split()


def free_port() -> int:
    """A loopback port leased to this test process until it ends (weightsync.local.ports)."""
    return ports.lease([1])[0]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Llama checkpoint's tensors as vLLM's Llama holds them: q, k, v in one qkv_proj, gate and up
    in one gate_up_proj (each concatenated on the output dim)."""
    return shards(tensors, LLAMA, 1, 0)


def shards(tensors: dict[str, torch.Tensor], config: dict, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """A Llama checkpoint's tensors as vLLM's Llama holds them on tensor-parallel rank `rank` of
    `tp`: its query heads' rows of q_proj and its KV heads' rows of k_proj and v_proj (replicated
    when tp exceeds the KV heads) in one qkv_proj; its rows of gate_proj and of up_proj in one
    gate_up_proj; its columns of o_proj and down_proj; its rows of the vocabulary (padded to a
    multiple of 64, then cut in equal parts, the padding zero) of embed_tokens and lm_head; the
    rest whole. Of an int8 checkpoint, a weight's per-row scales (`weight_scale`) as its rows."""
    out = {}
    for name, box in boxes({n: tuple(t.shape) for n, t in tensors.items()}, config, tp, rank).items():
        t = tensors[name]
        if box is None:
            continue
        dim, start, stop = box
        part = t.narrow(dim, start, stop - start)
        if ".self_attn.q_proj." in name:
            k, v = (tensors[name.replace("q_proj", p)] for p in ("k_proj", "v_proj"))
            (_, ks, ke), (_, vs, ve) = (boxes({n: tuple(k.shape)}, config, tp, rank)[n]
                                        for n in (name.replace("q_proj", "k_proj"), name.replace("q_proj", "v_proj")))
            out[name.replace("q_proj", "qkv_proj")] = torch.cat([part, k[ks:ke], v[vs:ve]])
        elif ".mlp.gate_proj." in name:
            up = tensors[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([part, up[start:stop]])
        elif any(f".{p}." in name for p in ("k_proj", "v_proj", "up_proj")):
            continue
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = _vocab_rows(t.shape[0], tp)
            padded = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype)
            padded[:part.shape[0]] = part
            out[name] = padded
        else:
            out[name] = part
    return out


def boxes(shapes: dict[str, tuple], config: dict, tp: int, rank: int) -> dict[str, tuple[int, int, int] | None]:
    """(dim, start, stop) of every checkpoint tensor that tensor-parallel rank `rank` of `tp` holds."""
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head = config["hidden_size"] // heads
    out = {}
    for name, shape in shapes.items():
        if tp == 1 or len(shape) == 0 or "norm" in name:
            out[name] = (0, 0, shape[0]) if shape else None
        elif ".q_proj." in name:
            size = heads // tp * head
            out[name] = (0, rank * size, (rank + 1) * size)
        elif ".k_proj." in name or ".v_proj." in name:
            per = max(1, kv // tp)  # KV heads per rank; replicated by tp // kv ranks when tp > kv
            first = (rank // max(1, tp // kv)) * per
            out[name] = (0, first * head, (first + per) * head)
        elif ".gate_proj." in name or ".up_proj." in name:
            size = shape[0] // tp
            out[name] = (0, rank * size, (rank + 1) * size)
        elif (".o_proj." in name or ".down_proj." in name) and name.endswith("_scale"):
            out[name] = (0, 0, shape[0])  # int8's per-row scales of a row-parallel weight: every row, on every worker
        elif ".o_proj." in name or ".down_proj." in name:
            size = shape[1] // tp
            out[name] = (1, rank * size, (rank + 1) * size)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = _vocab_rows(shape[0], tp)
            out[name] = (0, min(shape[0], rank * rows), min(shape[0], (rank + 1) * rows))
        else:
            raise AssertionError(f"the tests' Llama layout does not know {name}")
    return out


def _vocab_rows(vocab: int, tp: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING // tp


def save_adapter(tensors: dict[str, torch.Tensor], lora: dict, folder: Path) -> Path:
    """A PEFT adapter's folder (adapter_config.json, adapter_model.safetensors) of the adapter's
    tensors in PEFT's saved names, as vLLM loads an adapter from disk."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": lora["rank"], "lora_alpha": lora["alpha"], "target_modules": lora["targetModules"],
        "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return folder


def save_checkpoint(tensors: dict[str, torch.Tensor], config: dict, folder: Path, quantization: str | None = None) -> Path:
    """A Hugging Face checkpoint directory: config.json and model.safetensors; quantized (the
    tensors a quantized version holds, and the format's quantization_config) with `quantization`."""
    from safetensors.torch import save_file
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    if quantization is not None:
        cfg["quantization_config"] = quantization_config(FORMATS[quantization])
    model_type = cfg.pop("model_type")
    # the architecture vLLM builds: the causal LM, as weightsync names it for its own servers
    AutoConfig.for_model(model_type, architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]],
                         **cfg).save_pretrained(folder)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def assert_int8_slices(dump: Path, job, config: dict, tp: int, versions) -> dict[int, dict[str, torch.Tensor]]:
    """After each of `versions`, every worker of the job's one server (`tp` of them) holds the
    trainer's bytes of its slices of the int8 version, weights and their scales as vLLM shards them,
    read back from its int8 kernel, and nothing else of it. The versions as the trainer sent them."""
    from weightsync.model.build import meta_layout
    from weightsync.model.flat import torch_dtype

    sent = {v: torch.load(dump / f"trainer-0-v{v}.pt")["sent"] for v in versions}
    dtypes = {s.name: torch_dtype(s.dtype) for s in meta_layout(job.model).slots}  # as sent: the rest cast
    for version, tensors in sent.items():
        for rank in range(tp):
            want = shards({n: t.to(dtypes[n]) for n, t in tensors.items()}, config, tp, rank)
            got = torch.load(dump / f"inference-{rank}-v{version}.pt")["tensors"]
            # besides, what the int8 kernel makes of the weights when it processes them (oneDNN's azp_adj)
            made = {n for n in set(got) - set(want) if n.endswith(".azp_adj")}
            assert sorted(set(got) - made) == sorted(want), f"vLLM holds other tensors: {sorted(set(got) ^ set(want))}"
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, (name, got[name].shape)
                assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), f"version {version}: worker {rank} in {name}"
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert sent[versions[0]][weight].dtype == torch.int8 and sent[versions[0]][weight + "_scale"].dtype == torch.float32
    return sent


def int8_checkpoint(folder: Path) -> Path:
    """The tests' Llama (seed 3) quantized to int8 with its per-row scales, as a compressed-tensors checkpoint."""
    from weightsync.job import Model
    from weightsync.model.build import build
    from weightsync.model.quant import quantized_names

    base = build(Model(config=LLAMA, dtype="float32"), dtype="float32", seed=3)
    return save_checkpoint(quantized(base.state_dict(), quantized_names(base), "int8"), LLAMA, folder, "int8")


class PlainServer:
    """vLLM's server on a checkpoint, without weightsync: what a server that loaded the weights
    from disk holds."""

    def __init__(self, python: str, checkpoint: Path, port: int, tp: int, log: Path, dtype: str = "bfloat16",
                 expert_parallel: bool = False, quantization: str | None = None, lora=None):
        """`lora` (a job.Lora): LoRA enabled for adapters of its rank, loaded at run time from folders
        (load_adapter)."""
        from weightsync.job import Model
        from weightsync.roles.vllm_server import server_command, server_env

        model = Model(path=str(checkpoint), dtype=dtype, quantization=quantization, lora=lora)
        cmd = server_command(python, model, "plain", tuple(SERVER_ARGS), "127.0.0.1", port, tensor_parallel=tp, cpu=True,
                             expert_parallel=expert_parallel, guarded=False, backend=False)
        env = {**os.environ, **SERVER_ENV, **server_env(tp, True, os.environ), "VLLM_SERVER_DEV_MODE": "1",
               **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"} if lora is not None else {})}
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.proc = subprocess.Popen(cmd + ["--skip-tokenizer-init"], env=env, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self, timeout: float = REACH_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except OSError:
                pass
            assert self.proc.poll() is None, f"the plain vLLM server exited: {self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the plain vLLM server did not come up within {timeout:.0f}s"
            time.sleep(0.5)

    def load_adapter(self, name: str, folder: Path) -> None:
        """vLLM's own adapter loading, from a PEFT adapter's folder, served under `name`."""
        request = urllib.request.Request(self.url + "/v1/load_lora_adapter", json.dumps(
            {"lora_name": name, "lora_path": str(folder)}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120):
            pass

    def stop(self) -> None:
        from weightsync.runtime.procs import VLLM_STOP_GRACE, stop

        stop(self.proc, grace=VLLM_STOP_GRACE)
