"""Model sizes no model can have, found in a config as written and in a resolved one."""
import pytest

from weightsync.job.sizes import canonical_names, size_problems


def test_spellings_of_the_same_size_are_recognised():
    assert canonical_names({"n_layer": 2, "n_embd": 64, "other": 1}) == {"num_hidden_layers": "n_layer", "hidden_size": "n_embd"}
    # a config class's own attribute_map (name -> its key) adds to the common spellings
    assert canonical_names({"n_layers": 2}, {"num_hidden_layers": "n_layers"}) == {"num_hidden_layers": "n_layers"}


@pytest.mark.parametrize("config", [
    {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 10},
    {"num_hidden_layers": 1, "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": None},
    {"hidden_size": 65, "num_attention_heads": 2, "head_dim": 32},  # the head width is given, not derived
    {"something_else": -1},
])
def test_possible_sizes_pass(config):
    assert size_problems(config, head_dim_known=True) == []


@pytest.mark.parametrize("config, expected", [
    ({"n_layer": 0}, ["spec.model.config.n_layer: 0 must be a positive integer (the number of layers)"]),
    ({"n_head": True}, ["spec.model.config.n_head: True must be a positive integer (the number of attention heads)"]),
    ({"n_embd": 2.0}, ["spec.model.config.n_embd: 2.0 must be a positive integer (the embedding width)"]),
    ({"vocab_size": -5, "n_positions": 0},
     ["spec.model.config.vocab_size: -5 must be a positive integer (the vocabulary size)",
      "spec.model.config.n_positions: 0 must be a positive integer (the number of positions)"]),
])
def test_counts_must_be_positive_integers(config, expected):
    assert size_problems(config) == expected


def test_the_width_must_split_into_heads_only_where_the_head_width_is_derived():
    config = {"n_embd": 250, "n_head": 4}
    assert size_problems(config) == []  # as written: the model type may have a head_dim of its own
    (problem,) = size_problems(config, "here", head_dim_known=True)
    assert problem.startswith("here.n_embd: 250 is not divisible by n_head 4") and "for example 248 or 252" in problem
    assert size_problems({**config, "head_dim": None}, "here", head_dim_known=True) == [problem]


def test_heads_must_split_into_key_value_groups():
    (problem,) = size_problems({"num_attention_heads": 8, "num_key_value_heads": 3})
    assert "8 attention heads do not split into num_key_value_heads 3 key/value groups" in problem


def test_counts_beyond_any_model_are_refused_at_once():
    """A typo's layer or expert count is refused from the config as written, before any model is built."""
    assert size_problems({"n_layer": 100000}) == [
        "spec.model.config.n_layer: 100000 is more than any model has (the number of layers: at most 1024)"]
    assert size_problems({"n_routed_experts": 1 << 20, "vocab_size": 2 ** 63}) == [
        f"spec.model.config.n_routed_experts: {1 << 20} is more than any model has (the number of routed experts: "
        "at most 16384)",
        f"spec.model.config.vocab_size: {2 ** 63} is more than any model has (the vocabulary size: at most 8388608)"]
    assert size_problems({"num_hidden_layers": 126, "num_experts": 384, "hidden_size": 16384}) == []
