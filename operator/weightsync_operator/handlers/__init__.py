"""kopf's registrations, and only those: settings at start-up, the job itself, the children it
watches, and the Kueue Workloads of queued jobs. What they do is elsewhere: the reconcile in
reconcile.py, the status in status.py and report.py."""

from weightsync_operator.handlers import children, jobs, queued, startup  # noqa: F401
