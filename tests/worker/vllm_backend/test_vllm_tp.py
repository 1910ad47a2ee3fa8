"""vLLM's own tensor parallelism, for real: one job (two trainer ranks, a vLLM server of
tensor-parallel size 2 and one of size 1 beside it, on vLLM's CPU build) run once for the module,
loading each version in the pause. Loading ahead (spec.inference.vllm.loadAhead) puts the same
per-worker parts through the same loaders into a second copy: test_vllm_engine.py and
test_load_ahead.py run it, on servers of one worker.

What is checked: each of the TP-2 server's workers is an inference rank that receives only its own
slices (the model has one KV head, which vLLM replicates on both workers), planned from what vLLM's
model says the worker holds, and reports how many bytes that is (half of a version, and the whole
for the TP-1 server); after every version every worker's parameters equal the trainers' bytes as
vLLM shards them (tests/support/vllm.py states that layout independently of the backend), read
back through the CPU build's repacked GEMM kernels, which every load fills again (the model is in
float32, which vLLM's CPU build repacks on any x86 CPU); both servers
answer the same greedy tokens; vLLM's own weight checker (/weight_checker) sees the weights a reset
zeroed restored by the next version, equal to what vLLM itself loaded from that version's
checkpoint. The job's model is that checkpoint (spec.model.path), so each server starts as a plain
vLLM server of its size on it (vLLM's own load from disk, checksummed before weightsync loads
anything) and the trainers' version 0 holds its weights: one vLLM start per size, not two.

In the same job the TP-1 server's load of version 1 fails after half of its layers
(faults.FAIL_LOAD_ENV; spec.inference.onLoadFailure rollBack, the default): it holds half of two
versions, still labelled version 0, and answers its clients 503 naming no version, its admission
saying why, while the TP-2 server serves version 1 and status.receivers counts the failed rank
behind; version 2 comes to it whole, and from then on both servers answer the same tokens, named
version 2. Every answer's tokens are checked against the version it names.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

import pytest
import torch
from support.vllm import (
    LLAMA,
    REACH_TIMEOUT,
    VllmRun,
    admission,
    answer,
    as_bytes,
    boxes,
    checker,
    checksums_then_reset,
    completion,
    refused_before_version_0,
    save_checkpoint,
    shards,
    vllm_job,
    vllm_python,
    weight_version,
)
from support.waits import until

from weightsync.job import Model
from weightsync.local.runner import STATUS_FILE
from weightsync.model.build import build, meta_layout
from weightsync.plan.boxes import Box, RankSlices, Slice
from weightsync.plan.sliced_plan import LocalLayout

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`

# one KV head: vLLM gives both workers of the TP-2 server a copy of it (KV heads replicated)
MQA = {**LLAMA, "num_key_value_heads": 1}
SIZES = (2, 1)  # the servers' tensor-parallel sizes: inference ranks 0, 1 (TP 2) and 2 (TP 1)
WORKERS = [(2, 0), (2, 1), (1, 0)]  # (tp size, tp rank) of inference ranks 0, 1, 2
FAILED = 2  # the inference rank (the TP-1 server) whose load of version 1 fails part-way
EMPTY = hashlib.sha256(b"").hexdigest()  # vLLM's checksum of an empty parameter
ONEDNN_FALLBACK = "Failed to create oneDNN linear, fallback to torch linear"  # vLLM's line where it cannot repack
# float32: vLLM's CPU build repacks every linear weight for its GEMM kernels (and empties the
# parameter) on any x86 CPU, oneDNN's float32 matmul needing only AVX2; in bfloat16 it repacks only
# where the CPU has AVX512-BF16, and keeps the weights as they are elsewhere
DTYPE = "float32"
VERSIONS = 3  # 0..2: steps 4, every 2
TRAINERS = ("trainer-0", "trainer-1")


@dataclass
class TpRun:
    run: VllmRun
    end: dict
    tokens: dict[int, list[list[int]]] = field(default_factory=dict)  # version -> each server's greedy tokens
    plain: dict[str, dict] = field(default_factory=dict)  # each server's checksums as vLLM loaded the checkpoint
    reset: dict[str, dict] = field(default_factory=dict)  # right after the reset
    loaded: dict[str, dict] = field(default_factory=dict)  # once version 0 was loaded after the reset
    # what a client's generate request got of each server: version -> [(version named, tokens) or (status, header)]
    answers: dict[int, list[tuple]] = field(default_factory=dict)
    labels: dict[int, list[str | None]] = field(default_factory=dict)  # version -> each server's weight_version
    admissions: dict[int, list[tuple[int, dict]]] = field(default_factory=dict)  # version -> each server's admission
    receivers: dict = field(default_factory=dict)  # status.receivers while the fleet serves version 1


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> TpRun:
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm-tp")
    # the job's model is a checkpoint: its servers start as plain vLLM servers on it (vLLM's own
    # load from disk), and the trainers start from it, so that version 0 holds its weights
    base = build(Model(config=MQA, dtype=DTYPE), dtype=DTYPE, seed=3)
    checkpoint = save_checkpoint(dict(base.state_dict()), MQA, tmp / "checkpoint")
    job = vllm_job("vllm-tp", trainers=2, servers=2, steps=4, checkpoint=checkpoint, tensorParallelSizes=list(SIZES),
                   dtype=DTYPE)
    # the trainers hold version 0 (the servers loaded nothing of the job's yet) while the servers start
    run = VllmRun(tmp, job, python, pauses=[f"{t}-before-ready-v0" for t in TRAINERS] +
                  ["trainer-0-before-go-v1", "trainer-0-before-go-v2", "controller-0-delivered-v2"],
                  pause_limit=REACH_TIMEOUT, fail_load=f"{FAILED}@1")
    out = TpRun(run, {})
    try:
        for t in TRAINERS:
            run.reach(f"{t}-before-ready-v0")
        for s in run.servers:
            run.up(s)
        for s in run.servers:  # no client is served the start-up weights: the server holds no version of the job's
            refused_before_version_0(s, job.name)
        out.tokens[-1] = [completion(s, job.name, key=run.key) for s in run.servers]
        out.plain, out.reset = checksums_then_reset(run, run.servers)
        for t in TRAINERS:
            run.release(f"{t}-before-ready-v0")
        run.reach("trainer-0-before-go-v1")  # version 0 is served; the trainers hold version 1 back
        out.tokens[0] = [completion(s, job.name) for s in served(run, 0)]
        out.loaded = {s: checker(s, "checksum", key=run.key)["checksums"] for s in run.servers}
        out.answers[0] = [answer(s, job.name) for s in run.servers]
        run.release("trainer-0-before-go-v1")
        run.reach("trainer-0-before-go-v2")  # version 1 is served by the TP-2 server; the TP-1 server's load failed
        # (the trainers may be ready before the controller is done with version 1: its record of the
        # ranks that hold it comes after every server's load)
        out.receivers = until("status.receivers after version 1", lambda: receivers_at(run, 1), REACH_TIMEOUT)
        out.tokens[1] = [completion(s, job.name) for s in served(run, 1, run.servers[:1])]
        out.answers[1] = [answer(s, job.name) for s in run.servers]
        out.labels[1] = [weight_version(s) for s in run.servers]
        out.admissions[1] = [admission(s) for s in run.servers]
        run.release("trainer-0-before-go-v2")
        run.reach("controller-0-delivered-v2")  # the final version, loaded whole on both servers
        out.tokens[2] = [completion(s, job.name) for s in served(run, 2)]
        out.answers[2] = [answer(s, job.name) for s in run.servers]
        out.admissions[2] = [admission(s) for s in run.servers]
        run.release("controller-0-delivered-v2")
        out.end = run.finish()
    finally:
        run.local.stop()
    return out


def served(run: VllmRun, version: int, servers: list[str] | None = None) -> list[str]:
    for s in servers or run.servers:
        run.serving(s, version)
    return servers or run.servers


def receivers_at(run: VllmRun, version: int) -> dict | None:
    """status.receivers, once it says the latest version any rank holds is `version`."""
    path = run.local.workdir / STATUS_FILE
    got = json.loads(path.read_text()).get("receivers", {}) if path.exists() else {}
    return got if got.get("version") == version else None


def test_every_worker_holds_the_trainers_bytes_as_vllm_shards_them(tp_run):
    end, dump = tp_run.end, tp_run.run.dump
    assert end["state"] == "Succeeded", end
    assert end["versions"] == VERSIONS and end["failed_verifications"] == 0, end
    for version in range(VERSIONS):
        trainer = torch.load(dump / f"trainer-0-v{version}.pt")["tensors"]
        assert all(torch.equal(as_bytes(t), as_bytes(torch.load(dump / f"trainer-1-v{version}.pt")["tensors"][n]))
                   for n, t in trainer.items()), "the DDP trainers disagree"
        for rank, (tp, tp_rank) in enumerate(WORKERS):
            if (rank, version) == (FAILED, 1):  # its load failed part-way: it never served version 1
                assert not (dump / f"inference-{rank}-v{version}.pt").exists()
                continue
            want = shards(trainer, MQA, tp, tp_rank)
            got = torch.load(dump / f"inference-{rank}-v{version}.pt")["tensors"]
            assert sorted(got) == sorted(want), f"vLLM holds other tensors: {sorted(set(got) ^ set(want))}"
            for name, tensor in want.items():
                assert got[name].dtype == getattr(torch, DTYPE) and got[name].shape == tensor.shape, \
                    (name, got[name].shape, tensor.shape)
                assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), \
                    f"version {version}: inference rank {rank} (TP rank {tp_rank} of {tp}) differs in {name}"


def test_a_tp_worker_receives_only_its_share_as_planned(tp_run):
    """Each worker's reported bytes are its local layout of exactly the slices vLLM's layout gives
    it: for this model 0.5243 of a version per TP-2 worker (half, plus the norms and the one KV
    head, which both take whole)."""
    layout = meta_layout(tp_run.run.job.model)
    shapes = {s.name: tuple(s.shape) for s in layout.slots}
    logs = tp_run.run.log(3) + tp_run.run.log(4)  # the servers' pods: ordinals 3 (TP 2) and 4 (TP 1)
    for rank, (tp, tp_rank) in enumerate(WORKERS):
        needs = []
        for name, box in boxes(shapes, MQA, tp, tp_rank).items():
            start, stop = [0] * len(shapes[name]), list(shapes[name])
            start[box[0]], stop[box[0]] = box[1], box[2]
            needs.append(Slice(name, Box(tuple(start), tuple(stop))))
        share = LocalLayout.of(layout, RankSlices(rank, tuple(needs))).total_bytes
        said = re.search(rf"\[inference rank {rank}\] tensor-parallel rank {tp_rank} of {tp} .*?: receives (\d+) of "
                         rf"(\d+) bytes per version \(([\d.]+) of a whole version\)", logs)
        assert said, f"inference rank {rank} did not say what it receives"
        assert int(said[1]) == share and int(said[2]) == layout.total_bytes, (said[0], share)
        assert float(said[3]) == pytest.approx(share / layout.total_bytes, abs=1e-4)
        if tp == 2:
            assert 0.52 < share / layout.total_bytes < 0.53, said[0]


def test_the_tp2_and_tp1_servers_answer_the_same_greedy_tokens(tp_run):
    for version, answers in tp_run.tokens.items():
        assert len(answers) == (1 if version == 1 else 2), (version, answers)
        assert answers[0] == answers[-1], f"version {version}: TP 2 answered {answers[0]}, TP 1 {answers[-1]}"
    assert tp_run.tokens[0] == tp_run.tokens[-1], "version 0 answered otherwise than vLLM's own load of its checkpoint"
    firsts = [tp_run.tokens[v][0] for v in range(VERSIONS)]
    assert firsts[0] != firsts[1] != firsts[2], f"the greedy completion did not change with the version: {firsts}"


def test_a_server_whose_load_failed_part_way_serves_no_client_until_the_next_version_loads_whole(tp_run):
    """Each client's answer names one version, and its tokens are that version's (as the OpenAI
    route of a server holding it whole answers them); the TP-1 server, whose load of version 1
    failed after half of its layers, answers 503 and no token until version 2 loaded whole."""
    run, tp1 = tp_run.run, SIZES.index(1)
    for version, answers in tp_run.answers.items():
        for server, got in enumerate(answers):
            if (server, version) == (tp1, 1):
                assert got == (503, "none"), f"a server holding half of two versions answered {got}"
            else:
                assert got == (str(version), tp_run.tokens[version][0]), (version, server, got)
    # vLLM's own label still says version 0: the guard, not the label, keeps its clients out
    assert tp_run.labels[1] == ["1", "0"], tp_run.labels
    (status, said), refused = tp_run.admissions[1][0], tp_run.admissions[1][tp1]
    assert status == 200 and said["held"] == 1, said
    assert refused[0] == 503 and refused[1]["held"] is None and not refused[1]["admitted"], refused
    assert "its last load failed part-way" in refused[1]["why"], refused
    assert all(status == 200 and said["held"] == 2 for status, said in tp_run.admissions[2]), tp_run.admissions[2]
    ranks = {r["rank"]: (r["state"], r.get("version")) for r in tp_run.receivers["ranks"]}
    assert ranks == {0: ("current", 1), 1: ("current", 1), FAILED: ("behind", None)}, tp_run.receivers
    records = {t["version"]: t for t in run.local.transfers}
    assert records[1]["load_failed"] == [FAILED] and records[1]["inference_ranks"] == 2, records[1]
    assert all("load_failed" not in records[v] for v in (0, 2)), records
    log = run.log(4)  # the TP-1 server's pod
    assert "vLLM failed part-way through loading version 1 (LoadFault: the load of version 1 failed after" in log
    assert "loaded version 2 into vLLM" in log and "loaded version 1 into vLLM" not in log
    assert f"inference rank {FAILED} failed to load version 1" in run.log(0)


def test_vllms_weight_checker_sees_a_reset_restored_by_the_next_version(tp_run):
    servers = tp_run.run.servers
    # the servers' pods where vLLM said it keeps the linear weights unpacked (read once for both)
    unpacked = [p.name for p in tp_run.run.local.pods if p.role == "inference" and ONEDNN_FALLBACK in p.log.read_text(
        errors="replace")]
    assert not unpacked, f"vLLM's CPU build kept the linear weights unpacked in {unpacked}: {ONEDNN_FALLBACK!r}"
    for server, tp in zip(servers, SIZES):
        plain, reset, loaded = tp_run.plain[server], tp_run.reset[server], tp_run.loaded[server]
        assert all(k.startswith(tuple(f"dp0:pp0:pcp0:tp{i}:" for i in range(tp))) for k in plain)
        zeroed = [k for k in plain if reset[k] != plain[k]]
        assert any(k.endswith("embed_tokens.weight") for k in zeroed) and any("norm" in k for k in zeroed), \
            f"TP {tp}: the reset changed only {zeroed}"
        assert sorted(loaded) == sorted(plain), f"TP {tp}: other parameters than vLLM's own load"
        # version 0 is the checkpoint's weights: loaded after the reset, it is what vLLM itself
        # loaded from the checkpoint when the server started
        assert loaded == plain, f"TP {tp}: after the reset, version 0 differs from vLLM's own load of it in " \
                                f"{sorted(k for k in plain if loaded.get(k) != plain[k])}"
        assert loaded != reset, "the version did not restore what the reset zeroed"
        # vLLM's CPU build repacked the linear layers' weights for its GEMM kernels, leaving the
        # parameters empty: every load went through the processing that repacks them again (the
        # dumps above read the repacked kernels back)
        repacked = [k for k in loaded if loaded[k] == EMPTY and k.endswith("_proj.weight")]
        assert len(repacked) == 4 * MQA["num_hidden_layers"] * tp, f"TP {tp}: repacked only {repacked}"
