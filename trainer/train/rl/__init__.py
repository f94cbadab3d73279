"""RL post-training (data.task=grpo): rewards, rollouts, the GRPO loss and the objective the loop trains on.

    rewards.py    the reward functions named in grpo.rewards (built-ins and a user's own by import path)
    prompts.py    prompt + answer records from JSONL, checked, and the resumable per-step prompt loader
    rollout.py    the batched KV-cache sampler on the trainer's own model (ZeRO-3: parameters gathered)
    loss.py       group-normalised advantages and the clipped policy-gradient loss, as TRL 1.13 computes them
    objective.py  GrpoObjective: what `fit` (train/loop.py) calls per micro-batch, its metrics and saved state
    external.py   the interface for an external rollout engine (vLLM/SGLang): not wired into the loop
"""
