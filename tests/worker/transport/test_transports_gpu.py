"""The GPU transports (nccl, uccl, ipc): real transfers where the machine has what they need, and
everywhere a clear TransportUnavailable saying why, never a silent fallback. (The nccl
transport's transfers and failures are in test_transport_p2p.py.)"""

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from support import SUPPORT

from weightsync.transport import (
    Capabilities,
    RankContext,
    TransportUnavailable,
    capabilities_of,
    ipc,
    make_transport,
    nccl,
    options_for,
    resolve_transport,
    tcp,
    uccl,
)

PEER = SUPPORT / "transfer_peer.py"
TOKEN = b"test-job-token-0123456789"


@pytest.mark.parametrize("name,module", [("nccl", nccl), ("uccl", uccl), ("ipc", ipc)])
def test_a_transport_that_cannot_run_here_says_why(name, module):
    reason = module.unavailable_reason()
    if reason is None:
        pytest.skip(f"{name} can run on this machine; the real transfer test covers it")
    options = nccl.NcclOptions(1, 1, store=object()) if name == "nccl" else None
    with pytest.raises(TransportUnavailable) as err:
        make_transport(name, token=TOKEN, options=options)
    assert str(err.value) == f"{name}: {reason}"
    print(f"{name} is unavailable here: {reason}")


def test_uccl_is_refused_where_its_engine_would_end_the_process(tmp_path, monkeypatch):
    """uccl 0.1.1's engine asserts (and the process ends) on a machine without RDMA devices unless
    its TCP mode is chosen: the transport says so instead of starting it."""
    monkeypatch.setattr(uccl, "SYSFS_RDMA", str(tmp_path / "infiniband"))
    monkeypatch.delenv("UCCL_P2P_TRANSPORT", raising=False)
    assert "no RDMA device here" in uccl.rdma_unavailable_reason()
    assert "UCCL_P2P_TRANSPORT=tcp selects its TCP mode" in uccl.rdma_unavailable_reason()
    (tmp_path / "infiniband").mkdir()
    assert "lists none" in uccl.rdma_unavailable_reason()
    (tmp_path / "infiniband" / "mlx5_0").mkdir()
    assert uccl.rdma_unavailable_reason() is None
    (tmp_path / "infiniband" / "mlx5_0").rmdir()
    monkeypatch.setenv("UCCL_P2P_TRANSPORT", "tcp")
    assert uccl.rdma_unavailable_reason() is None


def test_auto_names_its_choice_and_the_reason():
    name, why = resolve_transport("auto", "tcp")
    assert name in ("tcp", "nccl") and why.startswith("auto: ")
    if nccl.unavailable_reason():
        assert (name, why) == ("tcp", f"auto: {nccl.unavailable_reason()}")
    assert resolve_transport("tcp", "rdma") == ("tcp", "spec.transfer.transport is tcp")
    colocated = resolve_transport("auto", "tcp", colocated=True)
    assert colocated[0] == ("tcp" if nccl.unavailable_reason() else "ipc"), colocated
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
        make_transport("carrier-pigeon", token=TOKEN)


def test_each_transport_declares_what_it_can_do_and_builds_its_options_for_a_rank():
    """One record per transport, carried by its senders and receivers; one Options record per
    transport, made from what a rank offers, and refused by another transport."""
    assert capabilities_of("tcp") == Capabilities(patches=True, scatters=True, in_place=True, buffer_device="cpu")
    assert capabilities_of("uccl") == Capabilities(buffer_device="cuda", range_limit=(1 << 32) - 1)
    assert capabilities_of("nccl") == capabilities_of("ipc") == Capabilities(buffer_device="cuda")
    transport = make_transport("tcp", token=TOKEN)
    sender, receiver = transport.sender(0), transport.receiver(0)
    assert sender.capabilities == receiver.capabilities == capabilities_of("tcp")
    receiver.close()
    if nccl.unavailable_reason("gloo") is None:  # nccl over gloo moves host tensors, and says so
        gloo = nccl.NcclTransport(TOKEN, 5, nccl.NcclOptions(1, 1, group=object(), backend="gloo"))
        assert gloo.capabilities == Capabilities(buffer_device="cpu")
    store = dist.HashStore()
    rank = RankContext(2, 3, torch.device("cuda", 1), lambda: store)
    assert options_for("tcp", rank) == tcp.TcpOptions() and options_for("ipc", rank) == ipc.IpcOptions()
    assert options_for("uccl", rank) == uccl.UcclOptions(gpu=1)
    built = options_for("nccl", rank)
    assert (built.trainers, built.inferences, built.device, built.backend, built.group) == (2, 3, 1, "nccl", None)
    built.store.set("key", "value")  # the job's store, under the transport's own prefix
    assert dist.PrefixStore(nccl.STORE_PREFIX, store).get("key") == b"value"
    with pytest.raises(TypeError, match="the tcp transport takes TcpOptions, not IpcOptions"):
        make_transport("tcp", token=TOKEN, options=ipc.IpcOptions())


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def one_gpu_env(role: str, shared: bool) -> dict:
    """The environment of a peer; where both share one GPU, each names a host of its own to NCCL
    (which uccl's TCP mode runs on), which otherwise refuses two ranks on one GPU."""
    env = dict(os.environ)
    if shared:
        env.update(nccl.shared_gpu_env(f"weightsync-{role}"))
    return env


def run_pair(transport, trainer_device, inference_device, dtype):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
    common = ["--trainers", "1", "--inferences", "1", "--shapes", "7x3,1,33,1024x1024", "--dtype", dtype,
              "--bucket", str(1 << 20), "--versions", "2", "--store-port", str(store.port), "--transport", transport]
    procs = [subprocess.Popen([sys.executable, str(PEER), "--role", role, "--rank", "0", "--device", device, *common],
                              env=one_gpu_env(role, trainer_device == inference_device != "cpu"))
             for role, device in (("inference", inference_device), ("trainer", trainer_device))]
    try:
        codes = [p.wait(300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    said = {key: store.get(key).decode() for key in ("error/trainer/0", "error/inference/0", "result/1/0")
            if store.check([key])}
    assert codes == [0, 0], (codes, said)  # exit 3: the connection failed, 4: a version did (transfer_peer.py)
    digests = []
    for v in (1, 2):
        res = json.loads(store.get(f"result/{v}/0"))
        assert res["bit_exact"] and res["digest"] == res["trainers_digest"]
        digests.append(res["digest"])
    return digests


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gpu_to_gpu_over_tcp_gives_the_bytes_and_digests_of_the_cpu_path(dtype):
    """The GPU casts and stages through pinned memory; the versions, and so their digests, are
    the CPU path's bit for bit."""
    if gpu_count() < 1:
        pytest.skip("needs a CUDA GPU (torch sees none on this machine)")
    assert run_pair("tcp", "cuda:0", "cuda:0", dtype) == run_pair("tcp", "cpu", "cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name,module", [("uccl", uccl), ("ipc", ipc)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_sided_transfers_between_processes(name, module, dtype):
    """uccl over RDMA (or its tcp mode), ipc on one node: the inference rank on a second GPU
    where there is one, else both on the first."""
    reason = module.unavailable_reason()
    if reason:
        pytest.skip(f"{name} cannot run here: {reason}")
    second = "cuda:1" if gpu_count() > 1 else "cuda:0"
    run_pair(name, "cuda:0", second, dtype)
