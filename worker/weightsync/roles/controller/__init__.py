"""The controller's pod (ordinal 0): the Controller that runs the job (driver.py), the plan it makes
of the ranks that joined and the checks that they agree (planning.py), what it reports (records.py:
the records and the job's status; receivers.py: status.receivers) and how it follows a job whose
inference pods are scaled (scaling.py). The rendezvous it hosts is rendezvous/roster.py's."""

from weightsync.roles.controller.driver import Controller, run

__all__ = ["Controller", "run"]
