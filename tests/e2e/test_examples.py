"""The examples run as written (on the built-in SmolLM2, small engine shapes) and print text."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.reference import SMOLLM2_ENGINE, cli_engine_flags
from xlm import envs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    # Same engine shapes as the session's SmolLM2 engine: compiled programs come from the
    # session compilation cache. The model is the example's default (smollm2-135m).
    env = dict(os.environ, XLM_DISABLE_PROGRESS_BARS="1")
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *cli_engine_flags(SMOLLM2_ENGINE), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.slow
def test_offline_inference_example(smollm2_gguf):
    result = run_example("offline_inference.py", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    completions = [
        ast.literal_eval(c) for c in re.findall(r"^Completion: (.*)$", result.stdout, flags=re.M)
    ]
    assert len(completions) == 4
    assert all(c.strip() for c in completions), result.stdout


@pytest.mark.slow
def test_chat_example(smollm2_gguf):
    result = run_example("chat.py", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    match = re.search(r"^Assistant: (.*)$", result.stdout, flags=re.M)
    assert match and match.group(1).strip(), result.stdout


@pytest.mark.slow
def test_structured_outputs_example(smollm2_gguf):
    result = run_example("structured_outputs.py", "--max-tokens", "120")
    assert result.returncode == 0, result.stderr
    lines = dict(re.findall(r"^(JSON|Choice|Regex|Tool call): (.*)$", result.stdout, flags=re.M))
    assert set(lines) == {"JSON", "Choice", "Regex", "Tool call"}, result.stdout
    person = json.loads(lines["JSON"])
    assert isinstance(person["name"], str) and 0 <= person["age"] <= 120
    assert lines["Choice"] in ("yes", "no")
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", lines["Regex"])
    name, arguments = re.fullmatch(r"(\w+)\((.*)\)", lines["Tool call"]).groups()
    assert name == "get_weather" and json.loads(arguments)["unit"] in ("celsius", "fahrenheit")


K8S = EXAMPLES / "k8s"


def _pods(manifest: Path) -> list[tuple[dict, dict[str, str], int]]:
    """Each pod of the manifest's engine: (container, the variables Kubernetes or the
    LeaderWorkerSet controller would set, accelerators it asks for)."""
    import yaml

    pods = []
    for doc in yaml.safe_load_all(manifest.read_text()):
        if doc["kind"] == "LeaderWorkerSet":
            name, group = doc["metadata"]["name"], doc["spec"]["leaderWorkerTemplate"]
            for index in range(group["size"]):
                template = group["leaderTemplate" if index == 0 else "workerTemplate"]
                platform = dict(
                    LWS_WORKER_INDEX=str(index),
                    LWS_GROUP_SIZE=str(group["size"]),
                    LWS_LEADER_ADDRESS=f"{name}-0.{name}.default",
                )
                pods.append((template["spec"]["containers"][0], platform))
        elif doc["kind"] == "Job":
            assert doc["spec"]["completionMode"] == "Indexed"
            assert doc["spec"]["completions"] == doc["spec"]["parallelism"]
            template = doc["spec"]["template"]
            # Pod 0's DNS name: <job name>-0.<subdomain> (a headless Service of that name).
            env = {e["name"]: e["value"] for e in template["spec"]["containers"][0]["env"]}
            pod0 = f"{doc['metadata']['name']}-0.{template['spec']['subdomain']}:"
            assert env["XLM_COORDINATOR_ADDRESS"].startswith(pod0)
            for index in range(doc["spec"]["completions"]):
                pods.append(
                    (template["spec"]["containers"][0], {"JOB_COMPLETION_INDEX": str(index)})
                )
    chips = [
        sum(int(v) for k, v in c["resources"]["limits"].items() if k.endswith(("gpu", "tpu")))
        for c, _ in pods
    ]
    return [(c, env, n) for (c, env), n in zip(pods, chips)]


@pytest.mark.parametrize("manifest", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_k8s_manifests_place_every_pod_in_one_engine(manifest, monkeypatch):
    """Every pod runs the same `xlm serve` command; with the variables its controller sets
    (and the manifest's own) it becomes process i of n of one engine over all the pods'
    chips, every pod naming the same coordinator: only pod 0 leads."""
    from xlm.engine.arg_utils import EngineArgs
    from xlm.entrypoints.cli import build_parser
    from xlm.executor.multihost import is_follower

    pods = _pods(manifest)
    assert len(pods) >= 2
    assert all(c["command"] == pods[0][0]["command"] for c, _, _ in pods)
    argv = pods[0][0]["command"]
    assert argv[:2] == ["xlm", "serve"]
    for name in (
        *envs.POD_VARIABLES,
        "XLM_COORDINATOR_ADDRESS",
        "XLM_NUM_PROCESSES",
        "XLM_PROCESS_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    configs = []
    for container, platform, _ in pods:
        with monkeypatch.context() as m:
            for name, value in {
                **platform,
                **{e["name"]: e["value"] for e in container.get("env", [])},
            }.items():
                m.setenv(name, value)
            args = build_parser("serve").parse_args(argv[1:])
            configs.append(EngineArgs.from_cli_args(args).create_parallel_config())
    assert [c.process_id for c in configs] == list(range(len(pods)))
    assert {c.num_processes for c in configs} == {len(pods)}
    assert len({c.coordinator_address for c in configs}) == 1
    assert configs[0].coordinator_address.endswith(":8476")
    assert {c.tensor_parallel_size for c in configs} == {sum(n for _, _, n in pods)}
    assert [is_follower(c) for c in configs] == [False] + [True] * (len(pods) - 1)
    # Only pod 0 is probed on the API port (the followers serve no HTTP).
    assert "readinessProbe" in pods[0][0]
