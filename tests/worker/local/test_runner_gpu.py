"""Jobs with GPU ranks: DDP over NCCL, casting and staging on the GPU, every transport that runs
on one GPU shared by all the job's processes, and the NCCL transport between GPUs. Skipped, with
the reason, on machines without enough CUDA GPUs."""
import pytest
from support.jobs import ODD, check_every_version, make_job, run_to_end


def cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = pytest.mark.gpu


@pytest.mark.skipif(cuda_gpus() < 1, reason="needs a CUDA GPU (torch sees none on this machine)")
def test_gpu_trainer_to_cpu_inference_over_tcp(tmp_path):
    job = make_job("gpu-to-cpu", config=ODD, dtype="float32", steps=4, every=2, gpus=(1, 0), transport="tcp")
    summary, transfers = run_to_end(tmp_path, job)
    assert summary["versions"] == 3 and transfers[0]["transport"] == "tcp"
    # weights bit for bit; logits from a GPU and a CPU agree to float32 rounding only
    assert check_every_version(tmp_path / "dump", job, logits_tolerance=1e-4) == 3


@pytest.mark.skipif(cuda_gpus() < 1, reason="needs a CUDA GPU (torch sees none on this machine)")
@pytest.mark.parametrize("transport,dtype", [("tcp", "bfloat16"), ("nccl", "bfloat16"), ("nccl", "float32"),
                                             ("ipc", "bfloat16"), ("auto", "bfloat16")])
def test_a_whole_job_on_one_gpu(tmp_path, transport, dtype):
    """Every trainer and inference process on the one GPU (colocated); auto picks ipc there.
    Weights bit for bit and logits identical to the trainer's cast model, after every version."""
    job = make_job(f"one-gpu-{transport}-{dtype}".replace("float", "f"), config=ODD, dtype=dtype, trainers=(2, 1),
                   inferences=(2, 1), steps=4, every=2, gpus=(1, 1), transport=transport)
    summary, transfers = run_to_end(tmp_path, job, share_gpus=True)
    assert summary["versions"] == 3
    assert transfers[0]["transport"] == ("ipc" if transport == "auto" else transport)
    assert check_every_version(tmp_path / "dump", job) == 2 * 3  # both inference ranks, every version


@pytest.mark.skipif(cuda_gpus() < 2, reason=f"needs 2 CUDA GPUs (torch sees {cuda_gpus()})")
def test_nccl_transport_between_gpus(tmp_path):
    job = make_job("gpu-nccl", config=ODD, dtype="bfloat16", steps=4, every=2, gpus=(1, 1), transport="nccl")
    summary, transfers = run_to_end(tmp_path, job)
    assert summary["versions"] == 3 and transfers[0]["transport"] == "nccl"
    assert check_every_version(tmp_path / "dump", job) == 3
