"""Every reason weightsync gives in a job's status and Events, each with what it means, in one place.

A reason is a CamelCase word that a person or a tool can match on (`kubectl wait
--for=condition=Failed`, an alert); the message beside it says the particulars (which rank, which
child). The job's controller reports why a job failed (status.completion.reason; the roster of
ranks decides the reasons that concern one rank), and the operator makes that the Failed
condition's reason; the operator gives its own conditions theirs. Both sides take the names from
here, so the worker and the operator never spell one differently.

Not here: the reasons Kubernetes gives for a pod that cannot run (Unschedulable, ImagePullBackOff,
FailedCreate, ...), which the Ready condition passes on as they are; and the Events of a new phase
and of the network chosen, whose reason is the phase (Running, Succeeded, Failed) or the condition
(NetworkResolved).
"""

from __future__ import annotations

DESCRIPTIONS: dict[str, str] = {}  # every reason: what it means


def _reason(name: str, description: str) -> str:
    if name in DESCRIPTIONS:
        raise ValueError(f"reason {name} is declared twice")
    DESCRIPTIONS[name] = description
    return name


def describe(reason: str) -> str:
    """What `reason` means; KeyError for a reason weightsync does not give."""
    return DESCRIPTIONS[reason]


# ---------------------------------------------------------------- why a job failed (Failed)
# The controller's, as status.completion.reason; the roster's concern one rank.

RANK_FAILED = _reason("RankFailed", "a trainer or inference rank gave up and said why (the message names the "
                      "rank; where another rank had stopped first, it names that one)")
RANK_LOST = _reason("RankLost", "an inference rank went away (its pod restarting, frozen, or cut off) and did not "
                    "come back within the away limit")
# one reason for a trainer rank's stop, however the controller noticed it first (its silence, its
# process's start again, a peer's failure that its stop explains), which is the machine's timing
TRAINER_STOPPED = _reason("TrainerStopped", "a trainer rank stopped: its process died, froze or lost the network "
                          "(no heartbeat past the trainers' silence limit) or started again after it had joined "
                          "(the message says which); the built-in trainer keeps no checkpoint to resume from, and a "
                          "user's script that resumes from its checkpoint does not when its ranks do not start again, "
                          "nor when an inference rank failed with it")
TRAINERS_DISAGREE = _reason("TrainersDisagree", "the trainer ranks did not publish the same versions: one closed "
                            "while another went on, or closed after another version, or they published one at "
                            "different steps")
CONTROLLER_RESTARTED = _reason("ControllerRestarted", "the controller started again: the rendezvous it hosted, and "
                               "with it every rank's progress, is gone, so the job cannot resume")
VERIFICATION_FAILED = _reason("VerificationFailed", "an inference rank applied a version whose digest is not the "
                              "one the trainers sent, or the trainers sent a version again with other bytes")
SERVER_LOAD_FAILED = _reason("ServerLoadFailed", "a vLLM server did not load a version its rank had received and "
                             "verified, and its workers did not say that their load failed part-way (it refused the "
                             "call, or ran past the transfer's timeout): what it serves may not be what its label says")
LOAD_FAILED = _reason("LoadFailed", "an inference rank's engine failed part-way through loading a version it had "
                      "received and verified (the message names the rank and the error), and "
                      "spec.inference.onLoadFailure is failJob")
CHECKSUM_MISMATCH = _reason("ChecksumMismatch", "bytes reached an inference rank other than their sender "
                            "checksummed them (the network, the memory or the code between changed them): the "
                            "version was never loaded")
TRANSPORT_ERROR = _reason("TransportError", "a rank could not move a version's bytes to or from a peer (a "
                          "connection refused, reset or closed part-way)")
OUT_OF_MEMORY = _reason("OutOfMemory", "a rank ran out of host or device memory")
TIMED_OUT = _reason("TimedOut", "the ranks did not join, send or apply a version within their deadline")
RANKS_DISAGREE = _reason("RanksDisagree", "the ranks do not make one job: different models or transports, or "
                         "holdings from which the version cannot be planned")
TOKEN_PROOF_FAILED = _reason("TokenProofFailed", "a rank, or the controller, could not prove it holds the job's "
                             "token (a token file that differs from the job's Secret, or a store of another job)")
NO_VERSIONS = _reason("NoVersions", "every trainer rank closed without publishing a version")
STORE_FULL = _reason("StoreFull", "the controller's rendezvous store reached one of its bounds (keys or bytes): a "
                     "rank of the job wrote more than a job needs")
WORKERS_FAILED = _reason("WorkersFailed", "the job's controller reported a failure without a reason")
CONTROLLER_ERROR = _reason("ControllerError", "the job's controller failed in a way it does not know: a bug in "
                           "weightsync, not a mistake in the job (the message names the error; the controller's "
                           "log has its traceback)")

# ---------------------------------------------------------------- the operator's conditions

# ChildrenCreated
CREATED = _reason("Created", "the job's Service, Secret, ConfigMap, RBAC objects and StatefulSets match the job")
REPAIRED = _reason("Repaired", "children that had been deleted or changed were put back (also an Event); a "
                   "Secret put back holds the job's own token")
INVALID_SPEC = _reason("InvalidSpec", "the job's spec is not valid; the message says what to fix")
TOKEN_LOST = _reason("TokenLost", "the job's Secret was deleted or changed and its token cannot be restored (the "
                     "operator's token key is not the one the job was created with)")
CHILD_REFUSED = _reason("ChildRefused", "the API server refused a child the job needs")
FORBIDDEN = _reason("Forbidden", "the operator may not write the job's children in its namespace (not one it "
                    "watches); it tries again")
IMAGE_PULL_SECRET_MISSING = _reason("ImagePullSecretMissing", "an image pull secret the job names does not exist; "
                                    "the StatefulSets are created once it does")
OPERATOR_ERROR = _reason("OperatorError", "the operator failed in a way it does not know; it tries again")
# ChildrenCreated reasons that no retry can fix: the job fails.
PERMANENT = frozenset({CHILD_REFUSED, INVALID_SPEC, TOKEN_LOST})

# NetworkResolved
REQUESTED = _reason("Requested", "spec.network.mode named the network mode")
RDMA_NODE_FOUND = _reason("RdmaNodeFound", "network mode auto: a node offers the RDMA resource, so the mode is rdma")
NO_RDMA_NODE = _reason("NoRdmaNode", "network mode auto: no node offers the RDMA resource, so the mode is tcp")

# Ready (besides the reasons Kubernetes gives for a stuck pod)
ALL_PODS_READY = _reason("AllPodsReady", "every pod of the job is ready")
PODS_NOT_READY = _reason("PodsNotReady", "some pods are not ready yet, and none is stuck for a reason someone "
                         "must fix")
FINISHED = _reason("Finished", "the job finished; its StatefulSets are scaled to zero")

# Suspended
SUSPENDED = _reason("Suspended", "spec.suspend is true: the job runs no pods; its status keeps what it delivered")
RESUMED = _reason("Resumed", "spec.suspend turned false: the job starts again from its beginning, in new pods")

# Admitted (a job labelled kueue.x-k8s.io/queue-name)
QUEUED = _reason("Queued", "the job waits in its Kueue queue and runs no pods: the message says why, in Kueue's "
                 "words (quota short, a LocalQueue that does not exist)")
ADMITTED = _reason("Admitted", "Kueue admitted the job: every role's pods start at once, on the flavors it assigned")
EVICTED = _reason("Evicted", "Kueue took the job's admission back (preempted, deactivated): its pods go, its quota is "
                  "given back, and it starts again from its beginning when admitted again")

# Completed
SUCCEEDED = _reason("Succeeded", "every version was delivered to and verified on the inference ranks")
