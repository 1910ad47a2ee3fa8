"""The job's control plane: the controller's authenticated store (store/), the protocol every rank
speaks over it (protocol: the keys and a rank's side; messages: what goes under the keys, typed),
and the roster that admits ranks, watches their heartbeats and lets restarted pods rejoin (roster:
the controller's side). Nothing here moves weights, and nothing imports torch but the store's
client, which is a torch.distributed Store."""
