"""The job contract: everything several parts of weightsync agree on about a WeightTransferJob,
and nothing else. The operator imports only this package; the worker and the local runner read
from it. No torch, no Kubernetes client.

- spec: reading, defaulting and validating a job (the CRD is the one schema), the names of its
  children, labels and annotations; its typed sections in sections (Model, Training, Transfer,
  Network, ...; job.transfer.bucket_bytes) and role_sections (Pods, Trainer, Inference, ...);
- topology: the ordinal -> role/rank layout;
- pod: what a pod receives (pod_env(), ports, mounts, probes) and the WorkerContext read back;
- schema, sizes: the CRD's schema and CEL rules applied locally, and model size checks;
- yamlfile, errors: a job file read as kubectl reads it, within bounds, and SpecError;
- files: what every reader of a person's file checks first (a regular file of a bounded size, an
  output that can be written, nesting depth, lines of any length);
- token: the job's secret, read and proven (one HMAC for every proof of it);
- join: what a process the user started needs to join as an external rank (three variables);
- states: the phases of a job, the types of its conditions, the states it ends in;
- reasons: every reason a job's status and Events give, with what it means.

The names below are the contract's vocabulary, re-exported so that callers need not know which
module defines each.
"""

from weightsync.job.join import Join, JoinEnv, external_roles, join_env
from weightsync.job.pod import (
                                DATA_PORT,
                                HEALTH_PORT,
                                LIVENESS,
                                MASTER_PORT,
                                MASTER_PORTS,
                                READINESS,
                                SHM_MOUNT,
                                SPEC_KEY,
                                SPEC_MOUNT,
                                STARTUP,
                                STORE_PORT,
                                TMP_MOUNT,
                                TOKEN_KEY,
                                TOKEN_MOUNT,
                                TORCHRUN_VARS,
                                WORKER_UID,
                                WRITABLE_ENV,
                                Env,
                                PodSite,
                                Probe,
                                Value,
                                WorkerContext,
                                master_addr,
                                network_env,
                                pod_env,
                                torchrun_env,
)
from weightsync.job.podtemplate import SCHEDULING_FIELDS, EnvVar, PodTemplate, pod_template_problems
from weightsync.job.role_sections import (
                                BUILTIN,
                                VLLM,
                                VLLM_PORT,
                                Inference,
                                Pods,
                                Trainer,
                                ValueFrom,
                                Vllm,
)
from weightsync.job.sections import (
                                Delta,
                                Lora,
                                Model,
                                Network,
                                Rdma,
                                Tcp,
                                Training,
                                Transfer,
)
from weightsync.job.spec import (
                                ANNOTATION_NETWORK_MODE,
                                ANNOTATION_NETWORK_REASON,
                                ANNOTATION_TOKEN_SHA256,
                                ANNOTATION_WORKER_IMAGE,
                                API_VERSION,
                                GROUP,
                                KIND,
                                LABEL_JOB,
                                LABEL_ROLE,
                                PLURAL,
                                POD_INDEX_LABEL,
                                QUEUE_LABEL,
                                VERSION,
                                Job,
                                SpecError,
                                load_job,
                                read_job_file,
                                schema,
)
from weightsync.job.states import PHASES
from weightsync.job.topology import CONTROLLER, INFERENCE, ROLES, TRAINER, Layout
from weightsync.job.yamlfile import KubectlLoader, dump_document

__all__ = [
    "ANNOTATION_NETWORK_MODE", "ANNOTATION_NETWORK_REASON", "ANNOTATION_TOKEN_SHA256", "ANNOTATION_WORKER_IMAGE",
    "API_VERSION", "BUILTIN", "PHASES", "CONTROLLER", "DATA_PORT", "GROUP", "HEALTH_PORT", "INFERENCE", "KIND", "LABEL_JOB",
    "LABEL_ROLE", "LIVENESS", "MASTER_PORT",
    "MASTER_PORTS", "PLURAL", "POD_INDEX_LABEL", "QUEUE_LABEL", "READINESS", "ROLES", "SHM_MOUNT",
    "SPEC_KEY", "SPEC_MOUNT", "STARTUP", "STORE_PORT", "TMP_MOUNT", "TOKEN_KEY", "TOKEN_MOUNT", "TORCHRUN_VARS", "TRAINER",
    "VERSION", "VLLM", "VLLM_PORT", "WORKER_UID", "WRITABLE_ENV", "Delta", "Env", "Inference", "Job", "KubectlLoader",
    "Join", "JoinEnv", "Layout", "Lora", "Model", "Network", "PodSite", "Pods", "Probe", "Rdma", "SpecError", "Tcp", "Trainer",
    "Training", "Transfer", "Value", "ValueFrom", "Vllm", "WorkerContext", "external_roles", "join_env", "load_job",
    "dump_document", "master_addr", "network_env", "pod_env", "read_job_file", "schema", "torchrun_env",
    "SCHEDULING_FIELDS", "EnvVar", "PodTemplate", "pod_template_problems",
]
