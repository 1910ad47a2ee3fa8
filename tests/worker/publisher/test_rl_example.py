"""The RL example (examples/rl) as a job, for real: examples/rl/job.yaml and its LoRA variant
examples/rl/lora-job.yaml, each shortened (one vLLM server, 16 steps), run by `weightsync run`'s
LocalJob with the script as the trainer's command. The script asks the server for its rollouts
through Sync.servers() and vLLM's generate route (the LoRA variant naming the adapter), and
publishes after every step. Checked, for both: the reward the rollouts earned rose clearly from the
first steps to the last; every rollout came from a version weightsync delivered (the controller's
records), never from one the trainer had not published yet; every version was verified; the
metrics and the plot were written. For the LoRA variant also: every version the controller moved
was the adapter's bytes (rank x (in + out) per target layer), a small share of the model's."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.jobs import assert_nothing_left
from support.vllm import vllm_python as find_vllm_python

from weightsync.job import Env, load_job
from weightsync.local.runner import LocalJob
from weightsync.model.build import meta_layout

pytestmark = pytest.mark.slow  # a whole job with a vLLM server: not in `make unit`

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "rl"
CONFIG = EXAMPLE / "model" / "config.json"
STEPS = 16
RUN_TIMEOUT = 600.0


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return find_vllm_python()


def short_job(name: str, out: Path, paths: dict[str, str] | None = None):
    """examples/rl/<name> with one server, fewer steps, this Python and absolute paths (`paths`:
    more flags' values, and spec.model.path for --base); and its group size (samples per prompt)."""
    spec = yaml.safe_load((EXAMPLE / name).read_text())
    trainer = spec["spec"]["trainer"]
    args = list(trainer["args"])
    for flag, value in {"--steps": str(STEPS), "--out": str(out), "--config": str(CONFIG), **(paths or {})}.items():
        if flag in args:
            args[args.index(flag) + 1] = value
    if "--base" in args:
        spec["spec"]["model"]["path"] = args[args.index("--base") + 1]
    trainer.update(command=[sys.executable, str(EXAMPLE / "grpo.py")], args=args)
    spec["spec"]["inference"]["replicas"] = 1
    return load_job(spec), int(args[args.index("--group") + 1])


def run_example(tmp_path: Path, vllm_python: str, job, group: int, out: Path) -> LocalJob:
    """Run the job to its end and check what both variants promise; the finished run."""
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
    return local


def test_the_rl_example_learns_from_rollouts_of_delivered_versions(tmp_path, vllm_python):
    out = tmp_path / "out"
    job, group = short_job("job.yaml", out)
    run_example(tmp_path, vllm_python, job, group, out)


def test_the_lora_variant_learns_sending_the_adapter_alone(tmp_path, vllm_python):
    base = tmp_path / "base"
    subprocess.run([sys.executable, str(EXAMPLE / "grpo.py"), "--config", str(CONFIG), "--save-base", str(base)],
                   check=True, timeout=120, capture_output=True)
    out = tmp_path / "out"
    job, group = short_job("lora-job.yaml", out, {"--base": str(base)})
    assert job.model.path == str(base) and job.model.lora is not None
    local = run_example(tmp_path, vllm_python, job, group, out)

    # what the controller reports it moved, version by version: the adapter, rank x (in + out) in
    # bfloat16 for each of the Llama layer's linear layers, not the model
    config = json.loads((base / "config.json").read_text())
    hidden, inner, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, hidden), "v_proj": (hidden, hidden),
              "o_proj": (hidden, hidden), "gate_proj": (hidden, inner), "up_proj": (hidden, inner),
              "down_proj": (inner, hidden)}  # (in, out): 2 heads of 64 for queries, keys and values alike
    lora = job.model.lora
    adapter = layers * sum(lora.rank * sum(shapes[m]) for m in lora.target_modules) * 2
    whole = meta_layout(job.model).total_bytes
    assert {t["bytes"] for t in local.transfers} == {adapter}, (local.transfers[:2], adapter, whole)
    assert adapter * 10 < whole, (adapter, whole)
