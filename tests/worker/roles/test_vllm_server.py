"""How an inference pod of engine vllm starts its server: the command (tensor-parallel size, vLLM's
multiprocessing executor on CPU, expert parallelism), the model config it is given (the causal LM's
architecture, or a refusal before any server starts) and the environment that binds each CPU
worker's threads to cores of its own (vLLM's CPU build refuses to guess them on a machine with one
NUMA node)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.waits import until

from weightsync.job import Lora, Model, SpecError
from weightsync.model.config import served_config
from weightsync.roles.vllm_server import OMP_BIND, lora_args, lora_env, server_command, server_env
from weightsync.vllm_backend import lora_problem

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 128, "max_position_embeddings": 64}
MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
       "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 128,
       "max_position_embeddings": 64, "num_experts": 8, "num_experts_per_tok": 2}
MODEL = Model(config=LLAMA, dtype="bfloat16")


def test_a_tensor_parallel_server_runs_its_workers_as_vllm_places_them():
    cpu = server_command("python", MODEL, "demo", ("--max-model-len", "256"), "10.0.0.5", 8000, tensor_parallel=2, cpu=True)
    at = cpu.index("--tensor-parallel-size")
    assert cpu[at + 1] == "2" and cpu[cpu.index("--distributed-executor-backend") + 1] == "mp"
    assert cpu[-2:] == ["--max-model-len", "256"]  # the user's arguments last
    gpu = server_command("python", MODEL, "demo", (), "10.0.0.5", 8000, tensor_parallel=4, cpu=False)
    assert gpu[gpu.index("--tensor-parallel-size") + 1] == "4" and "--distributed-executor-backend" not in gpu
    one = server_command("python", MODEL, "demo", (), "10.0.0.5", 8000)
    assert "--tensor-parallel-size" not in one


def test_each_cpu_worker_gets_cores_of_its_own_unless_the_pod_says():
    cores = sorted(os.sched_getaffinity(0))
    bind = server_env(2, True, {})[OMP_BIND].split("|")
    assert len(bind) == 2
    groups = [[int(c) for c in group.split(",")] for group in bind]
    assert all(groups) and all(c in cores for g in groups for c in g)
    if len(cores) >= 2:
        assert not set(groups[0]) & set(groups[1]), "two workers bound to one core"
    assert server_env(2, True, {OMP_BIND: "0-3|4-7"}) == {}  # the pod's own binding stands
    assert server_env(1, True, {}) == {} and server_env(2, False, {}) == {}


def served_architectures(cmd: list[str]) -> list[str]:
    return json.loads((Path(cmd[cmd.index("--model") + 1]) / "config.json").read_text())["architectures"]


def test_an_inline_config_is_served_as_its_causal_lm_and_expert_parallelism_is_passed_on():
    # without `architectures`, vLLM resolves a mixture of experts' base model and serves it for pooling
    cmd = server_command("python", Model(config=MOE, dtype="bfloat16"), "demo", (), "10.0.0.5", 8000,
                         tensor_parallel=2, expert_parallel=True)
    assert served_architectures(cmd) == ["Qwen3MoeForCausalLM"] and "--enable-expert-parallel" in cmd
    assert served_architectures(server_command("python", MODEL, "demo", (), "10.0.0.5", 8000)) == ["LlamaForCausalLM"]
    assert "--enable-expert-parallel" not in server_command("python", MODEL, "demo", (), "10.0.0.5", 8000)


def checkpoint(folder: Path, **config) -> Model:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, **config}))
    (folder / "model.safetensors").write_bytes(b"")
    return Model(path=str(folder), dtype="bfloat16")


@pytest.mark.parametrize("model, tensor_parallel, expert_parallel, says", [
    (Model(config={**MOE, "architectures": ["Qwen3MoeModel"]}), (), False, "Qwen3MoeModel is not a causal LM"),
    (Model(config=MOE), (3,), True, "8 experts do not split evenly over the 3 tensor-parallel workers"),
    (Model(config=LLAMA), (2,), True, "model_type llama has no experts"),
    (Model(config=MOE, quantization="int8"), (1, 2), False,
     "the 2 tensor-parallel workers of a vLLM server would split every expert of qwen3_moe.*set spec.inference.vllm"),
])
def test_what_vllm_would_not_serve_as_asked_is_refused_on_one_line(model, tensor_parallel, expert_parallel, says):
    with pytest.raises(SpecError, match=says) as e:
        served_config(model, tensor_parallel, expert_parallel)
    assert "\n" not in str(e.value)


def test_quantized_experts_are_served_whole_by_each_worker_or_by_one_worker():
    for tensor_parallel, expert_parallel in (((2,), True), ((1,), False)):
        assert served_config(Model(config=MOE, quantization="int8"), tensor_parallel, expert_parallel).quantization_config


def test_a_checkpoint_keeps_its_architecture_and_must_name_a_causal_lm(tmp_path):
    assert served_config(checkpoint(tmp_path / "ok", architectures=["LlamaForCausalLM"])).architectures == \
        ["LlamaForCausalLM"]
    with pytest.raises(SpecError, match="LlamaForSequenceClassification is not a causal LM.*name LlamaForCausalLM"):
        served_config(checkpoint(tmp_path / "classifier", architectures=["LlamaForSequenceClassification"]))
    with pytest.raises(SpecError, match='names no architecture.*"architectures": \\["LlamaForCausalLM"\\]'):
        served_config(checkpoint(tmp_path / "none"))


def test_a_lora_jobs_server_serves_the_adapter_and_one_that_cannot_is_refused_on_one_line():
    lora = Lora(rank=12, alpha=24.0, target_modules=("q_proj",), name="tuned")
    assert lora_args(lora, ()) == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1"]
    assert lora_args(lora, ("--enable-lora", "--max-lora-rank=32")) == ["--max-loras", "1"]
    assert lora_env(Model(path="/m", lora=lora)) == {"WEIGHTSYNC_VLLM_LORA": "tuned", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    with pytest.raises(SpecError, match=r"--max-lora-rank 8 is below the adapter's rank 12 .*--max-lora-rank 16$"):
        lora_args(lora, ("--max-lora-rank", "8"))
    assert "was started without LoRA: start it with --enable-lora --max-lora-rank 16" in lora_problem(lora, False, None)
    assert lora_problem(lora, True, 16) is None


# a server whose engine died: its API process answers, then closes its port and lives on (as vLLM's
# does while it waits for the requests in flight that its dead engine will never answer)
DYING = """
import http.server, json, sys, threading, time
class Admission(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"held": 3, "current": 3}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Admission)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(server.server_address[1], flush=True)
sys.stdin.readline()  # until the test says that the engine died
server.shutdown()
server.server_close()
print("closed", flush=True)
time.sleep(600)
"""


def test_a_server_whose_port_closed_while_its_process_lives_is_ended_as_dead(capsys):
    from weightsync.rendezvous.channel import Channel, connect_store
    from weightsync.rendezvous.store.server import StoreServer
    from weightsync.roles import vllm_server
    from weightsync.vllm_backend.control import Server

    token, job = b"0123456789abcdef0123456789abcdef", "default/dead-engine"
    store = StoreServer("127.0.0.1", 0, token, job)
    proc = subprocess.Popen([sys.executable, "-c", DYING], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        channel = Channel(connect_store("127.0.0.1", store.port, token, job, 10.0))
        stood = []
        thread = threading.Thread(target=lambda: stood.append(vllm_server._stand_by(
            proc, Server(f"http://127.0.0.1:{port}"), channel, "inference rank 0")))
        thread.start()
        until("the pod taking its server for admitted", lambda: "serves version 3: ready" in capsys.readouterr().err
              or stood, 30)
        proc.stdin.write("\n")
        proc.stdin.flush()
        closed = time.monotonic()
        assert proc.stdout.readline().strip() == "closed"
        thread.join(vllm_server.DEAD_AFTER + 30)
        assert stood == [None], "the pod went on standing by a server with its port closed"
        took = time.monotonic() - closed
        assert took >= vllm_server.DEAD_AFTER, f"ended {took:.1f}s after its port closed, before DEAD_AFTER"
        assert proc.poll() is not None, "the server's process lives on"
        said = capsys.readouterr().err
        assert "the vLLM server's process lives on, but its port has been closed for 5s (its engine died): ending it" \
            in said, said
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        store.close()


def test_a_plain_server_runs_no_weightsync_backend():
    """The benches' and the tests' plain vLLM servers (vLLM's own reloads from disk) are started
    without weightsync's backend, which refuses to start a server of no job without its trainer's secret."""
    plain = server_command("python", MODEL, "demo", (), "10.0.0.5", 8000, guarded=False, backend=False)
    assert "--weight-transfer-config" not in plain and "--middleware" not in plain
    assert "--weight-transfer-config" in server_command("python", MODEL, "demo", (), "10.0.0.5", 8000)
