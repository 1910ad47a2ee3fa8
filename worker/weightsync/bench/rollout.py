"""`weightsync bench --vllm PYTHON --rollout-load`: what an update costs a vLLM server that is
generating, as rollout servers in asynchronous RL are: CLIENTS long greedy generations run at
once, each client starting its next as its last ends, while a version arrives every EVERY seconds.

Each way of updating runs on a server of its own, started once, with the same model and load
as the others (the --vllm bench's model, bench/vllm.py):
  finish      a job with spec.inference.vllm.inflight finish: the pause waits for the requests in
              flight to end on their version, new ones wait, then the version loads.
  keep        inflight keep: the requests in flight are frozen, the version loads, they resume on it.
  keep+ahead  keep with spec.inference.vllm.loadAhead: the version is loaded into a second copy while
              the server generates, and the pause holds only the commit.
  disk        a plain vLLM server that reloads each version from a checkpoint, as slime's and
              vLLM's disk path do: the trainer saves it, the server pauses (mode wait), reloads,
              is labelled and resumes.
Every run first serves version 0 for WINDOW seconds under the load with no update (the baseline of
that run: the same server, the same load), then publishes a version every EVERY seconds for WINDOW
seconds. Per phase: tokens per second over it (every client's streamed tokens); the longest gap
between two tokens of one request; the longest a request waited for its first token; requests
aborted (vLLM's finish reason abort) or failed; and per version, the seconds from its publication
(the trainer's publish call; the disk's save) to the first token generated on it, read from vLLM's
own weight_versions spans and the arrival of each generation's chunks. The figures under updates
are also given as ratios to the baseline. Per version also the path between the two
(rollout_path.py): the controller's go, the version staged (ready to commit), the pause and the
resume answered, the seconds from staged to the first token, and the clients' silence before it;
and tokens per second second by second. --ways runs some of the ways; --logs keeps the jobs' logs.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import weightsync
from weightsync.bench.chart import rollout_chart
from weightsync.bench.rollout_path import first_token, medians, paths, round_marks, timeline
from weightsync.bench.vllm import (
    SERVER_ARGS,
    SERVER_ENV,
    UP_TIMEOUT,
    bench_job,
    reload_version,
    save_version,
)
from weightsync.job import Env, Model, WorkerContext
from weightsync.local import ports as leases
from weightsync.local.preflight import check_vllm_python
from weightsync.local.runner import LocalJob
from weightsync.model.build import build, parameters
from weightsync.roles.vllm_server import server_command
from weightsync.runtime.procs import VLLM_STOP_GRACE, stop
from weightsync.vllm_backend.admission import ROUTE as ADMISSION
from weightsync.vllm_backend.control import Server

CLIENTS = 4  # the generations at once: the bench servers' --max-num-seqs
TOKENS = 240  # each generation's tokens, after an 8-token prompt (the servers' --max-model-len is 256)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
EVERY = 10.0  # seconds between two versions' publications
WINDOW = 60.0  # seconds of each phase: no update, then updates
WARMUP = 5.0  # seconds of load before the baseline counts (the clients' first prefill)
WAYS = {"finish": {"inflight": "finish"}, "keep": {"inflight": "keep"},
        "keep+ahead": {"inflight": "keep", "ahead": True}, "disk": None}
RUN_TIMEOUT = 1800.0


@dataclass
class Generation:
    """One streamed generation: when it started, each chunk's arrival and token count, what its
    last chunk said (vLLM's weight_versions spans and finish reason), or why it failed."""

    started: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time.time(), tokens in the chunk)
    spans: list[dict] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None

    def first_token_of(self, version: str) -> float | None:
        """When the first token generated on `version` arrived (None where none was)."""
        start = next((s["start"] for s in self.spans if s["version"] == version), None)
        seen = 0
        for arrived, count in self.chunks:
            if start is not None and seen <= start < seen + count:
                return arrived
            seen += count
        return None


def generate(url: str, model: str, tokens: int = TOKENS) -> Generation:
    """One greedy generation streamed from vLLM's generate route."""
    body = {"model": model, "token_ids": PROMPT, "stream": True,
            "sampling_params": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    request = urllib.request.Request(url + "/inference/v1/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    got = Generation(time.time())
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                choice = json.loads(line[len(b"data: "):])["choices"][0]
                if choice.get("token_ids"):
                    got.chunks.append((time.time(), len(choice["token_ids"])))
                got.spans = choice.get("weight_versions") or got.spans
                got.finish = choice.get("finish_reason") or got.finish
    except (urllib.error.URLError, OSError, ValueError) as e:
        got.error = f"{type(e).__name__}: {e}"
    return got


class Load:
    """CLIENTS threads, each generating one request after another until stopped."""

    def __init__(self, url: str, model: str, clients: int = CLIENTS):
        self.url, self.model = url, model
        self.done: list[Generation] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        self.started = time.time()
        for t in self.threads:
            t.start()

    def _client(self) -> None:
        while not self.stopping.is_set():
            self.done.append(generate(self.url, self.model))

    def stop(self) -> list[Generation]:
        self.stopping.set()
        for t in self.threads:
            t.join(600)
        return self.done


def figures(runs: list[Generation], begin: float, end: float) -> dict:
    """The load's figures over [begin, end): tokens per second, the longest gap between two tokens
    of one request (that ended within it), the longest wait for a first token, and requests
    aborted or failed."""
    tokens = sum(n for g in runs for t, n in g.chunks if begin <= t < end)
    gaps = [b[0] - a[0] for g in runs for a, b in zip(g.chunks, g.chunks[1:]) if begin <= b[0] < end]
    waits = [g.chunks[0][0] - g.started for g in runs if g.chunks and begin <= g.started < end]
    started = [g for g in runs if begin <= g.started < end]
    return {"tokens_per_second": tokens / (end - begin), "longest_gap": max(gaps, default=0.0),
            "longest_first_token_wait": max(waits, default=0.0), "requests": len(started),
            "aborted": sum(g.finish == "abort" for g in started), "failed": sum(g.error is not None for g in started)}


def first_tokens(runs: list[Generation], published: dict[int, float]) -> dict[int, float | None]:
    """Per version: seconds from its publication to the first token generated on it."""
    return {version: None if (t := first_token(runs, version)) is None else t - at for version, at in published.items()}


def steps_of(model, generator) -> dict:
    """What every version adds to each weight: noise as the --vllm bench's versions add
    (bench/vllm.new_version), drawn once, before the load starts. Drawn at every version, its 50 M
    numbers took a core for 0.2 s (on an idle one) just before each publication, where adding a
    step drawn before takes 0.03 s: the trainer's arithmetic, which on a cluster runs on the
    trainer's own machine, was charged to the update it precedes."""
    import torch

    return {name: torch.randn(p.shape, generator=generator) * 1e-3 for name, p in parameters(model)}


def next_version(model, step: dict) -> None:
    """The next version: every weight moved by its step (steps_of)."""
    import torch

    with torch.no_grad():
        for name, p in parameters(model):
            p.add_(step[name])


def publish_on_cadence(versions: int, every: float, window: float, record: str) -> int:
    """The trainer rank's command in a way's job (one rank): version 0, then, once the bench's load ran
    `window` seconds on it, a version every `every` seconds; each publication's time in `record`
    (JSON lines), and the job ends once the bench says its load stopped (`record`.done)."""
    import torch

    ctx = WorkerContext.from_environ()
    model = build(ctx.job.model, dtype="float32", seed=0)
    step = steps_of(model, torch.Generator().manual_seed(1))
    with weightsync.attach(model) as sync, open(record, "a") as out:
        sync.publish(step=0)
        sync.wait_done(0)
        time.sleep(window)
        began = time.time()
        for v in range(1, versions):
            time.sleep(max(0.0, began + (v - 1) * every - time.time()))
            next_version(model, step)
            print(json.dumps({"version": v, "published": time.time()}), file=out, flush=True)
            sync.publish(step=v)
        sync.wait_done(versions - 1)
        time.sleep(every)
        print(json.dumps({"end": time.time()}), file=out, flush=True)
        deadline = time.monotonic() + RUN_TIMEOUT
        while not Path(record + ".done").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    return 0


def job_way(python: str, name: str, inflight: str, ahead: bool = False, logs: str | None = None) -> dict:
    """One way's run in a job of one trainer rank and one vLLM server; `logs`: a folder the job's
    logs are copied into (under the way's name)."""
    versions = int(WINDOW / EVERY) + 1
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-rollout-") as folder:
        record = str(Path(folder) / "published.jsonl")
        job = bench_job(f"rollout-{name.replace('+', '-')}", 1, 1, versions, ahead,
                        command=[sys.executable, "-m", "weightsync.bench.rollout", str(versions), str(EVERY),
                                 str(WINDOW), record], inflight=inflight)
        local = LocalJob(job, Path(folder) / "run", {Env.VLLM_PYTHON: python, **SERVER_ENV}, progress=io.StringIO())
        url = f"http://127.0.0.1:{next(p.env[Env.VLLM_PORT] for p in local.pods if p.role == 'inference')}"
        try:
            local.start()
            _until(lambda: _admitted(url), UP_TIMEOUT, f"the {name} server serving version 0")
            load = Load(url, job.name)
            events = _until(lambda: _ended(record), RUN_TIMEOUT, f"the {name} run's versions")
            runs = load.stop()
            Path(record + ".done").touch()
            local.wait(RUN_TIMEOUT)
        finally:
            local.stop()
            if logs:
                shutil.copytree(Path(folder) / "run" / "logs", Path(logs) / name, dirs_exist_ok=True)
    rounds = local.transfers[1:]
    return report(name, runs, load.started, events, [t["stall_seconds"] for t in rounds],
                  {t["version"]: round_marks(t) for t in rounds})


def disk_way(python: str) -> dict:
    """A plain vLLM server reloading each version from a checkpoint the trainer saved."""
    import torch
    from safetensors.torch import save_file

    model = build(bench_job("rollout-disk", 1, 1, 2).model, dtype="float32", seed=0)
    step = steps_of(model, torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-rollout-disk-") as folder:
        save_version(model, Path(folder) / "v0", save_file)
        (port,) = leases.lease([1])
        log = open(Path(folder) / "server.log", "w")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(server_command(python, Model(path=str(Path(folder) / "v0"), dtype="bfloat16"), "bench",
                                               (*SERVER_ARGS, "--skip-tokenizer-init"), "127.0.0.1", port,
                                               guarded=False, backend=False),
                                env={**os.environ, **SERVER_ENV, "VLLM_SERVER_DEV_MODE": "1"}, stdout=log,
                                stderr=subprocess.STDOUT)
        server = Server(f"http://127.0.0.1:{port}")
        stalls, events, marks = [], [], {}
        try:
            server.wait_up(UP_TIMEOUT, alive=lambda: proc.poll() is None)
            server.call("/update_weight_version", {"new_version": "0"}, 60)
            load = Load(server.url, "bench")
            time.sleep(WINDOW)
            began = time.time()
            for v in range(1, int(WINDOW / EVERY) + 1):
                time.sleep(max(0.0, began + (v - 1) * EVERY - time.time()))
                next_version(model, step)
                events.append({"version": v, "published": time.time()})
                save_version(model, Path(folder) / f"v{v}", save_file)
                saved = time.time()  # the checkpoint is there to load: the disk's "staged"
                times = reload_version(server, Path(folder) / f"v{v}", v)
                stalls.append(times["stall"])
                marks[v] = {"staged": saved, "paused": saved + times["pause"],
                            "resumed": saved + times["pause"] + times["stall"]}
            time.sleep(EVERY)
            events.append({"end": time.time()})
            runs = load.stop()
        finally:
            stop(proc, grace=VLLM_STOP_GRACE)
            log.close()
            leases.release([port])
    return report("disk", runs, load.started, events, stalls, marks)


def report(name: str, runs: list[Generation], load_started: float, events: list[dict], stalls: list[float],
           marks: dict[int, dict[str, float]] | None = None) -> dict:
    """A way's figures: the baseline's and the updates', their ratios, and per version the path from
    its publication to its first token (rollout_path.py; `marks`: each version's times as the
    epoch's seconds, from the controller's round records or the disk way's own calls)."""
    published = {e["version"]: e["published"] for e in events if "version" in e}
    first = min(published.values())
    end = next(e["end"] for e in events if "end" in e)
    base = figures(runs, load_started + WARMUP, first)
    under = figures(runs, first, end)
    latency = first_tokens(runs, published)
    seen = [s for s in latency.values() if s is not None]
    path = paths(runs, published, marks or {})
    return {"way": name, "baseline": base, "updates": under, "versions": len(published),
            "stall_seconds": statistics.median(stalls) if stalls else None,
            "publication_to_first_token": {str(v): s for v, s in latency.items()},
            "publication_to_first_token_median": statistics.median(seen) if seen else None,
            "throughput_ratio": under["tokens_per_second"] / base["tokens_per_second"],
            "gap_ratio": under["longest_gap"] / base["longest_gap"] if base["longest_gap"] else None,
            "path": {str(v): row for v, row in path.items()}, "path_median": medians(path.values()),
            "timeline": {"begin": round(load_started + WARMUP - first, 3), "published": [
                round(t - first, 3) for t in published.values()], "tokens_per_second": timeline(
                runs, load_started + WARMUP, end)}}


def run(python: str, names: list[str] | None = None, logs: str | None = None) -> dict:
    """The ways `names` (every way by default) one after another; `logs`: where the jobs' logs go."""
    check_vllm_python(python)
    ways = []
    for name in names or list(WAYS):
        how = WAYS[name]
        ways.append(disk_way(python) if how is None else
                    job_way(python, name, how["inflight"], how.get("ahead", False), logs))
        print(f"bench: {name}: {json.dumps(ways[-1])}", file=sys.stderr, flush=True)  # whole, should a later way fail
    return {"clients": CLIENTS, "tokens": TOKENS, "every": EVERY, "window": WINDOW, "ways": ways}


def table(result: dict) -> str:
    lines = [f"{result['clients']} generations of {result['tokens']} tokens at once; a version every "
             f"{result['every']:g}s for {result['window']:g}s, after {result['window']:g}s with none (the baseline)",
             f"{'way':<12}{'tok/s':>8}{'x base':>8}{'gap s':>8}{'x base':>8}{'1st tok s':>10}{'aborted':>8}"
             f"{'failed':>7}{'stall s':>9}{'pub->tok s':>11}"]
    for w in result["ways"]:
        u = w["updates"]
        lines.append(f"{w['way']:<12}{u['tokens_per_second']:>8.1f}{w['throughput_ratio']:>8.2f}"
                     f"{u['longest_gap']:>8.2f}{w['gap_ratio'] or 0:>8.1f}{u['longest_first_token_wait']:>10.2f}"
                     f"{u['aborted']:>8}{u['failed']:>7}{w['stall_seconds'] or 0:>9.3f}"
                     f"{w['publication_to_first_token_median'] or 0:>11.2f}")
    return "\n".join(lines)


def main(python: str, as_json: bool, chart: str | None = None, names: list[str] | None = None,
         logs: str | None = None) -> int:
    result = run(python, names, logs)
    print(json.dumps(result, indent=2) if as_json else table(result), flush=True)
    if chart:
        print(f"bench: chart in {rollout_chart(result, chart)}", file=sys.stderr, flush=True)
    return 0


def _admitted(url: str) -> bool:
    try:
        Server(url).call(ADMISSION, None, 5, method="GET")
        return True
    except Exception:  # noqa: BLE001 - not up, or not admitted yet
        return False


def _ended(record: str) -> list[dict] | None:
    path = Path(record)
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return events if any("end" in e for e in events) else None


def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench: no {what} within {timeout:.0f}s")
        time.sleep(0.5)
    return got


if __name__ == "__main__":
    sys.exit(publish_on_cadence(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]))
