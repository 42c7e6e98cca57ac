"""LoRA under tensor parallelism (eight fake CPU devices, one subprocess): a batch mixing
the base model and two adapters gives the same greedy tokens and logprobs at TP=2 and
TP=4 as at TP=1, with no recompiles, and each adapter B of a column-parallel projection
is split over the devices like its kernel."""

from __future__ import annotations

import numpy as np

from tests.distributed.test_tensor_parallel import run_checks
from tests.lora.adapters import write_adapter


def test_lora_tp_equals_tp1(tmp_path, tiny_checkpoint):
    base = tiny_checkpoint("llama")
    adapters = []
    for i, r in ((1, 8), (2, 4)):
        adapters.append(str(tmp_path / f"a{i}"))
        write_adapter(base, adapters[-1], "llama", seed=20 + i, r=r)
    results = run_checks(tmp_path, [f"llama={base}:1,2,4@{','.join(adapters)}"])
    runs = results["llama"]
    ref = runs["1"]
    assert ref["num_preemptions"] > 0
    for tp in ("2", "4"):
        run = runs[tp]
        assert run["tokens"] == ref["tokens"], f"TP={tp}"
        for got, want in zip(run["logprobs"], ref["logprobs"], strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"TP={tp}")
        assert run["compiles_after_generate"] == run["compiles_after_warmup"]
        assert run["lora_q_b_bytes_per_device"] == [run["lora_q_b_bytes"] // int(tp)]
