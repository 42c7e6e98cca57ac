"""JobStats: one small Ray actor that replicas report to, for the job's closing figures."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class ReplicaStats:
    """What one replica (one Ray actor, across its restarts) did."""

    starts: int = 0
    restarts: int = 0
    rows_started: int = 0
    rows_finished: int = 0
    output_tokens: int = 0
    first_start: float | None = None
    last_finish: float | None = None


class JobStats:
    """Counts per replica: starts, restarts, rows taken and returned, output tokens.

    Rows a replica took but never returned (it died holding them) are the rows Ray
    retried; restarts come from Ray's own `was_current_actor_reconstructed`.
    """

    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaStats] = {}
        self.pids: dict[str, list[int]] = {}
        # Per batch (keyed by its content): attempts so far, the row a careful attempt is
        # running, and the rows during which a careful attempt's replica died.
        self.attempts: dict[str, int] = {}
        self.row_in_flight: dict[str, int] = {}
        self.fatal_rows: dict[str, set[int]] = {}

    def _get(self, replica: str) -> ReplicaStats:
        return self.replicas.setdefault(replica, ReplicaStats())

    def replica_started(self, replica: str, pid: int, restarted: bool) -> None:
        stats = self._get(replica)
        stats.starts += 1
        stats.restarts += int(restarted)
        self.pids.setdefault(replica, []).append(pid)

    def batch_started(self, replica: str, rows: int) -> None:
        stats = self._get(replica)
        stats.rows_started += rows
        if stats.first_start is None:
            stats.first_start = time.time()

    def batch_finished(self, replica: str, rows: int, output_tokens: int) -> None:
        stats = self._get(replica)
        stats.rows_finished += rows
        stats.output_tokens += output_tokens
        stats.last_finish = time.time()

    def begin_batch(self, key: str) -> tuple[int, list[int]]:
        """This attempt's number for the batch, and its rows that killed a replica."""
        self.attempts[key] = self.attempts.get(key, 0) + 1
        row = self.row_in_flight.pop(key, None)
        if row is not None:  # the last attempt died while running this row alone
            self.fatal_rows.setdefault(key, set()).add(row)
        return self.attempts[key], sorted(self.fatal_rows.get(key, ()))

    def row_started(self, key: str, index: int) -> None:
        self.row_in_flight[key] = index

    def row_finished(self, key: str) -> None:
        self.row_in_flight.pop(key, None)

    def end_batch(self, key: str) -> None:
        self.row_in_flight.pop(key, None)

    def replica_pids(self) -> dict[str, list[int]]:
        """Replica -> the pids its process had (one more per restart)."""
        return dict(self.pids)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {key: vars(s).copy() for key, s in self.replicas.items()}

    def num_fatal_rows(self) -> int:
        return sum(len(rows) for rows in self.fatal_rows.values())


def summarize(snapshot: dict[str, dict[str, Any]], rows_out: int, elapsed: float) -> dict[str, Any]:
    """The closing figures: records/s, output tok/s per replica and overall, retries."""
    replicas = []
    for key, s in sorted(snapshot.items()):
        busy = (
            s["last_finish"] - s["first_start"]
            if s["first_start"] is not None and s["last_finish"] is not None
            else 0.0
        )
        replicas.append(
            {
                "replica": key[:12],
                "records": s["rows_finished"],
                "output_tokens": s["output_tokens"],
                "output_tok_per_s": s["output_tokens"] / busy if busy > 0 else 0.0,
                "restarts": s["restarts"],
            }
        )
    rows_started = sum(s["rows_started"] for s in snapshot.values())
    rows_finished = sum(s["rows_finished"] for s in snapshot.values())
    output_tokens = sum(s["output_tokens"] for s in snapshot.values())
    starts = [s["first_start"] for s in snapshot.values() if s["first_start"] is not None]
    finishes = [s["last_finish"] for s in snapshot.values() if s["last_finish"] is not None]
    return {
        "records": rows_out,
        "elapsed_s": elapsed,
        "records_per_s": rows_out / elapsed if elapsed > 0 else 0.0,
        "output_tokens": output_tokens,
        # From the first batch a replica took to the last one returned: engines' start-up
        # (load, compile) excluded.
        "busy_s": max(finishes) - min(starts) if starts and finishes else 0.0,
        "output_tok_per_s": output_tokens / elapsed if elapsed > 0 else 0.0,
        "replica_restarts": sum(s["restarts"] for s in snapshot.values()),
        # Rows a dead replica held, which Ray ran again elsewhere (or on its restart).
        "rows_retried": rows_started - rows_finished,
        "replicas": replicas,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a few lines for the log."""
    lines = [
        f"{summary['records']} records in {summary['elapsed_s']:.1f} s: "
        f"{summary['records_per_s']:.1f} records/s, {summary['output_tok_per_s']:.1f} output "
        f"tok/s overall; {summary['replica_restarts']} replica restarts, "
        f"{summary['rows_retried']} rows retried"
    ]
    for r in summary["replicas"]:
        lines.append(
            f"  replica {r['replica']}: {r['records']} records, {r['output_tokens']} output "
            f"tokens, {r['output_tok_per_s']:.1f} tok/s while busy, {r['restarts']} restarts"
        )
    return "\n".join(lines)
