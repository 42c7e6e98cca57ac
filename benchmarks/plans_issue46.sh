#!/bin/bash
# Issue 46: `xlm plan` for SmolLM2 (head_dim 64), a Llama-3.2-1B-shaped config (64) and a
# Llama-3.1-8B-shaped one (128, TP=4) on v5e:2x2 and v6e:2x2 (libtpu compiles; no TPU).
# usage: benchmarks/plans_issue46.sh OUTDIR [memory utilizations, default "0.9 0.4"]
# One JSON per plan in OUTDIR (benchmarks/plans_issue46/ holds this issue's before/after).
set -u
OUT=$1; MUS=${2:-0.9 0.4}; mkdir -p "$OUT/configs"
python - "$OUT/configs" <<'PY'
import sys
from transformers import AutoConfig
base = dict(vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000,
            eos_token_id=128001, max_position_embeddings=131072, torch_dtype="bfloat16")
shapes = {
    "llama32_1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                       tie_word_embeddings=True),
    "llama31_8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=False),
}
for name, shape in shapes.items():
    factor = 32.0 if name == "llama32_1b" else 8.0
    rope = dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    config = AutoConfig.for_model("llama", rope_scaling=rope, **base, **shape)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(f"{sys.argv[1]}/{name}")
PY
for topo in v5e:2x2 v6e:2x2; do
  for m in smollm2-135m:1 "$OUT/configs/llama32_1b":1 "$OUT/configs/llama31_8b":4; do
    model=${m%:*}; tp=${m##*:}; name=$(basename "$model")
    for mu in $MUS; do
      xlm plan "$model" --target-topology $topo -tp $tp --max-model-len 8192 \
        --memory-utilization $mu --json > "$OUT/${name}_${topo/:/_}_mu$mu.json"
      echo "$name $topo tp=$tp mu=$mu rc=$?"
    done
  done
done
