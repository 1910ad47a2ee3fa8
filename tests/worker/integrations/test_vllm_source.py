"""Any vLLM WeightSource, not only ModuleSource, through weightsync's trainer-side engine for
vLLM's RL API (integrations/vllm_source.py), for real: the user's torchrun of two ranks in vLLM's
own Python, each with a source of its own written against vLLM's WeightSource contract (a pipeline
stage's: the rank holds every other tensor, says so in held_names(), and yields the full tensors
it holds and None for the rest, in metadata order), joins a job as its external trainers. Each
rank sends only the tensors it holds, about half of every version; every version reaches the
inference rank verified, the last one bit for bit the weights the script saved. The job's
inference rank is weightsync's built-in engine, so that no vLLM server's start is paid for here:
the servers' side of the same engine is test_external_vllm.py's. (What a WeightSource that breaks
its contract gets, one line each: vllm_backend/test_plugin.py, in the same vLLM Python.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import pytest
from support.user_script import CONFIG, check_final_version
from support.vllm import vllm_python
from support.waits import until

from weightsync.job import API_VERSION, KIND, TORCHRUN_VARS, load_job
from weightsync.local.runner import LocalJob
from weightsync.runtime.faults import DUMP_DIR_ENV

pytestmark = pytest.mark.slow  # a job and a torchrun in vLLM's Python: not in `make unit`

RUN_TIMEOUT = 600.0

SCRIPT = """
import json, sys
import torch, torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from weightsync.integrations.vllm import WeightsyncTrainerInitInfo


class Stage(WeightSource):
    # this rank's stage: every other tensor of the model, as a pipeline-parallel producer holds its layers
    def __init__(self, model, rank, world):
        self.model = model
        self.mine = {n for n, _ in list(model.named_parameters())[rank::world]}

    def metadata(self):
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def held_names(self):
        return self.mine

    def __iter__(self):
        for n, p in self.model.named_parameters():
            yield n, (p.detach() if n in self.mine else None)


config, save = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same weights on every rank; each sends its own stage's
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
engine = WeightTransferTrainerFactory.trainer_init(WeightsyncTrainerInitInfo(rank=rank), client=[],
                                                   source=Stage(model, rank, world))
for step in range(3):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.full_like(p, 0.01 * (step + 1) * (i + 1)))
    engine.send_weights(step=step)
if rank == 0:
    torch.save({n: t.detach().clone() for n, t in model.state_dict().items()}, save)
engine.shutdown()
"""


def test_a_weight_source_of_the_users_own_sends_each_ranks_held_tensors_as_the_jobs_trainers(tmp_path):
    python = vllm_python()
    (tmp_path / "dump").mkdir()
    job = load_job({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "vllm-source"},
                    "spec": {"model": {"config": CONFIG, "dtype": "float16"},
                             "trainer": {"external": True, "replicas": 1, "procsPerPod": 2, "gpusPerProc": 0},
                             "inference": {"replicas": 1, "procsPerPod": 1, "gpusPerProc": 0},
                             "transfer": {"bucketMB": 1, "transport": "tcp", "timeoutSeconds": 120},
                             "network": {"mode": "tcp"}}})
    join_file = tmp_path / "join.env"
    local = LocalJob(job, tmp_path / "run", {DUMP_DIR_ENV: str(tmp_path / "dump")}, join_env=join_file)
    script = tmp_path / "stage.py"
    script.write_text(SCRIPT)
    trainers = None
    try:
        local.start()
        until("join file", local.offer.written.is_set, 120)
        args = shlex.join([str(script), json.dumps(CONFIG), str(tmp_path / "final.pt")])
        command = (f"set -a; . {shlex.quote(str(join_file))}; set +a; exec {shlex.quote(python)} -m "
                   f"torch.distributed.run --standalone --nproc-per-node 2 {args}")
        user = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_") and k not in TORCHRUN_VARS}
        trainers = subprocess.Popen(["bash", "-c", command], env=user, cwd=tmp_path, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        summary = local.wait(RUN_TIMEOUT)
        out, _ = trainers.communicate(timeout=120)
    finally:
        if trainers is not None and trainers.poll() is None:
            trainers.kill()
        local.stop()
    assert trainers.returncode == 0, out[-5000:]
    assert summary["versions"] == 3 and summary["failed_verifications"] == 0, summary
    check_final_version(tmp_path, job, 3)
    shares = {int(rank): int(sent) / int(total) for rank, sent, total in
              re.findall(r"trainer rank (\d+)\] attached on cpu.*; sends (\d+) of (\d+) bytes per version", out)}
    assert sorted(shares) == [0, 1] and all(0.2 < s < 0.8 for s in shares.values()), (shares, out[-3000:])
    assert abs(sum(shares.values()) - 1.0) < 0.01, shares  # each tensor sent once, by the rank that holds it
