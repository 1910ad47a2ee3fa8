"""Bad input to `weightsync run` / `weightsync plan`, one row per case users met: each is refused
with exit code 2 and one line that says what to fix, no traceback, before any process starts."""
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from support.cli import EXAMPLE, children, example, in_process

MARK = "WS_CLI_ERRORS_RUN"  # inherited by every process the CLI would start


def config(**changes) -> dict:
    """spec.model.config of the example with keys replaced (None removes one)."""
    cfg = dict(example()["spec"]["model"]["config"])
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    return example(**{"model.config": cfg})


def dump(obj) -> str:
    return yaml.safe_dump(obj, sort_keys=False)


def checkpoint_without_config(tmp_path: Path) -> str:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"")
    return dump(example(**{"model.config": None, "model.path": str(tmp_path / "ckpt")}))


def checkpoint_whose_config(write):
    """A job on a checkpoint directory whose config.json `write(path)` makes."""
    def content(tmp_path: Path) -> str:
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"")
        write(tmp_path / "ckpt" / "config.json")
        return dump(example(**{"model.config": None, "model.path": str(tmp_path / "ckpt")}))
    return content


def sparse(size: int):
    def write(path: Path) -> None:
        with open(path, "wb") as f:
            f.truncate(size)  # takes no disk; read whole, it would take the memory
    return write


LORA_ELSEWHERE = dump(example(**{"model.lora": {"rank": 4, "alpha": 8, "targetModules": ["lm_head", "nonexistent_proj"]}}))
# fp8 weights at tensor-parallel size 4: gate_proj's 192 rows per worker cut its 128x128 blocks
FP8_TP4 = dump(example(**{
    "model.config": {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 512, "intermediate_size": 768,
                     "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128},
    "model.quantization": "fp8", "inference.engine": "vllm", "inference.tensorParallel": 4, "inference.gpusPerProc": 0}))
GOOD = EXAMPLE.read_text()

# (id, the job file's content or a function of tmp_path giving it, command, words the message must hold)
ROWS = [
    ("malformed-yaml", GOOD.replace("metadata:\n  name: tcp-example", "metadata: {name: tcp-example"), "run",
     ["not valid YAML", "line 11"]),
    ("tab", GOOD.replace("  name: tcp-example", "\tname: tcp-example"), "run",
     ["not valid YAML", "line 11", "tab", "spaces"]),
    ("two-documents", GOOD + "---\n" + GOOD, "run", ["2 YAML documents", "exactly one WeightTransferJob"]),
    ("directory", "DIRECTORY", "run", ["is a directory", "YAML file"]),
    ("empty-file", "", "plan", ["0 YAML documents"]),
    ("wrong-type-layers", dump(config(n_layer="four")), "run", ["spec.model.config.n_layer", "'four'", "positive integer"]),
    ("wrong-type-float", GOOD.replace("model_type: gpt2,", "model_type: gpt2, layer_norm_epsilon: '1e-5',"), "run",
     ["spec.model.config.layer_norm_epsilon", "expected float", "without quotes"]),
    ("wrong-type-bool", dump(config(tie_word_embeddings="yes")), "plan",
     ["spec.model.config.tie_word_embeddings", "expected bool"]),
    ("unknown-field", GOOD.replace("    steps: 80", "    stpes: 4"), "run",
     ["spec.training.stpes", "unknown field", "did you mean steps"]),
    ("unknown-field-deep", dump(example(**{"network.rdma": {"gidindex": 3}})), "plan",
     ["spec.network.rdma.gidindex", "unknown field", "did you mean gidIndex"]),
    ("config-key-typo", dump(config(n_layers=2, n_layer=None)), "run",
     ["spec.model.config", "n_layers", "GPT2Config", "did you mean n_layer"]),
    ("bert-with-gpt2-keys", dump(config(model_type="bert")), "run",
     ["BertConfig", "n_layer (did you mean num_hidden_layers?)", "n_embd (did you mean hidden_size?)"]),
    ("negative-layers", dump(config(n_layer=-1)), "run", ["spec.model.config.n_layer", "-1", "positive integer", "layers"]),
    ("zero-vocab", dump(config(vocab_size=0)), "run", ["spec.model.config.vocab_size", "positive integer"]),
    ("width-not-divisible", dump(config(n_embd=250)), "run", ["spec.model.config.n_embd", "250", "not divisible by n_head 4"]),
    ("unknown-model-type", dump(config(model_type="gpt3")), "plan",
     ["unknown model type 'gpt3'", "did you mean", "gpt2", "more"]),
    ("missing-path", dump(example(**{"model.config": None, "model.path": "/nonexistent/model"})), "run",
     ["spec.model.path", "/nonexistent/model does not exist", "checkpoint directory"]),
    ("path-without-config", checkpoint_without_config, "run", ["spec.model.path", "no config.json"]),
    ("job-file-a-pipe", "FIFO", "plan",
     ["not a regular file (a named pipe)", "give the path of one WeightTransferJob YAML file"]),
    ("job-file-a-pipe-run", "FIFO", "run", ["not a regular file (a named pipe)"]),
    ("job-nested-too-deep", "[" * 520_000 + "]" * 520_000, "run", ["nested deeper than 100 levels", "line 1"]),
    ("job-nested-too-deep-map", '{"a":' * 100_000 + "1" + "}" * 100_000, "plan", ["nested deeper than 100 levels"]),
    ("config-json-300-mb", checkpoint_whose_config(sparse(300 << 20)), "run",
     ["spec.model.path", "config.json: 300 MiB (314572800 bytes), more than the 16 MiB"]),
    ("config-json-nested-too-deep", checkpoint_whose_config(lambda p: p.write_text("[" * 520_000 + "]" * 520_000)), "plan",
     ["spec.model.path", "config.json: nested deeper than 100 levels"]),
    ("config-json-a-pipe", checkpoint_whose_config(os.mkfifo), "run", ["config.json: not a regular file (a named pipe)"]),
    ("lora-target-missing", LORA_ELSEWHERE, "run",
     ["spec.model.lora.targetModules: nonexistent_proj names no linear layer", "its linear layers are named lm_head"]),
    ("lora-target-missing-plan", LORA_ELSEWHERE, "plan", ["nonexistent_proj names no linear layer"]),
    ("fp8-slice-cuts-a-block", FP8_TP4, "run",
     ["rows [0, 192) of model.layers.0.mlp.gate_proj.weight [768, 512]", "cut its 128x128 blocks"]),
    ("fp8-slice-cuts-a-block-plan", FP8_TP4, "plan", ["model.layers.0.mlp.gate_proj.weight", "cut its 128x128 blocks"]),
    ("too-big-for-memory", dump(config(vocab_size=4_000_000, n_embd=4096, n_layer=1)), "run",
     ["needs at least", "GiB", "MemAvailable", "2 trainer processes", "AdamW", "make spec.model smaller"]),
]


def processes_marked(mark: str) -> list[int]:
    """Live processes whose environment holds MARK=mark: the CLI and everything it started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (f"{MARK}={mark}".encode() in (entry / "environ").read_bytes().split(b"\0")
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def job_file(tmp_path: Path, content) -> Path:
    job = tmp_path / "job.yaml"
    if content == "DIRECTORY":
        job.mkdir()
    elif content == "FIFO":  # opened, it waits for a writer: the command would hang
        os.mkfifo(job)
    else:
        job.write_text(content(tmp_path) if callable(content) else content)
    return job


def assert_refused(out, command: str, words: list[str]) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"weightsync {command}: "), out.stderr
    assert len(lines[0]) < 600
    for word in words:
        assert word in lines[0]
    assert out.stdout == ""


@pytest.mark.parametrize("content, command, words", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_input_is_refused_on_one_line_before_anything_starts(tmp_path, content, command, words):
    job = job_file(tmp_path, content)
    logs = tmp_path / "logs"
    before = children()
    out = in_process(command, str(job), *(["--logs", str(logs)] if command == "run" else []))
    assert_refused(out, command, words)
    assert not logs.exists(), "a pod's files were written: the job was started"
    assert children() - before == set(), "a process was started"


def test_the_command_a_user_runs_refuses_bad_input_before_any_process_starts(tmp_path):
    """The same, through the command as its own process: its exit code, and nothing it started
    (every process it would start inherits MARK)."""
    _, content, command, words = next(row for row in ROWS if row[0] == "width-not-divisible")
    job, logs, mark = job_file(tmp_path, content), tmp_path / "logs", uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    out = subprocess.run([sys.executable, "-m", "weightsync.cli", command, str(job), "--logs", str(logs)],
                         capture_output=True, text=True, env={**env, MARK: mark}, timeout=120)
    assert_refused(out, command, words)
    assert not logs.exists(), "a pod's files were written: the job was started"
    assert processes_marked(mark) == []
