"""`weightsync bench --control-plane`: simulated ranks against the real controller. The checksums
that stand in for bytes make each receiver's digest the one the controller computes from the
trainers' reports, and any bucket left out breaks it; a layout larger than the job is refused
before anything is built; and 64 simulated ranks take a few versions from the real controller, in
its own process, to the job's end, every round applied and verified on every receiver, the figures
drawn as --chart draws them (the bench's timings are its own to report, not a test's to assert)."""

import json

import pytest

from weightsync.bench.chart import control_plane_chart
from weightsync.bench.control_plane import published_plan, run, setup
from weightsync.bench.sim_ranks import Wire
from weightsync.model.flat import FlatLayout
from weightsync.plan.boxes import Box, RankSlices, Slice
from weightsync.plan.job import fsdp_holdings
from weightsync.plan.sliced_plan import SlicedPlan
from weightsync.rendezvous.messages import Round, SentReport
from weightsync.transfer.receive import reference_digests

TINY_LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False}


def halves_plan() -> SlicedPlan:
    """Three trainer ranks holding dim-0 shards, two receivers each needing one column half."""
    layout = FlatLayout.from_shapes([("a", (6, 4)), ("b", (5, 8))], "float32", align=16)
    needs = tuple(RankSlices(r, (Slice("a", Box((0, 2 * r), (6, 2 * r + 2))), Slice("b", Box((0, 4 * r), (5, 4 * r + 4)))))
                  for r in range(2))
    return SlicedPlan(layout, tuple(fsdp_holdings(layout, 3, 3)), needs, 64)


def test_the_simulated_wire_gives_each_receiver_the_digest_the_controller_expects():
    plan = halves_plan()
    wire = Wire.of(plan)
    rnd = Round(4, receivers=(0, 1))
    sent = [wire.sent(t, rnd, 0.0) for t in range(plan.trainers)]
    reference = reference_digests(plan, sent, rnd.receivers)
    assert reference == {r: wire.received(4, r, 0.0).digest for r in (0, 1)}
    assert wire.received(5, 0, 0.0).digest != reference[0]  # another version's bytes
    # a trainer that left one bucket of receiver 1 out: that receiver's digest no longer matches
    t, report = next((t, s) for t, s in enumerate(sent) if s.receiver_checksums.get(1))
    short = dict(report.receiver_checksums)
    short[1] = dict(list(short[1].items())[1:])
    sent[t] = SentReport(report.bytes, 0.0, receiver_checksums=short)
    fewer = reference_digests(plan, sent, rnd.receivers)
    assert fewer[0] == reference[0] and fewer[1] != reference[1]


def test_an_inference_layout_with_as_many_ranks_as_the_job_is_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="the inference layout 4xEP32 alone has 128 ranks"):
        setup("kimi-k2", 128, "4xEP32", versions=1)


@pytest.mark.slow
def test_sixty_four_simulated_ranks_take_three_versions_from_the_real_controller_to_the_end(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    built = setup(str(config), 64, "16xTP2", versions=3)
    assert built.job.layout.world_size("trainer") == 32 and built.job.layout.sliced
    figures = run(built, versions=3, idle=0.5, directory=str(tmp_path))
    assert figures["errors"] == [] and figures["controller_exit"] == 0, (tmp_path / "controller.log").read_text()[-3000:]
    assert figures["join"]["ranks_joined"] == figures["join"]["ranks_read_plan"] == 64
    # every version applied, and its digest checked, on all 32 receivers, once each
    rounds = figures["controller"]["rounds"]
    assert [(r["version"], r["again"], r["inference_ranks"]) for r in rounds] == [(v, 0, 32) for v in range(3)]
    completion = figures["controller"]["completion"]
    assert completion["state"] == "Succeeded" and completion["versions"] == 3 and completion["failed_verifications"] == 0
    assert "on 32 inference ranks" in completion["message"]
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["transfer"]["version"] == 2 and status["completion"]["state"] == "Succeeded"
    # the controller watched every version to its record, and the store answered throughout
    assert len(figures["controller"]["version_wall_seconds"]) == 3
    assert len(figures["store"]["keys_after_each_version"]) == 3 and figures["store"]["peak_keys"] > 64
    # the plan the ranks read is the one --plan-share builds without a controller; what it costs a rank
    # was measured on a trainer and on an inference rank, each with its share
    assert (tmp_path / "plan.json").read_text() == published_plan(built)[0].header
    shares = {s["role"]: s for s in figures["plan"]["own_share"]}
    assert shares["trainer"]["share_bytes"] > 0 and shares["inference"]["share_bytes"] > 0
    # and --chart draws these figures
    drawn = control_plane_chart({"model": "a small Llama", "runs": [{"ranks": 64, **figures}]}, tmp_path / "cp.png")
    assert drawn.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and drawn.stat().st_size > 10_000
