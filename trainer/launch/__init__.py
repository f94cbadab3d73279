"""Starting ranks. `cli` is `python -m trainer launch` (one entry for every launcher); `topology` checks the
nodes x ranks against the preset; `hostfile` reads DeepSpeed hostfiles; `fabric` the NCCL profiles
(`fabrics/*.env`); `command` builds the one launch line (also what the planner, doctor and preset headers
print); `runner` runs deepspeed/torchrun/sbatch, `slurm` writes the sbatch script, `record` prints the command
and writes `launch.json`; `supervisor` is the node-local launcher that keeps the preemption promise; `signals` its handlers, up from the
launch's first instant; `shell` quotes every value written for a shell and refuses what cannot be quoted
(sbatch directives, DeepSpeed's pdsh command line, host names); `dsenv` the DS_ENV_FILE, secrets kept out of
the run directory."""
