"""`python -m trainer preflight` (issue 11): nccl-tests' bandwidth figures, the node grouping and slow-link
verdict (pure, with made-up hostnames), the agreement checks, and real 2-rank gloo runs under DeepSpeed's
launcher and a two-"node" torchrun rendezvous on loopback where one node was launched with another --set."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from distributed import DEEPSPEED, REPO, new_port, remove_shm_buffers, run_cli
from trainer.errors import UserError
from trainer.preflight import nodes as nd
from trainer.preflight.agree import config_differences, disagreements
from trainer.provenance import resolved_hash
from trainer.preflight.bandwidth import Measurement, bus_factor, parse_sizes

TORCHRUN = DEEPSPEED.parent / "torchrun"


# --- the formula (nccl-tests doc/PERFORMANCE.md) -------------------------------------------------------------

def test_bus_bandwidth_is_nccl_tests_formula():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_gather", 2) == 0.5
    # 1 GB in 0.1 s on 8 ranks: algbw 10 GB/s; a ring all-reduce carried 17.5 GB/s per link, all-gather 8.75
    reduce = Measurement("all_reduce", 10 ** 9, 8, 0.1)
    gather = Measurement("all_gather", 10 ** 9, 8, 0.1)
    assert reduce.algbw_gbps == pytest.approx(10.0) and reduce.busbw_gbps == pytest.approx(17.5)
    assert gather.algbw_gbps == pytest.approx(10.0) and gather.busbw_gbps == pytest.approx(8.75)
    assert Measurement("all_reduce", 10 ** 9, 1, 0.1).busbw_gbps == 0.0  # one rank moves nothing over a link


def test_sizes_parse_binary_units_and_bad_ones_are_named():
    assert parse_sizes("1M,64K, 16M,1K") == [1024, 65536, 1 << 20, 16 << 20]
    assert parse_sizes("2G,512") == [512, 2 << 30]
    with pytest.raises(UserError, match=r"--sizes .*'0'.*'ten'.*e\.g\. --sizes"):
        parse_sizes("0,ten,1M")


@pytest.mark.slow
def test_bad_settings_are_refused_before_any_rank_starts():
    result = run_cli("preflight", "--iters", "0")
    assert result.returncode == 2
    assert "argument --iters: '0' must be >= 1" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("preflight", "--sizes", "1X,1000G", "--world-size", "3")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--sizes '1X,1000G'" in result.stderr and "'1X'" in result.stderr and "'1000G'" in result.stderr
    assert "--world-size 3, but 1 rank(s) are running" in result.stderr  # the rest reported together


# --- nodes, pairs, slow links (pure; made-up hostnames) -------------------------------------------------------

def test_ranks_group_by_hostname_and_the_launchers_node_index():
    assert nd.node_index({"GROUP_RANK": "3", "CROSS_RANK": "1"}) == "3"     # torchrun's name first
    assert nd.node_index({"CROSS_RANK": "1"}) == "1"                        # DeepSpeed's launcher
    assert nd.node_index({"SLURM_NODEID": "2"}) == "2" and nd.node_index({}) is None
    keys = [nd.node_key(host, None) for host in ("gpu-a", "gpu-a", "gpu-b", "gpu-b", "gpu-c", "gpu-c")]
    nodes = nd.group_nodes(keys)
    assert [(n.key, n.ranks) for n in nodes] == [("gpu-a", (0, 1)), ("gpu-b", (2, 3)), ("gpu-c", (4, 5))]
    assert nd.node_pairs(nodes) == [(0, 1), (0, 2), (1, 2)]
    assert [nd.pair_ranks(nodes, p) for p in nd.node_pairs(nodes)] == [(0, 2), (0, 4), (2, 4)]
    # two containers with one hostname are still two nodes when the launcher numbered them
    same_host = nd.group_nodes([nd.node_key("pod", str(r // 2)) for r in range(4)])
    assert [n.ranks for n in same_host] == [(0, 1), (2, 3)] and nd.node_pairs(same_host) == [(0, 1)]
    assert nd.node_pairs(nd.group_nodes(["one"] * 8)) == []


def test_a_node_that_disagrees_with_local_world_size_is_named():
    nodes = nd.group_nodes(["pod"] * 4)  # two machines that share a hostname, no node index
    problems = nd.local_size_problems(nodes, [2, 2, 2, 2])
    assert len(problems) == 1 and "node pod: 4 rank(s)" in problems[0] and "LOCAL_WORLD_SIZE=2" in problems[0]
    assert nd.local_size_problems(nd.group_nodes(["a", "a", "b", "b"]), [2, 2, 2, 2]) == []
    assert nd.local_size_problems(nodes, [None] * 4) == []  # nothing told, nothing to compare


def test_slow_links_are_below_half_the_median_or_half_the_expected_figure():
    threshold, slow = nd.slow_pairs([40.0, 41.0, 39.0, 12.0])
    assert threshold == pytest.approx(0.5 * 39.5) and slow == [3]
    assert nd.slow_pairs([40.0]) == (20.0, [])                      # one pair is its own median: never slow
    threshold, slow = nd.slow_pairs([40.0, 15.0], expected=45.0)    # the fabric's figure is the reference
    assert threshold == pytest.approx(22.5) and slow == [1]
    assert nd.slow_pairs([]) == (0.0, [])


# --- agreement ------------------------------------------------------------------------------------------------

def _rank(rank, host="h0", torch="2.13.0", config=None, error=None):
    config = config if config is not None else {"train": {"lr": 0.003}, "name": "tiny_cpu"}
    return {"rank": rank, "host": host, "versions": {"torch": torch, "deepspeed": "0.19.8", "trainer": "0.1.0"},
            "config": None if error else config, "config_hash": None if error else resolved_hash(config),
            "config_error": error}


def test_resolved_hash_is_stable_and_sensitive():
    a = {"train": {"lr": 0.003, "betas": [0.9, 0.95]}, "name": "x"}
    b = {"name": "x", "train": {"betas": [0.9, 0.95], "lr": 0.003}}  # the same record, keys in another order
    assert resolved_hash(a) == resolved_hash(b) and resolved_hash(a).startswith("sha256:")
    assert resolved_hash(a) != resolved_hash({**a, "train": {**a["train"], "lr": 0.001}})


def test_disagreements_name_the_version_the_ranks_and_the_config_key():
    same = [_rank(0), _rank(1)]
    assert disagreements(same) == []
    problems = disagreements([_rank(0), _rank(1), _rank(2, "h1", torch="2.12.0")])
    assert problems == ["torch version differs: 2.13.0 on rank(s) 0, 1; 2.12.0 on rank(s) 2 (install the same "
                        "stack on every node)"]
    other = _rank(1, "h1", config={"train": {"lr": 0.001}, "name": "tiny_cpu"})
    (problem,) = disagreements([_rank(0), other])
    assert problem.startswith("resolved-preset hash: rank 1 (h1)") and "train.lr=0.001 vs 0.003" in problem
    (problem,) = disagreements([_rank(0), _rank(1, error="1 problem(s): train.lr=-1 must be > 0")])
    assert problem == "rank 1 (h0): the preset does not resolve: 1 problem(s): train.lr=-1 must be > 0"
    assert config_differences({"a": {"b": 1}}, {"a": {"c": 1}}) == ['a.b=1 vs "<absent>"', 'a.c="<absent>" vs 1']


# --- real ranks (gloo on CPU) ---------------------------------------------------------------------------------

def _env(extra=None) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(extra or {})}


def _check_measured(report: dict, sizes: list[int], ranks: int) -> None:
    for op in ("all_reduce", "all_gather"):
        rows = [c for c in report["collectives"] if c["op"] == op]
        assert [c["bytes"] for c in rows] == sizes, rows
        for c in rows:
            assert c["ranks"] == ranks and c["time_s"] > 0 and c["algbw_gbps"] > 0 and c["busbw_gbps"] > 0, c
            assert c["algbw_gbps"] == pytest.approx(c["bytes"] / c["time_s"] / 1e9)


@pytest.mark.multirank
def test_two_ranks_under_deepspeed_measure_every_size_and_agree(tmp_path):
    out = tmp_path / "preflight.json"
    port = new_port()
    cmd = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(port), "--module", "trainer", "preflight",
           "--preset", "tiny_cpu", "--sizes", "4K,256K,2M", "--warmup", "2", "--iters", "5", "--json", str(out)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    finally:
        remove_shm_buffers(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["verdict"] == "ok" and report["problems"] == [] and report["backend"] == "gloo"
    assert report["world_size"] == 2 and len(report["nodes"]) == 1 and report["node_pairs"] == []
    _check_measured(report, [4096, 262144, 2 << 20], ranks=2)
    assert len({r["config_hash"] for r in report["ranks"]}) == 1 and report["ranks"][0]["config_error"] is None
    assert all(r["memory"] == "host" and 0 < r["free_bytes"] <= r["total_bytes"] for r in report["ranks"])
    assert "verdict: ok" in proc.stdout and "busbw GB/s" in proc.stdout
    assert not list(tmp_path.glob(".preflight.json.*"))  # written whole: no temporary file left


@pytest.mark.multirank
def test_a_node_launched_with_another_set_fails_naming_the_key(tmp_path):
    """Two torchrun "nodes" on loopback (one rank each): node 1's launch line has an extra --set, as when one
    node's job script differs. Both exit 1; the report names the key; the node pair link is still measured."""
    out = tmp_path / "preflight.json"
    port = new_port()
    procs = []
    for node in (0, 1):
        extra = ["--set", "train.lr=0.001"] if node == 1 else []
        cmd = [str(TORCHRUN), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr",
               "127.0.0.1", "--master-port", str(port), "-m", "trainer", "preflight", "--preset", "tiny_cpu",
               "--sizes", "64K", "--warmup", "1", "--iters", "3", "--json", str(out), *extra]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        remove_shm_buffers(port)
    assert [p.returncode for p in procs] == [1, 1], outputs[0][-3000:] + outputs[1][-3000:]
    report = json.loads(out.read_text())
    assert report["verdict"] == "fail"
    (problem,) = report["problems"]
    assert "resolved-preset hash: rank 1" in problem and "train.lr=0.001 vs 0.003" in problem, problem
    assert "verdict: FAIL" in outputs[0] and "train.lr=0.001 vs 0.003" in outputs[0]
    assert [n["ranks"] for n in report["nodes"]] == [[0], [1]]
    (pair,) = report["node_pairs"]
    assert pair["ranks"] == [0, 1] and pair["time_s"] > 0 and pair["busbw_gbps"] > 0 and pair["slow"] is False
    _check_measured(report, [65536], ranks=2)
