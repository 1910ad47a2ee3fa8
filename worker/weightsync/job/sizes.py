"""Model sizes no model can have: a layer, head, expert, vocabulary or width count that is not a
positive integer or is beyond any model's (so that a typo such as `n_layer: 100000` is refused at
once, not after minutes of building the model it names), or heads that do not divide the width
they share.

transformers accepts these without complaint (`n_layer: -1` builds a model with no layers,
`vocab_size: 0` an embedding with no rows) and the job fails much later, in a rank, with a shape
error. Checked twice: on spec.model.config as written, by the job contract (so the operator
refuses it too, without transformers), and on the whole transformers config once it is resolved,
by the worker and the CLI (so defaults and checkpoint configs are covered). Pure: no torch, no
transformers.
"""

from __future__ import annotations

from typing import Any, Mapping

# What transformers calls a size (its configs' attribute_map names) -> what it counts.
COUNTS = {
    "num_hidden_layers": "the number of layers",
    "num_attention_heads": "the number of attention heads",
    "num_key_value_heads": "the number of key/value heads",
    "hidden_size": "the embedding width",
    "intermediate_size": "the feed-forward width",
    "head_dim": "the width of one attention head",
    "vocab_size": "the vocabulary size",
    "max_position_embeddings": "the number of positions",
    "num_experts": "the number of routed experts",
}

# Beyond any model's, by orders of magnitude (the largest open models have 126 layers, 384 routed
# experts, a width of 16384, a vocabulary of 256000 and 10 million positions).
MAXIMUM = {
    "num_hidden_layers": 1024, "num_attention_heads": 4096, "num_key_value_heads": 4096, "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20, "head_dim": 1 << 14, "vocab_size": 1 << 23, "max_position_embeddings": 1 << 30,
    "num_experts": 1 << 14,
}

# Other spellings of those sizes, as the configs of common model types write them (GPT-2's
# n_layer, T5's num_layers, OPT's ffn_dim, ...). A config class's own attribute_map adds to these.
ALIASES = {
    "n_layer": "num_hidden_layers", "num_layers": "num_hidden_layers",
    "n_head": "num_attention_heads", "num_heads": "num_attention_heads",
    "n_embd": "hidden_size", "d_model": "hidden_size",
    "n_inner": "intermediate_size", "ffn_dim": "intermediate_size",
    "n_positions": "max_position_embeddings",
    "n_routed_experts": "num_experts", "num_local_experts": "num_experts",
}


def canonical_names(config: Mapping[str, Any], attribute_map: Mapping[str, str] | None = None) -> dict[str, str]:
    """For each size named in COUNTS, the key `config` holds it under (the first one, if several)."""
    own = {key: name for name, key in (attribute_map or {}).items()}
    found: dict[str, str] = {}
    for key in config:
        name = own.get(key) or ALIASES.get(key) or key
        if name in COUNTS:
            found.setdefault(name, key)
    return found


def size_problems(config: Mapping[str, Any], where: str = "spec.model.config",
                  attribute_map: Mapping[str, str] | None = None, head_dim_known: bool = False) -> list[str]:
    """What is impossible about the sizes in `config` (keys as the config writes them).

    The width must split evenly into attention heads only where the head width is derived from it:
    with `head_dim_known` (the resolved config, which holds head_dim where the model type has
    one) when head_dim is absent or null; on a config as written, never (a model type may default
    head_dim)."""
    keys = canonical_names(config, attribute_map)
    value = {name: config[key] for name, key in keys.items() if config[key] is not None}
    problems = [f"{where}.{keys[name]}: {v!r} must be a positive integer ({COUNTS[name]})"
                for name, v in value.items() if not _positive_int(v)]
    if problems:
        return problems
    problems = [f"{where}.{keys[name]}: {v} is more than any model has ({COUNTS[name]}: at most {MAXIMUM[name]})"
                for name, v in value.items() if v > MAXIMUM[name]]
    if problems:
        return problems
    heads, kv = value.get("num_attention_heads"), value.get("num_key_value_heads")
    if heads and kv and heads % kv:
        problems.append(f"{where}.{keys['num_attention_heads']}: {heads} attention heads do not split into "
                        f"{keys['num_key_value_heads']} {kv} key/value groups; make it a multiple of {kv}")
    width = value.get("hidden_size")
    if head_dim_known and "head_dim" not in value and heads and width and width % heads:
        problems.append(f"{where}.{keys['hidden_size']}: {width} is not divisible by {keys['num_attention_heads']} "
                        f"{heads} (each attention head gets an equal share of the width); "
                        f"for example {width - width % heads or heads} or {width - width % heads + heads}")
    return problems


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0
