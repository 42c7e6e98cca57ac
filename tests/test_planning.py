"""The planner's parts on their own (the whole `xlm plan` compiled for TPU slices:
tests/entrypoints/test_plan.py): one program compiled with its cost and memory read, the
programs chosen to compile, the compiler's refusal parsed, and the per-chip budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from xlm.planning import (
    CompiledProgram,
    ProgramTooLargeError,
    _Budget,
    choose_programs,
    compile_program,
)
from xlm.worker.compilation import ProgramKey, ProgramKind, ProgramSpec


def _never_counted(key: ProgramKey) -> tuple[float, float]:
    raise AssertionError(f"the compiler gave a cost for {key}: no count needed")


def test_compile_program_reads_the_compilers_cost():
    """A [8, 16] @ [16, 4] float32 matmul on this host: 2*8*16*4 flops, its three arrays'
    bytes, no Pallas kernel."""
    fn = jax.jit(lambda a, b: a @ b)
    args = (jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 4), jnp.float32))
    key = ProgramKey(ProgramKind.SAMPLER, 8)
    spec = ProgramSpec(fn, args, None, jax.tree_util.tree_structure(0))
    p = compile_program(key, spec, _never_counted)
    assert p.key == key and p.compile_s > 0 and p.cost_source == "compiler"
    assert p.flops == 2 * 8 * 16 * 4
    assert p.bytes_accessed == (8 * 16 + 16 * 4 + 8 * 4) * 4
    assert p.pallas_kernel is False and p.temp_bytes >= 0
    j = p.as_json()
    assert (j["name"], j["kind"], j["size"]) == ("sampler[8]", "sampler", 8)
    assert j["flops"] == p.flops and j["cost_source"] == "compiler"


def _keys(kind: ProgramKind, *sizes: int) -> list[ProgramKey]:
    return [ProgramKey(kind, s) for s in sizes]


def test_choose_programs_keeps_each_kinds_ends_and_the_decode_programs():
    model = _keys(ProgramKind.MODEL, 1, 8, 16, 64)
    sampler = _keys(ProgramKind.SAMPLER, 1, 4, 16)
    specs = dict.fromkeys(model + sampler)
    decode = {ProgramKey(ProgramKind.MODEL, 16)}
    chosen = choose_programs(specs, decode, every=False)
    # In the specs' order: smallest and largest per kind, plus the decode step's.
    assert chosen == [model[0], model[2], model[3], sampler[0], sampler[2]]
    assert choose_programs(specs, decode, every=True) == model + sampler


def test_program_too_large_reads_the_temporaries_from_the_message():
    key = ProgramKey(ProgramKind.MODEL, 131072)
    e = ProgramTooLargeError(key, "RESOURCE_EXHAUSTED: ... HLO temporaries (31.50G) ...")
    assert isinstance(e, ValueError) and e.key == key
    assert e.temp_bytes == int(31.5 * (1 << 30))
    assert ProgramTooLargeError(key, "RESOURCE_EXHAUSTED: out of memory").temp_bytes is None


def test_budget_shortfall_and_message():
    budget = _Budget(hbm=1000, utilization=0.9)
    assert budget.allowed == 900
    sizes = {"weight_bytes": 700}
    over = budget.per_chip(sizes, temp=50, total=950)
    assert over["shortfall_bytes"] == 50 and over["budget_bytes"] == 900
    assert over["weight_bytes"] == 700 and over["max_temp_bytes"] == 50
    assert budget.per_chip(sizes, temp=50, total=800)["shortfall_bytes"] == 0
    assert budget.per_chip(sizes, temp=None, total=None)["shortfall_bytes"] is None
    assert budget.over("weights", 950) == (
        "weights need 950 bytes per chip; 900 allowed (0.9 of 1000): 50 short"
    )


@pytest.mark.parametrize("kind", list(ProgramKind))
def test_compiled_program_names_its_kind_and_size(kind):
    p = CompiledProgram(ProgramKey(kind, 32), 0.1, True, 1.0, 2.0, 3)
    assert p.name == f"{kind.value}[32]" and p.as_json()["pallas_kernel"] is True
