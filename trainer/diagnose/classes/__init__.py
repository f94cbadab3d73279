"""The doctor's failure classes beyond memory and collective timeouts, one module per area: launching the
ranks (launch), NCCL's network transport (network), compilers, CUDA toolkits and JIT-built ops (toolkit),
checkpoints and ZeRO-3 weights (checkpoint), messages that state their own fix (messages), known version
regressions (versions, with its table in versions.yaml), and the answer when nothing matches (fallback)."""
