"""spec.inference.vllm.inflight keep, for real: one job (one trainer, one vLLM server of its CPU
build, each version loaded ahead), run once for the module: one vLLM start for every check here.

What is checked: a long greedy generation (2000 tokens, seconds of the CPU build) is running when
version 1 arrives (the controller is released once vLLM's engine reports it running); the update's
keep pause freezes it mid-way, the version is committed, and it resumes on it and completes, not
aborted and never preempted (vLLM prefills a preempted request again: a cleared cache would have done that).
Its tokens before the bump are the ones the server gave the same request while it held version 0
alone; its weight versions name version 0 for those and version 1 for the rest; and the rest are
not version 0's own continuation: the new weights generated them. The prefix cache, read from
vLLM's own counters (vllm:prefix_cache_queries and hits, in tokens): a prompt repeated within one
version hits it; repeated after the bump, which cleared nothing, it is prefilled again (the guard
keyed its cache salt by the version), then hits again on the new version. The server answers
vLLM's OpenAI routes, which cannot say which version produced which token, 400 on one line.
(The guard's side without vLLM: test_inflight.py; the pause's calls: test_control.py.)
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.vllm import (
    LLAMA,
    LONG_PROMPT,
    REACH_TIMEOUT,
    VllmRun,
    completion,
    generate,
    vllm_job,
    vllm_python,
)
from support.waits import until

from weightsync.job import load_job

pytestmark = pytest.mark.slow  # a whole job with a vLLM server: not in `make unit`

# tokens of the generation in flight: about 4 s of the CPU build's 500 tokens a second, which the
# controller, released once the engine runs it, pauses within a fraction of
LONG = 2000
CONFIG = {**LLAMA, "max_position_embeddings": LONG + 192}
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")
GAUGES = ("vllm:num_requests_running",)


@dataclass
class KeepRun:
    run: VllmRun
    end: dict = field(default_factory=dict)
    alone: dict = field(default_factory=dict)  # the long generation on version 0 alone (the generate route's choice)
    crossed: dict = field(default_factory=dict)  # the same, in flight when version 1 arrived (its choice)
    cache: dict[str, list[dict]] = field(default_factory=dict)  # "v0", "v1": each ask's counter deltas, in order
    preemptions: float = -1.0  # vLLM's preemptions while the long generation crossed the bump
    refused: tuple[int, str] = (0, "")  # what the OpenAI completions route answered


def counters(server: str) -> dict[str, float]:
    """vLLM's own counters of the server (summed over its engines)."""
    with urllib.request.urlopen(server + "/metrics", timeout=30) as response:
        text = response.read().decode()
    got = dict.fromkeys(COUNTERS + GAUGES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if (name in COUNTERS and sample.name.endswith("_total")) or sample.name in GAUGES:
                got[name] += sample.value
    return got


def asked_twice(server: str, job_name: str) -> list[dict]:
    """The long prompt asked twice, one after the other: each ask's queries and hits (tokens)."""
    deltas = []
    for _ in range(2):
        before = counters(server)
        generate(server, job_name, prompt=LONG_PROMPT)
        # vLLM counts the prefill's lookups as it records the step's stats, with the request's outputs
        after = until("vLLM counting the prompt's prefix-cache lookup",
                      lambda before=before: counted(counters(server), before), 30)
        deltas.append({k.split(":")[1]: after[k] - before[k] for k in COUNTERS[:2]})
    return deltas


def counted(now: dict[str, float], before: dict[str, float]) -> dict[str, float] | None:
    return now if now["vllm:prefix_cache_queries"] > before["vllm:prefix_cache_queries"] else None


@pytest.fixture(scope="module")
def keep_run(tmp_path_factory) -> KeepRun:
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm-keep")
    obj = vllm_job("vllm-keep", trainers=1, servers=1, steps=2, ahead=True, config=CONFIG).to_object()  # versions 0, 1
    obj["spec"]["inference"]["vllm"]["inflight"] = "keep"
    args = obj["spec"]["inference"]["vllm"]["args"]
    args[args.index("--max-model-len") + 1] = str(LONG + 192)
    job = load_job(obj)
    # the controller holds once version 1, the last, is delivered: the job's end stops its server, which
    # the generation in flight and the checks on version 1 still need
    run = VllmRun(tmp, job, python, pauses=["trainer-0-before-go-v1", "controller-0-staged-v1",
                                            "controller-0-delivered-v1"], pause_limit=REACH_TIMEOUT)
    out = KeepRun(run)
    server = run.servers[0]
    try:
        run.reach("trainer-0-before-go-v1")  # version 0 is served; the trainer holds version 1 back
        run.serving(server, 0)
        try:
            completion(server, job.name)
        except urllib.error.HTTPError as e:
            out.refused = (e.code, e.read().decode(errors="replace"))
        out.cache["v0"] = asked_twice(server, job.name)
        out.alone = generate(server, job.name, tokens=LONG)
        run.release("trainer-0-before-go-v1")
        run.reach("controller-0-staged-v1")  # version 1 verified and loaded ahead; the server not paused yet
        before = counters(server)
        flight = threading.Thread(target=lambda: out.crossed.update(generate(server, job.name, tokens=LONG)),
                                  daemon=True)
        flight.start()
        until("the generation running in vLLM's engine", lambda: counters(server)["vllm:num_requests_running"], 60,
              every=0.02)
        # the update's keep pause freezes it where it is, the version is committed, and it resumes on
        # it (an update that waited for it, finish, would let it end on version 0 first)
        run.release("controller-0-staged-v1")
        flight.join(REACH_TIMEOUT)
        assert not flight.is_alive(), "the generation in flight never completed"
        out.preemptions = counters(server)["vllm:num_preemptions"] - before["vllm:num_preemptions"]
        run.serving(server, 1)
        out.cache["v1"] = asked_twice(server, job.name)
        run.release("controller-0-delivered-v1")
        out.end = run.finish()
    finally:
        run.local.stop()
    return out


def test_the_job_loads_every_version_ahead_and_keeps_the_requests_in_flight(keep_run):
    end = keep_run.end
    assert end["state"] == "Succeeded" and end["versions"] == 2 and end["failed_verifications"] == 0, end
    assert all("prepare" in t["phases"] for t in keep_run.run.local.transfers), "a version was not loaded ahead"
    assert "committed version 1 into vLLM" in keep_run.run.log(2)


def test_a_long_generation_running_when_a_version_arrives_completes_on_it_without_abort(keep_run):
    crossed, alone = keep_run.crossed, keep_run.alone
    assert crossed.get("finish_reason") == "length" and len(crossed.get("token_ids", ())) == LONG, \
        f"the generation in flight ended {crossed.get('finish_reason')} after {len(crossed.get('token_ids', ()))} tokens"
    assert keep_run.preemptions == 0, "the request in flight was preempted (prefilled again) by the update"
    assert alone["weight_versions"] == [{"version": "0", "start": 0, "end": LONG}]
    spans = crossed["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"], spans
    bump = spans[0]["end"]
    assert spans == [{"version": "0", "start": 0, "end": bump}, {"version": "1", "start": bump, "end": LONG}]
    assert 0 < bump < LONG
    assert crossed["token_ids"][:bump] == alone["token_ids"][:bump], \
        "the tokens before the bump are not those of the server holding version 0 alone"
    assert crossed["token_ids"][bump:] != alone["token_ids"][bump:], \
        "the tokens after the bump are version 0's own continuation: the new weights were not used"
    print(f"version 1 loaded after {bump} of {LONG} tokens; "
          "the request resumed on it, none aborted or preempted")


def test_a_prompt_repeated_within_a_version_hits_the_prefix_cache_and_across_a_bump_is_prefilled_again(keep_run):
    (first, again), (after_bump, again_after) = keep_run.cache["v0"], keep_run.cache["v1"]
    assert first == {"prefix_cache_queries": len(LONG_PROMPT), "prefix_cache_hits": 0}, first
    assert again["prefix_cache_queries"] == len(LONG_PROMPT) and again["prefix_cache_hits"] > 0, again
    assert after_bump == {"prefix_cache_queries": len(LONG_PROMPT), "prefix_cache_hits": 0}, \
        f"a prompt cached on version 0 was reused on version 1: {after_bump}"
    assert again_after == again, again_after
    print(f"prefix cache (tokens looked up, hit): version 0 {first}, {again}; after the bump {after_bump}, "
          f"{again_after}")


def test_a_server_that_keeps_requests_across_versions_refuses_the_routes_that_cannot_name_their_versions(keep_run):
    status, said = keep_run.refused
    assert status == 400, (status, said)
    assert ("/v1/completions: this vLLM server keeps requests in flight across versions (spec.inference.vllm.inflight "
            "keep)") in said
