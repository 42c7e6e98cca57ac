"""xlm on Ray Serve: an OpenAI-compatible application whose replicas are xlm engines.

`build_openai_app({"model": ..., ...}, num_replicas=2)` returns an application for
`serve.run(app)`; `serve run xlm.ray.serve:build_app model=... num_replicas=2` builds the
same from the command line. Each replica is one Ray actor that starts one engine
(AsyncLLM) and serves the FastAPI app `xlm serve` builds over it (mounted with
`@serve.ingress`), so the routes, the API key, the request limits and the metrics are the
server's own. Ray Serve's proxy spreads requests over the replicas. Importing this module
does not import ray; building an application does.
"""

from __future__ import annotations

import argparse
from typing import Any

from xlm.engine.arg_utils import EngineArgs
from xlm.entrypoints.openai.admission import default_max_waiting
from xlm.entrypoints.openai.api_server import build_app as build_fastapi_app
from xlm.entrypoints.openai.cli_args import make_arg_parser, mapping_args, settle_args
from xlm.entrypoints.openai.engine_setup import build_engine
from xlm.logger import init_logger

logger = init_logger(__name__)

# `serve run xlm.ray.serve:build_app KEY=VALUE ...` keys that place replicas; every other
# key is an `xlm serve` option (model=..., max_num_seqs=..., api_key=...).
REPLICA_KEYS = (
    "num_replicas",
    "min_replicas",
    "max_replicas",
    "replica_cpus",
    "replica_gpus",
    "replica_tpu_chips",
    "accelerator",
)

# Accelerators a replica's placement can be derived for, and Ray's resource name of each.
ACCELERATORS = {"gpu": "GPU", "tpu": "TPU"}


class _RaisingParser(argparse.ArgumentParser):
    """An argument parser whose errors raise ValueError instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def serve_args(engine_args: dict[str, Any]) -> argparse.Namespace:
    """The parsed `xlm serve` options for a mapping of option names to values."""
    if not isinstance(engine_args, dict) or not engine_args.get("model"):
        raise ValueError(f"engine_args={engine_args!r}: a dict with at least 'model' is needed")
    parser = make_arg_parser(_RaisingParser(prog="xlm.ray.serve"))
    values = dict(engine_args)
    for key, value in values.items():
        action = parser._option_string_actions.get("--" + key.replace("_", "-"))
        if isinstance(value, (list, tuple)) and action is not None and action.nargs is None:
            values[key] = ",".join(str(v) for v in value)  # a comma list: token_buckets=[8, 64]
    return settle_args(parser, parser.parse_args(mapping_args(values)))


class OpenAIServer:
    """One replica: an xlm engine and the FastAPI app `xlm serve` builds over it."""

    def __init__(self, engine_args: dict[str, Any]) -> None:
        self.args = serve_args(engine_args)
        self.engine, self.registry = build_engine(self.args)
        logger.info("Ray Serve replica ready: %s", self.args.model)

    async def __serve_build_asgi_app__(self) -> Any:
        """Ray Serve calls this after __init__: the app it serves on this replica."""
        app = build_fastapi_app(self.args, self.engine, self.registry)
        await app.state.xlm.models.check_lora_modules()
        return app

    async def check_health(self) -> None:
        """Ray Serve's health check: raises once the engine process is dead."""
        await self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def replica_placement(
    args: argparse.Namespace, accelerator: str, devices_per_host: int = 8
) -> dict[str, Any]:
    """One replica's placement for its engine options: `ray_actor_options` and a
    one-bundle placement group holding the devices its engines use (tensor_parallel_size
    x data_parallel_size GPUs or TPU chips) and a CPU for the replica's front end.

    The replica's devices are on one host (its engines are local processes): more than
    `devices_per_host` is refused."""
    resource = ACCELERATORS.get(accelerator)
    if resource is None:
        raise ValueError(
            f"accelerator={accelerator!r} is invalid: allowed {sorted(ACCELERATORS)} or None"
        )
    tp = int(args.tensor_parallel_size or 1)
    devices = tp * int(args.data_parallel_size or 1)
    if devices > devices_per_host:
        raise ValueError(
            f"tensor_parallel_size={tp} x data_parallel_size={args.data_parallel_size} = "
            f"{devices} {resource}s is more than one host has (devices_per_host="
            f"{devices_per_host}): allowed at most {devices_per_host} per replica"
        )
    actor: dict[str, Any] = {"num_cpus": 1.0}
    if resource == "GPU":
        actor["num_gpus"] = float(devices)
    else:
        actor["resources"] = {resource: float(devices)}
    return {
        "ray_actor_options": actor,
        "placement_group_bundles": [{"CPU": 1.0, resource: float(devices)}],
        "placement_group_strategy": "STRICT_PACK",
    }


def build_openai_app(
    engine_args: dict[str, Any],
    *,
    num_replicas: int | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    accelerator: str | None = None,
    devices_per_host: int = 8,
    ray_actor_options: dict[str, Any] | None = None,
    placement_group_bundles: list[dict[str, float]] | None = None,
    placement_group_strategy: str | None = None,
    name: str = "xlm",
    **deployment_options: Any,
) -> Any:
    """A Ray Serve application of xlm replicas for `serve.run(app)`.

    `engine_args` holds `xlm serve` options by name (`model`, `max_num_seqs`, `api_key`,
    ...). Give `num_replicas` or `autoscaling_config`. `accelerator` ("gpu" or "tpu")
    places each replica from its engine options (`replica_placement`: its
    tensor_parallel_size x data_parallel_size devices in one bundle on one host); or place
    it yourself with `ray_actor_options` ({"num_gpus": 8} or {"resources": {"TPU": 4}})
    and `placement_group_bundles` (the replica's actor takes the first bundle), which win.
    Other keywords go to `serve.deployment` (max_ongoing_requests, ...).
    """
    from ray import serve

    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError("give num_replicas or autoscaling_config, not both")
    if num_replicas is not None and (not isinstance(num_replicas, int) or num_replicas < 1):
        raise ValueError(f"num_replicas={num_replicas!r} is invalid: an integer >= 1")
    args = serve_args(engine_args)  # bad options fail here, not in every replica
    if accelerator is not None:
        placement = replica_placement(args, accelerator, devices_per_host)
        ray_actor_options = ray_actor_options or placement["ray_actor_options"]
        if placement_group_bundles is None:
            placement_group_bundles = placement["placement_group_bundles"]
    # Ray Serve's default (5 requests per replica) would starve the continuous batch: let
    # every request the server admits through (its own gate answers 429 beyond that).
    options: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": _admitted(args),
        **deployment_options,
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas or 1
    if ray_actor_options is not None:
        options["ray_actor_options"] = ray_actor_options
    if placement_group_bundles is not None:
        options["placement_group_bundles"] = placement_group_bundles
        options["placement_group_strategy"] = placement_group_strategy or "STRICT_PACK"
    deployment = serve.deployment(serve.ingress()(OpenAIServer), **options)
    return deployment.bind(dict(engine_args))


def _admitted(args: argparse.Namespace) -> int:
    """Requests one replica's server admits at once: running plus waiting."""
    max_num_seqs = int(args.max_num_seqs or EngineArgs.max_num_seqs)
    waiting = args.max_waiting_requests
    return max_num_seqs + (default_max_waiting(max_num_seqs) if waiting is None else waiting)


def build_app(cli_args: dict[str, Any]) -> Any:
    """The application `serve run xlm.ray.serve:build_app model=M num_replicas=2` builds.

    Keys are `xlm serve` options (values as text: "true"/"false" for switches) and the
    replica keys num_replicas, min_replicas and max_replicas (autoscaling), accelerator
    (gpu or tpu: each replica placed from its engine options), replica_cpus, replica_gpus
    and replica_tpu_chips (the resources of each replica, given outright).
    """
    values = {k.replace("-", "_"): _value(v) for k, v in dict(cli_args).items()}
    replica = {k: values.pop(k) for k in REPLICA_KEYS if k in values}
    actor: dict[str, Any] | None = {"num_cpus": float(replica.get("replica_cpus", 1))}
    if replica.get("replica_gpus"):
        actor["num_gpus"] = float(replica["replica_gpus"])
    if replica.get("replica_tpu_chips"):
        actor["resources"] = {"TPU": int(replica["replica_tpu_chips"])}
    accelerator = replica.get("accelerator")
    if accelerator and not ({"replica_gpus", "replica_tpu_chips"} & set(replica)):
        actor = None  # placed from the engine options
    autoscaling = None
    if "min_replicas" in replica or "max_replicas" in replica:
        autoscaling = {
            "min_replicas": int(replica.get("min_replicas", 1)),
            "max_replicas": int(replica.get("max_replicas", replica.get("min_replicas", 1))),
        }
    num = replica.get("num_replicas")
    return build_openai_app(
        values,
        num_replicas=None if num is None else int(num),
        autoscaling_config=autoscaling,
        accelerator=accelerator or None,
        ray_actor_options=actor,
    )


def _value(value: Any) -> Any:
    """`serve run`'s text values: "true"/"false" as switches, the rest as given."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value
