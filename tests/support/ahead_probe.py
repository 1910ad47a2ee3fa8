"""Run by the vLLM environment's Python (tests/worker/vllm_backend/test_load_ahead.py): vLLM's
engine in this process (its CPU build, no engine-core process), a small Llama for each config in
argv[1] (JSON: {name: config}, one engine after the other, so that vLLM is imported once), and a
few versions loaded ahead (vllm_backend/ahead.py), each prepared on a thread of its own while vLLM
generates (the prepare held once its loaders wrote the shadow, until vLLM answered), then
committed: copied into the served tensors in even versions, swapped with them in odd ones (as on
an eager CPU worker), so that each way follows the other. Prints one JSON line per config and
version: whether the served parameters were still the previous version's after the prepare, and
the greedy tokens before, during and after; saves the version (checkpoint names) and what vLLM
serves after the commit in the folder argv[2]/<name>, for the test to compare. Before version
FAILS_AHEAD, another version's load ahead fails after half of its layers (faults.FAIL_LOAD_ENV,
into the spares the next prepare loads into): its row says whether that raised, and whether vLLM
served on the previous version, bytes and tokens."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process, where the probe reaches it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed import cleanup_dist_env_and_memory  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from weightsync.runtime.faults import FAIL_LOAD_ENV, LoadFault, failing_half  # noqa: E402
from weightsync.vllm_backend.ahead import commit, prepare  # noqa: E402
from weightsync.vllm_backend.served import served_parameters  # noqa: E402

VERSIONS = 4
FAILS_AHEAD = 2  # before this version, another one's load ahead fails part-way


def main(configs: dict[str, dict], out: str) -> int:
    for name, config in configs.items():
        (Path(out) / name).mkdir(parents=True, exist_ok=True)
        probe(name, config, Path(out) / name)  # its engine dropped with its frame
        gc.collect()
        cleanup_dist_env_and_memory()  # the next engine starts as the first did
    return 0


def probe(name: str, config: dict, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="weightsync-ahead-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
        llm = LLM(model=folder, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.05)
        worker = llm.llm_engine.model_executor.driver_worker.worker
        model, model_config = worker.model_runner.model, worker.model_runner.model_config
        with torch.device("meta"):  # the checkpoint's names and shapes (a tied tensor once)
            reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        shapes = {n: p.shape for n, p in reference.named_parameters()}
        sampling = SamplingParams(max_tokens=8, temperature=0, detokenize=False)

        def tokens() -> list[int]:
            out = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], sampling, use_tqdm=False)
            return list(out[0].outputs[0].token_ids)

        spares = None
        for version in range(VERSIONS):
            generator = torch.Generator().manual_seed(version)
            weights = {n: (torch.randn(s, generator=generator) * 0.05).to(torch.bfloat16) for n, s in shapes.items()}
            before, served_before = tokens(), served_parameters(model)
            failed = fail_ahead(model, model_config, shapes, spares, version) if version == FAILS_AHEAD else {}
            if failed:
                failed["tokens_unchanged"] = tokens() == before
            box: dict = {}
            loaded, answered = threading.Event(), threading.Event()

            @contextlib.contextmanager
            def held(root):
                """The loaders' context: once they wrote the version into the shadow, the prepare
                waits until vLLM answered (so that it answers while a version is half-way in)."""
                yield
                loaded.set()
                answered.wait(600)

            thread = threading.Thread(target=lambda: box.update(prepared=prepare(
                model, model_config, list(weights.items()), held, spares)))
            thread.start()
            assert loaded.wait(600), "the prepare never loaded the version into its shadow"
            during = tokens()  # vLLM serves on while the version is prepared
            answered.set()
            thread.join()
            after_prepare = tokens()
            unchanged = all(torch.equal(t, served_before[n]) for n, t in served_parameters(model).items())
            swap = version % 2 == 1
            commit(box["prepared"], model_config, swap=swap)
            spares = box["prepared"].clones  # the next version loads into them, as the engine has it
            torch.save(weights, out / f"v{version}-version.pt")
            torch.save({n: t.contiguous() for n, t in served_parameters(model).items()}, out / f"v{version}-served.pt")
            print(json.dumps({"config": name, "version": version, "swap": swap, "unchanged_after_prepare": unchanged,
                              "before": before, "during": during, "after_prepare": after_prepare, "after": tokens(),
                              **({"failed_ahead": failed} if failed else {})}), flush=True)


def fail_ahead(model, model_config, shapes: dict, spares, version: int) -> dict:
    """Another version's load ahead, armed to fail after half of its layers: whether it raised
    LoadFault, and whether what vLLM serves is the same bytes as before."""
    generator = torch.Generator().manual_seed(1000 + version)
    weights = {n: (torch.randn(s, generator=generator) * 0.05).to(torch.bfloat16) for n, s in shapes.items()}
    served_before = {n: t.clone() for n, t in served_parameters(model).items()}
    os.environ[FAIL_LOAD_ENV] = f"0@{version}"
    try:
        prepare(model, model_config, failing_half(list(weights.items()), 0, version),
                lambda root: contextlib.nullcontext(), spares)
        raised = None
    except LoadFault as e:
        raised = str(e)
    finally:
        del os.environ[FAIL_LOAD_ENV]
    unchanged = all(torch.equal(t, served_before[n]) for n, t in served_parameters(model).items())
    return {"raised": raised, "served_unchanged": unchanged}


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1]), sys.argv[2]))
