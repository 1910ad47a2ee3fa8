"""The `weightsync` command: plan, bench, and clear refusals of bad specs and pod environments (its
`main` called in this process, as support/cli.py says why; the GPU bench, which starts processes,
and the version run as the command itself)."""
import re
from pathlib import Path

import pytest
import yaml
from support.cli import EXAMPLE, example
from support.cli import in_process as weightsync
from support.cli import weightsync as command

from weightsync.job import Env


def test_plan_prints_the_table_with_its_balance():
    out = weightsync("plan", str(EXAMPLE))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("version: ") and "2 trainer rank(s) -> 2 inference rank(s)" in lines[0]
    assert [line.split()[0] for line in lines[2:4]] == ["0", "1"]
    assert lines[-1] == "balance (largest trainer share / mean): 1.000"


def test_version_is_the_packages_one():
    out = command("--version")
    want = re.search(r'^version = "([^"]+)"', (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(), re.M)
    assert out.returncode == 0 and out.stdout.strip() == f"weightsync {want.group(1)}", out


@pytest.mark.parametrize("nic", ["400G", "400Gb", "400Gbps", "400Gb/s", "400gbit"])
def test_the_nic_rate_is_read_as_data_sheets_and_tc_write_it(nic):
    from weightsync.cli import nic_bits

    assert nic_bits(nic) == 400e9


def test_a_nic_rate_it_cannot_read_says_which_forms_it_takes():
    from weightsync.cli import nic_bits

    with pytest.raises(ValueError, match=r"--nic: link rate '3\.2T' is not .* \(or as a NIC's data sheet writes it: 400G"):
        nic_bits("3.2T")


def test_bench_is_delegated():
    out = weightsync("bench", "--help")
    assert out.returncode == 0 and "weightsync bench" in out.stdout and "--json" in out.stdout
    assert "--links RATE" in out.stdout and "--delta" in out.stdout


@pytest.mark.slow  # a real measurement between processes: not in `make unit`
def test_the_gpu_bench_runs_its_point_to_point_measurement_over_gloo_and_says_what_needs_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the GPU run measures it (tests/gpu/run.sh)")
    assert command("bench", "--gpu").returncode == 2  # without a GPU, only --backend gloo
    out = command("bench", "--gpu", "--backend", "gloo", "--mb", "4", "--reps", "1", "--shape", "2x1,1x1")
    assert out.returncode == 0, out.stderr
    for shape in ("2x1", "1x1"):
        assert re.search(rf"gloo {shape} .* ms .* broadcast from trainer rank 0: .* ratio +[0-9.]+x", out.stdout), out.stdout
    assert re.search(r"gloo 2x1 against 1x1, per byte delivered: ratio +[0-9.]+x", out.stdout), out.stdout
    assert "ipc, cast and ws64 need a CUDA GPU: not measured" in out.stdout


def test_bench_refuses_a_link_rate_it_cannot_read():
    out = weightsync("bench", "--links", "1GB/s")
    assert out.returncode == 2 and "--links: link rate '1GB/s' is not a number with bit" in out.stderr


def test_bench_refuses_zero_versions_rather_than_running_its_default():
    out = weightsync("bench", "--versions", "0")
    assert out.returncode == 2 and "--versions: 0 times nothing; give 1 or more timed versions" in out.stderr


def test_bench_fsdp_refuses_a_shape_without_shards():
    out = weightsync("bench", "--fsdp", "--shapes", "1x2")
    assert out.returncode == 2 and "at least 2 trainer ranks" in out.stderr
    out = weightsync("bench", "--fsdp", "--dtypes", "float64")
    assert out.returncode == 2 and "--dtypes: 'float64' is not one of" in out.stderr


def test_run_refuses_an_invalid_job_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(example(**{"trainer.replicas": 0, "transfer.verify": "maybe"})))
    out = weightsync("run", str(bad))
    assert out.returncode == 2
    assert "spec.trainer.replicas" in out.stderr and "spec.transfer.verify" in out.stderr
    assert "logs in" not in out.stderr  # nothing was started
    missing = weightsync("run", str(tmp_path / "absent.yaml"))
    assert missing.returncode == 2 and "absent.yaml: no such file" in missing.stderr


def test_run_refuses_a_suspended_job_saying_how_to_run_it(tmp_path):
    held = tmp_path / "held.yaml"
    held.write_text(yaml.safe_dump(example(**{"suspend": True})))
    out = weightsync("run", str(held))
    assert out.returncode == 2 and "has spec.suspend: true, so the job runs nothing; set it to false" in out.stderr
    assert "logs in" not in out.stderr


def test_run_says_a_kueue_queue_is_not_applicable_locally(tmp_path):
    # a model it then refuses, so that the run ends at once: the note comes first
    queued = example(**{"model.config": {"model_type": "gpt2", "n_layer": 1, "n_embd": 65, "n_head": 2}})
    queued["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "lq"}
    (tmp_path / "queued.yaml").write_text(yaml.safe_dump(queued))
    out = weightsync("run", str(tmp_path / "queued.yaml"))
    assert ("metadata.labels[kueue.x-k8s.io/queue-name] (lq): not applicable locally (Kueue admits the job in a "
            "cluster); it runs now") in out.stderr
    assert out.returncode == 2 and "spec.model" in out.stderr


def test_run_refuses_a_model_transformers_cannot_build(tmp_path):
    bad = tmp_path / "bad-model.yaml"
    config = {"model_type": "gpt2", "n_layer": 1, "n_embd": 65, "n_head": 2}  # 65 does not split into 2 heads
    bad.write_text(yaml.safe_dump(example(**{"model.config": config})))
    out = weightsync("run", str(bad))
    assert out.returncode == 2 and "spec.model" in out.stderr and "logs in" not in out.stderr


def test_run_refuses_sequences_longer_than_the_model_takes(tmp_path):
    bad = tmp_path / "long.yaml"
    bad.write_text(yaml.safe_dump(example(**{"training.seqLen": 129})))
    out = weightsync("run", str(bad))
    assert out.returncode == 2 and "spec.training.seqLen: 129 is longer than the model's 128 positions" in out.stderr


def test_run_refuses_a_job_asking_for_more_gpus_than_the_machine_has(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs; the refusal is for machines with fewer than the job asks for")
    job = tmp_path / "gpu.yaml"
    job.write_text(yaml.safe_dump(example(**{"trainer.gpusPerProc": 1})))
    out = weightsync("run", str(job))
    assert out.returncode == 2  # nothing started: the machine cannot run it
    assert "the job asks for 2 GPUs" in out.stderr and "this machine has 0" in out.stderr


def pod_env(tmp_path, ordinal="1"):
    spec = tmp_path / "job.yaml"
    spec.write_text(EXAMPLE.read_text())
    token = tmp_path / "token"
    token.write_text("x" * 32)
    return {Env.SPEC_FILE: str(spec), Env.TOKEN_FILE: str(token), Env.ORDINAL: ordinal,
            Env.CONTROLLER_HOST: "127.0.0.1"}


@pytest.mark.parametrize("change, message", [
    ({Env.SPEC_FILE: ""}, "environment variable WEIGHTSYNC_SPEC_FILE is not set"),
    ({Env.ORDINAL: "9"}, "ordinal 9 is outside this job (0..4)"),
    ({Env.ORDINAL: "one"}, "invalid literal for int()"),
    ({Env.TOKEN_FILE: "/nonexistent/token"}, "/nonexistent/token"),
])
def test_worker_refuses_a_bad_pod_environment(tmp_path, change, message):
    out = weightsync("worker", env={**pod_env(tmp_path), **change})
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


def test_worker_refuses_an_invalid_spec_file(tmp_path):
    env = pod_env(tmp_path)
    Path(env[Env.SPEC_FILE]).write_text(yaml.safe_dump(example(**{"model.dtype": "int4"})))
    out = weightsync("worker", env=env)
    assert out.returncode == 2 and "spec.model.dtype" in out.stderr
