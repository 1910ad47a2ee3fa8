"""weightsync as verl's checkpoint engine (weightsync/integrations/verl.py), driven the way verl
0.9.1 drives one, with verl's own classes, in verl's environment (`make verl-env`; without it the
test skips saying so, and fails under CI).

tests/support/verl_ranks.py imports the engine's module as verl imports custom_backend_module,
takes the class from verl's CheckpointEngineRegistry and runs two actor and two rollout workers as
real processes, each with its engine made as verl's workers make theirs; for each of three
updates it calls prepare, build_topology, init_process_group, send_weights beside
receive_weights, and finalize in verl's order. The actors hand a tiny Llama's state_dict (whose tied
lm_head is listed twice) as whole tensors, as verl's actor gathers them.

What the rollout workers receive is compared bit for bit with the actors' tensors cast to the
job's dtype: verl 0.9.1 has no verl.checkpoint_engine.weight_sync (no assert_weight_sync_equal),
so the comparison is the test's own (checked here against the installed verl). Each update is one
version verified on every rollout worker; both actors send a share of it (M to N, not a broadcast
from rank 0). One update more, whose bytes a trainer changes on the way (weightsync's fault hook),
is refused by every rollout worker before verl is handed a tensor of it, and the job's controller,
run in actor rank 0's process, fails the job; so does a second run whose rollout workers verl asks
for another global step than its actors publish. Bad input is refused on one line that says what to
fix: each call out of verl's order, a world size that is not the job's, metadata that does not
match the worker counts, and actor rank 0 without the job. The examples' job is one such a run
can hold, and their configuration names this engine (those two checks need no verl: `make unit`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from weightsync.integrations.ranks import check_job
from weightsync.job import load_job
from weightsync.runtime.faults import CORRUPT_ENV

slow = pytest.mark.slow  # the run needs verl's environment and costs seconds of verl's import

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_VERL_PYTHON = Path.home() / ".cache" / "weightsync" / "verl" / "bin" / "python"
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 128,
         "tie_word_embeddings": True}
STEPS = 3
RUN_TIMEOUT = 300  # seconds: about 15 on an idle 2-core machine (verl's import is half of it); a busy one takes 4x


def verl_python() -> str:
    python = os.environ.get("WEIGHTSYNC_TEST_VERL_PYTHON") or str(DEFAULT_VERL_PYTHON)
    why = None
    if not Path(python).exists():
        why = f"{python} does not exist"
    else:
        # only whether both are installed (an import of verl costs seconds; the run itself imports it)
        probe = subprocess.run([python, "-c", "import importlib.util as u, sys; "
                                "sys.exit(not (u.find_spec('verl') and u.find_spec('weightsync')))"], timeout=60)
        if probe.returncode:
            why = f"{python} has no verl or no weightsync installed"
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"verl cannot run here: {why}")
        pytest.skip(f"verl cannot run here ({why}); `make verl-env` makes its environment")
    return python


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    python = verl_python()
    tmp = tmp_path_factory.mktemp("verl")
    job = {"apiVersion": "weightsync.io/v1alpha1", "kind": "WeightTransferJob", "metadata": {"name": "verl-run"},
           "spec": {"model": {"config": LLAMA, "dtype": "bfloat16"},
                    "trainer": {"replicas": 2, "gpusPerProc": 0}, "inference": {"replicas": 2, "gpusPerProc": 0},
                    "transfer": {"bucketMB": 1, "transport": "tcp", "timeoutSeconds": 60},
                    "network": {"mode": "tcp"}}}
    (tmp / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, "WEIGHTSYNC_TOKEN": "verl-test-token-0123456789abcdef", "WEIGHTSYNC_POD_IP": "127.0.0.1",
           CORRUPT_ENV: str(STEPS),  # the update after the run's: a trainer changes a byte on the way
           # as in a pod of a Ray cluster on Kubernetes: the controller on its thread must still end
           "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    env.pop("WEIGHTSYNC_CONTROLLER", None)
    try:
        done = subprocess.run([python, str(ROOT / "tests" / "support" / "verl_ranks.py"), str(tmp / "job.yaml"),
                               str(tmp / "out.json"), str(STEPS)], env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        said = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"verl's workers did not finish within {RUN_TIMEOUT}s; their last lines:\n{said[-6000:]}")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    out = json.loads((tmp / "out.json").read_text())
    out["log"] = done.stdout + done.stderr
    return out


@slow
def test_verl_0_9_1_has_no_weight_sync_assertion_so_the_comparison_is_ours(run):
    assert run["verl"] == {"version": "0.9.1", "weight_sync": False}


@slow
def test_every_rollout_worker_receives_each_version_bit_for_bit(run):
    updates = run["updates"]
    assert [(u["step"], u["rollout"]) for u in updates] == [(s, r) for s in range(1, STEPS + 1) for r in (0, 1)]
    for u in updates:
        assert u["actors_agree"], u["step"]
        assert u["dtype"] == "torch.bfloat16"
        # the tied lm_head is the embedding's tensor: a version carries it once
        assert set(u["sent"]) - set(u["received"]) == {"lm_head.weight"}
        assert u["mismatched"] == [], u


@slow
def test_each_update_is_one_version_sent_by_every_actor_to_every_rollout(run):
    for step in range(1, STEPS + 1):
        first = next(u for u in run["updates"] if u["step"] == step)
        versions = {m["weightsync/version"] for m in first["metrics"]}
        assert versions == {step - 1}
        for metrics in first["metrics"]:
            assert metrics["weightsync/receivers"] == 2 and metrics["weightsync/sent_bytes"] > 0
    # the controller's records: each version delivered to both rollouts, at verl's global step
    records = [r for r in (json.loads(line) for line in run["log"].splitlines() if line.startswith('{"event": "transfer"'))
               if r["step"] <= STEPS]
    assert [(r["version"], r["step"], r["inference_ranks"]) for r in records] == \
        [(step - 1, step, 2) for step in range(1, STEPS + 1)]
    assert ("verl's update_weights_bucket_megabytes (2) is not used: the controller plans every rank's buckets of "
            "spec.transfer.bucketMB (1)") in run["log"]


@slow
def test_a_version_whose_bytes_changed_on_the_way_is_never_handed_to_verl_and_fails_the_job(run):
    actors, rollouts = run["corrupted"][:2], run["corrupted"][2:]
    for said in rollouts:
        # its own receive saw the mismatch, or the job's end (the other rollout's report) came first
        assert said.startswith(("RuntimeError: inference rank", "JobEnded: the job ended (Failed)")), said
        assert "ChecksumMismatch" in said and said.endswith("[0 tensors taken]"), said
    for said in actors:  # the job's end, or the version's record first: held by no rollout worker
        assert said is not None and said.startswith(("JobEnded: the job ended (Failed)",
                                                      "RuntimeError: version 3 (step 4) is held by 0 of 2")), said
    assert run["controller_exit"] == 1, run["log"][-4000:]


@slow
@pytest.mark.parametrize("case, says", [
    ("send_before_init", "RuntimeError: send_weights called where prepare comes next: verl's order per update is "
                         "prepare, build_topology, init_process_group, send_weights or receive_weights, finalize"),
    ("receive_before_init", "RuntimeError: receive_weights called where prepare comes next"),
    ("init_before_prepare", "RuntimeError: init_process_group called where prepare comes next"),
    ("finalize_before_send", "RuntimeError: finalize called where prepare comes next"),
    ("master_without_job", "ValueError: engine_kwargs.weightsync.job is not set: actor rank 0 needs the "
                           "WeightTransferJob file"),
    ("actor_world_size", "ValueError: actor_wg_world_size is 1, and job default/verl-run has 2 trainer ranks "
                         "(spec.trainer.replicas x procsPerPod): make the job's count verl's worker count"),
    ("metadata_count", "ValueError: build_topology got 4 workers' metadata for 2 actor and 3 rollout workers"),
])
def test_bad_input_is_refused_on_one_line_that_says_what_to_fix(run, case, says):
    refusal = run["refusals"][case]
    assert refusal.startswith(says) and "\n" not in refusal, refusal


def test_the_examples_job_is_one_verl_workers_can_hold_and_the_fragment_names_the_engine():
    check_job(load_job(ROOT / "examples" / "integrations" / "verl-job.yaml"))
    fragment = yaml.safe_load((ROOT / "examples" / "integrations" / "verl-weightsync.yaml").read_text())
    engine = fragment["actor_rollout_ref"]["rollout"]["checkpoint_engine"]
    assert engine["backend"] == "weightsync" and importlib.util.find_spec(engine["custom_backend_module"]) is not None
    assert engine["engine_kwargs"]["weightsync"]["job"].endswith("verl-job.yaml")


@slow
def test_a_rollout_asked_for_another_global_step_than_the_actors_sent_refuses_it_and_the_job_fails(run):
    actors, rollouts = run["wrong_step"][:2], run["wrong_step"][2:]
    for said in rollouts:  # its own refusal, or the job's end (the other rollout's refusal) first
        assert said.startswith(("ValueError: version 0 was published at global step 1, and verl asks this rollout "
                                "worker for global step 2: every actor and rollout worker must update at the same "
                                "global_steps", "RuntimeError: inference rank")) and said.endswith("[0 tensors taken]"), said
    assert any(said.startswith("ValueError") for said in rollouts), rollouts
    for said in actors:
        assert said is not None and said.startswith(("JobEnded: the job ended (Failed)", "RuntimeError: version 0")), said
    assert run["wrong_step_exit"] == 1
