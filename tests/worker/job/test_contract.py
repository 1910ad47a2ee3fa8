"""The job contract: CRD defaults, local validation, the ordinal layout and pod settings."""

import os
import re
import time
from pathlib import Path

import pytest
import yaml

import weightsync.job
from weightsync.job import (
    API_VERSION,
    KIND,
    VLLM_PORT,
    Delta,
    Env,
    Layout,
    Lora,
    Model,
    Pods,
    PodSite,
    SpecError,
    Training,
    ValueFrom,
    Vllm,
    WorkerContext,
    dump_document,
    load_job,
    network_env,
    pod_env,
)


def job(spec=None, name="demo", **top):
    obj = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
           "spec": {"model": {"config": {"model_type": "gpt2"}}, **(spec or {})}}
    obj.update(top)
    return obj


def test_defaults_come_from_the_crd():
    spec = load_job(job()).spec
    assert spec["model"]["dtype"] == "bfloat16"
    assert spec["trainer"] == {"replicas": 1, "procsPerPod": 1, "gpusPerProc": 1, "attachTimeoutSeconds": 1800,
                               "external": False}
    assert spec["inference"] == {"replicas": 1, "procsPerPod": 1, "gpusPerProc": 1, "tensorParallel": 1, "engine": "builtin",
                                 "external": False, "awayGraceSeconds": 900, "maxVersionLag": 0,
                                 "onLoadFailure": "rollBack"}
    assert load_job(job()).inference.max_version_lag == 0
    assert load_job(job()).inference.on_load_failure == "rollBack"
    assert load_job(job({"inference": {"onLoadFailure": "failJob"}})).inference.on_load_failure == "failJob"
    assert load_job(job({"inference": {"maxVersionLag": 2}})).inference.max_version_lag == 2
    assert "command" not in spec["trainer"]  # the built-in trainer
    assert spec["training"]["steps"] == 100 and spec["training"]["learningRate"] == 3.0e-4
    assert spec["transfer"] == {"everySteps": 10, "bucketMB": 64, "verify": "digest", "transport": "auto", "timeoutSeconds": 300,
                                "delta": {"enabled": False, "fullEvery": 10}}
    assert spec["network"]["mode"] == "auto"
    assert spec["network"]["rdma"]["trafficClass"] == 104  # DSCP 26
    assert spec["network"]["tcp"]["socketIfname"] == "^lo,docker0"


def test_the_spec_is_read_once_into_typed_sections():
    j = load_job(job({"trainer": {"replicas": 2, "procsPerPod": 4, "command": ["torchrun", "train.py"],
                                           "args": ["--fsdp"],
                                           "env": [{"name": "A", "value": "1"}, {"name": "B"},
                                                   {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}}]},
                                "inference": {"replicas": 3, "tensorParallelSizes": [2, 1], "gpusPerProc": 0},
                                "transfer": {"bucketMB": 3, "verify": "none"}, "imagePullSecrets": [{"name": "pull"}]}))
    assert j.model == Model(config={"model_type": "gpt2"}, dtype="bfloat16")
    assert (j.trainer.replicas, j.trainer.procs_per_pod, j.trainer.gpus) == (2, 4, 4)
    assert j.trainer.argv == ["torchrun", "train.py", "--fsdp"] and j.trainer.attach_timeout_seconds == 1800
    assert j.trainer.env == {"A": "1", "B": "", "T": ValueFrom({"secretKeyRef": {"name": "s", "key": "t"}})}
    assert j.inference.model_replicas == (2, 1) and j.inference.gpus == 0 and not j.inference.runs_vllm
    assert j.pods("controller") == Pods() and j.pods("trainer") is j.trainer
    assert j.transfer.bucket_bytes == 3 << 20 and j.transfer.timeout == 300.0 and not j.transfer.verify_digest
    assert j.transfer.delta == Delta(enabled=False, full_every=10)
    assert j.training == Training(steps=100, learning_rate=3.0e-4, batch_size=8, seq_len=128, seed=0)
    assert j.network.rdma.traffic_class == 104 and j.network.tcp.socket_ifname == "^lo,docker0"
    assert j.image is None and j.image_pull_policy == "IfNotPresent" and j.image_pull_secrets == ("pull",)
    assert j.layout == Layout(2, 4, 3, 1, (2, 1))
    vllm = load_job(job({"inference": {"engine": "vllm", "vllm": {"port": 8100, "args": ["--x"]}}})).inference
    assert vllm.runs_vllm and vllm.vllm == Vllm(port=8100, args=("--x",), inflight="finish")
    keep = load_job(job({"inference": {"engine": "vllm", "vllm": {"inflight": "keep", "loadAhead": True}}}))
    assert keep.inference.vllm.inflight == "keep" and keep.inference.vllm.load_ahead
    assert load_job(job()).inference.vllm.port == VLLM_PORT and not load_job(job()).trainer.argv
    quantized = load_job(job({"model": {"config": {"model_type": "gpt2"}, "quantization": "fp8"}}))
    assert quantized.model.quantization == "fp8" and load_job(job()).model.quantization is None


def test_a_lora_adapter_is_read_with_its_name_defaulted():
    j = load_job(job({"model": {"path": "/models/llama", "lora": {"rank": 16, "alpha": 32,
                                                                          "targetModules": ["q_proj", "v_proj"]}},
                               "inference": {"engine": "vllm"}}))
    assert j.model.lora == Lora(rank=16, alpha=32.0, target_modules=("q_proj", "v_proj"), name="adapter")
    assert j.model.lora.scaling == 2.0
    assert j.model.lora.targets("model.layers.0.self_attn.q_proj") and not j.model.lora.targets("model.layers.0.mlp.up_proj")
    assert load_job(job()).model.lora is None


def test_defaulting_keeps_what_the_user_set_and_is_idempotent():
    once = load_job(job({"trainer": {"replicas": 3}, "network": {"mode": "tcp"}}))
    assert once.spec["trainer"]["replicas"] == 3 and once.spec["network"]["mode"] == "tcp"
    twice = load_job(once.to_object())
    assert twice == once


@pytest.mark.parametrize("spec,name,expected", [
    ({"model": {}}, "demo", "exactly one of spec.model.config"),
    ({"model": {"config": {"model_type": "gpt2"}, "path": "/m"}}, "demo", "exactly one of spec.model.config"),
    ({"trainer": {"replicas": 0}}, "demo", "spec.trainer.replicas: 0 is less than the minimum of 1"),
    ({"network": {"mode": "infiniband"}}, "demo", "spec.network.mode: 'infiniband' is not one of"),
    ({"model": {"path": "models/x"}}, "demo", "spec.model.path: 'models/x' does not match"),
    ({"model": {"config": {"model_type": "gpt2"}, "quantization": "int4"}}, "demo",
     "spec.model.quantization: 'int4' is not one of ['int8', 'fp8']"),
    ({"model": {"config": {"model_type": "gpt2"}, "quantization": "int8"}, "inference": {"tensorParallel": 1,
      "tensorParallelSizes": [2]}}, "demo",
     "spec.model.quantization with the built-in engine needs inference ranks that hold whole versions"),
    ({"model": {"config": {"model_type": "qwen3_moe"}, "quantization": "fp8"},
      "inference": {"tensorParallel": 2, "engine": "vllm", "gpusPerProc": 0, "vllm": {"expertParallel": True}}}, "demo",
     "spec.model.quantization fp8 with spec.inference.vllm.expertParallel is not supported"),
    ({"model": {"path": "/m", "quantization": "fp8", "lora": {"rank": 8, "alpha": 16, "targetModules": ["q_proj"]}},
      "inference": {"engine": "vllm"}}, "demo", "spec.model.lora goes over int8 base weights only"),
    ({"transfer": {"verify": "sha"}}, "demo", "spec.transfer.verify"),
    ({"transfer": {"transport": "nccl", "delta": {"enabled": True}}}, "demo", "spec.transfer.delta.enabled needs transport tcp"),
    ({"transfer": {"transport": "uccl", "bucketMB": 4096}}, "demo",
     "spec.transfer.bucketMB must be below 4096 with transport uccl"),
    ({"transfer": {"delta": {"fullEvery": 0}}}, "demo", "spec.transfer.delta.fullEvery: 0 is less than the minimum of 1"),
    ({"trainer": {"args": ["--fsdp"]}}, "demo", "spec.trainer.args needs spec.trainer.command"),
    ({"trainer": {"env": [{"name": "A", "value": "1"}]}}, "demo", "spec.trainer.env needs spec.trainer.command"),
    ({"trainer": {"command": []}}, "demo", "spec.trainer.command: [] should be non-empty"),
    ({"trainer": {"command": [""]}}, "demo", "spec.trainer.command.0: '' should be non-empty"),
    ({"trainer": {"command": ["torchrun"], "env": [{"name": "WEIGHTSYNC_ORDINAL", "value": "1"}]}}, "demo",
     "spec.trainer.env[0]: spec.trainer.env may not set WEIGHTSYNC_* variables"),
    ({"trainer": {"command": ["torchrun"], "env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {}}}]}}, "demo",
     "spec.trainer.env[0]: spec.trainer.env entries take value or valueFrom, not both"),
    ({"trainer": {"command": ["torchrun"], "env": [{"name": "A B", "value": "1"}]}}, "demo",
     "spec.trainer.env.0.name: 'A B' does not match"),
    ({"trainer": {"command": ["torchrun"], "attachTimeoutSeconds": 0}}, "demo",
     "spec.trainer.attachTimeoutSeconds: 0 is less than"),
    ({"inference": {"command": ["python"]}}, "demo", "spec.inference.command: unknown field"),
    ({"inference": {"engine": "sglang"}}, "demo", "spec.inference.engine: 'sglang' is not one of"),
    ({"inference": {"onLoadFailure": "retry"}}, "demo", "spec.inference.onLoadFailure: 'retry' is not one of"),
    ({"inference": {"vllm": {"port": 9000}}}, "demo", "spec.inference.vllm needs spec.inference.engine vllm"),
    ({"inference": {"vllm": {"inflight": "keep"}}}, "demo", "spec.inference.vllm needs spec.inference.engine vllm"),
    ({"inference": {"engine": "vllm", "vllm": {"inflight": "abort"}}}, "demo",
     "spec.inference.vllm.inflight: 'abort' is not one of"),
    ({"inference": {"engine": "vllm", "procsPerPod": 2}}, "demo", "every inference pod runs one vLLM server"),
    ({"inference": {"engine": "vllm", "vllm": {"args": ["--max-model-len", "512", "--dtype=float16"]}}}, "demo",
     "spec.inference.vllm.args may not set --model, --dtype"),
    ({"inference": {"engine": "vllm", "vllm": {"args": ["--weight-transfer-config", "{}"]}}}, "demo",
     "spec.inference.vllm.args may not set"),
    ({"inference": {"replicas": 3, "tensorParallel": 2}}, "demo",
     "spec.inference: inference replicas x procsPerPod must be a multiple of tensorParallel"),
    ({"inference": {"tensorParallel": 0}}, "demo", "spec.inference.tensorParallel: 0 is less than the minimum of 1"),
    ({"inference": {"maxVersionLag": -1}}, "demo", "spec.inference.maxVersionLag: -1 is less than the minimum of 0"),
    ({"inference": {"replicas": 2, "procsPerPod": 2, "minAvailable": 5}}, "demo",
     "spec.inference: spec.inference.minAvailable is more than the job's inference ranks"),
    ({"inference": {"minAvailable": 0}}, "demo", "spec.inference.minAvailable: 0 is less than the minimum of 1"),
    ({"inference": {"replicas": 3, "maxReplicas": 2}}, "demo",
     "spec.inference: spec.inference.replicas is more than spec.inference.maxReplicas"),
    ({"inference": {"replicas": 2, "maxReplicas": 3, "tensorParallelSizes": [1, 1]}}, "demo",
     "spec.inference: spec.inference.maxReplicas needs model replicas of one tensor-parallel size"),
    ({"inference": {"engine": "vllm", "external": True, "maxReplicas": 2}}, "demo",
     "spec.inference: spec.inference.maxReplicas scales the inference pods the operator runs"),
    ({"inference": {"replicas": 2, "maxReplicas": 3, "tensorParallel": 2}}, "demo",
     "spec.inference: inference maxReplicas x procsPerPod must be a multiple of tensorParallel"),
    ({"inference": {"replicas": 3, "tensorParallelSizes": [2, 2]}}, "demo",
     "spec.inference: tensorParallelSizes must add up to inference replicas x procsPerPod"),
    ({"inference": {"replicas": 3, "tensorParallel": 3, "tensorParallelSizes": [2, 1]}}, "demo",
     "spec.inference: set either tensorParallel (every model replica) or tensorParallelSizes (each model replica), not both"),
    ({"inference": {"replicas": 2, "tensorParallelSizes": [0, 2]}}, "demo",
     "spec.inference.tensorParallelSizes.0: 0 is less than the minimum of 1"),
    ({"inference": {"replicas": 2, "tensorParallelSizes": [2], "engine": "vllm", "gpusPerProc": 0}}, "demo",
     "spec.inference: with spec.inference.engine vllm, tensorParallelSizes names each server's tensor-parallel size"),
    ({"inference": {"tensorParallel": 2, "engine": "vllm", "gpusPerProc": 2}}, "demo",
     "gpusPerProc is the GPUs of each of a server's tensor-parallel workers - 0 (CPU) or 1"),
    ({"inference": {"replicas": 2, "tensorParallelSizes": [2, 1], "engine": "vllm"}}, "demo",
     "with spec.inference.engine vllm on GPUs (gpusPerProc 1) every server has one tensor-parallel size"),
    ({"model": {"config": {"model_type": "llama", "num_attention_heads": 6}},
      "inference": {"tensorParallel": 4, "engine": "vllm"}}, "demo",
     "every tensor-parallel size must divide spec.model.config.num_attention_heads"),
    ({"model": {"config": {"model_type": "llama", "num_attention_heads": 12, "num_key_value_heads": 4}},
      "inference": {"replicas": 2, "tensorParallelSizes": [6, 1], "engine": "vllm", "gpusPerProc": 0}},
     "demo", "must divide spec.model.config.num_key_value_heads or be a multiple of it"),
    ({"model": {"config": {"model_type": "llama"}, "lora": {"rank": 8, "alpha": 16}}}, "demo",
     "spec.model.lora: 'targetModules' is a required property"),
    ({"model": {"config": {"model_type": "llama"}, "lora": {"rank": 0, "alpha": 16, "targetModules": ["q_proj"]}}},
     "demo", "spec.model.lora.rank: 0 is less than the minimum of 1"),
    ({"model": {"config": {"model_type": "llama"}, "lora": {"rank": 8, "alpha": 0, "targetModules": ["q_proj"]}}},
     "demo", "spec.model.lora.alpha: 0 is less than or equal to the minimum of 0"),
    ({"model": {"config": {"model_type": "llama"}, "lora": {"rank": 8, "alpha": 8, "targetModules": []}}},
     "demo", "spec.model.lora.targetModules: [] should be non-empty"),
    ({"model": {"config": {"model_type": "llama"}, "lora": {"rank": 8, "alpha": 8, "targetModules": ["q.proj"]}}},
     "demo", "spec.model.lora.targetModules.0: 'q.proj' does not match"),
    ({"model": {"config": {"model_type": "llama"}, "lora": {"rank": 8, "alpha": 8, "targetModules": ["q_proj"]}},
      "inference": {"engine": "vllm"}}, "demo", "spec.model.lora with spec.inference.engine vllm needs spec.model.path"),
    ({"model": {"config": {"model_type": "llama"}, "lora": {"rank": 8, "alpha": 8, "targetModules": ["q_proj"]}},
      "inference": {"replicas": 2, "tensorParallel": 2}}, "demo",
     "spec.model.lora with the built-in engine is served by whole model replicas only"),
    ({"model": {"path": "/m", "quantization": "int8", "lora": {"rank": 8, "alpha": 8, "targetModules": ["q_proj"]}}},
     "demo", "spec.model.lora over quantized base weights needs spec.inference.engine vllm"),
    ({"training": {"learningRate": float("nan")}}, "demo", "spec.training.learningRate: nan is not a finite number"),
    ({"training": {"learningRate": float("inf")}}, "demo", "spec.training.learningRate: inf is not a finite number"),
    ({"training": {"steps": 2 ** 63}}, "demo", "spec.training.steps: 9223372036854775808 does not fit in 64 bits (from "
     "-9223372036854775808 to 9223372036854775807)"),
    ({"model": {"config": {"model_type": "gpt2", "n_layer": -(10 ** 50)}}}, "demo",
     "spec.model.config.n_layer: an integer of 167 bits does not fit in 64 bits"),
    ({}, "Demo", "metadata.name must start with a lowercase letter"),
    ({}, "a" * 43, "metadata.name must be at most 42 characters"),
])
def test_invalid_jobs_are_refused_with_what_to_fix(spec, name, expected):
    with pytest.raises(SpecError) as err:
        load_job(job(spec, name=name))
    assert expected in str(err.value)


@pytest.mark.parametrize("model, inference", [
    ({"config": {"model_type": "llama"}, "quantization": "int8"},
     {"replicas": 2, "tensorParallel": 2, "engine": "vllm", "gpusPerProc": 0}),
    ({"config": {"model_type": "llama"}, "quantization": "fp8"},
     {"replicas": 2, "tensorParallelSizes": [2, 1], "engine": "vllm", "gpusPerProc": 0}),
    ({"path": "/m", "lora": {"rank": 8, "alpha": 8, "targetModules": ["q_proj"]}},
     {"tensorParallel": 2, "engine": "vllm", "gpusPerProc": 0, "vllm": {"loadAhead": True}}),
    ({"path": "/m", "quantization": "int8", "lora": {"rank": 8, "alpha": 8, "targetModules": ["q_proj"]}},
     {"tensorParallel": 2, "engine": "vllm", "gpusPerProc": 0}),
])
def test_quantized_and_lora_versions_go_to_tensor_parallel_vllm_servers(model, inference):
    """Quantized weights with their scales, and LoRA adapters (loaded ahead or not, over int8 base
    weights too), into vLLM servers whose workers each hold their slices."""
    loaded = load_job(job({"model": model, "inference": inference}))
    assert loaded.model.quantization == model.get("quantization") and loaded.layout.sliced
    assert (loaded.model.lora is None) == ("lora" not in model)


def test_wrong_kind_is_refused():
    with pytest.raises(SpecError, match="expected weightsync.io/v1alpha1 WeightTransferJob"):
        load_job(job(kind="Job"))


def test_layout_assigns_global_ordinals_and_role_ranks():
    j = load_job(job({"trainer": {"replicas": 2, "procsPerPod": 4}, "inference": {"replicas": 3, "procsPerPod": 2}}))
    layout = j.layout
    assert layout.pods == 6
    assert [layout.role_of(o) for o in range(6)] == ["controller", "trainer", "trainer", "inference", "inference", "inference"]
    assert list(layout.ranks_of(2)) == [4, 5, 6, 7]
    assert list(layout.ranks_of(5)) == [4, 5]
    assert layout.world_size("trainer") == 8 and layout.world_size("inference") == 6
    assert layout.ordinal_of_rank("inference", 5) == 5
    assert j.pod_name(4) == "demo-inference-4"
    assert j.controller_host == "demo-controller-0.demo.default.svc"
    with pytest.raises(ValueError, match="outside this job"):
        layout.role_of(6)
    assert list(layout.tp_group(5)) == [5]
    tp = load_job(job({"inference": {"replicas": 2, "procsPerPod": 2, "tensorParallel": 4}})).layout
    assert list(tp.tp_group(2)) == [0, 1, 2, 3] and tp.tensor_parallel == (4,) and tp.sliced
    mixed = load_job(job({"inference": {"replicas": 2, "procsPerPod": 2, "tensorParallelSizes": [1, 2, 1]}})).layout
    assert [list(mixed.tp_group(r)) for r in range(4)] == [[0], [1, 2], [1, 2], [3]] and mixed.sliced
    assert not load_job(job({"inference": {"replicas": 2, "tensorParallelSizes": [1, 1]}})).layout.sliced


def test_max_replicas_sizes_the_layout_and_replicas_the_pods_a_role_runs():
    j = load_job(job({"inference": {"replicas": 2, "maxReplicas": 4, "procsPerPod": 2}}))
    assert j.layout.replicas("inference") == 4 and j.layout.world_size("inference") == 8
    assert j.running_pods("inference") == 2 and j.inference.running_ranks == 4
    assert j.running_pods("trainer") == 1 and j.inference.ranks_of_pods(3) == 6
    vllm = load_job(job({"inference": {"engine": "vllm", "replicas": 1, "maxReplicas": 3, "tensorParallel": 2}}))
    assert vllm.layout.tensor_parallel == (2, 2, 2) and vllm.inference.running_ranks == 2
    assert vllm.layout.ranks_of(vllm.layout.first_ordinal("inference") + 2) == range(4, 6)
    fixed = load_job(job({"inference": {"replicas": 2}}))
    assert fixed.inference.capacity == 2 and fixed.layout.world_size("inference") == fixed.inference.running_ranks == 2


def test_network_env_per_mode():
    network = load_job(job({"network": {"rdma": {"hcas": ["mlx5_0", "mlx5_1"]}}})).network
    rdma = network_env(network, "rdma")
    assert rdma["NCCL_IB_DISABLE"] == "0" and rdma["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert rdma["NCCL_IB_TC"] == "104" and rdma["UCCL_P2P_RDMA_GID_INDEX"] == "3"
    tcp = network_env(network, "tcp")
    assert tcp["NCCL_IB_DISABLE"] == "1" and tcp["NCCL_SOCKET_IFNAME"] == "^lo,docker0"
    with pytest.raises(ValueError):
        network_env(network, "auto")


def test_pod_env_takes_what_differs_between_a_cluster_and_a_local_run_from_its_site():
    j = load_job(job({"trainer": {"command": ["torchrun", "train.py"], "env": [{"name": "A", "value": "1"},
                                                                                       {"name": "MASTER_PORT", "value": "7"}]},
                                "network": {"tcp": {"socketIfname": "eth0"}}}))
    site = PodSite(namespace="ns", ordinal="1", pod_name="demo-trainer-1", pod_ip="10.0.0.1", controller_host="ctl",
                            store_port=1, data_port=2, health_port=3, spec_file="/s", token_file="/t", master_addr="m",
                            master_port=4, report_to_kubernetes=False, status_file="/status")
    env = pod_env(j, "trainer", "tcp", site)
    assert env[Env.ORDINAL] == "1" and env[Env.STORE_PORT] == "1" and env[Env.HEALTH_PORT] == "3"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0" and env["MASTER_ADDR"] == "m"
    assert env["MASTER_PORT"] == "7" and list(env)[-1] == "A"  # the command's own come last and win
    assert Env.REPORT_TO_KUBERNETES not in env and "HOME" not in env
    controller = pod_env(j, "controller", "tcp", site)
    assert controller[Env.REPORT_TO_KUBERNETES] == "0" and controller[Env.STATUS_FILE] == "/status"
    assert "NCCL_IB_DISABLE" not in controller and "MASTER_ADDR" not in controller
    inference = pod_env(j, "inference", "tcp", site)
    assert "A" not in inference and "MASTER_ADDR" not in inference and inference["NCCL_IB_DISABLE"] == "1"


def test_worker_context_reads_env_and_files(tmp_path):
    import yaml
    j = load_job(job({"trainer": {"replicas": 2}}))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(j.to_object()))
    (tmp_path / "token").write_bytes(b"0123456789abcdef0123")
    env = {Env.SPEC_FILE: str(tmp_path / "job.yaml"), Env.TOKEN_FILE: str(tmp_path / "token"),
           Env.ORDINAL: "2", Env.CONTROLLER_HOST: "127.0.0.1"}
    ctx = WorkerContext.from_environ(env)
    assert ctx.role == "trainer" and list(ctx.ranks) == [1] and ctx.token == b"0123456789abcdef0123"
    del env[Env.ORDINAL]
    with pytest.raises(SpecError, match="WEIGHTSYNC_ORDINAL is not set"):
        WorkerContext.from_environ(env)


@pytest.mark.parametrize("spec, top, expected", [
    ({"training": {"stpes": 4}}, {}, "spec.training.stpes: unknown field (did you mean steps?)"),
    ({"network": {"rdma": {"gidindex": 3}}}, {}, "spec.network.rdma.gidindex: unknown field (did you mean gidIndex?)"),
    ({"imagePullSecrets": [{"name": "a"}, {"nmae": "b"}]}, {}, "spec.imagePullSecrets[1].nmae: unknown field"),
    ({"trainer": {"replica": 2}}, {}, "spec.trainer.replica: unknown field (did you mean replicas?)"),
    ({"zzz": 1}, {}, "spec.zzz: unknown field (known: image, imagePullPolicy"),
    ({}, {"metadata": {"name": "demo", "lables": {}}}, "metadata.lables: unknown field (did you mean labels?)"),
    ({}, {"stauts": {}}, "stauts: unknown field (did you mean status?)"),
])
def test_unknown_fields_are_refused_as_strict_field_validation_does(spec, top, expected):
    with pytest.raises(SpecError) as err:
        load_job(job(spec, **top))
    assert expected in str(err.value)


def test_fields_the_schema_leaves_open_are_kept():
    spec = {"model": {"config": {"model_type": "gpt2", "anything": 1}},  # checked by the worker against transformers
            "trainer": {"resources": {"limits": {"example.com/device": 1}}, "nodeSelector": {"any/label": "x"},
                        "tolerations": [{"key": "k", "operator": "Exists", "anyField": True}]}}
    loaded = load_job(job(spec, metadata={"name": "demo", "labels": {"a": "b"}, "annotations": {}}))
    assert loaded.spec["model"]["config"]["anything"] == 1
    assert loaded.spec["trainer"]["tolerations"][0]["anyField"] is True


def test_a_stored_job_is_read_without_strictness():
    # What a pod mounts was stored by the API server; a field newer than this worker is no reason to fail.
    loaded = load_job(job({"training": {"newField": 1}}), strict=False)
    assert loaded.spec["training"]["newField"] == 1


def test_every_problem_is_named_on_one_line():
    with pytest.raises(SpecError) as err:
        load_job(job({"trainer": {"replicas": 0}, "training": {"stpes": 1}, "transfer": {"verify": "x"}}))
    message = str(err.value)
    assert "\n" not in message and message.startswith("invalid WeightTransferJob: ")
    assert len(err.value.problems) == 3 and message.count("; ") == 2


def test_a_large_wrong_value_is_named_by_its_type():
    with pytest.raises(SpecError) as err:
        load_job(job({"image": {f"k{i}": i for i in range(500)}}))
    assert "spec.image: a dict is not of type 'string'" in str(err.value) and len(str(err.value)) < 200


@pytest.mark.parametrize("config, expected", [
    ({"n_layer": -1}, "spec.model.config.n_layer: -1 must be a positive integer (the number of layers)"),
    ({"vocab_size": 0}, "spec.model.config.vocab_size: 0 must be a positive integer (the vocabulary size)"),
    ({"num_attention_heads": 8, "num_key_value_heads": 3}, "8 attention heads do not split into num_key_value_heads 3"),
])
def test_impossible_model_sizes_are_refused_by_the_contract(config, expected):
    # The operator refuses these as well: it loads every job through the contract, without transformers.
    with pytest.raises(SpecError, match="spec.model.config") as err:
        load_job(job({"model": {"config": {"model_type": "gpt2", **config}}}))
    assert expected in str(err.value)


@pytest.mark.parametrize("content, expected", [
    ("kind: [", "not valid YAML at line 1, column 8"),
    ("a:\n\tb: 1\n", "not valid YAML at line 2, column 1: a tab; YAML indents with spaces only"),
    ("a: 1\n---\nb: 2\n", "holds 2 YAML documents; put exactly one WeightTransferJob in the file"),
    ("# nothing\n", "holds 0 YAML documents"),
    ("- a\n", "expected one WeightTransferJob object, got a YAML list"),
    (b"\xff\xfe", "not a text file"),
])
def test_job_files_that_are_not_one_yaml_object(tmp_path, content, expected):
    path = tmp_path / "job.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_missing_file_or_a_directory(tmp_path):
    with pytest.raises(SpecError, match="absent.yaml: no such file"):
        load_job(tmp_path / "absent.yaml")
    with pytest.raises(SpecError, match="is a directory; give the path of one WeightTransferJob YAML file"):
        load_job(tmp_path)


def test_a_job_file_whose_aliases_explode_is_refused_before_anything_expands_it(tmp_path):
    """A "billion laughs" in metadata.labels: nine levels of ten aliases each, a few hundred bytes
    that expand to 10^9 values. Refused on one line, at once (counting the aliases is linear)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    labels = "\n".join("    " + line for line in lines)
    path = tmp_path / "job.yaml"
    path.write_text(f"apiVersion: weightsync.io/v1alpha1\nkind: WeightTransferJob\nmetadata:\n  name: bomb\n"
                    f"  labels:\n{labels}\n    bomb: *a8\nspec: {{model: {{config: {{model_type: gpt2}}}}}}\n")
    with pytest.raises(SpecError, match="its aliases expand it past 100000 values; write the job without "
                                                 "nested aliases") as err:
        load_job(path)
    assert "\n" not in str(err.value)
    # an anchor used a few times, as people write YAML, is fine
    path.write_text("apiVersion: weightsync.io/v1alpha1\nkind: WeightTransferJob\nmetadata: {name: fine}\n"
                    "spec:\n  model: {config: &c {model_type: gpt2, n_layer: 1, n_embd: 32, n_head: 2}}\n")
    assert load_job(path).spec["model"]["config"]["n_layer"] == 1


def test_a_job_file_larger_than_an_object_can_be_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("# " + "x" * (1 << 20) + "\n")
    limit = "more than the 1 MiB (1048576 bytes) that one WeightTransferJob YAML file may be (as the API server takes an object)"
    with pytest.raises(SpecError, match=re.escape(f"job.yaml: 1.0 MiB (1048579 bytes), {limit}")):
        load_job(path)
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # a terabyte (sparse): read whole, it would not fit in memory
    with pytest.raises(SpecError, match=re.escape(f"job.yaml: 1024 GiB (1099511627776 bytes), {limit}")):
        load_job(path)
    with pytest.raises(SpecError) as err:  # endless, and no file
        load_job("/dev/zero")
    assert str(err.value) == ("invalid WeightTransferJob: /dev/zero: not a regular file (a character device); give "
                              "the path of one WeightTransferJob YAML file")


def test_a_named_pipe_is_refused_at_once_not_waited_on(tmp_path):
    """open() of a pipe waits for a writer that never comes: refused before it is opened."""
    path = tmp_path / "job.yaml"
    os.mkfifo(path)
    began = time.monotonic()
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert time.monotonic() - began < 5
    assert str(err.value) == (f"invalid WeightTransferJob: {path}: not a regular file (a named pipe); give the path of "
                              "one WeightTransferJob YAML file")


@pytest.mark.parametrize("content, line", [
    ("[" * 520_000 + "]" * 520_000, 1),  # under 1 MiB
    ('{"a":' * 100_000 + "1" + "}" * 100_000, 1),
    ("".join(" " * i + "a:\n" for i in range(300)) + " " * 300 + "1\n", 100),  # by indentation
])
def test_a_job_nested_deeper_than_any_job_is_refused_on_one_line(tmp_path, content, line):
    """PyYAML builds a document recursively: without the bound, Python's RecursionError."""
    path = tmp_path / "job.yaml"
    path.write_text(content)
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == (f"invalid WeightTransferJob: {path}: nested deeper than 100 levels at line {line}; a job "
                              "is a few levels deep: write it without the extra nesting")


def test_an_integer_too_long_for_python_to_read_is_refused_in_one_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: weightsync.io/v1alpha1\nkind: WeightTransferJob\nmetadata: {name: big}\n"
                    f"spec: {{model: {{config: {{model_type: gpt2}}}}, training: {{steps: {'9' * 5000}}}}}\n")
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == (f"invalid WeightTransferJob: {path}: holds an integer too long to read (Exceeds the limit "
                              "(4300 digits) for integer string conversion: value has 5000 digits); a job's integers "
                              "fit in 64 bits")


def test_the_spec_a_pod_reads_keeps_strings_that_look_like_numbers(tmp_path):
    """The defaulted job as a pod reads it (the ConfigMap, the local runner's file), written and
    read back as kubectl reads YAML: a command's arguments such as `3e-3` stay strings, where
    PyYAML's YAML 1.1 would write them plain and kubectl's reading make them numbers."""
    j = load_job({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "strings"},
                           "spec": {"model": {"config": {"model_type": "gpt2"}},
                                    "trainer": {"command": ["python", "train.py"],
                                                "args": ["--lr", "3e-3", "1e5", ".5", "-2", "007", "1.0"]}}})
    path = tmp_path / "job.yaml"
    path.write_text(dump_document(j.to_object()))
    again = load_job(path)
    assert again.trainer.args == ("--lr", "3e-3", "1e5", ".5", "-2", "007", "1.0")
    assert again.spec == j.spec


def test_choices_are_summarised():
    from weightsync.job.schema import choices

    assert choices(["a", "b"]) == "a, b"
    assert choices([str(i) for i in range(100)], limit=3) == "0, 1, 2 and 97 more"


def test_the_contract_checks_without_torch_or_transformers():
    # The operator loads every job through the contract, and its image has neither.
    import subprocess
    import sys

    code = ("import sys; from weightsync.job import API_VERSION, KIND, SpecError, load_job\n"
            "try:\n"
            "    load_job({'apiVersion': API_VERSION, 'kind': KIND, 'metadata': {'name': 'x'},\n"
            "              'spec': {'model': {'config': {'model_type': 'gpt2', 'n_layer': 0}}}})\n"
            "except SpecError as e:\n"
            "    print(e)\n"
            "print(sorted({'torch', 'transformers'} & sys.modules.keys()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["invalid WeightTransferJob: spec.model.config.n_layer: 0 must be a positive integer (the number of layers)",
                   "[]"]


def test_numbers_in_a_job_file_are_read_as_kubectl_reads_them(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: weightsync.io/v1alpha1\nkind: WeightTransferJob\nmetadata: {name: demo}\n"
                    "spec:\n  model: {config: {model_type: gpt2, layer_norm_epsilon: 1e-5, name: '2e-3'}}\n"
                    "  training: {learningRate: 1e-5, steps: 80}\n")
    spec = load_job(path).spec
    assert spec["training"]["learningRate"] == 1e-5 and spec["training"]["steps"] == 80
    assert spec["model"]["config"]["layer_norm_epsilon"] == 1e-5 and spec["model"]["config"]["name"] == "2e-3"


def test_a_vllm_servers_tensor_parallel_workers_are_its_pods_ranks():
    """engine vllm: every inference pod runs one server, one model replica, its workers the ranks."""
    j = load_job(job({"model": {"config": {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}},
                               "trainer": {"replicas": 2},
                               "inference": {"replicas": 3, "tensorParallelSizes": [2, 1, 4], "engine": "vllm",
                                             "gpusPerProc": 0}}))
    layout = j.layout
    assert [list(layout.ranks_of(o)) for o in layout.ordinals("inference")] == [[0, 1], [2], [3, 4, 5, 6]]
    assert layout.world_size("inference") == 7 and layout.sliced
    assert [layout.ordinal_of_rank("inference", r) for r in range(7)] == [3, 3, 4, 5, 5, 5, 5]
    assert [list(layout.tp_group(r)) for r in (1, 2, 6)] == [[0, 1], [2], [3, 4, 5, 6]]
    assert layout.procs_per_pod("inference") == 4  # the most workers a pod's server runs: its data ports
    gpus = load_job(job({"inference": {"replicas": 2, "tensorParallel": 2, "engine": "vllm"}}))
    assert gpus.inference.gpus == 2 and gpus.layout.world_size("inference") == 4


def test_the_running_spec_rule_names_every_field_but_the_inference_replicas():
    """A running job takes a change of spec.inference.replicas alone: the CRD's rule compares every
    other field one by one (CEL cannot compare an object but one field), so a field added to the
    schema must be added to the rule, or it could change on a running job."""
    crd = yaml.safe_load(Path(weightsync.job.__file__).with_name("crd.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    (rule,) = [r["rule"] for r in schema["x-kubernetes-validations"] if "oldSelf.status.phase != 'Running'" in r["rule"]]
    spec = schema["properties"]["spec"]["properties"]
    fields = [f"spec.{k}" for k in spec if k != "inference"] + \
        [f"spec.inference.{k}" for k in spec["inference"]["properties"] if k != "replicas"]
    assert [f for f in fields if f"self.{f} == oldSelf.{f}" not in rule] == []
    assert "self.spec.inference.replicas" not in rule
