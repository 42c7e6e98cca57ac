"""compressed-tensors checkpoints (llm-compressor's int8 / fp8 format) loaded as stored.

Each checkpoint is written here from a tiny random float one: its projections quantized
in numpy with xlm.quantization's rules, saved as compressed-tensors stores them (codes
[out, in], weight_scale [out, 1] or a per-tensor [1], pack-quantized int32 words through
the compressed_tensors package's own packer) with a ``quantization_config``. The
reference is transformers loading the same directory with the compressed_tensors package
(it decompresses each layer to codes * scale in float32). The package's dynamic int8
activation step divides by 127.5 over [-128, 127]; xlm's w8a8, like vLLM's kernels, by
127 over [-127, 127], so for w8a8 its activation step is swapped for xlm's
(tests/quantization/reference.py); fp8 activations run in float in xlm, so the
reference's fp8 static activation step is off too. Greedy tokens equal, logprobs within
test_quant_engine's tolerances; the placed kernels are the file's codes and scales.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import xlm
from tests.conftest import VOCAB_SIZE, fake_devices_env
from tests.engine.reference import TINY_ENGINE, hf_greedy
from tests.quantization.reference import PROJECTIONS, quantize_inputs
from tests.test_quantization import ATOL, NEW_TOKENS, greedy, log_softmax
from tests.test_quantization import stored_params as stored
from xlm.quantization import from_q8_strips, get_scheme, quantize_weight

pytest.importorskip("compressed_tensors")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
IGNORED = "model.layers.1.mlp.down_proj"  # left in float by the int8 checkpoint
INT8_TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}


def weights_args(kind: str, strategy: str) -> dict:
    return {"num_bits": 8, "type": kind, "strategy": strategy, "symmetric": True, "dynamic": False}


def write_checkpoint(
    base: str,
    path: str,
    fmt: str,
    weights: dict,
    input_activations: dict | None = None,
    ignore: tuple[str, ...] = (),
    **extra,
) -> str:
    """A compressed-tensors copy of the float checkpoint `base` in `path`."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    shutil.copytree(base, path, ignore=shutil.ignore_patterns("model.safetensors"))
    scheme = get_scheme("fp8" if weights["type"] == "float" else "int8")
    tensors = {}
    for name, w in load_file(os.path.join(base, "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if module == name or module.rpartition(".")[2] not in PROJECTIONS or module in ignore:
            tensors[name] = torch.from_numpy(w)
            continue
        if weights["strategy"] == "tensor":  # one scale: quantized as a single column
            codes, scale = quantize_weight(w.reshape(-1, 1), scheme)
            codes, scale = codes.reshape(w.shape), scale.reshape(1)
        else:
            codes, scale = quantize_weight(w.T, scheme)
            codes, scale = codes.T.copy(), scale.T.copy()
        codes = torch.from_numpy(codes.view(np.int8))
        if scheme.name == "fp8":
            codes = codes.view(torch.float8_e4m3fn)
        if fmt == "pack-quantized":
            tensors[f"{module}.weight_packed"] = pack_to_int32(codes, 8)
            tensors[f"{module}.weight_shape"] = torch.tensor(codes.shape)
        else:
            tensors[name] = codes
        tensors[f"{module}.weight_scale"] = torch.from_numpy(scale)
        if input_activations and not input_activations["dynamic"]:
            tensors[f"{module}.input_scale"] = torch.tensor([0.05])
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    group = {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": input_activations,
        "output_activations": None,
        "format": fmt,
    }
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head", *ignore],
        **extra,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


# name -> (family, format, weights, input activations, ignored layers, xlm scheme)
CASES = {
    # llm-compressor's W8A16 int8: pack-quantized words; one MLP layer left in float.
    "int8": ("llama", "pack-quantized", weights_args("int", "channel"), None, (IGNORED,), "int8"),
    # W8A8 int8 on Phi-3's checkpoint-fused qkv_proj and gate_up_proj.
    "w8a8": ("phi3", "int-quantized", weights_args("int", "channel"), INT8_TOKEN, (), "w8a8"),
    # FP8 per-tensor scales with static input scales: xlm's fused gate | up gets two
    # different scales, each repeated over its columns.
    "fp8": (
        "llama",
        "float-quantized",
        weights_args("float", "tensor"),
        {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False},
        (),
        "fp8",
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("compressed_tensors")
    return {
        name: write_checkpoint(tiny_checkpoint(arch), str(root / name), fmt, w, acts, ignore)
        for name, (arch, fmt, w, acts, ignore, _) in CASES.items()
    }


def reference_model(path: str, scheme: str):
    """transformers + compressed_tensors on the directory, decompressed to float32, with
    xlm's activation step (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        model(torch.tensor([[1, 2]]))  # decompresses every layer
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        assert module.weight.dtype == torch.float32, name  # decompressed
        module.quantization_enabled = False  # the package's activation step
        if scheme == "w8a8":
            quantize_inputs(module, get_scheme(scheme), 1)  # per token, as the checkpoint
    return model


def file_tensors(path: str) -> dict[str, np.ndarray]:
    """The file's tensors as numpy (fp8 codes viewed as int8: compared bit for bit)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    return {
        name: (t.view(torch.int8) if t.dtype == torch.float8_e4m3fn else t).numpy()
        for name, t in tensors.items()
    }


def test_engine_equals_transformers_on_the_same_directory(checkpoints):
    """The int8 case through the engine: greedy tokens and logprobs, no recompiles."""
    path, scheme = checkpoints["int8"], "int8"
    rng = np.random.default_rng(3)
    prompts = [rng.integers(6, VOCAB_SIZE, size=n).tolist() for n in (5, 40)]
    llm = xlm.LLM(model=path, **TINY_ENGINE)  # no quantization given: the checkpoint's
    assert llm.llm_engine.config.model_config.quantization == scheme
    compiled = llm.llm_engine.num_compilations
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert llm.llm_engine.num_compilations == compiled
    reference = reference_model(path, scheme)
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(reference, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref.token_ids
        want = log_softmax(ref.logits)[np.arange(NEW_TOKENS), ref.token_ids]
        have = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(have, want, atol=ATOL[scheme])
    check_stored(stored(llm), path, "int8")


@pytest.fixture(scope="module")
def model_runs(checkpoints) -> dict:
    """case -> (placed parameters, xlm's logits per request, the requests' tokens) of the
    model-level cases: one compile each instead of an engine's five."""
    from flax import nnx

    from tests.models.logits_check import PROMPT_LENS, SCHEDULE, run_schedule
    from xlm.config import ModelConfig, XlmConfig
    from xlm.models.loader import get_model

    runs = {}
    rng = np.random.default_rng(0)
    fed = {r: sum(plan.get(r, 0) for plan in SCHEDULE) for r in PROMPT_LENS}
    token_ids = {r: rng.integers(6, VOCAB_SIZE, n).tolist() for r, n in fed.items()}
    for case in ("w8a8", "fp8"):
        config = XlmConfig(ModelConfig(model=checkpoints[case]))  # no quantization given
        model = get_model(config)
        assert config.model_config.quantization == CASES[case][-1]
        flat = nnx.to_flat_state(nnx.state(model))
        params = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in flat}
        runs[case] = params, run_schedule(model, token_ids, seed=0), token_ids
    return runs


@pytest.mark.parametrize("case", ["w8a8", "fp8"])
def test_model_equals_transformers_on_the_same_directory(case, checkpoints, model_runs):
    """Over a paged, chunked batch: every position's greedy token equal to transformers'
    on the same directory, logprobs within test_quant_engine's tolerance."""
    import torch

    params, logits, token_ids = model_runs[case]
    scheme = CASES[case][-1]
    reference = reference_model(checkpoints[case], scheme)
    for r, ids in token_ids.items():
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_array_equal(logits[r].argmax(-1), ref.argmax(-1), err_msg=case)
        np.testing.assert_allclose(
            log_softmax(logits[r]), log_softmax(ref), atol=ATOL[scheme], err_msg=case
        )
    check_stored(params, checkpoints[case], case)


def file_codes(tensors: dict, module: str) -> np.ndarray:
    """A layer's codes [out, in] in the file (unpacked through the package for packed)."""
    if f"{module}.weight_packed" in tensors:
        import torch
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        packed = torch.from_numpy(tensors[f"{module}.weight_packed"])
        shape = torch.Size(tensors[f"{module}.weight_shape"].tolist())
        return unpack_from_int32(packed, 8, shape).numpy()
    return tensors[f"{module}.weight"]


def check_stored(params: dict, path: str, case: str) -> None:
    """The placed kernels and scales are the file's (1 byte per code, not requantized)."""
    tensors = file_tensors(path)
    layer = "model.layers.0"
    if case == "w8a8":  # Phi-3: the checkpoint's own fused projections
        parts = {"self_attn.qkv_proj": ["self_attn.qkv_proj"]}
    else:  # xlm merges q | k | v and gate | up
        parts = {"self_attn.qkv_proj": [f"self_attn.{x}_proj" for x in "qkv"]}
        parts["mlp.gate_up_proj"] = ["mlp.gate_proj", "mlp.up_proj"]
    for xlm_name, sources in parts.items():
        kernel = params[f"{layer}.{xlm_name}.kernel"]
        scale = params[f"{layer}.{xlm_name}.weight_scale"]
        assert kernel.dtype.itemsize == 1 and scale.dtype == np.float32, xlm_name
        # int8 and w8a8 on CPU are stored in the CPU kernels' strips: the same codes.
        assert (np.ndim(kernel) == 4) == (case in ("int8", "w8a8")), xlm_name
        if np.ndim(kernel) == 4:
            kernel, scale = from_q8_strips(np.asarray(kernel), np.asarray(scale))
        codes = np.concatenate([file_codes(tensors, f"{layer}.{s}").T for s in sources], 1)
        np.testing.assert_array_equal(np.asarray(kernel).view(np.int8), codes, err_msg=xlm_name)
        want = [  # a per-tensor scale repeated over its layer's columns
            np.broadcast_to(
                tensors[f"{layer}.{s}.weight_scale"].reshape(1, -1),
                (1, file_codes(tensors, f"{layer}.{s}").shape[0]),
            )
            for s in sources
        ]
        np.testing.assert_array_equal(scale, np.concatenate(want, 1), err_msg=xlm_name)
    if case == "fp8":  # per tensor: gate and up differ, each repeated over its columns
        gate_up = params[f"{layer}.mlp.gate_up_proj.weight_scale"][0]
        half = gate_up.shape[0] // 2
        assert len(set(gate_up[:half])) == 1 and gate_up[0] != gate_up[half]
    if case == "int8":  # the ignored layer stays float: no scale
        assert params[f"{IGNORED}.kernel"].dtype == np.float32
        assert f"{IGNORED}.weight_scale" not in params
        assert params["model.layers.0.mlp.down_proj.kernel"].dtype == np.int8


def _config(**changes) -> dict:
    group = {"targets": ["Linear"], "weights": weights_args("int", "channel"), "format": None}
    for key, value in changes.items():
        if key in ("weights", "input_activations", "output_activations"):
            group[key] = value
    top = {k: v for k, v in changes.items() if k not in group or k == "format"}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": group},
        **top,
    }


@pytest.mark.parametrize(
    "config, unsupported",
    [
        (_config(weights={**weights_args("int", "channel"), "symmetric": False}), "asymmetric"),
        (_config(weights={**weights_args("int", "group"), "group_size": 128}), "'group'"),
        (_config(weights={**weights_args("int", "channel"), "num_bits": 4}), "4-bit int"),
        (_config(format="pack-quantized", weights=weights_args("float", "channel")), "pack"),
        (_config(input_activations={**INT8_TOKEN, "dynamic": False}), "input activations"),
        (_config(format="sparse-24-bitmask"), "format 'sparse-24-bitmask'"),
        (_config(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity format"),
        (_config(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
        (_config(output_activations=INT8_TOKEN), "output activation"),
    ],
)
def test_unsupported_variants_are_named(config, unsupported):
    from types import SimpleNamespace

    from xlm.models.loader.compressed_tensors import resolve_quantization

    hf_config = SimpleNamespace(quantization_config=config)
    with pytest.raises(ValueError, match=f"compressed-tensors.*{unsupported}.*not supported"):
        resolve_quantization(None, hf_config)


def test_schemes_conflicts_and_other_methods():
    from types import SimpleNamespace

    from xlm.models.loader.compressed_tensors import resolve_quantization

    def resolve(requested, config):
        return resolve_quantization(requested, SimpleNamespace(quantization_config=config))

    assert resolve(None, _config()) == "int8"
    assert resolve("int8", _config()) == "int8"
    assert resolve(None, _config(input_activations=INT8_TOKEN)) == "w8a8"
    fp8 = _config(weights=weights_args("float", "tensor"), input_activations=None)
    assert resolve(None, fp8) == "fp8"
    with pytest.raises(ValueError, match="quantization='w8a8' conflicts.*stored as 'fp8'"):
        resolve("w8a8", fp8)
    with pytest.raises(ValueError, match="quant_method='awq'.*compressed-tensors"):
        resolve(None, {"quant_method": "awq", "bits": 4})
    assert resolve("fp8", None) == "fp8"  # a float checkpoint: quantized as loaded


def test_conflicting_flag_and_mixed_fused_layer(checkpoints, tmp_path, tiny_checkpoint):
    from xlm.config import ModelConfig, XlmConfig
    from xlm.engine.arg_utils import EngineArgs
    from xlm.models.loader import get_model

    with pytest.raises(ValueError, match="quantization='fp8' conflicts.*'int8'"):
        EngineArgs(model=checkpoints["int8"], quantization="fp8").create_config()
    # xlm fuses gate | up: one part quantized and the other float cannot be stored.
    path = write_checkpoint(
        tiny_checkpoint("llama"),
        str(tmp_path / "mixed"),
        "int-quantized",
        weights_args("int", "channel"),
        ignore=("model.layers.0.mlp.up_proj",),
    )
    with pytest.raises(ValueError, match="gate_up_proj.*up_proj.*float.*not supported"):
        get_model(XlmConfig(ModelConfig(model=path)))


TP_SCRIPT = """
import json
import sys
import jax
import numpy as np
from jax.sharding import AxisType
from tests.models.logits_check import run_schedule
from xlm.config import ModelConfig, ParallelConfig, XlmConfig
from xlm.models.loader import get_model

model_dir, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
mesh = jax.make_mesh((1, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
config = XlmConfig(ModelConfig(model=model_dir), parallel_config=ParallelConfig(4))
model = get_model(config, mesh=mesh)
k_proj = model.model.layers[0].self_attn.k_proj
results = {}
for leaf in ("kernel", "weight_scale"):
    value = getattr(k_proj, leaf)[...]
    assert len(value.sharding.device_set) == 4, value.sharding
    results[leaf] = np.asarray(value).view(np.int8) if leaf == "kernel" else np.asarray(value)
with jax.set_mesh(mesh):
    logits = run_schedule(model, ids, seed=0, mesh=mesh)
np.savez(out, **results, **logits)
"""


def test_tp4_replicates_kv_heads_of_the_files_codes(checkpoints, model_runs, tmp_path):
    """fp8 per-tensor at TP=4 (2 KV heads, each held twice): the same logits as one device,
    k_proj's codes and scales the file's, repeated per head replica and split."""
    env = fake_devices_env(4)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = str(tmp_path / "tp.npz")
    path = checkpoints["fp8"]
    _, plain, token_ids = model_runs["fp8"]
    proc = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, path, json.dumps(token_ids), out],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = np.load(out)
    for r, want in plain.items():
        np.testing.assert_allclose(res[r], want, rtol=1e-5, atol=1e-5, err_msg=r)
    tensors = file_tensors(path)
    codes = tensors["model.layers.0.self_attn.k_proj.weight"].T  # [in, 2 heads * 16]
    heads = codes.reshape(codes.shape[0], 2, 1, -1)
    replicated = np.broadcast_to(heads, (codes.shape[0], 2, 2, heads.shape[-1]))
    np.testing.assert_array_equal(res["kernel"], replicated.reshape(codes.shape[0], -1))
    scale = tensors["model.layers.0.self_attn.k_proj.weight_scale"]
    np.testing.assert_array_equal(res["weight_scale"], np.full((1, 2 * codes.shape[1]), scale[0]))
