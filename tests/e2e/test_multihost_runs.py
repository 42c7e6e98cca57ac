"""One TP=4 engine over two processes x two fake CPU devices on 127.0.0.1 (jax.distributed):
`xlm generate` (w8a8-quantized), `xlm run-batch` (LoRA adapters) and `xlm serve` give
TP=1's greedy text; a killed follower makes the leader fail naming it, a rerun completes
every record once; a killed leader makes its follower exit.

Multi-host programs are not saved to the program cache, so every process compiles: each
pod start is costly, and each test starts as few as its behaviours need."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

import xlm
from tests.conftest import fake_devices_env
from tests.e2e.server_utils import bound_port
from tests.engine_args import cli_flags
from tests.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(
    max_model_len=64,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    token_buckets=[16],
    num_gpu_blocks_override=40,
)
FLAGS = cli_flags(ENGINE)
PROMPTS = [f"w{i} w{i + 7} w{i + 30} w{2 * i + 1}" for i in range(12)]
MAX_TOKENS = 8
FAULT_S = 30.0  # the bound on noticing a dead process
PORT_ATTEMPTS = 3
JOINED = "follower process(es) joined"  # the leader's line once its ports are bound


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def expected(model) -> dict[str, str]:
    """TP=1 greedy completions, one device, this process."""
    llm = xlm.LLM(model=model, **ENGINE)
    params = xlm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


PodEnv = Callable[[int, int], dict[str, str]]


class Pod:
    """Two `xlm` processes (process 0 leads) forming one TP=4 engine on 127.0.0.1."""

    def __init__(
        self,
        tmp_path: Path,
        command: list[str],
        leader_extra: list[str] = (),
        pod_env: PodEnv | None = None,
    ):
        # The coordinator's port (and the step channel's two after it) must be known to
        # both processes before the leader binds them, so they cannot come from binding
        # port 0; another process may take them in between: start again on fresh ports.
        # With `pod_env`, each process learns its place from a platform's variables
        # (pod_env(process_id, coordinator port)) instead of the multihost flags.
        self.pod_env = pod_env
        for attempt in range(PORT_ATTEMPTS):
            self._start(tmp_path, command, list(leader_extra))
            if not self._lost_port_race() or attempt == PORT_ATTEMPTS - 1:
                return
            self.close()

    def _start(self, tmp_path: Path, command: list[str], leader_extra: list[str]) -> None:
        port = free_ports(3)
        self.coordinator = f"127.0.0.1:{port}"
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        env = fake_devices_env(2)
        env.update(JAX_PLATFORMS="cpu", XLM_DISABLE_PROGRESS_BARS="1", XLM_LOGGING_LEVEL="INFO")
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        for process_id in (1, 0):
            log = tmp_path / f"process{process_id}-{time.monotonic_ns()}.log"
            multihost = ["-tp=4", "--distributed-executor-backend=multihost"]
            if self.pod_env is None:
                multihost += [
                    f"--coordinator-address={self.coordinator}",
                    "--num-processes=2",
                    f"--process-id={process_id}",
                ]
            else:
                env.update(self.pod_env(process_id, port))
            extra = leader_extra if process_id == 0 else []
            # Each process hashes strings differently, as separate hosts do: anything
            # that must agree across processes may not follow a set's order.
            env["PYTHONHASHSEED"] = str(process_id + 1)
            cmd = [sys.executable, "-m", "xlm.entrypoints.cli", *command, *FLAGS, *multihost]
            self.procs.insert(
                0,
                subprocess.Popen(
                    cmd + extra,
                    stdout=subprocess.PIPE if process_id == 0 else subprocess.DEVNULL,
                    stderr=log.open("w"),
                    env=env,
                    cwd=str(ROOT),
                    text=True,
                    start_new_session=True,  # a "host": its whole process group
                ),
            )
            self.logs.insert(0, log)

    def _lost_port_race(self) -> bool:
        """Wait until the leader has bound its ports and the follower joined (True: the
        leader died because a port was taken)."""
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if JOINED in self.log(0):
                return False
            if self.leader.poll() is not None:
                return "address already in use" in self.log(0).lower()
            time.sleep(0.2)
        return False

    @property
    def leader(self) -> subprocess.Popen:
        return self.procs[0]

    @property
    def follower(self) -> subprocess.Popen:
        return self.procs[1]

    def log(self, process_id: int) -> str:
        return self.logs[process_id].read_text(errors="replace")

    def kill_host(self, process_id: int) -> None:
        os.killpg(self.procs[process_id].pid, signal.SIGKILL)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture
def pods(tmp_path):
    made: list[Pod] = []

    def make(
        command: list[str], leader_extra: list[str] = (), pod_env: PodEnv | None = None
    ) -> Pod:
        made.append(Pod(tmp_path, command, leader_extra, pod_env))
        return made[-1]

    yield make
    for pod in made:
        pod.close()


def wait_healthy(pod: Pod) -> str:
    """The URL of the pod's server once /health answers 200."""
    deadline = time.monotonic() + 900
    while True:
        assert pod.leader.poll() is None, pod.log(0)[-4000:]
        assert time.monotonic() < deadline, "server never became healthy"
        port = bound_port(pod.log(0))
        url = f"http://127.0.0.1:{port}"
        try:
            if port and httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_generate_quantized_over_two_processes_equals_tp1(pods, model):
    """w8a8 over two processes: each quantizes the kernel and scale shards it holds as it
    loads them, and the text is TP=1's w8a8 text (the float path over two processes is
    the run-batch and serve tests')."""
    prompt = PROMPTS[0]
    llm = xlm.LLM(model=model, quantization="w8a8", **ENGINE)
    params = xlm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    del llm
    command = ["generate", "--model", model, prompt, f"--max-tokens={MAX_TOKENS}"]
    pod = pods([*command, "--temperature=0", "--quantization=w8a8"])
    out, _ = pod.leader.communicate(timeout=900)
    assert pod.leader.returncode == 0, pod.log(0)[-4000:]

    # stdout holds the generated text and nothing else: Gloo's C++ connection lines,
    # which used to land inside it, go to stderr (multihost.keep_stdout_for_python).
    assert out.strip() == want.strip()
    assert "quantization w8a8" in pod.log(0) and "quantization w8a8" in pod.log(1)
    assert pod.follower.wait(60) == 0, pod.log(1)[-4000:]
    assert "follower process 1 ready" in pod.log(1)


NUM_RECORDS = 2 * len(PROMPTS)
ADAPTER_NAMES = [None, "a1", "a2", "a3"]  # record i's: ADAPTER_NAMES[i % 4]
LORA_ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=4)


def batch_file(path: Path, model: str) -> None:
    with path.open("w") as f:
        for i in range(NUM_RECORDS):
            prompt = PROMPTS[i % len(PROMPTS)]
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            body["model"] = ADAPTER_NAMES[i % 4] or model
            record = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions"}
            f.write(json.dumps({**record, "body": body}) + "\n")


@pytest.mark.slow
def test_run_batch_with_adapters_survives_a_killed_follower_by_rerun(pods, model, tmp_path):
    """3 LoRA adapters through 2 slots on every process (each writes the same slots in the
    same order); the follower is killed mid-job: the leader fails naming it, and a rerun
    completes every record once with TP=1's text under the same adapters. (One job checks
    both: each pod start compiles every program in both processes.)"""
    from tests.lora.adapters import write_adapter

    loras = []
    for i in (1, 2, 3):
        write_adapter(model, str(tmp_path / f"a{i}"), "llama", seed=30 + i, r=4)
        loras.append(xlm.LoRARequest(f"a{i}", i, str(tmp_path / f"a{i}")))
    llm = xlm.LLM(model=model, **ENGINE, **LORA_ENGINE)
    params = xlm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chosen = [None if ADAPTER_NAMES[i % 4] is None else loras[i % 4 - 1] for i in range(12)]
    outs = llm.generate(PROMPTS, params, lora_request=chosen, use_tqdm=False)
    expected = [o.outputs[0].text for o in outs]  # record i's: expected[i % 12]
    del llm
    assert len(set(expected)) > 1

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    batch_file(inp, model)
    modules = [f"{lo.lora_name}={lo.lora_path}" for lo in loras]
    command = ["run-batch", "-i", str(inp), "-o", str(out), "--model", model]
    command += [*cli_flags(LORA_ENGINE), "--lora-modules", *modules]
    # One request at a time keeps the run going long enough to kill mid-way.
    pod = pods(command, ["--max-concurrency=1", "--disable-log-stats"])
    deadline = time.monotonic() + 900
    while not (out.exists() and out.read_text().count("\n") >= 2):
        assert pod.leader.poll() is None, pod.log(0)[-4000:]
        assert time.monotonic() < deadline, "run-batch wrote nothing"
        time.sleep(0.1)
    pod.kill_host(1)
    killed = time.monotonic()
    try:
        pod.leader.wait(FAULT_S + 15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"leader still running after the follower died:\n{pod.log(0)[-3000:]}")
    assert time.monotonic() - killed < FAULT_S + 15
    assert pod.leader.returncode != 0
    # The leader names the dead follower: its heartbeat went silent, or (async scheduling
    # sends the next step while one is in flight) the step channel found it unreachable.
    log = pod.log(0)
    assert (
        "follower process 1 stopped responding" in log or "follower process 1 is unreachable" in log
    ), log[-3000:]
    deadline = time.monotonic() + 10
    while group_alive(pod.leader.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pod.leader.pid), "the leader left processes behind"
    done_before = out.read_text().count("\n")
    assert 2 <= done_before < NUM_RECORDS

    rerun = pods(command, ["--disable-log-stats"])
    rerun.leader.communicate(timeout=900)
    assert rerun.leader.returncode == 0, rerun.log(0)[-4000:]
    assert rerun.follower.wait(60) == 0, rerun.log(1)[-4000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{i}" for i in range(NUM_RECORDS))
    for r in results:
        i = int(r["custom_id"][1:]) % len(PROMPTS)
        assert r["response"]["body"]["choices"][0]["text"] == expected[i], r["custom_id"]


def tpu_vm_env(process_id: int, port: int) -> dict[str, str]:
    """What a TPU VM's runtime sets on each host (JAX_COORDINATOR_PORT: the free port)."""
    return dict(
        TPU_WORKER_ID=str(process_id),
        TPU_WORKER_HOSTNAMES="127.0.0.1,127.0.0.1",
        JAX_COORDINATOR_PORT=str(port),
    )


# Each platform's variables are mapped to the multihost options without processes
# (tests/test_envs.py: TPU VM, LeaderWorkerSet, Indexed Job); one pod placed by a TPU VM's
# checks that the mapped options start a real engine (tests/e2e/test_examples.py places
# the examples' manifests' pods).
@pytest.mark.slow
def test_same_serve_command_on_each_host_serves_from_host_0_until_its_death(pods, model, expected):
    """`xlm serve` with the same flags on both "hosts", each placed by a TPU VM's variables
    alone: one engine over both, host 0 answers HTTP with TP=1's text, host 1 follows, and
    the follower ends when its leader dies."""
    pod = pods(
        ["serve", model, "--host", "127.0.0.1", "--port", "0"],
        pod_env=tpu_vm_env,
    )
    url = wait_healthy(pod)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    for prompt in PROMPTS[:3]:
        completion = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert completion.choices[0].text == expected[prompt]
    assert "jax.distributed: process 0 of 2, 2 local / 4 global devices" in pod.log(0)
    assert "multihost: follower process 1 ready." in pod.log(1)
    assert "Listening on" not in pod.log(1)
    pod.kill_host(0)
    try:
        pod.follower.wait(FAULT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"follower outlived its leader:\n{pod.log(1)[-3000:]}")
    assert pod.follower.returncode != 0
    # Our heartbeat names the leader; JAX's coordination client (the service lived in the
    # leader) may notice first and end the process itself.
    log = pod.log(1)
    assert "leader process 0 stopped responding" in log or "JAX distributed service" in log


HOST_TIER_LEADER = """
import json, sys, xlm
model, coordinator, out = sys.argv[1:4]
engine = json.loads(sys.argv[4])
llm = xlm.LLM(model=model, tensor_parallel_size=4, distributed_executor_backend="multihost",
              coordinator_address=coordinator, num_processes=2, process_id=0,
              kv_offloading_size=0.001, **engine)
params = xlm.SamplingParams(temperature=0.0, max_tokens=int(sys.argv[5]))
passes = [[o.outputs[0].text for o in llm.generate(sys.argv[6:], params, use_tqdm=False)]
          for _ in range(2)]
stats = llm.get_stats()
json.dump({"passes": passes, "host_hits": stats.host_kv_cache_hits,
           "bytes_to_device": stats.host_kv_bytes_to_device}, open(out, "w"))
"""


@pytest.mark.slow
def test_host_kv_tier_over_two_processes_equals_tp1(model, tmp_path):
    """The host tier's copies ride in the broadcast step: both processes save and load
    their own shards, and a second pass served from the host gives TP=1's text."""
    engine = dict(ENGINE, num_gpu_blocks_override=17)  # one max_model_len request + null
    # Four times each prompt: 16 tokens, three full blocks a hit can serve.
    prompts = [" ".join([p] * 4) for p in PROMPTS]
    params = xlm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    reference = xlm.LLM(model=model, **ENGINE).generate(prompts, params, use_tqdm=False)
    want = [o.outputs[0].text for o in reference]
    coordinator = f"127.0.0.1:{free_ports(3)}"
    env = fake_devices_env(2)
    env.update(JAX_PLATFORMS="cpu", XLM_DISABLE_PROGRESS_BARS="1", XLM_LOGGING_LEVEL="INFO")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "leader.json"
    follower_cmd = [sys.executable, "-m", "xlm.entrypoints.cli", "generate", "--model", model]
    follower_cmd += ["x", *cli_flags(engine), "--kv-offloading-size=0.001", "-tp=4"]
    follower_cmd += ["--distributed-executor-backend=multihost", "--num-processes=2"]
    follower_cmd += [f"--coordinator-address={coordinator}", "--process-id=1"]
    leader_cmd = [sys.executable, "-c", HOST_TIER_LEADER, model, coordinator, str(out)]
    leader_cmd += [json.dumps(engine), str(MAX_TOKENS), *prompts]
    logs = [tmp_path / "leader.log", tmp_path / "follower.log"]
    procs = []
    try:
        for cmd, log in zip((follower_cmd, leader_cmd), logs[::-1]):
            procs.append(
                subprocess.Popen(
                    cmd, stderr=log.open("w"), stdout=subprocess.DEVNULL, env=env, cwd=ROOT
                )
            )
        follower, leader = procs
        assert leader.wait(900) == 0, logs[0].read_text()[-4000:]
        assert follower.wait(60) == 0, logs[1].read_text()[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    run = json.loads(out.read_text())
    assert run["passes"] == [want, want]
    assert run["host_hits"] > 0 and run["bytes_to_device"] > 0
    assert "Host KV tier" in logs[1].read_text()  # the follower sized its own
