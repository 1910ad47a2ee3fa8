"""Delta versions in a job: who gets a delta is the controller's decision (plan/job.py) - only a
rank holding the version the trainers kept, never a new or restarted one, everyone whole every
fullEvery versions and whenever the transport carries no patches; and a whole job as local
processes with delta versions on, where every inference rank holds the trainers' weights bit for
bit after every version while the controller's lines show the bytes saved on the wire."""

import pytest
from support.jobs import ODD, check_every_version, make_job, run_to_end

from weightsync.job import Delta, load_job
from weightsync.plan.job import bases, delta_in_effect
from weightsync.transport import capabilities_of

ON = Delta(enabled=True, full_every=4)


def test_only_a_rank_holding_the_version_before_gets_a_delta():
    assert bases(ON, 0, 0, {0: None, 1: None}) == {0: None, 1: None}  # nobody holds anything yet
    assert bases(ON, 1, 0, {0: 0, 1: 0}) == {0: 0, 1: 0}
    # rank 1 is behind (it missed version 1), rank 2 restarted and rejoined: it holds nothing
    assert bases(ON, 2, 0, {0: 1, 1: 0, 2: None}) == {0: 1, 1: None, 2: None}
    assert bases(ON, 4, 0, {0: 3, 1: 3}) == {0: None, 1: None}  # every 4th version goes whole
    assert bases(ON, 5, 0, {0: 4, 1: 4}) == {0: 4, 1: 4}


def test_the_final_version_sent_again_goes_whole():
    """The final version goes again only to ranks that do not hold it; the trainers kept that
    version, not the one before, so even a rank holding the one before gets it whole."""
    assert bases(ON, 9, 1, {1: None, 2: 8}) == {1: None, 2: None}


def test_without_delta_or_without_patches_every_version_is_whole():
    assert bases(Delta(enabled=False, full_every=10), 1, 0, {0: 0, 1: 0}) == {0: None, 1: None}
    assert delta_in_effect(Delta(True, 10), "tcp", capabilities_of("tcp").patches)[0]
    on, why = delta_in_effect(Delta(True, 10), "nccl", capabilities_of("nccl").patches)
    assert not on and "nccl transport carries no patches" in why
    assert not delta_in_effect(Delta(False, 10), "tcp", True)[0]


@pytest.mark.slow
def test_a_job_with_delta_versions(tmp_path):
    """Two trainer and two inference ranks, a version every optimizer step at a learning rate RL
    fine-tuning uses; version 0 and every 4th go whole, the others as deltas."""
    obj = make_job("deltas", config=ODD, trainers=(2, 1), inferences=(2, 1), steps=5, every=1,
                   delta={"enabled": True, "fullEvery": 4}).to_object()
    obj["spec"]["training"]["learningRate"] = 1e-6
    job = load_job(obj)
    summary, transfers = run_to_end(tmp_path, job)
    assert summary["versions"] == 6 and summary["failed_verifications"] == 0, summary
    assert [t["version"] for t in transfers] == [0, 1, 2, 3, 4, 5]
    for t in transfers:
        if t["version"] in (0, 4):
            assert t["deltaRanks"] == 0 and t["wireBytes"] == t["bytes"], t
        else:
            assert t["deltaRanks"] == 2 and t["wireBytes"] < t["bytes"] / 2, t
            assert 0 < t["changed"] < 0.5, t
    assert check_every_version(tmp_path / "dump", job) == 12
