"""What a vLLM server the user started is seen to serve, from vLLM's model config alone (no vLLM
needed): the layout it claims its rank with is its weights quantized as it serves them, so a server
on the job's quantized checkpoint matches the trainers' quantized versions, and a server that
quantizes otherwise (or not at all) is refused on one line naming both, before it claims a rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.vllm import LLAMA
from transformers import AutoConfig

from weightsync.job import Model
from weightsync.model.build import meta_layout
from weightsync.vllm_backend.place import quantization_problem, served_layout, served_quantization


def model_config(quantization: str | None, dtype=torch.bfloat16):
    """The fields of vLLM's ModelConfig the place reads: its Hugging Face config, dtype and quantization."""
    return SimpleNamespace(hf_config=AutoConfig.for_model(**LLAMA), dtype=dtype, quantization=quantization)


@pytest.mark.parametrize("fmt,method", [("int8", "compressed-tensors"), ("fp8", "fp8"), (None, None)])
def test_a_server_quantized_as_the_job_says_claims_the_trainers_layout(fmt, method):
    served = model_config(method)
    assert served_quantization(served) == fmt
    assert quantization_problem(Model(config=LLAMA, dtype="bfloat16", quantization=fmt), served) is None
    served_layout(served).check_matches(meta_layout(Model(config=LLAMA, dtype="bfloat16", quantization=fmt)))


@pytest.mark.parametrize("fmt,method,how", [
    ("int8", None, "spec.model.quantization int8 (compressed-tensors) in place; this server serves them unquantized"),
    ("int8", "fp8", "spec.model.quantization int8 (compressed-tensors) in place; this server quantizes them as fp8"),
    (None, "compressed-tensors", "unquantized weights in place; this server quantizes them as compressed-tensors"),
    ("fp8", "awq", "spec.model.quantization fp8 (fp8) in place; this server quantizes them as awq"),
])
def test_a_server_quantized_otherwise_is_refused_on_one_line(fmt, method, how):
    problem = quantization_problem(Model(config=LLAMA, dtype="bfloat16", quantization=fmt), model_config(method))
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"the weightsync backend loads the job's {how}: serve the job's model as spec.model says")
