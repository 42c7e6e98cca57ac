"""LoRA flags of `xlm serve` / run-batch and the server's adapter registry (no engine: a
stub answers add_lora / remove_lora; tests/e2e/test_server_lora.py runs the real one)."""

from __future__ import annotations

import argparse
import asyncio
from http import HTTPStatus

import pytest

from xlm.entrypoints.openai.cli_args import (
    LoRAModulePath,
    config_file_args,
    finish_args,
    make_arg_parser,
    parse_lora_module,
)
from xlm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from xlm.entrypoints.openai.serving_engine import OpenAIError, ServingContext
from xlm.entrypoints.openai.serving_models import OpenAIServingModels


def _parse(argv: list[str]) -> argparse.Namespace:
    return finish_args(make_arg_parser(argparse.ArgumentParser()), argv)


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        _parse(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_lora_modules_as_name_path_or_vllm_json(tmp_path):
    assert parse_lora_module("a=/x/y") == LoRAModulePath("a", "/x/y")
    value = '{"name": "b", "path": "/p", "base_model_name": "m"}'
    assert parse_lora_module(value) == LoRAModulePath("b", "/p", "m")
    for bad in ("just-a-name", "=/p", "a=", '{"name": "b"}', '{"name": "b", "path": "/p", "x": 1}'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)
    (tmp_path / "a").mkdir()
    value = f'{{"name": "b", "path": "{tmp_path / "a"}", "base_model_name": "m"}}'
    args = _parse(["m", "--enable-lora", "--lora-modules", f"a={tmp_path / 'a'}", value])
    assert [m.name for m in args.lora_modules] == ["a", "b"]


def test_lora_flags_need_enable_lora_and_runtime_loads_need_a_root(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    module = f"a={tmp_path / 'a'}"
    assert "--lora-modules needs --enable-lora" in _refused(["m", "--lora-modules", module], capsys)
    err = _refused(["m", "--lora-root", str(tmp_path), "--allow-runtime-lora-updating"], capsys)
    assert "--lora-root and --allow-runtime-lora-updating need --enable-lora" in err
    err = _refused(["m", "--enable-lora", "--allow-runtime-lora-updating"], capsys)
    assert "--allow-runtime-lora-updating needs --lora-root" in err
    err = _refused(["m", "--enable-lora", "--lora-root", str(tmp_path / "none")], capsys)
    assert "is not a directory" in err
    args = _parse(
        ["m", "--enable-lora", "--lora-root", str(tmp_path), "--allow-runtime-lora-updating"]
    )
    assert args.allow_runtime_lora_updating and args.lora_root == str(tmp_path)


def test_lora_module_names_and_paths_are_checked(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    path = str(tmp_path / "a")
    err = _refused(["m", "--enable-lora", "--lora-modules", f"a={tmp_path / 'no'}"], capsys)
    assert "no such adapter directory" in err
    err = _refused(["m", "--enable-lora", "--lora-modules", f"a={path}", f"a={path}"], capsys)
    assert "already taken" in err
    err = _refused(["m", "--enable-lora", "--lora-modules", f"m={path}"], capsys)
    assert "already taken" in err
    value = f'{{"name": "a", "path": "{path}", "base_model_name": "other"}}'
    err = _refused(["m", "--enable-lora", "--lora-modules", value], capsys)
    assert "base_model_name 'other' is not a served model name" in err


def test_config_file_lora_modules_as_mappings(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("lora_modules:\n  - a=/x\n  - {name: b, path: /y}\n")
    argv = config_file_args(str(config))
    assert argv[0] == "--lora-modules" and argv[1] == "a=/x"
    assert parse_lora_module(argv[2]) == LoRAModulePath("b", "/y")


class StubEngine:
    """add_lora / remove_lora as the engine answers them (RuntimeError names the reason)."""

    def __init__(self) -> None:
        self.added: list = []
        self.removed: list[int] = []

    async def add_lora(self, lora) -> bool:
        if lora.lora_path.endswith("bad"):
            raise RuntimeError(f"LoRAAdapterError: LoRA adapter {lora.lora_path!r} is bad")
        self.added.append(lora)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True


def _models(tmp_path, modules=()) -> OpenAIServingModels:
    ctx = ServingContext(StubEngine(), ["base"], 64)
    return OpenAIServingModels(ctx, modules, lora_root=str(tmp_path / "root"))


def _load(models: OpenAIServingModels, name: str, path: str) -> str:
    return asyncio.run(
        models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=path))
    )


def _error(models: OpenAIServingModels, name: str, path: str) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        _load(models, name, path)
    return info.value


def test_ids_are_never_reused_and_names_resolve(tmp_path):
    (tmp_path / "root" / "x").mkdir(parents=True)
    (tmp_path / "start").mkdir()
    models = _models(tmp_path, [LoRAModulePath("s", str(tmp_path / "start"))])
    assert models.ctx.check_model("s").lora_int_id == 1
    assert models.ctx.check_model("base") is None and models.ctx.check_model(None) is None
    assert "Success" in _load(models, "x", "x")
    assert models.ctx.check_model("x").lora_int_id == 2
    asyncio.run(models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name="x")))
    assert models.ctx.engine.removed == [2]
    with pytest.raises(OpenAIError) as info:
        models.ctx.check_model("x")
    assert info.value.status == HTTPStatus.NOT_FOUND
    _load(models, "x", "x")
    assert models.ctx.check_model("x").lora_int_id == 3  # 2 is never given again
    cards = models.show_available_models().data
    assert [(c.id, c.parent) for c in cards] == [("base", None), ("s", "base"), ("x", "base")]


def test_runtime_paths_stay_under_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_model.safetensors").write_bytes(b"secret")
    (root / "out").symlink_to(outside, target_is_directory=True)
    (root / "leaky").mkdir()
    (root / "leaky" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    (root / "bad").mkdir()
    models = _models(tmp_path)
    for path in (str(outside), "../outside", "out", "ok/../../outside"):
        assert "outside the server's --lora-root" in _error(models, "n", path).message, path
    assert "adapter_model.safetensors links outside" in _error(models, "n", "leaky").message
    assert "no such adapter directory" in _error(models, "n", "missing").message
    error = _error(models, "n", "bad")
    assert error.status == HTTPStatus.BAD_REQUEST and "is bad" in error.message
    assert "LoRAAdapterError" not in error.message
    assert "already" in _error(models, "base", "ok").message
    _load(models, "n", str(root / "ok"))  # absolute under the root
    assert "already" in _error(models, "n", "ok").message
    assert [lora.lora_path for lora in models.ctx.engine.added] == [str(root / "ok")]
