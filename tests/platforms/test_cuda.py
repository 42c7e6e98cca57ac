"""The CUDA platform's XLA options (step programs as CUDA graphs with their conditionals,
the user's XLA_FLAGS winning) and that a platform's options reach the step programs."""

from __future__ import annotations

import pytest

import xlm
from xlm import platforms
from xlm.platforms.cuda import COMMAND_BUFFER_OPTIONS, CudaPlatform


def test_cuda_programs_compile_as_graphs_with_their_conditionals(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    options = CudaPlatform().compiler_options()
    assert options == COMMAND_BUFFER_OPTIONS
    assert "CONDITIONAL" in options["xla_gpu_enable_command_buffer"].split(",")
    # A flag the user set in XLA_FLAGS is theirs: xlm leaves that option out.
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer= --xla_foo=1")
    assert CudaPlatform().compiler_options() == {"xla_gpu_graph_min_graph_size": 1}


def test_a_platforms_compiler_options_reach_the_step_programs(monkeypatch, tiny_checkpoint):
    # An option XLA does not know fails the compile that receives it: the step programs'.
    monkeypatch.setattr(
        platforms.current_platform, "compiler_options", lambda: {"xla_no_such_option": "1"}
    )
    with pytest.raises(Exception, match="xla_no_such_option"):
        llm = xlm.LLM(model=tiny_checkpoint("llama"), max_model_len=64, max_num_seqs=2)
        llm.generate("a b c", xlm.SamplingParams(max_tokens=2), use_tqdm=False)


def test_estimates_use_a_chips_measured_copy_bandwidth():
    from xlm.platforms.target import CHIPS

    # Measured on an H200 (benchmarks/RESULTS.md, "GPU"): below the data sheet's 4.8 TB/s.
    h200 = CHIPS["h200"]
    assert h200.bytes_per_s == h200.copy_bytes_per_s < h200.hbm_bytes_per_s
    assert "H200" in h200.copy_source
    # Not measured: the data sheet's figure.
    assert CHIPS["h100"].copy_bytes_per_s is None
    assert CHIPS["h100"].bytes_per_s == CHIPS["h100"].hbm_bytes_per_s
