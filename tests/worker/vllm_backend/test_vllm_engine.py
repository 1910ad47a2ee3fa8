"""vLLM as the inference engine, for real: jobs whose inference pods run vLLM's OpenAI-compatible
server (its CPU build, in the environment `make vllm-env` makes) with weightsync as the weight
transfer backend, as local processes (`weightsync run`'s LocalJob).

What is checked (the first job loading every version ahead, into a second copy while the
servers serve; the other in the pause): after every version the parameters vLLM computes with,
read in its worker (fused qkv_proj and gate_up_proj included, read back through the CPU build's
repacked GEMM kernels where it leaves the parameter empty), equal the trainer's weights bit for
bit; a greedy completion through the OpenAI API changes with the version, and vLLM's generate
route names the version of every token; a client, which has no control key, is refused every
control route (relabel, reset, pause, collective_rpc) and the server serves on what it did, while
the controller's own calls load every version; a version loaded ahead is not served before its pause; a
request in flight while a version is loaded completes on one version, and no request after a
load uses KV blocks cached before it; a server frozen between two versions (SIGSTOP to its API
server, engine core and workers, for FROZEN seconds) is counted away, ends itself once woken and
is started again by its pod, rejoining where it used to fail the job: from the freeze on it answers
its clients nothing or 503 until it holds the fleet's version, and never a token of another, while
the other server serves on; delta versions arrive bit for bit, and
vLLM's own weight checker sees a reset restored by the next delta version; in that same job (one
vLLM start for both) a later version whose bytes were corrupted on the way is never loaded, the
server goes on serving the one before, and the job fails naming the rank.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support.vllm import (
    LLAMA,
    LONG_PROMPT,
    VllmRun,
    as_bytes,
    checker,
    checksums_then_reset,
    completion,
    fused,
    generate,
    post,
    save_checkpoint,
    vllm_job,
    weight_version,
)
from support.vllm import vllm_python as find_vllm_python
from support.vllm_asker import asked, in_flight, spans
from support.waits import until

from weightsync.job import Env, Model, load_job
from weightsync.model.build import build

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`

REACH_TIMEOUT = 600.0


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return find_vllm_python()


def test_vllm_servers_serve_every_version_bit_for_bit(tmp_path, vllm_python):
    # loaded ahead: every worker loads a verified version into a second copy while it serves
    job = vllm_job("vllm-job", trainers=2, servers=2, steps=6, ahead=True)  # versions 0..3
    run = VllmRun(tmp_path, job, vllm_python,
                  pauses=["trainer-0-before-go-v2", "trainer-0-before-ready-v3", "controller-0-staged-v2",
                          "controller-0-delivered-v3"],  # the job holds on until the restarted server is admitted
                  pause_limit=REACH_TIMEOUT)
    # version 3 is not announced while the trainers hold before it (a trainer is not ready): a
    # server frozen then waits for a round, and finds the controller's word that it was counted away
    holds = {1: "trainer-0-before-go-v2", 2: "trainer-0-before-ready-v3"}
    seen: dict[int, list[list[int]]] = {}
    try:
        for version in (1, 2):  # the trainers hold the next version back while the test asks
            run.reach(holds[version])
            for server in run.servers:
                run.serving(server, version)
                tokens = completion(server, job.name)
                choice = generate(server, job.name)
                assert choice["token_ids"] == tokens, "the generate route and the OpenAI route disagree"
                assert choice["weight_versions"] == [{"version": str(version), "start": 0, "end": 8}]
                seen.setdefault(version, []).append(tokens)
            if version == 1:
                check_metrics(run, serving=1)
                for server, tokens in zip(run.servers, seen[1]):
                    check_strangers_refused(server, job.name, tokens, version=1)
            if version == 1:  # server 0 caches the long prompt's blocks on version 1
                completion(run.servers[0], job.name, LONG_PROMPT)
            else:  # a load clears them: server 0 answers on version 2 as server 1, which never saw the prompt
                assert completion(run.servers[0], job.name, LONG_PROMPT) == completion(run.servers[1], job.name, LONG_PROMPT), \
                    "a server answered from KV blocks cached before the load"
            if version == 1:  # a long request is in flight when version 2 is loaded
                long, flight = in_flight(run.servers[0], job.name)
            if version == 2:  # server 1 freezes, ends itself once woken and comes back while the fleet serves version 2
                restarted = Restart(run, run.servers[1], pod=4, frozen=FROZEN)
                restarted.until_rejoined()
            run.release(holds[version])
            if version == 1:  # version 2 verified and loaded ahead on every worker, no server paused yet
                run.reach("controller-0-staged-v2")
                for server, tokens in zip(run.servers, seen[1]):
                    assert completion(server, job.name) == tokens, "a version loaded ahead was served before its pause"
                run.release("controller-0-staged-v2")
        restarted.until_admitted()
        run.release("controller-0-delivered-v3")
        flight.join(REACH_TIMEOUT)
        assert len(long["token_ids"]) == 200
        assert long["weight_versions"] == [{"version": "1", "start": 0, "end": 200}], \
            "a request in flight during an update ran on more than one version"
        end = run.finish()
    finally:
        run.local.stop()
    assert end["state"] == "Succeeded", end
    assert end["versions"] == 4 and end["failed_verifications"] == 0, end
    assert all("prepare" in t["phases"] for t in run.local.transfers), "a version was not loaded ahead"
    calls = [set(t["phases"]) for t in run.local.transfers]  # the control calls each version took
    assert "start" in calls[0] and all({"start", "finish"}.isdisjoint(c) and "version" in c for c in calls[1:3]), \
        f"vLLM's update session was not opened once and kept from one version to the next: {calls}"
    assert any("start" in c for c in calls[3:]), f"the restarted server's first version opened no session: {calls}"
    restarted.check(fleet=3)
    for ordinal in (3, 4):  # the inference pods (after the controller and the two trainer pods)
        assert "committed version 3 into vLLM" in run.log(ordinal) and "loaded ahead" in run.log(ordinal)
        assert "storages swapped" in run.log(ordinal)  # an eager model on the CPU (ahead.py)
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


def check_strangers_refused(server: str, job_name: str, tokens: list[int], version: int) -> None:
    """A client of the server, which has no control key, cannot relabel the version it serves,
    zero its weights or pause it: each call is refused, and the server serves on what it did."""
    for route, body in (("/update_weight_version", {"new_version": "999"}), ("/weight_checker", {"action": "reset"}),
                        ("/pause", {}), ("/collective_rpc", {"method": "reload_weights"})):
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(server, route, body, timeout=60)
        assert refused.value.code == 401, f"{route} answered {refused.value.code} to a client"
        assert "answered only to job default/vllm-job's controller" in refused.value.read().decode(), route
    assert weight_version(server) == str(version)
    choice = generate(server, job_name)
    assert choice["token_ids"] == tokens and choice["weight_versions"] == [{"version": str(version), "start": 0, "end": 8}]


def metrics_of(url: str) -> dict[tuple[str, str], float]:
    """{(sample name, its rank label or ""): value} of one scrape of a pod's /metrics."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {(s.name, s.labels.get("rank", "")): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def check_metrics(run: VllmRun, serving: int) -> None:
    """The vLLM servers' workers count into their pod's /metrics (the version each rank serves),
    and the controller times each version's stall in the servers."""
    for pod in (p for p in run.local.pods if p.role == "inference"):
        url = f"http://127.0.0.1:{pod.env[Env.HEALTH_PORT]}/metrics"
        until(f"{pod.name} serving version {serving} in its metrics", lambda url=url, pod=pod: all(
            metrics_of(url).get(("weightsync_serving_version", str(r))) == serving for r in pod.ranks), 60)
    until(f"the controller's stalls of versions 0..{serving}", lambda: metrics_of(run.local.metrics_url).get(
        ("weightsync_vllm_stall_seconds_count", "")) == serving + 1, 60)


def test_delta_versions_are_loaded_bit_for_bit_and_a_corrupted_version_never_is(tmp_path, vllm_python):
    """transfer.delta with the vLLM engine: the worker applies each delta to the version it holds,
    staged beside the one vLLM serves, and vLLM loads the result. vLLM's own weight checker: after
    its reset zeroed the weights, the next version, which comes as a delta where only some tensors
    changed, restores all of them (the worker loads the whole version it rebuilt, not what changed),
    equal to what vLLM's own reload of that version's checkpoint from disk holds (in the same
    server: the job's model is a checkpoint, so its server has vLLM's loader from disk). Version 3
    (whole: fullEvery 3) has a byte corrupted on the way: the bucket's checksum, which travels with
    it, refuses it (before the version's digest), it is never loaded, the server goes on serving
    version 2, the job fails naming the rank, and version 4 reaches no one."""
    # the job's model is a checkpoint: its server loads it from disk as a plain vLLM server would,
    # and can reload a version's checkpoint from disk (a server of a config holds dummy weights);
    # in float32, as the trainer holds its weights, so that a small step changes some of their bfloat16
    base = build(Model(config=LLAMA, dtype="bfloat16"), seed=3)
    start = save_checkpoint(dict(base.state_dict()), LLAMA, tmp_path / "checkpoint")
    obj = vllm_job("vllm-delta", trainers=1, servers=1, steps=4, every=1, checkpoint=start).to_object()  # versions 0..4
    obj["spec"]["training"]["learningRate"] = 1e-6  # as in RL fine-tuning: a few percent of the elements change
    obj["spec"]["transfer"]["delta"] = {"enabled": True, "fullEvery": 3}
    run = VllmRun(tmp_path, load_job(obj), vllm_python, pauses=["trainer-0-before-go-v2", "trainer-0-before-go-v3"],
                  corrupt=3)
    try:
        run.reach("trainer-0-before-go-v2")
        server = run.servers[0]
        run.serving(server, 1)
        held, zeroed = (each[server] for each in checksums_then_reset(run, [server]))
        run.release("trainer-0-before-go-v2")
        run.reach("trainer-0-before-go-v3")
        run.serving(server, 2)
        loaded = checker(server, "checksum", key=run.key)["checksums"]
        # vLLM's own reload of version 2's checkpoint from disk, in the same server: what it holds
        # then is what a plain server that loaded that checkpoint holds
        v1, v2 = (torch.load(run.dump / f"trainer-0-v{v}.pt")["tensors"] for v in (1, 2))
        post(server, "/collective_rpc", {"method": "reload_weights", "kwargs": {
            "weights_path": str(save_checkpoint(v2, LLAMA, tmp_path / "checkpoint-v2"))}}, key=run.key)
        assert checker(server, "compare", loaded, key=run.key) == {"match": True, "mismatches": []}, \
            "the version loaded after the reset differs from vLLM's own load of its checkpoint"
        run.release("trainer-0-before-go-v3")
        end = run.finish()
    finally:
        run.local.stop()
    # (a corruption, never taken for a rank cut off, which would start again and rejoin)
    assert end["state"] == "Failed", end
    assert end["message"].startswith("inference rank 0 failed: ChecksumMismatch"), end
    assert "checksum mismatch" in end["message"] and "of version 3" in end["message"], end
    assert end["versions"] == 3, end  # versions 0..2: the round after the failure reached no one
    log = run.log(2)
    assert "loaded version 2 into vLLM" in log and "loaded version 3" not in log
    assert "the vLLM server serves version 2" in log, log[-3000:]
    assert sorted(p.name for p in run.dump.glob("inference-*")) == [f"inference-0-v{v}.pt" for v in range(3)]
    transfers = [t for t in run.local.transfers if t["version"] < 3]
    assert [t["version"] for t in transfers] == [0, 1, 2]
    assert [t["deltaRanks"] for t in transfers] == [0, 1, 1], transfers
    for t in transfers[1:]:
        assert t["wireBytes"] < t["bytes"] / 2, t
    changed = [n for n in v2 if not torch.equal(as_bytes(v1[n]), as_bytes(v2[n]))]
    assert 0 < len(changed) < len(v2), f"version 2 should change some tensors, not {len(changed)} of {len(v2)}"
    assert [k for k in held if zeroed[k] != held[k]], "the reset changed no checksum"
    assert loaded != zeroed and loaded != held
    for version in range(3):
        want = fused(torch.load(run.dump / f"trainer-0-v{version}.pt")["tensors"])
        got = torch.load(run.dump / f"inference-0-v{version}.pt")["tensors"]
        for name, tensor in want.items():
            assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), \
                f"version {version}: the vLLM server holds other bytes than the trainer in {name}"


FROZEN = 30.0  # seconds a server is frozen: far past the 8 s of silence after which it is counted away


class Restart:
    """One of the job's vLLM servers killed (its API server process, with which its engine and
    workers end), or with `frozen` stopped (SIGSTOP to its API server and every process under it)
    for that many seconds, and started again by its pod; its generation route asked every 0.2 s
    from the kill or freeze on, and the other servers' every 10 s: what each client saw, (seconds
    since the kill, status or None where nothing answered, the version the answer names)."""

    EVERY = 0.2

    def __init__(self, run: VllmRun, server: str, pod: int, frozen: float | None = None):
        self.run, self.server, self.pod, self.frozen = run, server, pod, frozen
        self.others = [s for s in run.servers if s != server]
        self.joined = run.log(pod).count("joined the job")
        self.seen: dict[str, list[tuple[float, int | None, str | None]]] = {s: [] for s in run.servers}
        self.stop = threading.Event()
        self.killed = time.monotonic()
        api = api_server_pid(server)
        tree = [api, *descendants(api)]  # its engine core and workers
        for pid in tree:
            os.kill(pid, signal.SIGKILL if frozen is None else signal.SIGSTOP)
        self.askers = [threading.Thread(target=self._ask, args=(s,), daemon=True) for s in run.servers]
        for asker in self.askers:
            asker.start()
        if frozen is not None:
            away = run.log(0).count("is away")
            until(f"{server} counted away while frozen", lambda: run.log(0).count("is away") > away, REACH_TIMEOUT)
            time.sleep(max(0.0, self.killed + frozen - time.monotonic()))
            for pid in tree:
                os.kill(pid, signal.SIGCONT)

    def _ask(self, server: str) -> None:
        # the others generate, and a vLLM worker spins a core for a second after each call: seldom
        every = self.EVERY if server == self.server else 50 * self.EVERY
        while not self.stop.is_set():
            self.seen[server].append((time.monotonic() - self.killed, *asked(server, self.run.job.name)))
            self.stop.wait(every)

    def until_rejoined(self) -> None:
        """Until the pod's new server is up and its workers joined the job again."""
        until(f"{self.server} restarted and rejoined", lambda: self.run.log(self.pod).count("joined the job") > self.joined,
              REACH_TIMEOUT)
        self.rejoined = time.monotonic() - self.killed  # the fleet's next version is held back until now

    def until_admitted(self) -> None:
        """Until the restarted server answered a client; then the askers stop."""
        try:
            until(f"{self.server} admitted again", lambda: any(s == 200 for _, s, _ in self.seen[self.server]),
                  REACH_TIMEOUT)
        except AssertionError as e:
            raise AssertionError(f"{e}; its clients saw {spans(self.seen[self.server])}") from None
        self.stop.set()
        for asker in self.askers:
            asker.join(30)

    def check(self, fleet: int) -> None:
        """The restarted server answered nothing but refusals until it held `fleet`, then only
        tokens of `fleet`; the others answered throughout."""
        seen = self.seen[self.server]
        first = next(i for i, (_, status, v) in enumerate(seen) if status == 200 and v == str(fleet))
        refusals = [(t, s, v) for t, s, v in seen[:first] if s == 503]
        # woken, the frozen server still holds the fleet's version of then, until it ends itself:
        # it may serve it (the controller's word reached it again) or refuse as one behind (the
        # word it had ran out while it was frozen), but only while that version is the fleet's
        held = {"none"} if self.frozen is None else {"none", str(fleet - 1)}
        before = {(503, v) for v in held} | ({(200, str(fleet - 1))} if self.frozen is not None else set())
        assert refusals and all(s is None or ((s, v) in before and (s == 503 or t < self.rejoined))
                                for t, s, v in seen[:first]), \
            f"the restarted server answered before it held the fleet's version: {seen[:first]}"
        assert all(s == 200 and v == str(fleet) for _, s, v in seen[first:]), seen[first:]
        for other in self.others:
            assert {(s, v) for _, s, v in self.seen[other]} <= {(200, str(fleet - 1)), (200, str(fleet))}, \
                f"{other} did not serve on while the other server restarted: {self.seen[other]}"
        up = refusals[0][0]
        what = "the kill" if self.frozen is None else f"the freeze ({self.frozen:g}s)"
        print(f"restarted vLLM server: first refusal {up:.1f}s after {what}, refused {len(refusals)} requests (503), "
              f"admitted {seen[first][0]:.1f}s after {what} ({seen[first][0] - up:.1f}s after its first refusal)")
        for server, asked_it in self.seen.items():  # what its clients saw, span by span
            print(f"{'restarted' if server == self.server else 'other'} server {server}: " + "; ".join(
                f"{a:.1f}-{b:.1f}s {'no answer' if s is None else s} {'' if v is None else 'version ' + v}".rstrip()
                for a, b, s, v in spans(asked_it)))


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (vLLM's engine core and workers under its API server)."""
    parents = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [pid]
    while todo:
        under = todo.pop()
        children = [p for p, parent in parents.items() if parent == under]
        found += children
        todo += children
    return found


def api_server_pid(server: str) -> int:
    """The vLLM API server process listening on the server's port."""
    port = server.rsplit(":", 1)[1]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"vllm.entrypoints.openai.api_server" in argv and b"--port" in argv and \
                    argv[argv.index(b"--port") + 1] == port.encode():
                return int(proc.name)
    raise AssertionError(f"no vLLM API server listens on port {port}")
