"""`weightsync bench --vllm PYTHON`: how long until every vLLM server serves a new version.

Two ways to get a version from trainer ranks into running vLLM servers, measured in one run, on
the same model and the same number of servers:
  weightsync  a job with spec.inference.engine vllm (`weightsync run`'s local processes) whose
              trainer ranks run this module as their command: they only change the weights and
              publish, as the disk baseline does, and make the next version once every server
              serves this one (no training competes with the load for the cores). Each version
              goes M to N into every server's staging buffer and is verified there, then the
              controller has every server load it between two steps. From the controller's go
              to the last server serving the version (the round's time). Twice: loading in
              the pause (`weightsync`), and with spec.inference.vllm.loadAhead (`ahead`: each
              server loads the verified version into a second copy of its weights while it
              serves, and the pause holds only the copy into the weights it runs on).
  disk        what slime's and vLLM's disk path do: the trainer saves the version as a safetensors
              checkpoint, then every server pauses, reloads its weights from that checkpoint
              (vLLM's reload_weights) and resumes. From the start of the save to the last server
              serving it.
The stall is how long a server serves nothing: from its pause to its resume (the longest of the
servers). Between two versions both methods wait a training step (STEP seconds, --step): in RL a
version follows a step of training, and vLLM's CPU worker busy-polls its message queue for a
second after every call it answers (shm_broadcast's spin before it goes idle), so versions back
to back would time each load against the last one's polling on the same two cores. vLLM's own
nccl backend needs GPUs; this machine has none, so it is not run here.

Where the seconds go, per phase (the median over the versions of the slowest server's), comes from
what the parts recorded, not from estimates: for weightsync the controller's round record (its
line on stdout: the transfer, the reference digest, the staging, each control call as control.py
timed it, the stall, and the load as every worker timed it in its applied record); for the disk
the calls this module makes itself.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import weightsync
from weightsync.bench.chart import vllm_chart
from weightsync.job import API_VERSION, KIND, Env, Model, WorkerContext, load_job
from weightsync.local import ports as leases
from weightsync.local.preflight import check_vllm_python
from weightsync.local.runner import LocalJob
from weightsync.model.build import build, parameters
from weightsync.rendezvous.protocol import Keys
from weightsync.roles.vllm_server import server_command
from weightsync.runtime.procs import VLLM_STOP_GRACE, stop
from weightsync.vllm_backend.control import Server

# A Llama of about 50M parameters (100 MB a version in bfloat16), shaped as vLLM's CPU backend takes it
MODEL = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 12,
         "num_key_value_heads": 4, "num_hidden_layers": 6, "vocab_size": 8192, "max_position_embeddings": 512,
         "bos_token_id": 0, "eos_token_id": 0}
SERVER_ARGS = ["--enforce-eager", "--gpu-memory-utilization", "0.05", "--max-model-len", "256", "--max-num-seqs", "4"]
# Every server's worker unbound, on one thread. vLLM's CPU build binds a worker to the cores it
# believes its own (here all of them but the one it leaves to its frontend: core 0), so every
# server's worker would share that one core; and a worker spins on its message queue for a second
# after every call, so the first to finish a load takes most of the core from the one still
# loading (loads of 1.0-1.5 s instead of 0.1 s). On a cluster each server has its own.
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
UP_TIMEOUT = 900.0
# The phases of a version, in the order they happen; each the slowest server's, where per server
PHASES = {"transfer": "go -> every trainer sent", "save": "the checkpoint written",
          "verify": "reference digest published", "prepare": "loaded ahead, serving on",
          "staging": "-> every server staged",
          "pause": "pause call", "start": "start_weight_update call", "update": "update_weights call",
          "reload": "reload_weights call", "finish": "finish_weight_update call",
          "version": "update_weight_version call", "resume": "resume call",
          "load": "the worker's load", "applied": "last call -> every applied",
          "stall": "pause -> resume answered", "total": "start -> every server serving"}
RUN_TIMEOUT = 1800.0
VERSIONS = 9  # per method; weightsync's first is its warm-up, the disk's first is the servers' start
STEP = 2.0  # seconds between a version served and the next made: a training step, past vLLM's polling


def bench_job(name: str, trainers: int, servers: int, versions: int, ahead: bool = False, step: float = 0.0,
              command: list[str] | None = None, inflight: str = "finish"):
    """The bench's job; `command`: the trainer ranks' own (publish_versions by default)."""
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
        "spec": {"model": {"config": MODEL, "dtype": "bfloat16"},
                 "trainer": {"replicas": trainers, "gpusPerProc": 0,
                             "command": command or [sys.executable, "-m", "weightsync.bench.vllm", str(versions),
                                                    str(step)]},
                 "inference": {"replicas": servers, "gpusPerProc": 0, "engine": "vllm",
                               "vllm": {"args": SERVER_ARGS, "loadAhead": ahead, "inflight": inflight}},
                 "transfer": {"transport": "tcp", "timeoutSeconds": 300},
                 "network": {"mode": "tcp"}}})


def weightsync_times(python: str, trainers: int, servers: int, versions: int, ahead: bool = False,
                     step: float = STEP) -> list[dict]:
    """The records of a vLLM job's versions after the first: seconds from go to every server
    serving it, and the stall; `ahead`: with spec.inference.vllm.loadAhead."""
    job = bench_job("bench-vllm", trainers, servers, versions, ahead, step)
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-vllm-") as folder:
        local = LocalJob(job, Path(folder), {Env.VLLM_PYTHON: python, **SERVER_ENV}, progress=io.StringIO())
        try:
            local.start()
            local.wait(RUN_TIMEOUT)
        finally:
            local.stop()
    return [version_row(t) for t in local.transfers[1:]]


def version_row(record: dict) -> dict:
    """A version's row from the controller's round record (its line on stdout): the round's
    seconds, the stall and where the seconds went (phases, as the controller measured them)."""
    return {"seconds": record["seconds"], "stall": record["stall_seconds"], "bytes": record["bytes"],
            "phases": {**record["phases"], "total": record["seconds"]}}


def disk_times(python: str, servers: int, versions: int, step: float = STEP) -> list[dict]:
    """Versions saved as a checkpoint and reloaded from it by every server."""
    import subprocess

    import torch
    from safetensors.torch import save_file

    model = build(bench_job("bench-vllm-disk", 1, servers, versions).model, dtype="float32", seed=0)
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-disk-") as folder:
        first = Path(folder) / "v0"
        save_version(model, first, save_file)
        ports = leases.lease([1] * servers)
        logs = [open(Path(folder) / f"server-{i}.log", "w") for i in range(servers)]  # noqa: SIM115 - closed below
        # the checkpoint has no tokenizer: token ids in, as the weightsync job's servers
        args = (*SERVER_ARGS, "--skip-tokenizer-init")
        procs = [subprocess.Popen(server_command(python, Model(path=str(first), dtype="bfloat16"), "bench", args, "127.0.0.1", p,
                                                 guarded=False, backend=False),
                                  env={**os.environ, **SERVER_ENV, "VLLM_SERVER_DEV_MODE": "1"},
                                  stdout=log, stderr=subprocess.STDOUT) for p, log in zip(ports, logs)]
        urls = [Server(f"http://127.0.0.1:{p}") for p in ports]
        try:
            for s, proc, log in zip(urls, procs, logs):
                try:
                    s.wait_up(UP_TIMEOUT, alive=lambda proc=proc: proc.poll() is None)
                except Exception:  # noqa: BLE001 - whatever kept it down, its log says why
                    log.flush()
                    tail = Path(log.name).read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"a vLLM server of the disk baseline did not come up; its log ends:\n{tail}") from None
            out = []
            generator = torch.Generator().manual_seed(1)
            for v in range(1, versions):
                time.sleep(step)
                new_version(model, generator)
                start = time.monotonic()
                where = Path(folder) / f"v{v}"
                save_version(model, where, save_file)
                saved = time.monotonic() - start
                with ThreadPoolExecutor(len(urls)) as pool:
                    calls = list(pool.map(lambda s: reload_version(s, where, v), urls))
                seconds = time.monotonic() - start
                slowest = {k: max(c[k] for c in calls) for k in calls[0]}
                out.append({"seconds": seconds, "stall": slowest["stall"],
                            "bytes": sum(p.numel() * 2 for _, p in parameters(model)) * servers,
                            "phases": {"save": saved, **slowest, "load": slowest["reload"], "total": seconds}})
            return out
        finally:
            for proc, log in zip(procs, logs):
                stop(proc, grace=VLLM_STOP_GRACE)
                log.close()
            leases.release(ports)


def new_version(model, generator) -> None:
    """What a version changes, in both methods: a little noise on every weight."""
    import torch

    with torch.no_grad():
        for _, p in parameters(model):
            p.add_(torch.randn(p.shape, generator=generator), alpha=1e-3)


def publish_versions(count: int, step: float) -> int:
    """The trainer ranks' command in the weightsync job: `count` versions, `step` seconds apart
    once every server serves the last (every rank the same weights: a DDP replica)."""
    import torch

    ctx = WorkerContext.from_environ()
    model = build(ctx.job.model, dtype="float32", seed=0)
    generator = torch.Generator().manual_seed(1)
    with weightsync.attach(model) as sync:
        for v in range(count):
            if v:
                time.sleep(step)
                new_version(model, generator)
            sync.publish(step=v)
            # the next version is made once every server serves this one, as the disk baseline
            # makes it after the reload: the trainers' arithmetic must not take the cores the
            # servers load on (on a cluster they have their own)
            sync.member.wait_for(Keys.done(v), f"every server to serve version {v}", RUN_TIMEOUT)
    return 0


def save_version(model, where: Path, save_file) -> None:
    """The model's weights at `where` as a bfloat16 safetensors checkpoint with its config, which
    names the model's class as its architecture (a vLLM server refuses a checkpoint that names none)."""
    import copy

    import torch

    where.mkdir()
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(where)
    save_file({n: p.detach().to(torch.bfloat16).contiguous() for n, p in parameters(model)}, str(where / "model.safetensors"))


def reload_version(server, where: Path, version: int) -> dict[str, float]:
    """One server's reload of the checkpoint: the seconds each call took, and the stall."""
    times = {}

    def timed(name: str, route: str, body: dict | None, timeout: float) -> None:
        began = time.monotonic()
        server.call(route, body, timeout)
        times[name] = time.monotonic() - began

    timed("pause", "/pause?mode=wait&clear_cache=true", None, 300)
    paused = time.monotonic()
    try:
        timed("reload", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(where)}}, 600)
        timed("version", "/update_weight_version", {"new_version": str(version)}, 60)
    finally:
        timed("resume", "/resume", None, 60)
    times["stall"] = time.monotonic() - paused
    return times


def run(python: str, trainers: int = 2, servers: int = 2, versions: int = VERSIONS, step: float = STEP) -> dict:
    check_vllm_python(python)
    results = {"weightsync": weightsync_times(python, trainers, servers, versions, step=step),
               "ahead": weightsync_times(python, trainers, servers, versions, ahead=True, step=step),
               "disk": disk_times(python, servers, versions, step)}
    report = {"model": f"Llama, {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, bfloat16",
              "trainers": trainers, "servers": servers, "step": step, "methods": {}}
    for method, rows in results.items():
        report["methods"][method] = {
            "seconds_per_version": statistics.median(r["seconds"] for r in rows),
            "stall_seconds": statistics.median(r["stall"] for r in rows),
            "bytes_per_version": rows[0]["bytes"], "seconds": [round(r["seconds"], 4) for r in rows],
            "stalls": [round(r["stall"], 4) for r in rows], "phases": medians([r["phases"] for r in rows]),
            "versions": [{k: round(v, 4) for k, v in r["phases"].items()} for r in rows]}
    base = report["methods"]["disk"]["seconds_per_version"]
    for m in report["methods"].values():
        m["speedup_over_disk"] = base / m["seconds_per_version"]
    return report


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over the versions that have it."""
    names = [k for k in PHASES if any(k in r for r in rows)] + sorted({k for r in rows for k in r} - set(PHASES))
    return {k: statistics.median(r[k] for r in rows if k in r) for k in names}


def table(report: dict) -> str:
    lines = [f"model: {report['model']}; {report['trainers']} trainer ranks -> {report['servers']} vLLM servers; "
             f"{report.get('step', 0):g}s between versions",
             f"{'method':<12}{'s/version':>10}{'stall s':>10}{'MB/version':>12}{'vs disk':>9}"]
    for name, m in report["methods"].items():
        lines.append(f"{name:<12}{m['seconds_per_version']:>10.3f}{m['stall_seconds']:>10.3f}"
                     f"{m['bytes_per_version'] / 1e6:>12.1f}{m['speedup_over_disk']:>8.2f}x")
    return "\n".join(lines) + "\n\n" + breakdown(report["methods"])


def breakdown(methods: dict[str, dict]) -> str:
    """Where a version's seconds go, per method: each phase's median over the versions (slowest
    server), "-" where a method has no such phase."""
    names = list(methods)
    phases = [k for k in PHASES if any(k in m["phases"] for m in methods.values())]
    phases += sorted({k for m in methods.values() for k in m["phases"]} - set(PHASES))
    lines = [f"{'seconds (median)':<44}" + "".join(f"{n:>12}" for n in names)]
    for k in phases:
        cells = "".join(f"{methods[n]['phases'][k]:>12.3f}" if k in methods[n]["phases"] else f"{'-':>12}" for n in names)
        lines.append(f"{k + ': ' + PHASES.get(k, ''):<44}"[:44] + cells)
    return "\n".join(lines)


def main(python: str, as_json: bool, chart: str | None = None, step: float = STEP) -> int:
    report = run(python, step=step)
    print(json.dumps(report, indent=2) if as_json else table(report), flush=True)
    if chart:
        print(f"bench: chart in {vllm_chart(report, list(PHASES), chart)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(publish_versions(int(sys.argv[1]), float(sys.argv[2])))
