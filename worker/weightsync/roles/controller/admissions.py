"""The controller's word to every vLLM server of the job on the version the fleet serves, which
keeps a server that is behind, or that stopped hearing from the controller, out of the fleet
(vllm_backend/admission.py says what a server does with it).

The word goes to every server the roster knows, whatever its ranks' state: a server whose ranks
are away may still answer its clients (its engine frozen, its API process not), and must learn
that it is behind. It goes at once when a version was delivered, and every RENEW seconds besides,
from a thread of its own with a short deadline per server, so that a server that does not answer
delays neither the others nor the versions; its word runs out (LEASE), which is what it is for.
When the job ends the last word lasts for ever: the servers go on serving the final version to
their clients, and a server that is behind stays out.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from weightsync.rendezvous.roster import Host
from weightsync.vllm_backend.admission import LEASE, RENEW, word
from weightsync.vllm_backend.control import ControlError, Server

CALL_TIMEOUT = 1.0  # seconds a server has to take the word
MOST_AT_ONCE = 32  # servers told at the same time


class Admissions:
    """Tells the job's vLLM servers the version the fleet serves and the lag it accepts."""

    def __init__(self, host: Host, key: str, lag: int, say: Callable[[str], None], driven: frozenset[str] = frozenset()):
        """`driven`: the servers driven from this process otherwise than over HTTP (a vLLM Ray
        actor): no client reaches one but through its owner, so none is told."""
        self.host, self.key, self.lag, self.say, self.driven = host, key, lag, say, driven
        self.current: int | None = None  # the latest version delivered
        self._wake, self._stop = threading.Event(), threading.Event()
        self._warned: set[str] = set()
        self._pool = ThreadPoolExecutor(MOST_AT_ONCE, thread_name_prefix="admission")
        self._thread = threading.Thread(target=self._run, name="admissions", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def delivered(self, version: int) -> None:
        """`version` was delivered: it is the fleet's from now on, and every server hears so at once."""
        self.current = version
        self._wake.set()

    def end(self) -> None:
        """The job ended: every server's last word, for ever."""
        if self._thread.is_alive():
            self._stop.set()
            self._wake.set()
            self._thread.join()
        self.tell(lease=None)
        self._pool.shutdown(wait=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(RENEW)
            self._wake.clear()
            if not self._stop.is_set():
                self.tell()

    def servers(self) -> list[str]:
        """Every vLLM server the roster knows of (the control URL its workers told)."""
        return sorted({s.info.server for s in self.host.seats_now().values()
                       if s.info and s.info.server and s.info.server not in self.driven})

    def tell(self, lease: float | None = LEASE) -> None:
        if self.current is None:  # nothing delivered yet: no server serves a version of the job's
            return
        target = word(self.current, self.lag, lease)
        for url, error in zip(urls := self.servers(), self._pool.map(lambda u: self._tell(u, target), urls)):
            if error is not None and url not in self._warned:  # once per server: it may be down for a while
                self._warned.add(url)
                self.say(f"could not tell the vLLM server at {url} the fleet's version {self.current}: {error}; "
                         f"it serves no client until it hears it again")
            elif error is None:
                self._warned.discard(url)

    def _tell(self, url: str, target: str) -> ControlError | None:
        try:
            Server(url, self.key).call(target, None, CALL_TIMEOUT)
        except ControlError as e:  # gone or frozen; or 404: a server without weightsync's middleware
            return e
        return None
