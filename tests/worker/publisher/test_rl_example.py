"""The RL example (examples/rl) as a job, for real: examples/rl/job.yaml, shortened (one vLLM
server, 16 steps), run by `weightsync run`'s LocalJob with the script as the trainer's command. The
script asks the server for its rollouts through Sync.servers() and vLLM's generate route, and
publishes after every step. Checked: the reward the rollouts earned rose clearly from the first
steps to the last; every rollout came from a version weightsync delivered (the controller's
records), never from one the trainer had not published yet; every version was verified; the
metrics and the plot were written."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import yaml
from support.jobs import assert_nothing_left
from support.vllm import vllm_python as find_vllm_python

from weightsync.job import Env, load_job
from weightsync.local.runner import LocalJob

pytestmark = pytest.mark.slow  # a whole job with a vLLM server: not in `make unit`

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "rl"
STEPS = 16
RUN_TIMEOUT = 600.0


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return find_vllm_python()


def short_job(out: Path):
    """examples/rl/job.yaml with one server, fewer steps, this Python and absolute paths; and its
    group size (samples per prompt)."""
    spec = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    trainer = spec["spec"]["trainer"]
    args = list(trainer["args"])
    for flag, value in (("--steps", str(STEPS)), ("--out", str(out)), ("--config", str(EXAMPLE / "model" / "config.json"))):
        args[args.index(flag) + 1] = value
    trainer.update(command=[sys.executable, str(EXAMPLE / "grpo.py")], args=args)
    spec["spec"]["inference"]["replicas"] = 1
    return load_job(spec), int(args[args.index("--group") + 1])


def test_the_rl_example_learns_from_rollouts_of_delivered_versions(tmp_path, vllm_python):
    out = tmp_path / "out"
    job, group = short_job(out)
    local = LocalJob(job, tmp_path / "run", {Env.VLLM_PYTHON: vllm_python, "VLLM_CPU_KVCACHE_SPACE": "1"},
                     progress=io.StringIO())
    local.start()
    try:
        summary = local.wait(RUN_TIMEOUT)
    finally:
        local.stop()
    assert_nothing_left(local)
    assert summary["failed_verifications"] == 0 and summary["restarts"] == {}, summary
    delivered = {t["version"] for t in local.transfers}
    assert delivered == set(range(STEPS + 1)), delivered  # version 0, then one after every step

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    for row in rows:
        versions = {int(v): n for v, n in row["rollout_versions"].items()}
        assert sum(versions.values()) == len(row["prompt_rewards"]) * group, row  # every prompt's group
        assert set(versions) <= delivered, f"step {row['step']}: rollouts from versions weightsync never delivered: {row}"
        assert max(versions) <= row["trainer_version"], f"a rollout from a version not published yet: {row}"
        assert row["max_staleness"] == row["trainer_version"] - min(versions)
    first = sum(r["mean_reward"] for r in rows[:4]) / 4
    last = sum(r["mean_reward"] for r in rows[-4:]) / 4
    assert last > first + 0.25, f"the reward did not rise: {first:.3f} over the first 4 steps, {last:.3f} over the last 4"
    assert (out / "reward.png").stat().st_size > 0
