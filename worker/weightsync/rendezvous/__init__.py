"""The job's control plane: the controller's authenticated store (store/), a client of it and the
waits on its keys (channel), the protocol every rank speaks over it (protocol: a rank's side, with
following, an inference rank's following of the rounds; keys: every key; messages: what goes
under the keys, typed; proofs: the HMACs that prove the job's token), and the roster that admits
ranks, watches their heartbeats and lets restarted pods rejoin (roster: the controller's side,
with its rounds, its watch, the job's end and the pods' scaling). Nothing here moves weights, and
nothing imports torch but the store's client, which is a torch.distributed Store."""
