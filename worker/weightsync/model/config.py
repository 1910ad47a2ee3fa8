"""spec.model as a transformers config, refused with a one-line reason where transformers would
take it silently or fail with a long traceback.

transformers keeps any key it does not know (`n_layers: 2` builds the default 12 layers, GPT-2
keys under `model_type: bert` build bert-base), and its own errors are many lines long (an unknown
model_type lists all 800 of them). Here unknown keys are refused with the key transformers knows
that is closest, values of the wrong type with the type the config class declares, an unknown
model_type with a short list of choices, and a model.path that is not a checkpoint directory
before transformers takes it for a hub repository id; its config.json is read within bounds
(read_config_json: a file of 300 MB took a minute and 2 GB, one nested a million levels deep
ended in a RecursionError). The resolved config (defaults included) then goes through the same
size checks the job contract applies to the config as written.

Worker and CLI only: this imports transformers (the operator checks sizes through the contract).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

from weightsync.job import Model, SpecError
from weightsync.job.files import FileProblem, json_depth_problem, read_regular
from weightsync.job.schema import choices, did_you_mean
from weightsync.job.sizes import ALIASES, size_problems
from weightsync.model.quant import VLLM_METHOD, format_of, quantization_config

WHERE = "spec.model.config"
# Shown first when model_type is unknown, where this transformers has them.
COMMON_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt_neox", "opt")
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
# A checkpoint's config.json is a few KiB; the largest, with per-layer quantization lists, a few
# hundred. A larger one is refused before it is read (one of 300 MB took a minute and 2 GB).
MAX_CONFIG_BYTES = 16 << 20


def config_of(model: Model):
    """The transformers config of spec.model (a config or a checkpoint directory); SpecError if
    it cannot be one or holds sizes no model can have."""
    if model.config is not None:
        config, where = from_mapping(dict(model.config)), WHERE
    else:
        config, where = from_path(model.path), f"spec.model.path ({model.path}/config.json)"
    problems = size_problems(config.to_dict(), where, getattr(config, "attribute_map", None), head_dim_known=True)
    if problems:
        raise SpecError(problems)
    return config


# where a config holds its number of routed experts (qwen2_moe and qwen3_moe, DeepSeek, Mixtral and gpt-oss)
EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def expert_count(config) -> int:
    """The routed experts of each mixture-of-experts layer; 0 for a dense model."""
    return next((int(getattr(config, k)) for k in EXPERT_KEYS if getattr(config, k, None)), 0)


def served_config(model: Model, tensor_parallel: tuple[int, ...] = (), expert_parallel: bool = False):
    """config_of(model) as a vLLM server is given it: with `architectures`, which vLLM builds the
    model from. Where spec.model.config names none, the causal LM of its model_type (transformers'
    auto class; without it vLLM resolves the base model, which it serves for pooling, not
    generation). SpecError, on one line, where an architecture named (spec.model.config's, or
    the checkpoint's config.json's) is not a causal LM, where servers of the tensor-parallel sizes
    `tensor_parallel` with `expert_parallel` (spec.inference.vllm.expertParallel) cannot split the
    model's experts evenly, or where they would split quantized experts by tensor parallelism (a
    worker receives quantized experts whole only)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = config_of(model)
    experts = expert_count(config)
    split = [n for n in tensor_parallel if n > 1]
    if model.quantization and experts and split and not expert_parallel:
        raise SpecError([f"spec.model.quantization {model.quantization}: the {split[0]} tensor-parallel workers of a "
                         f"vLLM server would split every expert of {config.model_type}, and a worker receives quantized "
                         "experts with their scales whole only: set spec.inference.vllm.expertParallel"])
    expert_parallel = tuple(tensor_parallel) if expert_parallel else ()
    if expert_parallel and not experts:
        raise SpecError([f"spec.inference.vllm.expertParallel: model_type {config.model_type} has no experts "
                         f"({', '.join(EXPERT_KEYS)} unset): drop expertParallel"])
    uneven = [n for n in expert_parallel if experts % n]
    if uneven:
        raise SpecError([f"spec.inference.vllm.expertParallel: {experts} experts do not split evenly over the "
                         f"{uneven[0]} tensor-parallel workers of a server: use a tensor-parallel size that divides "
                         f"{experts}"])
    fmt = format_of(model.quantization)
    if fmt is not None:
        method = (getattr(config, "quantization_config", None) or {}).get("quant_method")
        if model.path is None:
            config.quantization_config = quantization_config(fmt)
        elif method != VLLM_METHOD[fmt.name]:
            raise SpecError([f"spec.model.quantization {fmt.name}: spec.model.path ({model.path}/config.json) has "
                             f"{'quantization_config ' + str(method) if method else 'no quantization_config'}, so vLLM "
                             f"would not serve it as {fmt.name}: point spec.model.path at a checkpoint quantized as "
                             f"{VLLM_METHOD[fmt.name]}, or give spec.model.config"])
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]
    named = list(getattr(config, "architectures", None) or [])
    where = WHERE + ".architectures" if model.config is not None else f"spec.model.path ({model.path}/config.json)"
    if not named:
        if model.path is not None:
            raise SpecError([f"{where} names no architecture, so vLLM cannot tell which model to build: add "
                             f'"architectures": ["{causal}"] to it'])
        config.architectures = [causal]
        return config
    every = {n for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((names,) if isinstance(names, str) else names)}
    other = [n for n in named if n not in every]
    if other:
        raise SpecError([f"{where}: {other[0]} is not a causal LM (vLLM would serve it for pooling or "
                         f"classification, not generation); name {causal}, the causal LM of model_type "
                         f"{config.model_type}"])
    return config


def from_mapping(values: dict):
    from transformers import AutoConfig

    model_type = values.get("model_type")
    config_class = _config_class(model_type, f"{WHERE}.model_type")
    known = known_keys(config_class)
    unknown = [f"{key}{_suggest(key, known, config_class)}" for key in values if key not in known]
    if unknown:
        raise SpecError([f"{WHERE}: unknown key{'s' if len(unknown) > 1 else ''} for {config_class.__name__} "
                         f"(model_type {model_type}): {', '.join(unknown)}"])
    try:
        return AutoConfig.for_model(**values)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; each is a bad value here
        raise SpecError([_value_problem(e, values, config_class)]) from None


def from_path(path: str):
    """The config of a checkpoint directory, once it is known to be one (transformers would take
    a missing directory for a hub repository id and say that the id is malformed)."""
    from transformers import AutoConfig

    where = "spec.model.path"
    directory = Path(path)
    if not directory.exists():
        raise SpecError([f"{where}: {path} does not exist (it must be a checkpoint directory, config.json plus "
                         "weights, at this path in every pod; `weightsync run` reads it on this machine)"])
    if not directory.is_dir():
        raise SpecError([f"{where}: {path} is a file; give the checkpoint directory (config.json plus weights)"])
    if not os.path.lexists(directory / "config.json"):
        raise SpecError([f"{where}: {path} has no config.json, so it is not a transformers checkpoint directory "
                         "(save one with model.save_pretrained(DIRECTORY))"])
    if not any(next(directory.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise SpecError([f"{where}: {path} has config.json but no weights ({' or '.join(WEIGHT_FILES)})"])
    try:
        settings = read_config_json(directory / "config.json")
    except FileProblem as e:
        raise SpecError([f"{where}: {e}"]) from None
    _config_class(settings.get("model_type"), f"{where} ({path}/config.json): model_type")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - as in from_mapping
        raise SpecError([f"{where}: transformers cannot read {path}/config.json: {_one_line(e)}"]) from None


def read_config_json(path: str | Path) -> dict:
    """The settings of a transformers config.json, read within bounds (job/files.py: a regular
    file of at most MAX_CONFIG_BYTES, nested at most MAX_DEPTH levels), or FileProblem saying on
    one line what is wrong with it."""
    data = read_regular(path, MAX_CONFIG_BYTES, "a transformers config.json",
                        "a model's config.json is a few KiB: point at the checkpoint's own")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise FileProblem(f"{path}: not a text file (JSON is UTF-8 text)") from None
    deep = json_depth_problem(text)
    if deep:
        raise FileProblem(f"{path}: {deep}; a config.json is a few levels deep")
    try:
        settings = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise FileProblem(f"{path} cannot be read as JSON: {_one_line(e)}") from None
    if not isinstance(settings, dict):
        raise FileProblem(f"{path} is not a JSON object")
    return settings


def known_keys(config_class) -> set[str]:
    """The keys a config class takes: its fields (a dataclass from transformers 5), its
    constructor's parameters (before), what its default instance holds, and its attribute_map
    aliases (GPT-2 takes hidden_size for n_embd)."""
    keys = {"model_type", *getattr(config_class, "attribute_map", {})}
    if dataclasses.is_dataclass(config_class):
        keys |= {f.name for f in dataclasses.fields(config_class)}
    keys |= {name for name, p in inspect.signature(config_class.__init__).parameters.items()
             if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    try:
        keys |= set(config_class().to_dict())
    except Exception:  # noqa: BLE001 - a config with required arguments: its fields and parameters suffice
        pass
    return keys


def _config_class(model_type: Any, where: str):
    """The config class of a model type that transformers can build a causal LM for."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if isinstance(model_type, str) and model_type in causal and model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    if model_type is None:
        what = "missing"
    elif isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        what = f"{model_type} has no causal LM in transformers"
    else:
        what = f"unknown model type {model_type!r}"
    close = [t for t in difflib.get_close_matches(str(model_type), causal, n=3, cutoff=0.6) if t != model_type]
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    examples = [t for t in COMMON_TYPES if t in causal] + [t for t in causal if t not in COMMON_TYPES]
    raise SpecError([f"{where}: {what}; {hint}transformers builds causal LMs for {len(causal)} model types: "
                     f"{choices(examples)}"])


def _suggest(key: str, known: set[str], config_class) -> str:
    """' (did you mean X?)': the key this class uses for the same size (GPT-2's n_layer is
    bert's num_hidden_layers), else the closest spelling."""
    own = {ALIASES.get(k, k): k for k in known}
    own.update(getattr(config_class, "attribute_map", {}))
    same = own.get(ALIASES.get(key, key))
    if same and same != key:
        return f" (did you mean {same}?)"
    return did_you_mean(key, sorted(known))


def _value_problem(error: Exception, values: Mapping, config_class) -> str:
    """One line for a value transformers refused: the field, its value and the type it takes."""
    text = _one_line(error)
    field = re.search(r"field '(\w+)'", text, re.IGNORECASE)
    if field and field.group(1) in values:
        name, value = field.group(1), values[field.group(1)]
        declared = {f.name: f.type for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else {}
        if name in declared:
            return (f"{WHERE}.{name}: {value!r} is {_a(value)}, "
                    f"expected {_type_name(declared[name])}{_hint(value, declared[name])}")
    return f"{WHERE}: transformers refuses it: {text}"


def _type_name(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def _a(value: Any) -> str:
    name = type(value).__name__
    return "null" if value is None else f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _hint(value: Any, annotation: Any) -> str:
    expected = _type_name(annotation)
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", value.strip()):
        return " (write the number without quotes)"
    if isinstance(value, int) and not isinstance(value, bool) and "float" in expected and "int" not in expected:
        return f" (write {value}.0)"
    return ""


def _one_line(error: BaseException) -> str:
    """The error's message on one line of at most 300 characters; its type where it has none
    (a MemoryError has no message)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."
