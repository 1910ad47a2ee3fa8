"""The files weightsync reads or writes for a person (a job file, a checkpoint's config.json, a
controller's log, a picture), checked before they are opened, in one place.

Without these checks a named pipe with no writer hangs the command on open(), a device or a file
of gigabytes is read into memory before any refusal, a document nested a million levels deep
ends in Python's RecursionError, and a loop of symbolic links or a missing folder under an output
is found only after minutes of work. Each reader here says what is wrong with the path in one
line that names it and what to give instead (FileProblem); callers put that line in their own
error. Nothing here imports torch or a third-party package: the operator loads it too.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import BinaryIO, Iterator

# How deep a JSON or YAML document may nest: a job is about 12 levels deep (a pod template's
# affinity), a transformers config 3 or 4; Python's parsers recurse once or more per level and
# stop at about 1000 frames.
MAX_DEPTH = 100
KiB, MiB = 1 << 10, 1 << 20


class FileProblem(ValueError):
    """What is wrong with a path, on one line that names it and says what to give instead."""


def size_text(n: int) -> str:
    """Bytes as a person reads them: 512 bytes, 3.5 KiB, 300.0 MiB, 16 MiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n // size} {unit}" if n % size == 0 else f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def kind_of(mode: int) -> str:
    """What a path that is not a regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"


def reason(error: OSError) -> str:
    """Why the system refused a path, in words that never come out empty."""
    words = {errno.ELOOP: "a loop of symbolic links", errno.ENOTDIR: "a part of its path is not a directory",
             errno.EACCES: "permission denied", errno.ENAMETOOLONG: "its name is too long"}
    return words.get(error.errno) or error.strerror or str(error) or type(error).__name__


def check_regular(path: str | os.PathLike, limit: int | None, what: str, why: str = "") -> int:
    """The size of `path`, a regular file (through symbolic links) of at most `limit` bytes;
    FileProblem naming the path, what it is, and `what` to give instead (with `why` the limit is
    what it is). Nothing is opened: stat() of a pipe or a device never blocks."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileProblem(f"{path}: no such file") from None
    except OSError as e:
        raise FileProblem(f"{path}: {reason(e)}; give the path of {what}") from None
    if stat.S_ISDIR(st.st_mode):
        raise FileProblem(f"{path}: is a directory; give the path of {what}")
    if not stat.S_ISREG(st.st_mode):
        raise FileProblem(f"{path}: not a regular file ({kind_of(st.st_mode)}); give the path of {what}")
    if limit is not None and st.st_size > limit:
        raise FileProblem(too_large(path, st.st_size, limit, what, why))
    return st.st_size


def too_large(path, size: int, limit: int, what: str, why: str = "") -> str:
    return (f"{path}: {size_text(size)} ({size} bytes), more than the {size_text(limit)} ({limit} bytes) that {what} "
            f"may be" + (f" ({why})" if why else ""))


def read_regular(path: str | os.PathLike, limit: int, what: str, why: str = "") -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (check_regular), read with
    that bound: a file that grew past it since, or a path that became a pipe, is refused, not
    read without end (opened without blocking, checked again on the open file)."""
    check_regular(path, limit, what, why)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FileProblem(f"{path}: cannot be read: {reason(e)}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise FileProblem(f"{path}: not a regular file ({kind_of(mode)}); give the path of {what}")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise FileProblem(f"{path}: cannot be read: {reason(e)}") from None
    if len(data) > limit:
        raise FileProblem(too_large(path, len(data), limit, what, why))
    return data


def output_problem(path: str | os.PathLike) -> str | None:
    """Why a file cannot be written at `path`, found before any work that ends in writing it (a
    folder, a pipe or a device there, a loop of symbolic links, a missing folder or one this user
    cannot write in); None if it can be."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        return f"{reason(e)}; name a file to write"
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            return "is a directory; name a file in it"
        if not stat.S_ISREG(st.st_mode):
            return f"not a regular file ({kind_of(st.st_mode)}); name a file to write"
        return None if os.access(path, os.W_OK) else "this user may not write it"
    folder = os.path.dirname(os.path.realpath(path))  # a symbolic link to nothing writes where it points
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"this user cannot write in the folder {folder}"
    return None


# what a JSON document nests with, once its strings (which may hold brackets) are taken out
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_depth_problem(text: str, limit: int = MAX_DEPTH) -> str | None:
    """'nested deeper than N levels' where the JSON text `text` is (Python's reader would end in
    a RecursionError), None where it is not. Linear in the text; counts brackets, so that a text
    that is not JSON at all is left to the reader to refuse."""
    depth = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > limit:
            return f"nested deeper than {limit} levels"
    return None


def bounded_lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(number, line) of every line of a file opened in binary, counted from 1; a line of more
    than `limit` bytes comes as None, read through in pieces and never held whole (a log with a
    line of a gigabyte is read in bounded memory)."""
    number = 0
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        number += 1
        if len(line) > limit and not line.endswith(b"\n"):
            while True:
                rest = f.readline(MiB)
                if not rest or rest.endswith(b"\n"):
                    break
            yield number, None
        else:
            yield number, line
