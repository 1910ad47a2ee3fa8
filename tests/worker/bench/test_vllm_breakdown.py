"""The vLLM benchmark's breakdown: a version's row from the controller's round record, each
phase's median over the versions, and the table that sets the methods side by side. Parsing and
arithmetic only: the times themselves are the benchmark's to measure."""

import pytest
from support.cli import in_process

from weightsync.bench.vllm import PHASES, breakdown, medians, table, version_row


def record(version: int, seconds: float, stall: float, update: float) -> dict:
    """A round record as the controller prints it for a version loaded into vLLM servers."""
    return {"event": "transfer", "version": version, "bytes": 200, "seconds": seconds, "stall_seconds": stall,
            "phases": {"transfer": 0.1, "verify": 0.0001, "staging": 0.002, "pause": 0.03, "start": 0.005,
                       "update": update, "finish": 0.004, "resume": 0.002, "stall": stall, "load": update - 0.01,
                       "applied": 0.0001}}


def test_a_row_takes_the_round_records_phases_and_its_seconds_as_the_total():
    row = version_row(record(3, 0.5, 0.2, 0.19))
    assert row["seconds"] == 0.5 and row["stall"] == 0.2 and row["bytes"] == 200
    assert row["phases"]["total"] == 0.5
    assert row["phases"]["update"] == 0.19 and row["phases"]["load"] == pytest.approx(0.18)


def test_a_record_without_phases_is_refused_by_name():
    rec = record(1, 0.5, 0.2, 0.19)
    del rec["phases"]
    with pytest.raises(KeyError, match="phases"):
        version_row(rec)


def test_medians_are_per_phase_over_the_versions_that_have_it_in_the_order_a_version_goes():
    rows = [{"total": 3.0, "update": 1.0, "pause": 0.1}, {"total": 1.0, "update": 5.0, "pause": 0.3},
            {"total": 2.0, "update": 2.0}, {"total": 4.0, "update": 3.0, "extra": 7.0}]
    got = medians(rows)
    assert got == {"pause": pytest.approx(0.2), "update": 2.5, "total": 2.5, "extra": 7.0}
    assert list(got) == ["pause", "update", "total", "extra"]  # PHASES' order, then the unknown by name
    assert list(PHASES).index("pause") < list(PHASES).index("update") < list(PHASES).index("total")


def test_the_breakdown_sets_the_methods_side_by_side_with_a_dash_where_a_method_has_no_such_phase():
    versions = [version_row(record(v, 0.4 + v / 100, 0.2, 0.15))["phases"] for v in range(1, 4)]
    methods = {"weightsync": {"phases": medians(versions)},
               "disk": {"phases": {"save": 0.3, "pause": 0.02, "reload": 0.2, "version": 0.003, "resume": 0.002,
                                   "load": 0.2, "stall": 0.21, "total": 0.55}}}
    lines = breakdown(methods).splitlines()
    assert lines[0].split() == ["seconds", "(median)", "weightsync", "disk"]
    cells = {line.split(":")[0]: line.split()[-2:] for line in lines[1:]}
    assert cells["transfer"] == ["0.100", "-"]
    assert cells["save"] == ["-", "0.300"]
    assert cells["reload"] == ["-", "0.200"]
    assert cells["update"] == ["0.150", "-"]
    assert cells["stall"] == ["0.200", "0.210"]
    assert cells["total"] == ["0.420", "0.550"]
    assert [line.split(":")[0] for line in lines[1:]] == [k for k in PHASES if k in cells]


def test_the_table_puts_the_summary_above_the_breakdown():
    report = {"model": "Llama", "trainers": 2, "servers": 2, "methods": {
        "weightsync": {"seconds_per_version": 0.4, "stall_seconds": 0.1, "bytes_per_version": 2e8,
                       "speedup_over_disk": 1.25, "phases": {"total": 0.4, "stall": 0.1}},
        "disk": {"seconds_per_version": 0.5, "stall_seconds": 0.2, "bytes_per_version": 2e8,
                 "speedup_over_disk": 1.0, "phases": {"total": 0.5, "stall": 0.2}}}}
    text = table(report)
    summary, details = text.split("\n\n")
    assert "1.25x" in summary.splitlines()[2]
    assert details.splitlines()[-1].split()[-2:] == ["0.400", "0.500"]


def test_the_summary_names_the_step_between_versions():
    report = {"model": "Llama", "trainers": 2, "servers": 2, "step": 2.0, "methods": {
        "disk": {"seconds_per_version": 0.5, "stall_seconds": 0.2, "bytes_per_version": 2e8,
                 "speedup_over_disk": 1.0, "phases": {"total": 0.5, "stall": 0.2}}}}
    assert table(report).splitlines()[0].endswith("2 vLLM servers; 2s between versions")


def test_a_negative_step_is_refused_before_any_server_starts():
    out = in_process("bench", "--vllm", "/no/such/python", "--step", "-1")
    assert out.returncode == 2 and "--step: -1.0 is not a number of seconds (0 or more)" in out.stderr, out.stderr


def test_a_step_without_the_vllm_bench_is_refused():
    out = in_process("bench", "--step", "1")
    assert out.returncode == 2 and "--step: only the --vllm bench waits between versions" in out.stderr, out.stderr
