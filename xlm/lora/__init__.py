"""LoRA adapters: many fine-tunes of one base model served side by side.

``request.py`` (``LoRARequest``) is a root module every layer may import; the rest sits
with the models: ``adapter.py`` reads and checks a PEFT directory into host arrays laid
out for the model's LoRA parameters, ``slots.py`` keeps adapters in the device's fixed
slots. The LoRA-augmented projection is the ``lora`` CustomOp (xlm/ops/lora.py).
"""
