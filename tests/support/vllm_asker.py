"""A client of a vLLM server that asks its generate route over time, as a job's users do while
the server restarts or joins late: what each answer was (the version its tokens name, or the
refusal's status and X-Weightsync-Version), and the runs of the same answer, for the tests that
check what clients see; and a long generation streamed from it while the server loads a version."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from support.vllm import PROMPT, REACH_TIMEOUT


def spans(seen: list[tuple[float, int | None, str | None]]) -> list[tuple[float, float, int | None, str | None]]:
    """Runs of the same answer: (from, to, status, version)."""
    out: list[tuple[float, float, int | None, str | None]] = []
    for t, status, version in seen:
        if out and out[-1][2:] == (status, version):
            out[-1] = (out[-1][0], t, status, version)
        else:
            out.append((t, t, status, version))
    return out


def asked(server: str, job_name: str) -> tuple[int | None, str | None]:
    """(status, version) of one greedy request to the generate route: the version its tokens name,
    or the refusal's X-Weightsync-Version; (None, None) where nothing answered."""
    body = {"model": job_name, "token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "temperature": 0}}
    request = urllib.request.Request(server + "/inference/v1/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            spans = json.loads(response.read())["choices"][0]["weight_versions"]
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("X-Weightsync-Version")
    except (urllib.error.URLError, OSError):
        return None, None
    versions = {span["version"] for span in spans}
    return 200, versions.pop() if len(versions) == 1 else ",".join(sorted(versions))


class Asker:
    """A client of a vLLM server asking its generate route every `every` seconds on a thread of
    its own from its start: what it saw, (seconds since `since`, status or None where nothing
    answered, the version the answer names)."""

    def __init__(self, server: str, job_name: str, every: float, since: float | None = None):
        self.server, self.job_name, self.every = server, job_name, every
        self.since = time.monotonic() if since is None else since
        self.seen: list[tuple[float, int | None, str | None]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._ask, daemon=True)
        self.thread.start()

    def _ask(self) -> None:
        while not self.stopping.is_set():
            self.seen.append((time.monotonic() - self.since, *asked(self.server, self.job_name)))
            self.stopping.wait(self.every)

    def admitted(self) -> bool:
        return any(status == 200 for _, status, _ in self.seen)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(60)

    def refused_until(self, version: str) -> tuple[list, int]:
        """Its refusals (503, naming no version) before its first answer, every answer from then on
        of `version`: (the refusals, the index of the first answer)."""
        first = next(i for i, (_, status, _) in enumerate(self.seen) if status == 200)
        refusals = [(t, s, v) for t, s, v in self.seen[:first] if s is not None]
        assert refusals and all(s == 503 and v == "none" for _, s, v in refusals), \
            f"{self.server} answered before it held the fleet's version: {spans(self.seen[:first])}"
        assert all(s == 200 and v == version for _, s, v in self.seen[first:]), spans(self.seen[first:])
        return refusals, first


def in_flight(server: str, job_name: str, tokens: int = 200) -> tuple[dict, threading.Thread]:
    """A long greedy generation on its way: streamed from vLLM's generate route, and returned once
    its first tokens arrived, so that the engine has taken it whatever the machine's pace (a signal
    that cannot be missed, unlike a scrape of the running requests, which one may run whole
    between). (where the answer will be: its token ids, the final chunk's weight versions and
    finish reason; the thread that reads the rest)."""
    body = {"model": job_name, "token_ids": PROMPT, "stream": True,
            "sampling_params": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    request = urllib.request.Request(server + "/inference/v1/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=REACH_TIMEOUT)
    answer: dict = {"token_ids": []}

    def chunks():
        for line in response:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                choice = json.loads(line[len(b"data: "):])["choices"][0]
                answer["token_ids"] += choice.get("token_ids") or []
                for field in ("weight_versions", "finish_reason"):
                    if choice.get(field):
                        answer[field] = choice[field]
                yield choice

    stream = chunks()
    first = next(stream)
    assert first.get("token_ids"), f"the stream's first chunk carries no token: {first}"

    def rest():
        with response:
            for _ in stream:
                pass

    flight = threading.Thread(target=rest, daemon=True)
    flight.start()
    return answer, flight
