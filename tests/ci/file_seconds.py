"""Refresh tests/ci/file_seconds.json, the seconds each test file took in a full run, from
that run's output with `--durations=0` (pytest-xdist's workers report each test's phases):

    python -m pytest --durations=0 | tee suite.log
    python -m tests.ci.file_seconds suite.log

tests/conftest.py orders the files by these seconds, longest first, so that `--dist
loadfile` hands its two workers the long files early and the run does not end on one worker
finishing a long file alone. A file missing from the table runs after those in it; the
figures only order the files, no test reads them."""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

TABLE = Path(__file__).with_name("file_seconds.json")
_PHASE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(tests/\S+?\.py)::")


def file_seconds(log_lines) -> dict[str, int]:
    """Seconds per test file, summed over every phase of its tests the log lists."""
    seconds: collections.Counter[str] = collections.Counter()
    for line in log_lines:
        if match := _PHASE.match(line):
            seconds[match.group(2)] += float(match.group(1))
    return {path: round(s) for path, s in sorted(seconds.items()) if round(s) > 0}


def main(argv: list[str]) -> None:
    with open(argv[0]) as log:
        TABLE.write_text(json.dumps(file_seconds(log), indent=0, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
