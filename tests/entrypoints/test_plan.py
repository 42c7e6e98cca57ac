"""`xlm plan`: the engine's programs compiled for TPU slices by the TPU compiler (libtpu, no
TPU), checked field by field against arithmetic done here from the model's config."""

from __future__ import annotations

import importlib.util
import json

import jax
import pytest
from transformers import AutoConfig

from tests.conftest import _BASE
from xlm.entrypoints import cli
from xlm.entrypoints.plan import format_report
from xlm.platforms.target import CHIPS

pytest.importorskip("libtpu")

# The tiny test config with shapes the TPU kernel tiles: 128-wide heads (16-token pages are
# the TPU platform's minimum), bf16 as a served checkpoint would be.
LLAMA = dict(
    _BASE,
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    head_dim=128,
    max_position_embeddings=2048,
    torch_dtype="bfloat16",
)
ENGINE = ["--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
# For plans whose test is not about the decode batch or the cache's sizing: one request
# (the decode programs are then the smallest bucket's, no 4-row sampler) and a fixed cache
# (compiled once; sized automatically, the model programs compile twice, see
# xlm.planning.plan), about a third of ENGINE's compile work. 64 blocks hold two 512-token
# requests.
ONE_SEQ = [
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "1",
    "--max-num-batched-tokens",
    "64",
]
FIXED_CACHE = ["--num-gpu-blocks-override", "64"]


def config_dir(tmp_path, model_type: str, architecture: str, **overrides) -> str:
    """A directory with config.json only: plan reads no weights."""
    config = AutoConfig.for_model(model_type, **{**LLAMA, **overrides})
    config.architectures = [architecture]
    path = tmp_path / model_type
    config.save_pretrained(path)
    return str(path)


def run_plan(capsys, model: str, *flags: str) -> tuple[int, dict, str]:
    code = cli.main(["plan", model, *flags, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def llama_weight_bytes_per_chip(c: dict, tp: int) -> int:
    """Parameters one chip holds at TP=tp, counted from the config: every matrix split over
    the chips (embedding and head over the vocabulary), KV heads replicated up to tp."""
    h, d, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q_width = c["num_attention_heads"] * d
    kv_width = max(c["num_key_value_heads"], tp) * d
    per_layer = (h * q_width + 2 * h * kv_width + q_width * h + 3 * h * inter) // tp + 2 * h
    total = 2 * c["vocab_size"] * h // tp + c["num_hidden_layers"] * per_layer + h
    return total * 2  # bfloat16


def test_tiny_llama_fits_v5e_2x2_at_tp4_field_by_field(tmp_path, capsys):
    model = config_dir(tmp_path, "llama", "LlamaForCausalLM")
    code, r, _ = run_plan(
        capsys,
        model,
        "--target-topology",
        "v5e:2x2",
        "-tp",
        "4",
        "--kv-offloading-size",
        "1",
        *ENGINE,
    )
    assert code == 0 and r["fits"] is True
    assert (r["topology"], r["chips"], r["hosts"], r["chips_per_host"]) == ("v5e:2x2", 4, 1, 4)
    assert r["device_kind"] == "TPU v5 lite" and r["dtype"] == "bfloat16"
    pc = r["per_chip"]
    assert pc["weight_bytes"] == llama_weight_bytes_per_chip(LLAMA, 4)
    # KV: 2 KV heads replicated to one per chip; a 16-token block of 2 layers holds K and V.
    block = r["block_size"]
    assert block == 16
    block_bytes = LLAMA["num_hidden_layers"] * 2 * block * 1 * LLAMA["head_dim"] * 2
    assert pc["kv_cache_bytes"] == pc["kv_cache_tokens"] // block * block_bytes
    # Sized from what the chip has left after the weights and the largest program's
    # temporaries, within the utilization budget, as the engine does on a real device.
    hbm = CHIPS["v5e"].hbm_bytes
    assert pc["hbm_bytes"] == hbm and pc["budget_bytes"] == int(hbm * 0.9)
    left = pc["budget_bytes"] - pc["total_bytes"]
    assert 0 <= left < block_bytes
    assert pc["total_bytes"] == pc["weight_bytes"] + pc["kv_cache_bytes"] + pc["max_temp_bytes"]
    assert pc["max_temp_bytes"] == max(p["temp_bytes"] for p in r["programs"])
    # Per kind the smallest and largest bucket, and the decode programs (1 and 4 rows).
    names = {p["name"] for p in r["programs"]}
    assert {"model[1]", "model[4]", "model[64]", "sampler[1]", "sampler[4]"} <= names
    assert len(r["programs"]) < r["num_programs"]
    for p in r["programs"]:
        assert p["compile_s"] > 0 and p["flops"] > 0 and p["bytes_accessed"] > 0
        assert p["pallas_kernel"] is (p["kind"] == "model")
    est = r["decode_estimate"]
    assert est["max_num_seqs"] == 4
    # The roofline adds the KV the kernel reads: 4 requests at the longest context.
    assert est["batch_max"]["context_tokens"] == 512
    assert est["batch_max"]["kv_read_bytes"] == 4 * 512 * block_bytes // block
    # Each decode step: the KV read at the chip's bandwidth plus, per program the step
    # runs, the larger of its flops at peak and its bytes at bandwidth. (Not "batch 4 beats
    # batch 1": at this size the sampler's bytes, which grow with its rows, outweigh the
    # tiny model's, so the estimate rightly says it does not.)
    chip, by_name = CHIPS["v5e"], {p["name"]: p for p in r["programs"]}
    for batch, key in ((1, "batch_1"), (4, "batch_max")):
        step = est[key]["kv_read_bytes"] / chip.bytes_per_s
        for name in (f"model[{batch}]", f"sampler[{batch}]"):
            p = by_name[name]
            step += max(p["flops"] / chip.peak_bf16_flops, p["bytes_accessed"] / chip.bytes_per_s)
        assert est[key]["step_ms"] == pytest.approx(step * 1e3, rel=1e-9)
        assert est[f"{key}_tok_s"] == pytest.approx(batch / step, rel=1e-9)
    # The host KV tier: the one host keeps the four chips' shards of each block.
    host = r["host_kv_tier"]
    assert host["block_bytes_per_host"] == 4 * block_bytes
    assert host["blocks"] == (1 << 30) // (4 * block_bytes)
    assert host["tokens"] == host["blocks"] * block


def test_tiny_qwen3_moe_on_v5e_2x2_has_the_kernel_in_its_programs(tmp_path, capsys):
    model = config_dir(
        tmp_path,
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )
    flags = ["--target-topology", "v5e:2x2", "-tp", "4", *ONE_SEQ, *FIXED_CACHE]
    code, r, _ = run_plan(capsys, model, *flags)
    assert code == 0 and r["fits"] is True
    models = [p for p in r["programs"] if p["kind"] == "model"]
    assert models and all(p["pallas_kernel"] for p in models)


def test_multi_host_slice_compiles_in_one_process_with_kv_head_replication(tmp_path, capsys):
    """v5e:4x4 spans 4 hosts; TP=16 over 2 KV heads replicates each 8 times."""
    model = config_dir(tmp_path, "llama", "LlamaForCausalLM", num_attention_heads=16)
    flags = ["--target-topology", "v5e:4x4", "-tp", "16", *ONE_SEQ, *FIXED_CACHE]
    code, r, _ = run_plan(capsys, model, *flags)
    assert code == 0 and r["fits"] is True
    assert (r["chips"], r["hosts"], r["chips_per_host"]) == (16, 4, 4)
    c = {**LLAMA, "num_attention_heads": 16}
    assert r["per_chip"]["weight_bytes"] == llama_weight_bytes_per_chip(c, 16)
    assert all(p["pallas_kernel"] for p in r["programs"] if p["kind"] == "model")


def test_weights_that_do_not_fit_exit_nonzero_naming_the_shortfall(tmp_path, capsys):
    # An 8M-token vocabulary at hidden 2048: embedding and head are 2 x 33.6 GB, 16.8 GB
    # per chip of a v5e:2x2 at TP=4, over the 14.2 GB budget (0.9 of 15.75 GiB).
    model = config_dir(
        tmp_path, "llama", "LlamaForCausalLM", vocab_size=8_192_000, hidden_size=2048
    )
    code, r, err = run_plan(capsys, model, "--target-topology", "v5e:2x2", "-tp", "4", *ENGINE)
    assert code == 1 and r["fits"] is False
    pc = r["per_chip"]
    c = {**LLAMA, "vocab_size": 8_192_000, "hidden_size": 2048}
    assert pc["weight_bytes"] == llama_weight_bytes_per_chip(c, 4)
    assert pc["total_bytes"] == pc["weight_bytes"] + pc["kv_bytes_one_request"]
    assert pc["shortfall_bytes"] == pc["total_bytes"] - pc["budget_bytes"] > 0
    assert r["programs"] == []  # nothing to compile once the weights alone do not fit
    assert "does not fit" in err and "max_model_len=512" in err


def test_program_the_compiler_refuses_exits_nonzero_naming_it(tmp_path, capsys):
    # The weights fit, but a 131072-token step through a 131072-wide MLP (32768 per chip)
    # needs 34 GB of temporaries: the TPU compiler refuses the largest model program.
    model = config_dir(tmp_path, "llama", "LlamaForCausalLM", intermediate_size=131072)
    flags = ["--max-model-len", "512", "--max-num-seqs", "1"]
    code, r, err = run_plan(
        capsys,
        model,
        "--target-topology",
        "v5e:2x2",
        "-tp",
        "4",
        *flags,
        "--max-num-batched-tokens",
        "131072",
    )
    assert code == 1 and r["fits"] is False
    assert r["reason"].startswith("the compiler refused model[131072]: RESOURCE_EXHAUSTED")
    assert r["per_chip"]["max_temp_bytes"] > CHIPS["v5e"].hbm_bytes
    assert "does not fit" in err


def test_bad_target_is_a_clear_error(tmp_path, capsys):
    model = config_dir(tmp_path, "llama", "LlamaForCausalLM")
    assert cli.main(["plan", model, "--target-topology", "v9z:2x2"]) == 2
    assert "target_topology='v9z:2x2'" in capsys.readouterr().err
    assert cli.main(["plan", model, "--target-topology", "v5e:2x2", "-tp", "8"]) == 2
    assert "tensor_parallel_size=8 needs 8 chips" in capsys.readouterr().err


def test_data_parallel_replicas_report_one_replica_and_their_total(tmp_path, capsys):
    """Two TP=2 replicas on a v5e:2x2: one replica is compiled on 2 chips (its figures equal
    the per-chip ones times the chips), the total is twice a replica."""
    model = config_dir(tmp_path, "llama", "LlamaForCausalLM")
    flags = ["--target-topology", "v5e:2x2", "-tp", "2", *ONE_SEQ, *FIXED_CACHE]
    code, r, _ = run_plan(capsys, model, *flags, "--data-parallel-size", "2")
    assert code == 0 and r["fits"] is True and r["data_parallel_size"] == 2
    pc, one, total = r["per_chip"], r["per_replica"], r["total"]
    assert pc["weight_bytes"] == llama_weight_bytes_per_chip(LLAMA, 2)
    assert one == {
        "chips": 2,
        "weight_bytes": 2 * pc["weight_bytes"],
        "kv_cache_tokens": pc["kv_cache_tokens"],
        "max_num_seqs": 1,
        "batch_max_tok_s": r["decode_estimate"]["batch_max_tok_s"],
    }
    assert total == {key: 2 * value for key, value in one.items()}
    text = format_report(r)
    assert "2 replicas of TP=2" in text
    assert f"{total['kv_cache_tokens']:>12}{2:>10}" in text  # the total row


def test_more_replicas_than_the_topology_holds_is_a_clear_error(tmp_path, capsys):
    model = config_dir(tmp_path, "llama", "LlamaForCausalLM")
    flags = ["--target-topology", "v5e:2x2", "-tp", "2", "--data-parallel-size", "3"]
    assert cli.main(["plan", model, *flags]) == 2
    assert "data_parallel_size=3: allowed 1 to 2" in capsys.readouterr().err


def test_gpu_node_compiles_with_the_triton_kernel(tmp_path, capsys):
    """An H100 node, compiled by XLA:GPU (ptxas included) without a GPU. Needs JAX's CUDA
    plugin (jax[cuda12] or jax[cuda13], 5.5 GB: not in the test extra; docs/tpu.md says how
    to run it)."""
    if importlib.util.find_spec("jax_plugins") is None or not any(
        importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13)
    ):
        pytest.skip("needs JAX's CUDA plugin (jax_plugins.xla_cuda12 or xla_cuda13)")
    model = config_dir(tmp_path, "llama", "LlamaForCausalLM")
    code, r, _ = run_plan(capsys, model, "--target-topology", "h100:4", "-tp", "4", *ENGINE)
    assert code == 0 and r["fits"] is True
    assert (r["chips"], r["hosts"], r["chip"]["name"]) == (4, 1, "h100")
    # JAX's default share of a GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION=0.75).
    assert r["per_chip"]["hbm_bytes"] == int(CHIPS["h100"].hbm_bytes * 0.75)
    assert r["per_chip"]["weight_bytes"] == llama_weight_bytes_per_chip(LLAMA, 4)
    for p in r["programs"]:
        # XLA:GPU reports no cost without a device: xlm's own count stands in.
        assert p["cost_source"] == "count" and p["flops"] > 0
        assert p["pallas_kernel"] is (p["kind"] == "model")


def _model_programs(model: str, topology: str, num_blocks: int, sizes: tuple[int, ...]) -> dict:
    """model[size] programs compiled for `topology` with a `num_blocks`-block cache: their
    figures, the weights' and the cache's bytes per chip."""
    from xlm.engine.arg_utils import EngineArgs
    from xlm.planning import compile_program, counted_cost
    from xlm.platforms.target import compile_target, compiling_for
    from xlm.worker.compilation import ProgramKind
    from xlm.worker.worker import Worker

    args = EngineArgs(
        model=model,
        load_format="dummy",
        target_topology=topology,
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=max(sizes),
        num_gpu_blocks_override=num_blocks,
    )
    with compiling_for(compile_target(topology)):
        worker = Worker(args.create_config())
        runner = worker.model_runner
        specs, count = runner.program_specs(), counted_cost(worker)
        keys = [runner._key(ProgramKind.MODEL, size) for size in sizes]
        programs = {key.size: compile_program(key, specs[key], count) for key in keys}
    cache = sum(c.size * c.dtype.itemsize for c in jax.tree.leaves(runner.kv_caches))
    return dict(programs=programs, weights=worker.weight_bytes_per_device(), cache=cache)


# Head widths of small models (SmolLM2, Llama-3.2-1B: 64; others 80) and of large ones
# (128); 64, the width issue 46 was about, on both chips, the others on one each.
@pytest.mark.parametrize(
    ("head_dim", "topology"),
    [(64, "v5e:2x2"), (64, "v6e:2x2"), (80, "v5e:2x2"), (128, "v6e:2x2")],
)
def test_steps_update_the_cache_in_place_for_any_head_width(tmp_path, head_dim, topology):
    """A step compiled for the TPU reads the weights and its own rows of the cache, never a
    copy of the whole cache: bytes and temporaries stay put when the cache grows 4 times
    (issue 46: 64-wide heads made the compiler lay the cache out blocks-minor and copy it
    two or three times per layer and step; a scatter with K/V as a window dimension did
    the same to 2048-token steps). Caches of hundreds of MB per layer, so that none fits
    in the chip's VMEM, where the compiler would stage it."""
    model = config_dir(tmp_path, "llama", "LlamaForCausalLM", head_dim=head_dim)
    sizes = (1, 2048)
    small, big = (_model_programs(model, topology, n, sizes) for n in (16384, 65536))
    grown = big["cache"] - small["cache"]
    assert grown > 100 * big["weights"]  # any copy of the cache would dwarf the rest
    for size in sizes:
        a, b = small["programs"][size], big["programs"][size]
        assert b.pallas_kernel, size
        assert b.temp_bytes - a.temp_bytes < 0.01 * grown, (size, a.temp_bytes, b.temp_bytes)
        assert b.bytes_accessed - a.bytes_accessed < 0.05 * grown, (size, a, b)
    # A decode step moves far less than one layer's cache (a copy reads and writes it whole).
    one_layer = small["cache"] // LLAMA["num_hidden_layers"]
    assert big["programs"][1].bytes_accessed < one_layer / 4


def llava_encoder_bytes(path: str, itemsize: int) -> int:
    """Bytes of the vision tower layers LLaVA runs (up to vision_feature_layer) and the
    projector, counted on transformers' model of the same config."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig.from_pretrained(path)
    layers = config.vision_config.num_hidden_layers
    feature = config.vision_feature_layer
    run = layers + 1 + feature if feature < 0 else feature
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    vision = model.model.vision_tower  # CLIPVisionModel
    vision = getattr(vision, "vision_model", vision)  # older transformers nest it
    kept = [vision.embeddings, vision.pre_layrnorm, *vision.encoder.layers[:run]]
    kept.append(model.model.multi_modal_projector)
    return itemsize * sum(p.numel() for module in kept for p in module.parameters())


def test_tiny_llava_counts_the_encoders_programs_weights_and_cache(tmp_path, capsys):
    from tests.multimodal_fixtures import TOKENS_PER_IMAGE, write_llava_config

    model = write_llava_config(str(tmp_path / "llava"), LLAMA)
    # The cache sized automatically (checked below), one request: no decode batch needed.
    code, r, _ = run_plan(capsys, model, "--target-topology", "v5e:2x2", "-tp", "1", *ONE_SEQ)
    assert code == 0 and r["fits"] is True
    # The encoder is one program per image-count bucket up to the pool's slots: 64 batched
    # tokens are 4 images of 16 tokens, plus 2 (a chunk may start and end inside one).
    slots = 64 // TOKENS_PER_IMAGE + 2
    assert r["num_programs_by_kind"]["encoder"] == len((1, 2, 4, slots))
    assert sum(r["num_programs_by_kind"].values()) == r["num_programs"]
    names = {p["name"] for p in r["programs"]}
    assert {"encoder[1]", f"encoder[{slots}]", "model[64]"} <= names
    for p in r["programs"]:
        assert p["flops"] > 0 and p["bytes_accessed"] > 0
    # Its weights (replicated) are in the chip's weights, beside the text model's.
    pc = r["per_chip"]
    encoder = llava_encoder_bytes(model, 2)  # bfloat16 on the TPU
    assert pc["encoder_weight_bytes"] == encoder
    assert pc["weight_bytes"] == llama_weight_bytes_per_chip(LLAMA, 1) + encoder
    # The encoder cache's pool comes out of the chip's budget before the KV cache is sized.
    assert pc["encoder_cache_bytes"] == (1 + slots * TOKENS_PER_IMAGE) * LLAMA["hidden_size"] * 2
    taken = pc["weight_bytes"] + pc["encoder_cache_bytes"] + pc["max_temp_bytes"]
    assert pc["total_bytes"] == taken + pc["kv_cache_bytes"]
    block_bytes = pc["kv_cache_bytes"] // (pc["kv_cache_tokens"] // r["block_size"])
    assert 0 <= pc["budget_bytes"] - pc["total_bytes"] < block_bytes
    text = format_report(r)
    assert "encoder cache" in text and "encoder[1]" in text


def test_qwen2_vl_plan_follows_the_pixel_cap_and_mm_processor_kwargs(tmp_path, capsys):
    """The encoder's patch buckets and the encoder cache's pool follow the engine's
    preprocessor config: the real default max_pixels capped to the step budget (64
    tokens), or the --mm-processor-kwargs max_pixels (16 tokens)."""
    from tests.qwen2_vl_fixtures import (
        MERGE_SIZE,
        MIN_PIXELS,
        PATCH_SIZE,
        _configs,
        write_real_style_processor_config,
    )
    from xlm.models.qwen2_vl_inputs import patch_buckets

    path = str(tmp_path / "qwen2_vl")
    config = _configs(False)
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    config.save_pretrained(path)
    write_real_style_processor_config(path)
    flags = ["--target-topology", "v5e:2x2", "-tp", "1", *ONE_SEQ, *FIXED_CACHE]
    flags += ["--max-model-len", "256"]
    hidden = config.text_config.hidden_size
    rows = {}
    for tokens, extra in ((64, []), (16, ["--mm-processor-kwargs", '{"max_pixels": 1024}'])):
        code, r, _ = run_plan(capsys, path, *flags, *extra)
        assert code == 0
        buckets = patch_buckets(MIN_PIXELS // PATCH_SIZE**2, tokens * MERGE_SIZE**2)
        assert r["num_programs_by_kind"]["encoder"] == len(buckets)
        names = {p["name"] for p in r["programs"]}
        assert f"encoder[{buckets[-1]}]" in names
        slots = max(4, 64 // tokens + 2)
        rows[tokens] = 1 + slots * tokens
        per_row = r["per_chip"]["encoder_cache_bytes"] / (rows[tokens] * hidden)
        assert per_row in (2, 4)  # one element of the model's dtype a row entry
    assert (rows[64], rows[16]) == (257, 97)
