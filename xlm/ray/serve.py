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
)


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


def build_openai_app(
    engine_args: dict[str, Any],
    *,
    num_replicas: int | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    ray_actor_options: dict[str, Any] | None = None,
    placement_group_bundles: list[dict[str, float]] | None = None,
    placement_group_strategy: str | None = None,
    name: str = "xlm",
    **deployment_options: Any,
) -> Any:
    """A Ray Serve application of xlm replicas for `serve.run(app)`.

    `engine_args` holds `xlm serve` options by name (`model`, `max_num_seqs`, `api_key`,
    ...). Give `num_replicas` or `autoscaling_config`; place each replica's devices with
    `ray_actor_options` ({"num_gpus": 8} or {"resources": {"TPU": 4}}) or with
    `placement_group_bundles` (the replica's actor takes the first bundle). Other keywords
    go to `serve.deployment` (max_ongoing_requests, health_check_period_s, ...).
    """
    from ray import serve

    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError("give num_replicas or autoscaling_config, not both")
    if num_replicas is not None and (not isinstance(num_replicas, int) or num_replicas < 1):
        raise ValueError(f"num_replicas={num_replicas!r} is invalid: an integer >= 1")
    args = serve_args(engine_args)  # bad options fail here, not in every replica
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
    replica keys num_replicas, min_replicas and max_replicas (autoscaling), replica_cpus,
    replica_gpus and replica_tpu_chips (the resources of each replica).
    """
    values = {k.replace("-", "_"): _value(v) for k, v in dict(cli_args).items()}
    replica = {k: values.pop(k) for k in REPLICA_KEYS if k in values}
    actor: dict[str, Any] = {"num_cpus": float(replica.get("replica_cpus", 1))}
    if replica.get("replica_gpus"):
        actor["num_gpus"] = float(replica["replica_gpus"])
    if replica.get("replica_tpu_chips"):
        actor["resources"] = {"TPU": int(replica["replica_tpu_chips"])}
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
        ray_actor_options=actor,
    )


def _value(value: Any) -> Any:
    """`serve run`'s text values: "true"/"false" as switches, the rest as given."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value
