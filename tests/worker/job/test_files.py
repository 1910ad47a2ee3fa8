"""The files weightsync reads and writes for a person (job/files.py): anything but a regular file
of a sane size is refused before it is opened, on one line that names it, never read without end
or waited on; an output that cannot be written is said before any work; a document nested too
deep and a log line of any length are handled in bounded time and memory."""

import io
import os
import threading

import pytest

from weightsync.job.files import (
    MAX_DEPTH,
    FileProblem,
    bounded_lines,
    check_regular,
    json_depth_problem,
    output_problem,
    read_regular,
    size_text,
)


def fifo(path):
    os.mkfifo(path)
    return path


def loop(path):
    os.symlink(path.name, path)  # a link to itself
    return path


def returns_quickly(call, seconds=10):
    """call(), failing the test instead of hanging it (a pipe without a writer blocks an open)."""
    result = {}

    def target():
        try:
            result["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still waiting after {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.parametrize("make, says", [
    (fifo, "not a regular file (a named pipe); give the path of a job file"),
    (loop, "a loop of symbolic links; give the path of a job file"),
    (lambda p: p.mkdir() or p, "is a directory; give the path of a job file"),
    (lambda p: p, "no such file"),
])
def test_anything_but_a_regular_file_is_refused_before_it_is_opened(tmp_path, make, says):
    path = make(tmp_path / "job.yaml")
    with pytest.raises(FileProblem) as err:
        returns_quickly(lambda: read_regular(path, 1 << 20, "a job file"))
    assert str(err.value) == f"{path}: {says}"


def test_a_device_is_named_as_what_it_is():
    with pytest.raises(FileProblem, match="^/dev/zero: not a regular file \\(a character device\\)"):
        check_regular("/dev/zero", 1 << 20, "a job file")


def test_a_file_over_the_limit_is_refused_with_its_size_and_the_limit_without_reading_it(tmp_path):
    path = tmp_path / "config.json"
    with open(path, "wb") as f:
        f.truncate(300 << 20)  # sparse: 300 MiB that take no disk, and would take memory if read
    with pytest.raises(FileProblem) as err:
        read_regular(path, 16 << 20, "a config.json", "they are a few KiB")
    assert str(err.value) == (f"{path}: 300 MiB (314572800 bytes), more than the 16 MiB (16777216 bytes) that a "
                              "config.json may be (they are a few KiB)")
    path.write_bytes(b"{}")
    assert read_regular(path, 16 << 20, "a config.json") == b"{}" and check_regular(path, 2, "a config.json") == 2


@pytest.mark.parametrize("make, says", [
    (fifo, "not a regular file (a named pipe); name a file to write"),
    (loop, "a loop of symbolic links; name a file to write"),
    (lambda p: p.mkdir() or p, "is a directory; name a file in it"),
    (lambda p: p.parent / "absent" / p.name, "the folder {parent}/absent does not exist"),
    (lambda p: (p.parent / "file").write_text("") or p.parent / "file" / p.name,
     "a part of its path is not a directory; name a file to write"),
])
def test_an_output_that_cannot_be_written_is_said_before_any_work(tmp_path, make, says):
    path = make(tmp_path / "out.png")
    assert output_problem(path) == says.format(parent=tmp_path)


def test_an_output_that_can_be_written(tmp_path):
    assert output_problem(tmp_path / "out.png") is None
    (tmp_path / "out.png").write_bytes(b"old")
    assert output_problem(tmp_path / "out.png") is None
    os.symlink("elsewhere.png", tmp_path / "link.png")  # a link to a file not there yet: written where it points
    assert output_problem(tmp_path / "link.png") is None


def test_json_nested_too_deep_is_found_without_reading_it():
    assert json_depth_problem("[" * 520_000 + "]" * 520_000) == f"nested deeper than {MAX_DEPTH} levels"
    assert json_depth_problem('{"a":' * 100_000 + "1" + "}" * 100_000) == f"nested deeper than {MAX_DEPTH} levels"
    assert json_depth_problem('{"a": {"b": [1, 2, {"c": 3}]}}') is None
    # brackets inside strings (escaped quotes too) are no nesting
    assert json_depth_problem('{"x": "' + "[" * 500 + '\\"' + "{" * 500 + '"}') is None


def test_lines_longer_than_the_limit_come_as_none_and_are_never_held_whole():
    text = b"short\n" + b"x" * 5000 + b"\nafter\n" + b"y" * 30 + b"\n" + b"last"
    assert list(bounded_lines(io.BytesIO(text), 30)) == [(1, b"short\n"), (2, None), (3, b"after\n"),
                                                         (4, b"y" * 30 + b"\n"), (5, b"last")]


def test_sizes_read_as_a_person_writes_them():
    assert [size_text(n) for n in (512, 3584, 16 << 20, 314572800, 1 << 30)] == \
        ["512 bytes", "3.5 KiB", "16 MiB", "300 MiB", "1 GiB"]
