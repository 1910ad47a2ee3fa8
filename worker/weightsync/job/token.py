"""The job's token: the secret that every process of one job holds and no one else does, and the
one way weightsync proves that it holds it.

The operator derives a job's token from its own key and the job's uid and keeps it in the job's
Secret; a pod reads it from the file mounted from there (read_token). The token never crosses the
wire: a party proves it holds it with an HMAC-SHA256 (mac) over what it claims, under the token or
a key derived from it, and checks the other side's proof with same(), in constant time. The
rendezvous (rank proofs, the signed plan and endpoints, the store's handshake and frames), the
socket transports' handshake, nccl's hello and the controller's load requests to vLLM servers are
all made with mac; each names its own purpose among its parts, so that a proof made for one can
never pass for another.
"""

from __future__ import annotations

import hmac
import os
import struct
from pathlib import Path

from weightsync.job.spec import SpecError

MIN_BYTES = 16  # a token file holding less is a mistake (an empty Secret, a truncated copy)


def read_token(path: str | os.PathLike) -> bytes:
    """The token in the file at `path` (surrounding whitespace dropped); SpecError if it is too
    short to be one."""
    token = Path(path).read_bytes().strip()
    if len(token) < MIN_BYTES:
        raise SpecError([f"the job token in {path} is shorter than {MIN_BYTES} bytes"])
    return token


def mac(key: bytes, *parts: str | bytes, lengths: str | None = None) -> bytes:
    """HMAC-SHA256 of `parts` under `key` (a str part counts as its UTF-8 bytes). With `lengths`, a
    struct format such as "<Q", each part is preceded by its length in that format, so that no two
    lists of parts are signed as the same bytes; without it the parts are joined as they are (for
    parts of fixed size, or fixed parts that end in a separator)."""
    # One call into OpenSSL over the joined bytes, not an HMAC object fed part by part: the store
    # signs and checks every request and answer with this, and the object's Python layers cost
    # a fifth of what the controller's process spent per request.
    blobs = [part.encode() if isinstance(part, str) else part for part in parts]
    if lengths is not None:
        prefix = struct.Struct(lengths)
        blobs = [b for blob in blobs for b in (prefix.pack(len(blob)), blob)]
    return hmac.digest(key, b"".join(blobs), "sha256")


def same(proof: str | bytes, expected: str | bytes) -> bool:
    """Whether a proof received is the one expected, in time that does not depend on where they
    differ (a str proof is a hex digest)."""
    return hmac.compare_digest(proof, expected)
