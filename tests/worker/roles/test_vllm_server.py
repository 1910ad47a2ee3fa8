"""How an inference pod of engine vllm starts its server: the command (tensor-parallel size, vLLM's
multiprocessing executor on CPU) and the environment that binds each CPU worker's threads to cores
of its own (vLLM's CPU build refuses to guess them on a machine with one NUMA node)."""

from __future__ import annotations

import os

from weightsync.job import Model
from weightsync.roles.vllm_server import OMP_BIND, server_command, server_env

MODEL = Model(path="/models/llama", dtype="bfloat16")


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
