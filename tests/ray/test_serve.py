"""xlm on Ray Serve, on a local Ray cluster (127.0.0.1, 2 CPUs): two replicas of the tiny
model behind Ray's proxy answer the official openai client with the local LLM's greedy
text, behind the server's own API key; `serve run`'s builder and bad options."""

from __future__ import annotations

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

import xlm  # noqa: E402
from tests.ports import free_ports  # noqa: E402
from tests.ray.cluster import local_cluster  # noqa: E402
from tests.ray.tiny_engine import ENGINE  # noqa: E402
from xlm.entrypoints.openai.admission import default_max_waiting  # noqa: E402
from xlm.ray.serve import build_openai_app, replica_placement, serve_args  # noqa: E402

PROMPTS = [f"w{i} w{i + 3} w{2 * i + 5}" for i in range(6)]
MAX_TOKENS = 8
API_KEY = "sk-ray"


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def expected(model) -> dict[str, str]:
    """The reference: greedy text of the same model and options, in this process, no Ray."""
    llm = xlm.LLM(model=model, **ENGINE)
    params = xlm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outputs)}


@pytest.fixture(scope="module")
def served(model) -> str:
    """The app with 2 replicas on a local cluster; yields the proxy's URL."""
    with local_cluster():
        port = free_ports(1)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            engine_args = {"model": model, **ENGINE, "disable_log_stats": True, "api_key": API_KEY}
            app = build_openai_app(engine_args, num_replicas=2, ray_actor_options={"num_cpus": 0.5})
            serve.run(app, name="xlm", route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()


@pytest.mark.slow
def test_two_replicas_answer_the_openai_client_with_the_local_greedy_text(expected, served, model):
    # `expected` first: its engine compiles the programs that both replicas then load from
    # the suite's program cache instead of compiling them at once on the same cores.
    status = serve.status().applications["xlm"].deployments["xlm"]
    assert status.replica_states == {"RUNNING": 2}
    client = openai.OpenAI(base_url=served + "/v1", api_key=API_KEY, max_retries=0)
    for prompt in PROMPTS:
        completion = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert completion.choices[0].text == expected[prompt]
        assert completion.usage.completion_tokens == MAX_TOKENS
    stream = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert (
        "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[PROMPTS[0]]
    )
    assert [m.id for m in client.models.list().data] == [model]
    # The server's own guard: the key, in OpenAI's error shape.
    wrong = openai.OpenAI(base_url=served + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    # Its own validation, naming the parameter.
    response = httpx.post(
        served + "/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": model, "prompt": "hi", "max_tokens": 4, "temperature": -1},
        timeout=30,
    )
    assert response.status_code == 400
    assert "temperature" in response.json()["error"]["message"]


def test_serve_run_builder_reads_text_values(model):
    # What `serve run xlm.ray.serve:build_app KEY=VALUE ...` does with the import path.
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    app = call_user_app_builder_with_args_if_necessary(
        import_attr("xlm.ray.serve:build_app"),
        {
            "model": model,
            "num_replicas": "3",
            "replica_cpus": "0.25",
            "enable-prefix-caching": "false",
            "max_num_seqs": "8",
        },
    )
    deployment = app._bound_deployment
    assert deployment.num_replicas == 3
    assert deployment.ray_actor_options["num_cpus"] == 0.25
    # Every request the server admits (8 running and its waiting room) reaches the replica.
    assert deployment.max_ongoing_requests == 8 + default_max_waiting(8) > 8
    engine_args = deployment.init_args[0]
    assert engine_args["enable_prefix_caching"] is False
    assert serve_args(engine_args).enable_prefix_caching is False


def test_bad_options_fail_when_the_app_is_built(model):
    with pytest.raises(ValueError, match="unrecognized arguments: --max-nums-seqs"):
        build_openai_app({"model": model, "max_nums_seqs": 4})
    with pytest.raises(ValueError, match="'model'"):
        build_openai_app({"max_num_seqs": 4})
    with pytest.raises(ValueError, match="not both"):
        build_openai_app({"model": model}, num_replicas=2, autoscaling_config={"max_replicas": 2})
    with pytest.raises(ValueError, match="num_replicas=0 is invalid"):
        build_openai_app({"model": model}, num_replicas=0)


@pytest.mark.parametrize("accelerator,resource", [("tpu", "TPU"), ("gpu", "GPU")])
def test_each_replica_is_placed_on_its_tensor_parallel_devices(model, accelerator, resource):
    app = build_openai_app(
        {"model": model, "tensor_parallel_size": 4}, num_replicas=2, accelerator=accelerator
    )
    deployment = app._bound_deployment
    # One bundle per replica: its 4 chips (or GPUs) and a CPU for its front end, packed on
    # one host; the replica's actor takes that bundle whole.
    assert deployment._deployment_config.num_replicas == 2
    options = deployment._replica_config
    assert options.placement_group_bundles == [{"CPU": 1.0, resource: 4.0}]
    assert options.placement_group_strategy == "STRICT_PACK"
    if resource == "GPU":
        assert deployment.ray_actor_options["num_gpus"] == 4.0
    else:
        assert deployment.ray_actor_options["resources"] == {"TPU": 4.0}
    # Two data-parallel engines in a replica take twice the devices.
    args = serve_args({"model": model, "tensor_parallel_size": 2, "data_parallel_size": 2})
    placement = replica_placement(args, accelerator)
    assert placement["placement_group_bundles"] == [{"CPU": 1.0, resource: 4.0}]
    # `serve run` builder: accelerator=tpu places from the engine options too.
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    built = call_user_app_builder_with_args_if_necessary(
        import_attr("xlm.ray.serve:build_app"),
        {"model": model, "tensor_parallel_size": "4", "accelerator": accelerator},
    )
    assert built._bound_deployment._replica_config.placement_group_bundles == [
        {"CPU": 1.0, resource: 4.0}
    ]


def test_a_replica_larger_than_a_host_is_refused(model):
    args = serve_args({"model": model, "tensor_parallel_size": 16})
    with pytest.raises(ValueError, match="tensor_parallel_size=16 .* at most 8 per replica"):
        replica_placement(args, "tpu")
    with pytest.raises(ValueError, match="accelerator='npu' is invalid"):
        replica_placement(args, "npu")
