"""PEFT adapters for the LoRA tests, written by the `peft` package over tiny checkpoints."""

from __future__ import annotations

# The projections each tiny family's adapters train (PEFT module names, the checkpoint's).
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    # Checkpoints that fuse projections themselves (Phi-3's qkv and gate_up, GPT-2's c_attn).
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
}


def write_adapter(base_dir: str, out_dir: str, arch: str, seed: int, r: int = 8, **config):
    """A random (nonzero B) PEFT LoRA adapter of rank `r` over `base_dir`, saved to
    `out_dir`; returns the PeftModel (float32, eval): transformers + peft, the reference."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    settings = dict(r=r, lora_alpha=2 * r, target_modules=TARGETS[arch], init_lora_weights=False)
    settings.update(config)
    model = get_peft_model(base, LoraConfig(**settings))
    with torch.no_grad():  # B at a scale that moves the logits clearly (not only ties)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(out_dir)
    return model.eval()
