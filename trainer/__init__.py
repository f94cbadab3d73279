"""LLM pretraining and fine-tuning on DeepSpeed, from presets named by model and hardware.

preset (presets.py, config.py, strict.py) -> resolved config (resolve.py, rules.py) -> DeepSpeed config (ds/),
model (model.py), data (data/) -> engine and loop (train/) -> checkpoints and metrics (train/). Beside the
training job: plan/ (what fits), diagnose/ (doctor, lint), launch/ (launch lines, the node launcher).
"""

from . import jit_env

jit_env.settle()  # before anything imports DeepSpeed: this environment's op cache and ninja, for every rank
