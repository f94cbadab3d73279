"""`python -m trainer preflight`: before a long run, measure the fabric and check the ranks agree.

bandwidth.py (all-reduce / all-gather bus bandwidth over message sizes, as nccl-tests reports it) ->
nodes.py (ranks grouped into nodes, node pairs, slow links; pure) -> agree.py (versions and the resolved-config
hash every rank must share; pure) -> cli.py (the command: ranks up, measure, one report from rank 0).
"""
