"""Inference and evaluation of trained models: `generate` (prompts -> completions) and `evaluate` (loss and
perplexity), on DeepSpeed's inference engine with AutoTP, or ZeRO-Inference for models larger than the GPU.

`source` (what --model names: HF directory, run, checkpoint, LoRA adapter, hub id) -> `consolidate` (a checkpoint's
ZeRO/AutoTP files as one state dict) -> `runner` (the model placed on the ranks) -> `session` (what both commands
share) -> `generate` / `evaluate`.
"""
