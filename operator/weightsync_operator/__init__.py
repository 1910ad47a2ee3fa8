"""The weightsync operator. `kopf run -m weightsync_operator` imports this package, which
registers the handlers; render, network, decisions, status, report, tokens and kube are plain
modules the handlers use.

kopf sets up its log before it imports the package; the package then gives every line the shape
of the workers' lines (weightsync/job/logline.py: UTC time to the millisecond, the source, the
job a line is about), so that the operator's log and its jobs' pod logs merge into one story."""

from weightsync.job import logline
from weightsync_operator import handlers  # noqa: F401  (registers the kopf handlers)

logline.restyle("kopf")  # kopf's handlers; nothing where kopf set up no log
