"""Quantized weights under tensor parallelism (eight fake CPU devices, one subprocess):
int8 and w8a8 engines give the same greedy tokens and logprobs at TP=2 and TP=4 as at
TP=1, with no recompiles, and each kernel and its scales are split over the devices."""

from __future__ import annotations

from tests.distributed.test_tensor_parallel import assert_equal_to_tp1, run_checks


def test_quantized_tp_equals_tp1(tmp_path, tiny_checkpoint):
    base = tiny_checkpoint("llama")
    results = run_checks(tmp_path, [f"int8={base}:1,2,4#int8", f"w8a8={base}:1,2,4#w8a8"])
    for name in ("int8", "w8a8"):
        runs = results[name]
        assert_equal_to_tp1(name, runs)
        for tp in ("2", "4"):
            for leaf in ("kernel", "weight_scale"):
                whole = runs[tp][f"q_{leaf}_bytes"]
                assert runs[tp][f"q_{leaf}_bytes_per_device"] == [whole // int(tp)], (name, leaf)
