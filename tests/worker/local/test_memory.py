"""The memory estimate `weightsync run` checks before it starts a job's processes."""
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from weightsync.job import API_VERSION, KIND, load_job
from weightsync.local import memory
from weightsync.local.memory import MiB
from weightsync.model.flat import FlatLayout


def job(dtype="bfloat16", trainers=2, gpus=0, bucket=1, delta=False):
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "m"},
        "spec": {"model": {"config": {"model_type": "gpt2"}, "dtype": dtype},
                 "trainer": {"replicas": trainers, "gpusPerProc": gpus},
                 "inference": {"replicas": 1, "procsPerPod": 3, "gpusPerProc": 0},
                 "transfer": {"bucketMB": bucket, "delta": {"enabled": delta}}}})


def layout(dtype):
    return FlatLayout.from_shapes([("a", (1000, 1000)), ("b", (1000,))], dtype)  # 1,001,000 parameters


def test_per_process_needs_from_the_parameter_count():
    lay = layout("bfloat16")
    assert memory.parameters(lay) == 1_001_000
    controller, trainer, inference = memory.needs(job(), lay)
    assert (controller.processes, controller.each) == (1, memory.CONTROLLER_RUNTIME)
    # 2 trainer ranks: float32 weights, gradients, AdamW's two moments, DDP's gradient buckets; two 1 MiB cast buffers
    assert trainer.processes == 2 and trainer.each == 1_001_000 * 20 + 2 * MiB + memory.RANK_RUNTIME
    assert "1.0M parameters x 20 bytes" in trainer.why and "DDP" in trainer.why
    # an inference rank: three versions at bfloat16
    assert inference.processes == 3 and inference.each == 3 * lay.total_bytes + memory.RANK_RUNTIME


def test_one_float32_trainer_has_no_ddp_and_no_cast_buffers():
    _, trainer, _ = memory.needs(job(dtype="float32", trainers=1), layout("float32"))
    assert trainer.each == 1_001_000 * 16 + memory.RANK_RUNTIME and "DDP" not in trainer.why


def test_delta_versions_keep_a_share_of_the_last_version_and_send_through_buffers():
    lay = layout("float32")
    _, trainer, _ = memory.needs(job(dtype="float32", trainers=2, delta=True), lay)
    share = -(-lay.total_bytes // 2)
    assert trainer.each == 1_001_000 * 20 + 2 * MiB + share + memory.RANK_RUNTIME
    assert "share of the last version sent" in trainer.why
    _, on_gpu, _ = memory.needs(job(gpus=1, delta=True), layout("bfloat16"))  # kept in host memory
    assert on_gpu.each == memory.RANK_RUNTIME + -(-layout("bfloat16").total_bytes // 2)
    # an inference rank keeps the last version's patch entries, at most a quarter of a version
    version = layout("bfloat16").total_bytes
    _, _, inference = memory.needs(job(delta=True), layout("bfloat16"))
    assert inference.each == 3 * version + version // 4 + memory.RANK_RUNTIME and "patch entries" in inference.why


def test_a_gpu_process_counts_only_its_runtime_on_the_host():
    _, trainer, _ = memory.needs(job(gpus=1), layout("bfloat16"))
    assert trainer.each == memory.RANK_RUNTIME and "GPU" in trainer.why


def test_shortfall_names_the_numbers():
    j, lay = job(), layout("bfloat16")
    total = sum(n.total for n in memory.needs(j, lay))
    assert memory.shortfall(j, lay, have=(total, "MemAvailable")) is None
    assert memory.shortfall(j, lay, have=(total - 1, "MemAvailable")) is not None
    message = memory.shortfall(j, lay, have=(1536 * MiB, "MemAvailable"))
    assert message.startswith(f"the job needs at least {total / 1024 / MiB:.2f} GiB of memory "
                              "and this machine has 1.50 GiB available")
    assert "(MemAvailable): 2 trainer processes x" in message and "3 inference processes x" in message
    assert "\n" not in message


def test_available_reads_meminfo():
    have = memory.available()
    assert have is not None and have[0] > 0 and have[1]


def test_a_memory_cgroup_that_allows_less_than_the_machine_bounds_what_is_available():
    """A process in a memory cgroup of 2.5 GiB (a container's limit, on a machine with more) can
    have at most that: the preflight says so, naming the cgroup, instead of letting the job's
    processes be OOM-killed one after the other."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    parent = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/memory")
    group = parent / f"weightsync-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup under {parent} here ({e.strerror}): needs root and a writable cgroupfs")
    limit = 2560 * MiB
    try:
        (group / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
        code = (f"import os; open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
                "from weightsync.local import memory\nhave, source = memory.available()\nprint(have)\nprint(source)")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        have, source = proc.stdout.splitlines()
        assert int(have) <= limit and str(group) in source and "2.50 GiB" in source, proc.stdout
    finally:
        for _ in range(50):  # the process has left; the kernel frees the group a moment later
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
