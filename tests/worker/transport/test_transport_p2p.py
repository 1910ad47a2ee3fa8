"""The nccl transport, every rank a real process (transfer_peer.py): over NCCL where a GPU is
there (all processes sharing it), and on every machine over gloo on host tensors (backend
"gloo"), where the framing, the bookkeeping and the failure paths are the NCCL transport's own and
only the backend differs. Every failure ends the version within the transfer timeout, naming the
peer, never a hang and never a process killed by a library's watchdog."""

import json
import threading
import time

import pytest
from support.tiers import first_in_unit
from support.transfer import ODD, send_and_check

from weightsync.runtime.faults import CORRUPT_ENV
from weightsync.transport import nccl, nccl_wait


class Backend:
    """The flags and environment of the ranks of one backend."""

    def __init__(self, name: str):
        self.name = name
        device = "cuda:0" if name == "nccl" else "cpu"
        self.flags = ("--transport", "nccl", "--backend", name, "--device", device)

    def env(self, role: str, rank: int) -> dict:
        if self.name != "nccl":
            return {}
        # every process on the one GPU, each a host of its own to NCCL; its warnings go to the
        # rank's stderr, which a failing test prints
        return {**nccl.shared_gpu_env(f"weightsync-{role}-{rank}"), "NCCL_DEBUG": "WARN"}


@pytest.fixture(params=["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def p2p(request):
    reason = nccl.unavailable_reason(request.param)
    if reason:
        pytest.skip(f"the nccl transport over {request.param} cannot run here: {reason}")
    return Backend(request.param)


def wait_for_key(keys, key: str, timeout: float = 60, ranks=None) -> float:
    """Poll the store `keys` until `key` is there; returns when it appeared. A key that never
    comes fails the test with what `ranks` (a Ranks) were doing."""
    deadline = time.monotonic() + timeout
    while not keys.check([key]):
        if time.monotonic() > deadline:
            pytest.fail(f"{key} never appeared in the store" + (f"\n{ranks.report()}" if ranks else ""))
        time.sleep(0.02)
    return time.monotonic()


@pytest.mark.parametrize("trainers,inferences,dtype,shapes,bucket", first_in_unit([
    # the frames carry bytes, whatever the dtype (the sender's cast or not is test_transfer.py's, the
    # same for every transport): several trainers to several inference ranks in many small buckets
    # that cut tensors, and one to one, a bucket that ends where a tensor does
    (2, 3, "float16", ODD, 256),
    (1, 1, "float32", "64x64,10", 4096),
]))
def test_versions_arrive_bit_for_bit_over_point_to_point(p2p, ranks, store, trainers, inferences, dtype, shapes, bucket):
    send_and_check(ranks(trainers, inferences, shapes, dtype, bucket, 3, env=p2p.env), store, trainers, inferences, 3,
                   *p2p.flags)


@pytest.mark.slow  # waits for a heartbeat to go silent: not in `make unit`
def test_a_killed_trainer_is_named_within_seconds(p2p, ranks, store):
    r = ranks(2, 1, "256x256,77", "float32", 4096, 1, env=p2p.env)
    r.start("inference", 0, *p2p.flags, "--timeout", "20")
    r.start("trainer", 0, *p2p.flags, "--timeout", "20")
    victim = r.start("trainer", 1, *p2p.flags, "--timeout", "20", "--pause-after-first-bucket")
    wait_for_key(store, "paused/trainer/1", ranks=r)
    victim.kill()
    killed = time.monotonic()
    failed = wait_for_key(store, "result/1/0", ranks=r)
    res = json.loads(store.get("result/1/0"))
    assert res["peer"] == "trainer rank 1", res
    assert "of version 1" in res["error"], res
    # gloo sees the closed connection at once; NCCL at the latest at the transfer timeout
    assert failed - killed < (10 if p2p.name == "gloo" else 20 + 5)
    assert r.procs[("inference", 0)].wait(30) == 4


@pytest.mark.slow  # waits out the version's deadline: not in `make unit`
def test_a_stalled_trainer_fails_the_version_at_its_deadline(p2p, ranks, store):
    r = ranks(1, 1, "256x256,77", "float32", 4096, 1, env=p2p.env)
    r.start("inference", 0, *p2p.flags, "--timeout", "4")
    r.start("trainer", 0, *p2p.flags, "--timeout", "4", "--pause-after-first-bucket")
    started = wait_for_key(store, "paused/trainer/0", ranks=r)
    failed = wait_for_key(store, "result/1/0", ranks=r)
    res = json.loads(store.get("result/1/0"))
    assert res["peer"] == "trainer rank 0", res
    assert "of version 1" in res["error"], res
    assert failed - started < 4 + 5


def test_a_byte_changed_on_the_way_fails_the_checksum(p2p, ranks, store, monkeypatch):
    monkeypatch.setenv(CORRUPT_ENV, "1")
    r = ranks(1, 1, "64x64", "bfloat16", 4096, 1, env=p2p.env)
    r.start("inference", 0, *p2p.flags)
    r.start("trainer", 0, *p2p.flags)
    wait_for_key(store, "result/1/0", ranks=r)
    res = json.loads(store.get("result/1/0"))
    assert res["peer"] == "trainer rank 0", res
    assert "checksum mismatch for bytes [0, 4096) of version 1" in res["error"], res


def test_a_trainer_without_the_job_token_is_refused_and_nothing_is_applied(p2p, ranks, store):
    r = ranks(1, 1, "64x64", "float32", 4096, 1, env=p2p.env)
    r.start("inference", 0, *p2p.flags)
    r.start("trainer", 0, *p2p.flags, "--token", "not-the-job-token-987654321")
    wait_for_key(store, "result/1/0", ranks=r)
    res = json.loads(store.get("result/1/0"))
    assert res["peer"] == "trainer rank 0", res
    assert "does not prove the job token" in res["error"], res
    assert res["untouched"]


@pytest.mark.slow  # waits out the join's deadline: not in `make unit`
def test_a_rank_that_never_joins_is_named(p2p, ranks, store):
    r = ranks(2, 1, "64x64", "float32", 4096, 1, env=p2p.env)
    r.start("inference", 0, *p2p.flags, "--timeout", "3")
    r.start("trainer", 0, *p2p.flags, "--timeout", "3")
    if p2p.name == "gloo":  # gloo connects every pair while the group forms
        wait_for_key(store, "error/inference/0", ranks=r)
        error = store.get("error/inference/0").decode()
        assert "did not form within 3s" in error and "not joined: trainer rank 1" in error, error
        assert r.procs[("inference", 0)].wait(30) == 3
        return
    wait_for_key(store, "result/1/0", ranks=r)
    res = json.loads(store.get("result/1/0"))
    assert res["peer"] == "trainer rank 1" and "did not announce itself" in res["error"], res


def test_a_group_that_failed_carries_no_more_versions():
    """After a failure the ranks' streams of frames are out of step: the transport says so at
    once instead of reading another rank's leftovers as a new version."""
    transport = nccl.NcclTransport(b"test-job-token-0123456789", 5, nccl.NcclOptions(1, 1, group=object(), backend="gloo"))
    transport.abort("trainer rank 0: bytes at 0 of version 3 failed: Connection closed by peer")
    with pytest.raises(nccl.TransferError, match="aborted after an earlier failure .*version 3.*carries no more"):
        transport.check("trainer rank 0")


class BackendWork:
    """A backend operation as torch.distributed's Work shows it, in the states NCCL left the
    receiver of a killed trainer in: never completing, or completed with the communicator's error;
    either way its wait() never returns, as NCCL's did there."""

    def __init__(self, error: Exception | None = None):
        self.error = error

    def is_completed(self) -> bool:
        return self.error is not None

    def exception(self):
        return self.error

    def wait(self, timeout=None):
        threading.Event().wait()


class Torch211Work(BackendWork):
    """A Work as torch 2.11 shows an NCCL operation: exception() cannot convert its answer to
    Python (TypeError), whatever the operation's state; wait() raises the operation's error, hangs
    (aborting a failed communicator), or returns at once."""

    def __init__(self, error: Exception | None = None, hangs: bool = False):
        super().__init__(error)
        self.hangs = hangs

    def is_completed(self) -> bool:
        return True

    def exception(self):
        raise TypeError("Unable to convert function return value to a Python type! The signature was\n"
                        "\t(self: torch._C._distributed_c10d.Work) -> std::__exception_ptr::exception_ptr")

    def wait(self, timeout=None):
        if self.hangs:
            threading.Event().wait()
        if self.error:
            raise self.error
        return True


@pytest.mark.parametrize("work,expected", [
    (Torch211Work(), None),
    (Torch211Work(RuntimeError("NCCL error: remote process exited")), "failed: NCCL error: remote process exited"),
    (Torch211Work(RuntimeError("NCCL error"), hangs=True), "did not complete in time"),
])
def test_an_nccl_operation_completes_or_fails_where_torch_cannot_say_its_error_but_through_its_wait(work, expected):
    """Every NCCL transfer once failed on torch 2.11, at its first completed operation: the
    transport asked the operation for its error, which that torch cannot convert to Python.
    There a completed operation's wait says it, bounded by the deadline."""
    deadline = time.monotonic() + 0.5
    if expected is None:
        nccl_wait.wait_work(work, deadline, "trainer rank 1", "a header of version 3", poll=True)
        return
    with pytest.raises(nccl.TransferError, match=expected) as err:
        nccl_wait.wait_work(work, deadline, "trainer rank 1", "a header of version 3", poll=True)
    assert err.value.peer == "trainer rank 1" and time.monotonic() < deadline + 5


@pytest.mark.parametrize("error", [None, RuntimeError("NCCL error: remote process exited or there was a network error\n"
                                                      "ncclRemoteError: ...")])
def test_an_nccl_operation_is_polled_to_its_deadline_and_never_waited_on_when_it_failed(error):
    """A polled wait ends at its deadline, or at the operation's error naming the peer, without
    entering the backend's wait."""
    outcome = {}

    def run():
        try:
            nccl_wait.wait_work(BackendWork(error), time.monotonic() + 0.5, "trainer rank 1", "a header of version 3", poll=True)
        except nccl.TransferError as e:
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the wait entered the backend's wait and never returned"
    assert outcome["error"].peer == "trainer rank 1"
    expected = "did not complete in time" if error is None else "failed: NCCL error: remote process exited"
    assert expected in str(outcome["error"]), outcome


def test_an_abort_that_hangs_still_leaves_the_failure_reported(monkeypatch):
    """NCCL's abort may not return (a communicator its watchdog is aborting too): the transport
    gives it ABORT_SECONDS, then goes on with the failure recorded."""
    monkeypatch.setattr(nccl, "ABORT_SECONDS", 0.2)

    class Group:
        def abort(self):
            threading.Event().wait()

    transport = nccl.NcclTransport(b"test-job-token-0123456789", 5, nccl.NcclOptions(1, 1, group=Group(), backend="gloo"))
    done = threading.Thread(target=transport.abort, args=("trainer rank 1: a header of version 1 failed",), daemon=True)
    done.start()
    done.join(30)
    assert not done.is_alive(), "abort hung"
    with pytest.raises(nccl.TransferError, match="aborted after an earlier failure .*version 1"):
        transport.check("trainer rank 1")
