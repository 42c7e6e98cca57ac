"""The commands' output lines: the exact bytes print() wrote before, on the right stream."""

from __future__ import annotations

from xlm.entrypoints import console


def test_out_and_err_write_one_line_each_to_their_stream(capsys):
    for text in ("Wrote /tmp/x", "", "two\nlines", "ünï {code}"):
        console.out(text)
        print(text)
        console.err(text)
        captured = capsys.readouterr()
        assert captured.out == 2 * (text + "\n")
        assert captured.err == text + "\n"
