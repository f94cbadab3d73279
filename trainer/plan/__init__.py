"""`python -m trainer plan`: which ZeRO stage, which offload, which micro-batch, will it fit, how to launch.

Inputs are the seed's step 1.1 (model, GPU type and count, nodes, host RAM, NVMe, training type,
sequence length, batch) as flags or a scenario file (scenarios/*.yaml). The planner prices every
candidate (stage 0, 1, 2, 2 + CPU optimizer offload, 3, 3 + CPU optimizer offload, 3 + CPU optimizer
and param offload, 3 + NVMe) with `plan.memory`, then walks the seed's decision tree:

1. the lowest stage that fits, offloading only when nothing without offload fits; stage 1 is never
   chosen (stage 2 costs the same communication and needs less memory);
2. activation checkpointing only when activations are what does not fit;
3. on several nodes at stage 3, ZeRO++ hpZ when its node-local parameter copy still fits;
4. the largest micro-batch that fits (and divides the target global batch), then gradient
   accumulation to reach the global batch.

It prints the table, the walk, the DeepSpeed config (`-o` writes it), the nearest shipped preset and
the launch line. `--json` prints one JSON object on stdout and nothing else.

One module per step: `inputs` (flags, scenario files) and `models` -> `estimate` (prices, `plan.memory`)
-> `decide` (the walk) -> `artifacts` (DeepSpeed config, nearest preset, launch line) -> `report`; `cli`
is the command. `plan_for_resolved` (in `estimate`) prices a resolved preset for lint and the doctor.
"""
