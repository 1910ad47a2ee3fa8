"""The rendezvous store: a small key-value store that only the job's own processes can use.

The controller runs the server; every rank talks to it through a client that is also a
torch.distributed Store, so the trainers' gloo group and the NCCL transport meet through it too.
It replaces torch's TCPStore, which serves anyone who reaches its port (no authentication: a
stranger could read the plan and the endpoints, forge the keys that end a job, or fill the
controller's memory) and whose client's check() ignores the client's timeout (against a controller
stopped with SIGSTOP it blocked far past it). Here:

- A client proves it holds the job's token, bound to the job's identity (namespace/name) and to
  nonces from both sides, before the server reads anything else from it; the server proves the
  same back. Every request and response then carries a strictly increasing sequence number and an
  HMAC under a key derived for this connection alone, so nothing can be altered, replayed,
  reordered, or carried over from another connection or another job. Messages are authenticated,
  not encrypted: the token never crosses the wire, and nothing the store holds is a secret.
- The server binds one address (the pod's own), never every interface, and bounds what a client
  can make it hold: bytes per value, bytes and keys in all, connections, and unauthenticated
  connections, which must prove the token within HANDSHAKE_SECONDS. Going over a bound is an
  error that says which bound.
- Every client call has a deadline: a blocking call (get, wait) is answered by the server before
  the client's timeout, and every send and receive of the client has a socket timeout, so a
  frozen or dead controller is an error within the timeout, never a hang.

The modules: wire (the bytes on the wire, defined in one place), table (the keys and values with
their bounds, and the store's errors), server, client (the only one that imports torch). Nothing
is imported here, so that the server's side stays free of torch.
"""
