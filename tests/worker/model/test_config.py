"""spec.model as a transformers config: unknown keys, wrong types, unknown model types,
checkpoint directories that are not one and config.json files that no config is (too large, nested
too deep, a pipe) are refused on one line, with a reason; sizes are checked after defaults."""
import json
import os
import time

import pytest

from weightsync.job import Model, SpecError
from weightsync.model import build as model
from weightsync.model.config import config_of, known_keys

GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16}


def refusal(spec: Model) -> str:
    with pytest.raises(SpecError) as err:
        config_of(spec)
    message = str(err.value)
    assert "\n" not in message and len(message) < 600
    return message


def test_a_good_config_and_its_aliases():
    assert config_of(Model(config=GPT2)).n_layer == 1
    # GPT-2's config takes the common names too (its attribute_map)
    aliased = {"model_type": "gpt2", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4}
    assert config_of(Model(config=aliased)).n_layer == 3
    assert {"n_layer", "hidden_size", "bos_token_id", "tie_word_embeddings"} <= known_keys(type(config_of(Model(config=GPT2))))


@pytest.mark.parametrize("config, expected", [
    ({"n_layers": 2}, "spec.model.config: unknown key for GPT2Config (model_type gpt2): n_layers (did you mean n_layer?)"),
    ({"n_embed": 2, "qqq": 1}, "unknown keys for GPT2Config (model_type gpt2): n_embed (did you mean n_embd?), qqq"),
    ({"model_type": "bert"}, "BertConfig (model_type bert): n_layer (did you mean num_hidden_layers?), n_embd (did you mean "
                             "hidden_size?), n_head (did you mean num_attention_heads?), n_positions (did you mean "
                             "max_position_embeddings?)"),
])
def test_unknown_keys_are_refused_with_the_closest_known_one(config, expected):
    assert expected in refusal(Model(config={**GPT2, **config}))


@pytest.mark.parametrize("key, value, expected", [
    ("activation_function", 3, "spec.model.config.activation_function: 3 is an int, expected str"),
    ("layer_norm_epsilon", "1e-5", "'1e-5' is a str, expected float (write the number without quotes"),
    ("layer_norm_epsilon", 1, "1 is an int, expected float (write 1.0)"),
    ("bos_token_id", "x", "spec.model.config.bos_token_id: 'x' is a str, expected int | None"),
])
def test_values_of_the_wrong_type_are_refused_with_the_declared_type(key, value, expected):
    assert expected in refusal(Model(config={**GPT2, key: value}))


def test_an_unknown_model_type_gets_a_short_list_of_choices():
    message = refusal(Model(config={"model_type": "gpt3"}))
    assert "spec.model.config.model_type: unknown model type 'gpt3'; did you mean" in message and "gpt2" in message
    assert "transformers builds causal LMs for" in message and " more" in message and len(message) < 400
    assert "has no causal LM in transformers" in refusal(Model(config={"model_type": "t5"}))


def test_sizes_are_checked_with_the_defaults_filled_in():
    # n_head is not written: GPT-2's default, 12, does not divide 64
    assert ("spec.model.config.n_embd: 64 is not divisible by n_head 12"
            in refusal(Model(config={"model_type": "gpt2", "n_embd": 64})))


def test_a_path_that_is_not_a_checkpoint_directory(tmp_path):
    assert "spec.model.path: /nonexistent/x does not exist" in refusal(Model(path="/nonexistent/x"))
    (tmp_path / "file").write_text("")
    assert "is a file; give the checkpoint directory" in refusal(Model(path=str(tmp_path / "file")))
    assert f"{tmp_path} has no config.json" in refusal(Model(path=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    assert "has config.json but no weights" in refusal(Model(path=str(tmp_path)))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text("{")
    assert "config.json cannot be read as JSON" in refusal(Model(path=str(tmp_path)))
    (tmp_path / "config.json").write_text("[1]")
    assert "config.json is not a JSON object" in refusal(Model(path=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"model_type": "nope"}')
    assert "model_type: unknown model type 'nope'" in refusal(Model(path=str(tmp_path)))


def test_a_checkpoint_with_impossible_sizes(tmp_path):
    saved = model.build(Model(config=GPT2, dtype="float32"))
    saved.config.n_layer = -1
    saved.save_pretrained(tmp_path)
    message = refusal(Model(path=str(tmp_path)))
    assert f"spec.model.path ({tmp_path}/config.json).n_layer: -1 must be a positive integer" in message


def checkpoint(tmp_path):
    """A checkpoint directory whose config.json the test writes."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path / "config.json"


def test_a_config_json_larger_than_any_config_is_refused_with_its_size_before_it_is_read(tmp_path):
    """One of 300 MB took a minute and 2 GB before a refusal that gave no reason."""
    with open(checkpoint(tmp_path), "wb") as f:
        f.truncate(300 << 20)  # sparse: read, it would take the memory
    began = time.monotonic()
    message = refusal(Model(path=str(tmp_path)))
    assert time.monotonic() - began < 5
    assert message == (f"invalid WeightTransferJob: spec.model.path: {tmp_path}/config.json: 300 MiB (314572800 bytes), "
                       "more than the 16 MiB (16777216 bytes) that a transformers config.json may be (a model's "
                       "config.json is a few KiB: point at the checkpoint's own)")


@pytest.mark.parametrize("text", ["[" * 520_000 + "]" * 520_000, '{"a":' * 100_000 + "1" + "}" * 100_000])
def test_a_config_json_nested_too_deep_is_refused_on_one_line(tmp_path, text):
    checkpoint(tmp_path).write_text(text)
    assert refusal(Model(path=str(tmp_path))) == (f"invalid WeightTransferJob: spec.model.path: {tmp_path}/config.json: "
                                                  "nested deeper than 100 levels; a config.json is a few levels deep")


def test_a_config_json_that_is_a_pipe_or_a_loop_is_refused_not_waited_on(tmp_path):
    config = checkpoint(tmp_path)
    os.mkfifo(config)
    assert "config.json: not a regular file (a named pipe)" in refusal(Model(path=str(tmp_path)))
    config.unlink()
    config.symlink_to("config.json")
    assert "config.json: a loop of symbolic links" in refusal(Model(path=str(tmp_path)))


def test_an_error_without_a_message_still_gives_a_reason(tmp_path, monkeypatch):
    import transformers

    checkpoint(tmp_path).write_text(json.dumps({"model_type": "gpt2"}))

    def out_of_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", out_of_memory)
    assert refusal(Model(path=str(tmp_path))).endswith(f"transformers cannot read {tmp_path}/config.json: MemoryError")
    assert str(SpecError([""])) == "invalid WeightTransferJob: refused without a reason (a bug in weightsync)"


def test_simulate_reads_a_config_json_within_the_same_bounds(tmp_path):
    from weightsync.plan.simulate import model_config

    config = tmp_path / "config.json"
    config.write_text("[" * 1000 + "]" * 1000)
    with pytest.raises(ValueError, match=f"^--simulate: {config}: nested deeper than 100 levels"):
        model_config(str(tmp_path))
    config.unlink()
    os.mkfifo(config)
    with pytest.raises(ValueError, match=r"not a regular file \(a named pipe\)"):
        model_config(str(config))
