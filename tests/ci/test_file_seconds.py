"""The table that orders the suite's files: parsed from a run's --durations output."""

from tests.ci.file_seconds import TABLE, file_seconds


def test_phases_of_each_file_are_summed():
    log = [
        "============================== slowest durations ===============================",
        "62.50s setup    tests/engine/test_core.py::test_a[ngram]",
        "30.25s call     tests/engine/test_core.py::test_a[ngram]",
        "0.40s teardown tests/e2e/test_server.py::test_b",
        "(12 durations < 0.005s hidden.  Use -vv to show these durations.)",
        "FAILED tests/e2e/test_server.py::test_b - assert 1 == 2",
    ]
    assert file_seconds(log) == {"tests/engine/test_core.py": 93}


def test_the_table_is_read_as_the_conftest_reads_it():
    import json

    seconds = json.loads(TABLE.read_text())
    assert seconds and all(path.startswith("tests/") for path in seconds)
    assert all(isinstance(s, int) and s > 0 for s in seconds.values())
