"""`python -m trainer autotune`: DeepSpeed's autotuner on the GPUs, over the search space the planner says fits,
and its best config written as a new preset. space.py (planner -> stages and micro-batches) -> cli.py (the
tuning config and the `deepspeed --autotuning` command) -> results.py (the results dir -> a preset)."""
