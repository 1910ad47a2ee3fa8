"""The one error of the job contract: a job the API server would refuse, said on one line."""

from __future__ import annotations

import re


class SpecError(ValueError):
    """A job that the API server would refuse; the message says what to fix, on one line (it is
    printed by the CLI and becomes a condition's message in a cluster)."""

    def __init__(self, problems: list[str]):
        self.problems = [re.sub(r"\s*\n\s*", " ", p) for p in problems]
        super().__init__("invalid WeightTransferJob: " + "; ".join(self.problems))
