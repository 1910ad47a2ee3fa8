"""The rollout-load bench's figures (bench/rollout.py), from generations as vLLM's stream gives
them, without vLLM: tokens per second within a window, the longest gap between two tokens of one
request, the longest wait for a first token, requests aborted, and a version's first token, found
through vLLM's weight_versions spans and the arrival of the chunk that carried it."""

from __future__ import annotations

import pytest
from safetensors.torch import save_file

from weightsync.bench.chart import rollout_chart
from weightsync.bench.rollout import Generation, figures, first_tokens, report, table
from weightsync.bench.rollout_path import medians, paths, round_marks, timeline
from weightsync.bench.vllm import save_version
from weightsync.job import Model
from weightsync.model.build import build
from weightsync.model.config import served_config


def crossing() -> Generation:
    """Started at 10, five chunks of two tokens a second apart from 11 on; version 1 from token 4,
    frozen from 13 to 16 while it loaded."""
    return Generation(10.0, [(11.0, 2), (12.0, 2), (13.0, 2), (16.0, 2), (17.0, 2)],
                      [{"version": "0", "start": 0, "end": 4}, {"version": "1", "start": 4, "end": 10}], "length")


def test_a_generation_says_when_the_first_token_of_each_version_arrived():
    g = crossing()
    assert g.first_token_of("0") == 11.0 and g.first_token_of("1") == 13.0 and g.first_token_of("2") is None


def test_the_figures_count_only_what_falls_in_the_window():
    aborted = Generation(12.5, [(14.0, 1)], [], "abort")
    failed = Generation(30.0, error="URLError: refused")
    got = figures([crossing(), aborted, failed], 10.0, 20.0)
    assert got["tokens_per_second"] == pytest.approx(11 / 10)
    assert got["longest_gap"] == 3.0  # the freeze, between two chunks of one request
    assert got["longest_first_token_wait"] == pytest.approx(1.5)
    assert (got["requests"], got["aborted"], got["failed"]) == (2, 1, 0)
    assert figures([crossing()], 12.5, 15.0)["longest_gap"] == 1.0  # a gap is counted where it ends
    assert figures([crossing()], 17.5, 20.0)["longest_gap"] == 0.0


def test_a_versions_first_token_is_timed_from_its_publication_over_every_generation():
    later = Generation(12.0, [(12.5, 4), (13.5, 4)], [{"version": "1", "start": 0, "end": 8}], "length")
    assert first_tokens([crossing(), later], {1: 12.0, 2: 20.0}) == {1: 0.5, 2: None}


def test_a_ways_report_sets_the_updates_against_its_own_baseline_and_is_drawn(tmp_path):
    steady = [Generation(float(t), [(t + 0.5 + k, 2) for k in range(3)], [{"version": "0", "start": 0, "end": 6}],
                         "length") for t in range(0, 16, 4)]
    crossed = Generation(16.0, [(16.5, 2), (17.5, 2), (20.0, 2)],
                         [{"version": "0", "start": 0, "end": 4}, {"version": "1", "start": 4, "end": 6}], "length")
    events = [{"version": 1, "published": 18.0}, {"end": 22.0}]
    got = report("keep", steady + [crossed], load_started=-5.0, events=events, stalls=[0.02])
    assert got["baseline"]["tokens_per_second"] == pytest.approx(28 / 18)
    assert got["updates"]["longest_gap"] == pytest.approx(2.5) and got["gap_ratio"] == pytest.approx(2.5)
    assert got["publication_to_first_token"] == {"1": 2.0} and got["stall_seconds"] == 0.02
    result = {"clients": 4, "tokens": 6, "every": 10.0, "window": 60.0, "ways": [got, {**got, "way": "disk"}]}
    assert table(result).splitlines()[2].startswith("keep")
    assert rollout_chart(result, tmp_path / "rollout.png").stat().st_size > 10_000


def test_a_saved_version_names_its_architecture_as_a_vllm_server_needs(tmp_path):
    """The disk way's checkpoints (bench/vllm.save_version): their config names the model's causal LM,
    without which a vLLM server refuses the checkpoint before it starts."""
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
              "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 128, "max_position_embeddings": 64}
    model = build(Model(config=config, dtype="float32"), dtype="float32", seed=0)
    save_version(model, tmp_path / "v0", save_file)
    assert served_config(Model(path=str(tmp_path / "v0"))).architectures == ["LlamaForCausalLM"]
    assert (tmp_path / "v0" / "model.safetensors").exists()


def test_a_versions_path_is_laid_from_its_publication_through_the_round_to_its_first_token():
    """The controller's round record (its go as the epoch's seconds, then its phases) and the tokens'
    arrival give each mark after the publication; the clients' silence runs from the last token of
    any request before the version's first."""
    record = {"version": 1, "began": 12.25, "stall_seconds": 0.0625,
              "phases": {"transfer": 0.25, "verify": 0.125, "staging": 0.125, "pause": 0.125, "stall": 0.0625}}
    marks = round_marks(record)
    assert marks == {"go": 12.25, "staged": 12.75, "paused": 12.875, "resumed": 12.9375}
    other = Generation(10.0, [(12.5, 1), (12.9, 1)], [{"version": "0", "start": 0, "end": 2}], "length")
    got = paths([crossing(), other], {1: 12.0, 2: 20.0}, {1: marks})
    assert got[1] == {"go": 0.25, "staged": 0.75, "paused": 0.875, "resumed": 0.9375, "first_token": 1.0,
                      "staged_to_first_token": 0.25, "resume_to_first_token": 0.0625, "silence": 0.1}
    assert got[2] == {}
    assert medians(got.values())["staged"] == 0.75


def test_the_timeline_counts_tokens_per_second_in_bins():
    assert timeline([crossing()], 11.0, 15.0) == [2.0, 2.0, 2.0, 0.0]
    assert timeline([crossing()], 11.0, 15.0, width=2.0) == [2.0, 1.0]
