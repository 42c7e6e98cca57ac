"""Start a real `xlm serve` subprocess on 127.0.0.1 and wait for it to be healthy."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
# Small, fast engine settings for tests: short context, small KV pool, few buckets (powers
# of two: the default's 1.5x midpoints would add 4 programs to every server's background
# compile, for a bucket policy tests/worker tests on its own).
DEFAULT_ARGS = [
    "--max-model-len",
    "256",
    "--kv-cache-memory",
    "0.1",
    "--max-num-seqs",
    "32",
    "--max-num-batched-tokens",
    "256",
    "--token-buckets",
    "1,2,4,8,16,32,64,128,256",
    "--max-logprobs",
    "5",
]
STARTUP_TIMEOUT_S = 420.0


# `xlm serve --port 0` logs this once its socket is bound: the port comes from the server,
# so no other process can take it between a test choosing it and the server binding it.
LISTENING = re.compile(r"Listening on http://127\.0\.0\.1:(\d+)")


def bound_port(log: str) -> int | None:
    """The port a `--port 0` server logged once bound, if it has."""
    match = LISTENING.search(log)
    return int(match.group(1)) if match else None


class RemoteServer:
    """An `xlm serve` subprocess; its log goes to a temp file shown on failure."""

    def __init__(self, extra_args: list[str] | None = None, model: str = MODEL) -> None:
        self.port: int | None = None
        self.url = ""
        self.log = tempfile.NamedTemporaryFile("w+", prefix="xlm-serve-", suffix=".log")
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("XLM_DISABLE_PROGRESS_BARS", "1")
        env.setdefault("XLM_LOGGING_LEVEL", "INFO")  # the "Listening on" line
        cmd = [
            sys.executable,
            "-m",
            "xlm.entrypoints.cli",
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *DEFAULT_ARGS,
            *(extra_args or []),
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT)
        )
        self._wait_healthy()

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"xlm serve exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            if self.port is None:
                self.log.flush()
                self.port = bound_port(Path(self.log.name).read_text(errors="replace"))
                self.url = f"http://127.0.0.1:{self.port}" if self.port else ""
            if self.port is not None:
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"xlm serve not healthy in {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        """The last lines of the server's output."""
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def child_pids(self) -> list[int]:
        """Direct children of the server process (the engine core among them)."""
        path = f"/proc/{self.proc.pid}/task/{self.proc.pid}/children"
        try:
            return [int(p) for p in Path(path).read_text().split()]
        except OSError:
            return []

    def engine_pid(self) -> int:
        """The pid of the engine-core process."""
        for pid in self.child_pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                return pid
        raise RuntimeError(f"no engine process among children {self.child_pids()}")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """One sample's value from Prometheus text (labels must all match)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric = head.split("{", 1)[0]
        if metric != name:
            continue
        if labels and not all(f'{k}="{v}"' in head for k, v in labels.items()):
            continue
        return float(value)
    return None


def fuzz_for_server_errors(
    url: str,
    headers: dict[str, str] | None = None,
    paths: set[str] | None = None,
    examples=25,
    *,
    call_headers: dict[str, str] | None = None,
    is_wrong: Callable[[Any], bool] | None = None,
) -> tuple[set[str], list[str]]:
    """Schemathesis over a live server's OpenAPI operations (those under `paths`, or all):
    the paths fuzzed and a line per case answered with a 5xx (or for which `is_wrong`
    holds). `call_headers`: the cases' headers where they differ from the schema's."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    headers = dict(headers or {})
    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=headers)
    operations = [result.ok() for result in schema.get_all_operations()]
    operations = [op for op in operations if paths is None or op.path in paths]
    failures: list[str] = []
    for operation in operations:

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def fuzz(case) -> None:
            response = case.call(
                headers=headers if call_headers is None else call_headers, timeout=120
            )
            if response.status_code >= 500 or (is_wrong is not None and is_wrong(response)):
                failures.append(
                    f"{case.method} {case.path} {case.body!r} -> "
                    f"{response.status_code} {response.text[:300]}"
                )

        fuzz()
    return {op.path for op in operations}, failures
