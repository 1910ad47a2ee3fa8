"""vLLM servers the tests start themselves, as a user starts them for a job whose inference ranks
are external: vLLM's OpenAI-compatible server (its CPU build) with weightsync as its weight-transfer
backend and the job's join variables in its environment, and nothing that calls it afterwards."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
import urllib.request
from pathlib import Path

from support.vllm import LLAMA, free_port, vllm_python  # noqa: F401 - the tests take both from here
from weightsync.job import Model
from weightsync.roles.vllm_server import server_command

# a trainer written against vLLM's own trainer API, with weightsync's init info
VLLM_API_EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "integrations" / "vllm_trainer_api.py")
# vLLM's CPU backend: head size 64 (LLAMA), a small share of memory, a small KV cache (the env below)
SERVER_ARGS = ("--enforce-eager", "--gpu-memory-utilization", "0.05", "--max-model-len", "256", "--max-num-seqs", "4")
UP_TIMEOUT = 600.0  # seconds: a vLLM server starts in about 1-2 minutes on 2 busy cores
# its sitecustomize traces the engine's init in the server's own processes (support/paths.py)
TRACED_INIT = Path(__file__).resolve().parent / "traced_init"


def read_join_file(path: Path, timeout: float = 300.0) -> dict[str, str]:
    """The variables `weightsync run --join-env` wrote, once it has."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was not written within {timeout:.0f}s"
        time.sleep(0.1)
    return dict(shlex.split(line)[0].split("=", 1) for line in path.read_text().splitlines() if line.strip())


def traced_init(out: Path) -> dict[str, str]:
    """The environment of a server whose engine's init is traced, each init into `out` as JSON
    (traced_init/sitecustomize.py): that folder first on its PYTHONPATH."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(TRACED_INIT), os.environ.get("PYTHONPATH")])),
            "WEIGHTSYNC_TEST_TRACE_INIT": str(out)}


class ExternalServer:
    """One vLLM server with the join variables `join` (and `url` as WEIGHTSYNC_VLLM_SERVER unless
    None), listening on `port` (default: a free one); its output goes to `log`."""

    def __init__(self, python: str, model: Model, name: str, join: dict[str, str], log: Path, url: str | None = "",
                 env: dict[str, str] | None = None, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = server_command(python, model, name, SERVER_ARGS, "127.0.0.1", self.port)
        if model.path is not None:  # a checkpoint as save_checkpoint writes it, without a tokenizer
            cmd.append("--skip-tokenizer-init")
        environ = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
        environ.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **join, **(env or {})})
        if url is not None:
            environ["WEIGHTSYNC_VLLM_SERVER"] = url or self.url
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=environ, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def exited(self, timeout: float = UP_TIMEOUT) -> int:
        """Its exit code, once it has exited (a refused server must not hang)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the vLLM server at {self.url} still runs after {timeout:.0f}s:\n"
                                 f"{self.text()[-3000:]}") from None

    def weight_version(self) -> str | None:
        try:
            with urllib.request.urlopen(self.url + "/weight_info", timeout=10) as response:
                return json.loads(response.read())["weight_version"]
        except OSError:
            return None

    def up(self, timeout: float = UP_TIMEOUT) -> None:
        """Wait until the server answers (it names the version it serves: vLLM's "default" before any)."""
        deadline = time.monotonic() + timeout
        while self.weight_version() is None:
            assert self.proc.poll() is None, f"the vLLM server at {self.url} exited:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.url} did not answer within {timeout:.0f}s"
            time.sleep(0.5)

    def serving(self, version: int, timeout: float = UP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while self.weight_version() != str(version):
            assert self.proc.poll() is None, f"the vLLM server at {self.url} exited:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.url} serves {self.weight_version()}, not {version}"
            time.sleep(0.1)

    def kill(self) -> None:
        """Gone at once, as a crashed or preempted server is: nothing it could tell anyone."""
        os.killpg(self.proc.pid, 9)
        self.proc.wait(30)

    def kill_engine_core(self) -> int:
        """Only the server's engine core killed (SIGKILL), as the kernel's OOM killer takes the
        process that holds the model: its workers end with it, its API server lives on. Its pid."""
        cores = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes()
            except OSError:  # ended while we looked
                continue
            if int(fields[1]) == self.proc.pid and b"EngineCore" in cmdline:  # the API server's child, by vLLM's title
                cores.append(int(stat.parent.name))
        assert len(cores) == 1, f"the vLLM server at {self.url} has engine cores {cores}"
        os.kill(cores[0], 9)
        return cores[0]

    def all_gone(self) -> bool:
        """Whether no process of the server's process group runs any more (an orphan that ended is
        a zombie until whoever adopted it reaps it)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # ended while we looked
                continue
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":  # its process group, and not a zombie
                return False
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)


def fused(tensors: dict) -> dict:
    """A Llama checkpoint's tensors as vLLM's Llama holds them: q, k, v in one qkv_proj, gate and up
    in one gate_up_proj (each concatenated on the output dim)."""
    import torch

    out = {}
    for name, t in tensors.items():
        if ".self_attn.q_proj." in name:
            out[name.replace("q_proj", "qkv_proj")] = torch.cat([tensors[name.replace("q_proj", p)]
                                                                 for p in ("q_proj", "k_proj", "v_proj")])
        elif ".mlp.gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, tensors[name.replace("gate_proj", "up_proj")]])
        elif not any(f".{p}." in name for p in ("k_proj", "v_proj", "up_proj")):
            out[name] = t
    return out


def assert_served_bit_for_bit(dump: Path, versions, ranks: int = 1) -> None:
    """Every one of `versions` each inference rank's server computed with (its dump) is the trainer's,
    bit for bit."""
    import torch

    for version in versions:
        want = fused(torch.load(dump / f"trainer-0-v{version}.pt")["tensors"])
        for rank in range(ranks):
            got = torch.load(dump / f"inference-{rank}-v{version}.pt")["tensors"]
            assert sorted(got) == sorted(want), f"vLLM holds other tensors: {sorted(set(got) ^ set(want))}"
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
                assert torch.equal(got[name].contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), \
                    f"version {version}: the vLLM server of inference rank {rank} holds other bytes in {name}"
