"""The pieces every plug point of another RL stack stands on (weightsync/integrations/ranks.py),
without that stack: the token a framework's workers share, the jobs such a run can hold, and how a
version handed over as (name, tensor) pairs is put in the job's layout order, each thing that
cannot be refused on one line that says what to fix. (The whole path, with verl's own classes:
test_verl_engine.py.)"""

from __future__ import annotations

import os
import stat

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from weightsync.integrations.ranks import Names, check_job, job_token
from weightsync.job import API_VERSION, KIND, SpecError, load_job

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 64, "max_position_embeddings": 64,
         "tie_word_embeddings": True}


def job(**spec):
    base = {"model": {"config": LLAMA, "dtype": "bfloat16"}, "trainer": {"replicas": 2, "gpusPerProc": 0},
            "inference": {"replicas": 2, "gpusPerProc": 0}, "network": {"mode": "tcp"}}
    for section, fields in spec.items():
        base[section] = {**base.get(section, {}), **fields}
    return load_job({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "rl"}, "spec": base})


@pytest.fixture
def names():
    return Names.of(job())


@pytest.fixture
def state_dict():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA)).state_dict()


def test_the_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", "  0123456789abcdef0123  ")
    assert job_token(None) == b"0123456789abcdef0123"


def test_a_short_or_missing_token_is_refused_saying_what_to_set(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", "short")
    with pytest.raises(ValueError, match=r"^WEIGHTSYNC_TOKEN is shorter than 16 bytes: give every process the same"):
        job_token(None)
    monkeypatch.delenv("WEIGHTSYNC_TOKEN")
    with pytest.raises(ValueError, match=r"^no job token here: set WEIGHTSYNC_TOKEN in every worker's environment"):
        job_token(None)


def test_the_controllers_process_creates_the_token_file_private_and_the_others_read_it(monkeypatch, tmp_path):
    monkeypatch.delenv("WEIGHTSYNC_TOKEN", raising=False)
    path = tmp_path / "token"
    with pytest.raises(ValueError, match=r"token_file .* does not exist here: it must be a path every worker reads"):
        job_token(str(path))  # a rank's read, before any process created it
    made = job_token(str(path), create=True)
    assert len(made) == 64 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert job_token(str(path)) == made and job_token(str(path), create=True) == made  # never replaced
    path.write_text("short")
    with pytest.raises(ValueError, match=r"shorter than 16 bytes: it must hold the job's token"):
        job_token(str(path))


def test_a_job_the_frameworks_ranks_cannot_hold_is_refused_naming_each_field():
    check_job(job())
    with pytest.raises(SpecError) as e:
        check_job(job(trainer={"external": True}, transfer={"delta": {"enabled": True, "fullEvery": 4}}))
    assert e.value.problems == [
        "spec.trainer.external: the framework's processes are this job's trainer ranks; leave it unset",
        "spec.transfer.delta.enabled: a rollout worker keeps no earlier version to patch; set it false"]
    with pytest.raises(SpecError, match="spec.model.quantization: a version through a framework's plug point is the "
                                        "whole model; leave it unset"):
        check_job(job(model={"quantization": "int8"}))


def test_a_version_is_put_in_the_layouts_order_its_tied_weight_once(names, state_dict):
    assert "lm_head.weight" in state_dict and names.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    ordered = names.order(reversed(list(state_dict.items())))  # the alias first: the layout's name is taken
    assert [n for n, _ in ordered] == names.layout.names
    assert all(t.data_ptr() == state_dict[n].data_ptr() for n, t in ordered)  # the tied one under either name


@pytest.mark.parametrize("change, says", [
    (lambda d: d.update({"model.extra.weight": torch.zeros(2)}),
     r"^model.extra.weight: spec.model has no such tensor \(it has 11, the first model.embed_tokens.weight\): the job's "
     r"spec.model must be the model the trainers train$"),
    (lambda d: d.pop("model.norm.weight"),
     r"^1 tensor\(s\) of spec.model were not given, the first model.norm.weight: give every tensor"),
    (lambda d: d.update({"model.norm.weight": torch.zeros(31)}),
     r"^model.norm.weight is \[31\], and spec.model's is \[32\]: the job's spec.model must be"),
])
def test_a_version_that_is_not_the_jobs_model_is_refused_naming_the_tensor(names, state_dict, change, says):
    change(state_dict)
    with pytest.raises(ValueError, match=says):
        names.order(state_dict.items())


def test_a_tensor_given_twice_is_refused(names, state_dict):
    items = list(state_dict.items())
    with pytest.raises(ValueError, match=r"^model.norm.weight was given twice in one version: give each tensor once$"):
        names.order(items + [("model.norm.weight", state_dict["model.norm.weight"])])


def test_a_rank_keeps_only_the_tensors_its_share_overlaps(names, state_dict):
    first, second = names.layout.slots[0], names.layout.slots[1]
    share = names.touched([(first.offset, first.nbytes + 1)])  # one byte into the second tensor
    assert share == {first.name, second.name}
    stand_ins = dict(names.stand_ins(torch.device("cpu")))
    ordered = dict(names.order(state_dict.items(), {n: t for n, t in stand_ins.items() if n not in share}))
    assert ordered[first.name] is state_dict[first.name] and ordered[second.name] is state_dict[second.name]
    held = [t for n, t in ordered.items() if n not in share]
    assert held and all(t.untyped_storage().nbytes() == 2 for t in held)  # one bfloat16 element each
    assert all(tuple(ordered[s.name].shape) == s.shape for s in names.layout.slots)
