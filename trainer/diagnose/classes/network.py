"""NCCL's transport failing (not timing out): no usable network interface, InfiniBand/RoCE errors, a peer that
went away, different NCCL versions on the ranks. The failure names the layer; the first change is the one that
layer needs, and the rerun carries NCCL_DEBUG=INFO so the next log shows the transport NCCL chose.

A "remote process exited" is often another rank's death (an OOM, a kill): those recognisers run first, so
reaching this one means the log shows no such death.
"""
from __future__ import annotations

import re

from typing import Optional

from ..findings import Diagnosis, Found, Proposal
from ..raised import final_exception

NCCL_FAILURE = re.compile(r"(unhandled system error|internal error - please report this issue to the NCCL|remote process exited or there was a network error|ncclSystemError|"
                          r"ncclInternalError|ncclRemoteError|NCCL WARN (NET|Bootstrap|Socket|Call to ibv|IB)|"
                          r"NET/IB ?:|socketStartConnect|Socket creation failed|no socket interface found|"
                          r"ibv_\w+ failed|NCCL Error \d+:|NCCL error in:.*(system|internal|remote))", re.IGNORECASE)
IB = re.compile(r"(NET/IB|ibv_\w+|\bmlx\d_\d|\bRoCE\b|InfiniBand|NCCL_IB_\w+|\bGID\b)")
NO_INTERFACE = re.compile(r"no socket interface found|No interface found|Bootstrap : no socket", re.IGNORECASE)
SOCKET = re.compile(r"(no socket interface found|Socket creation failed|socketStartConnect|Connection (refused|reset|"
                    r"timed out)|remote process exited or there was a network error|Bootstrap ?:|NET/Socket|Using internal Network Socket|"
                    r"NCCL_SOCKET_IFNAME|Address family not supported)", re.IGNORECASE)
NCCL_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)")
DEBUG_ENV = (("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", "INIT,NET"))


def diagnose_network(f: Found) -> Diagnosis:
    versions = sorted({m.group(1) for m in f.log.all(NCCL_VERSION)})
    if len(versions) > 1:
        d = Diagnosis("nccl_network", f"the ranks run different NCCL versions ({', '.join(versions)})", f.line)
        d.proposal = Proposal("install the same torch (and NCCL) on every node", [],
                              "NCCL's wire protocol differs between versions: one environment image or `pip install "
                              "torch==<same>` on each node, then `python -m trainer preflight` checks the versions "
                              "agree", env=DEBUG_ENV)
        return d
    facts = f.facts
    torch = f.versions.get("torch", "")
    if re.match(r"[01]\.", torch) and f.log.has(re.compile(r"unhandled system error|ncclSystemError|ncclInternalError|"
                                                            r"unhandled cuda error", re.IGNORECASE)):
        return _old_torch(f, torch)
    ib_off = facts.already_set("NCCL_IB_DISABLE", "1")
    wrong = _wrong_interface(f)
    if wrong:
        return wrong
    if f.log.has(IB) and not ib_off and _ib_beyond_exports(f):
        return _infiniband(f)
    if facts.single_node:
        return _one_node(f)
    if f.log.has(SOCKET) or ib_off:
        return _sockets(f)
    if (facts.nodes or 0) > 1:  # across nodes, no IB and no transport named: the socket interface, most often
        return _sockets(f, f"NCCL failed in a system call across {facts.nodes} nodes, with no InfiniBand in the log: "
                           f"most often the socket transport on an interface the other node cannot reach")
    d = Diagnosis("nccl_network", "NCCL failed in a system call (network, shared memory or a peer that went away)",
                  f.line)
    d.proposal = Proposal("rerun with NCCL_DEBUG=INFO to see which transport failed", [],
                          "'unhandled system error' is NCCL's code for a failing socket, InfiniBand verb or shared "
                          "memory call; the INFO log names it (the lines before the NCCL WARN) and the transport it "
                          "chose (NET/IB or NET/Socket, and the interface)", env=DEBUG_ENV)
    if not facts.single_node:
        d.advice.append("across nodes: pin the interface that connects them, NCCL_SOCKET_IFNAME=<iface> (`ip -br addr` "
                        "on each node)")
    if not facts.already_set("NCCL_IB_DISABLE"):
        d.advice.append("with InfiniBand/RoCE: test with NCCL_IB_DISABLE=1 - if sockets work, the IB setup is the "
                        "problem (NCCL_IB_HCA, NCCL_IB_GID_INDEX for RoCE, `ulimit -l` unlimited, `ibstat` ports Active)")
    if facts.single_node and facts.environment == "container":
        d.advice.append("one node in a container: NCCL's intra-node transports need the host's IPC and a large "
                        "/dev/shm - docker run --ipc=host (or --shm-size=16g)")
    d.advice.append("if another rank died first (OOM, kill), that is the cause: look for the first error of every rank")
    return d


def _old_torch(f: Found, torch: str) -> Diagnosis:
    """torch 1.x bundles an NCCL years older than today's: its system and internal errors are, first, fixed bugs."""
    d = Diagnosis("nccl_network", f"NCCL failed inside torch {torch}, whose bundled NCCL is years old", f.line)
    d.proposal = Proposal(f"upgrade torch (the run has {torch}; pip install -U torch brings a current NCCL with it), "
                          "then rerun with NCCL_DEBUG=INFO if it still fails", [],
                          "NCCL ships inside the torch wheel; the 'unhandled system/internal error's of the NCCL 2.4-"
                          "2.10 era (torch 1.x) include many fixed since, and this trainer needs torch 2.x anyway",
                          env=DEBUG_ENV)
    d.then.append(Proposal("if it persists: pin the interface the nodes share, NCCL_SOCKET_IFNAME=<iface>", [],
                           "`ip -br addr` on each node", env=DEBUG_ENV))
    return d


IFNAME_IGNORED = ("lo", "docker0")


def _one_node(f: Found) -> Diagnosis:
    """One node: the ranks talk through shared memory and P2P, not through an interface between nodes."""
    d = Diagnosis("nccl_network", "NCCL failed between the GPUs of one node (shared memory / P2P, not the network)",
                  f.line)
    if f.facts.environment == "container":
        d.proposal = Proposal("give the container the host's IPC and a large /dev/shm: docker run --ipc=host "
                              "(or --shm-size=16g)", [],
                              "on one node NCCL moves data through /dev/shm and CUDA IPC; a container's default 64 MB "
                              "/dev/shm and private IPC namespace break both", env=DEBUG_ENV)
    elif pcie_gpus(f):
        d.proposal = p2p_test(f)
    else:
        d.proposal = Proposal("rerun with NCCL_DEBUG=INFO; test with NCCL_P2P_DISABLE=1 (P2P between the GPUs)", [],
                              "on one node the transports are P2P (NVLink/PCIe) and shared memory; the INFO log names "
                              "the one that failed. P2P failing under IOMMU/ACS or a virtual machine is common: "
                              "NCCL_P2P_DISABLE=1 as a test", env=DEBUG_ENV)
    d.then.append(Proposal("or keep NCCL off shared memory", [], "NCCL_SHM_DISABLE=1 (slower)",
                           env=(("NCCL_SHM_DISABLE", "1"),)))
    d.advice.append("if another rank died first (OOM, kill), that is the cause: look for the first error of every rank")
    return d


def pcie_gpus(f: Found) -> bool:
    """The GPUs of the log (else of the preset) reach each other over PCIe, not NVLink."""
    return f.gpu.interconnect == "pcie"


def one_node(f: Found) -> bool:
    """One node, by the log's node count, else by the preset's."""
    return f.nodes == 1


def p2p_test(f: Found) -> Proposal:
    """PCIe GPUs of one node: P2P off as the test (consumer cards often have no working P2P at all)."""
    return Proposal("test with NCCL_P2P_DISABLE=1: these GPUs reach each other over PCIe, where peer-to-peer often "
                    "does not work (`nvidia-smi topo -m` shows the path)", [],
                    f"{f.gpu.description} has no NVLink: NCCL's P2P transport goes through the PCIe switch or the "
                    f"CPU, which ACS, the IOMMU, a virtual machine or a consumer card's driver breaks; if the run "
                    f"passes with P2P off (through host memory, slower), keep NCCL_P2P_DISABLE=1 or disable ACS/IOMMU",
                    env=(("NCCL_P2P_DISABLE", "1"),) + DEBUG_ENV)


IB_SIGNS = re.compile(r"(NET/IB|ibv_\w+|\bmlx\d_\d|\bRoCE\b|InfiniBand|\bGID\b)")
SETTING = re.compile(r"(NCCL_IB_\w+\s*=|NCCL_IB_\w+ set by environment)")


# NCCL chose TCP sockets: an IB line beside it is NCCL's sideband interface (IPoIB) or a failed probe, not IB in use
SOCKETS_CHOSEN = re.compile(r"(Using internal Network Socket|NET/Socket : Using \[|NET/IB : No device found)")
IB_NOT_USED = re.compile(r"(for sideband communication|NET/IB : No device found)")


def _ib_beyond_exports(f: Found) -> bool:
    """IB shows in the log beyond the user's own NCCL_IB_* settings: an export names IB, it does not show it used;
    nor does an IB line of a run whose NCCL says it chose sockets."""
    if f.log.has(SOCKETS_CHOSEN):
        return any(IB_SIGNS.search(line) and not IB_NOT_USED.search(line) for line in f.log.lines)
    return f.log.has(IB_SIGNS) or any(not SETTING.search(line) for line in f.log.lines if "NCCL_IB_" in line)


def _wrong_interface(f: Found):
    """NCCL_SOCKET_IFNAME set to an interface the log shows is not the one in use or up (or NCCL found none)."""
    named = f.facts.exported.get("NCCL_SOCKET_IFNAME")
    if not named or named.startswith(("^", "=")):
        return None
    wanted = [name.strip() for name in named.split(",")]
    others = [i for i in f.facts.interfaces if i not in IFNAME_IGNORED and not any(i.startswith(w) for w in wanted)]
    none_found = f.log.has(NO_INTERFACE)
    if not others and not none_found:
        return _one_name_for_several_nodes(f, named) if (f.facts.nodes or 0) > 1 and len(wanted) == 1 else None
    d = Diagnosis("nccl_network", f"NCCL_SOCKET_IFNAME={named} names an interface NCCL cannot use here", f.line)
    if f.facts.single_node and not others:  # one node: NCCL's bootstrap needs no more than the loopback
        d.proposal = Proposal("one node: point NCCL_SOCKET_IFNAME at the loopback, NCCL_SOCKET_IFNAME=lo (or unset it)",
                              [], f"the run exported NCCL_SOCKET_IFNAME={named}, and NCCL found no interface by that "
                              "name (in a container the names differ from the host's); the ranks of one node "
                              "bootstrap over any interface that is up, and lo always is",
                              env=(("NCCL_SOCKET_IFNAME", "lo"),) + DEBUG_ENV)
        return d
    target = others[0] if others else "<iface>"
    d.proposal = Proposal(f"set NCCL_SOCKET_IFNAME to the interface the nodes share: NCCL_SOCKET_IFNAME={target}", [],
                          f"the run exported NCCL_SOCKET_IFNAME={named}"
                          + (f", but the log shows {', '.join(others)}" if others else ", and NCCL found no interface "
                             "by that name") + "; `ip -br addr` on every node shows the names (they may differ per "
                          "node: a comma list, or a prefix such as NCCL_SOCKET_IFNAME=en)",
                          env=(("NCCL_SOCKET_IFNAME", target),) + DEBUG_ENV if others else DEBUG_ENV)
    return d


def _one_name_for_several_nodes(f: Found, named: str) -> Diagnosis:
    """One interface name for every node: on hosts whose NICs are named differently (enp6s0 here, enp4s0 there) the
    nodes without it find no interface - NCCL accepts a comma list, or a prefix."""
    d = Diagnosis("nccl_network", f"NCCL_SOCKET_IFNAME={named} on {f.facts.nodes} nodes: a node whose interface has "
                                  f"another name finds none", f.line)
    d.proposal = Proposal(f"name every node's interface: NCCL_SOCKET_IFNAME={named},<the other nodes' names> (a comma "
                          f"list), or a prefix they share (NCCL_SOCKET_IFNAME={re.sub(r'[0-9].*$', '', named) or named})",
                          [], f"the run exported one name, {named}, to every node; `ip -br addr` on each node shows its "
                          "own name for the interface on the nodes' network, and NCCL_SOCKET_IFNAME takes a comma list "
                          "(any of them) or a prefix", env=DEBUG_ENV)
    return d


# NCCL prints the work completion's status as libibverbs numbers it (enum ibv_wc_status, verbs.h): the number says
# which layer refused the transfer, and so which test comes first.
IB_COMPLETION = re.compile(r"Got completion (?:from peer \S+ )?with error (\d+)(?:, opcode \d+, len \d+, vendor err (\d+))?")
WC_STATUS = {1: "LOC_LEN_ERR", 2: "LOC_QP_OP_ERR", 4: "LOC_PROT_ERR", 5: "WR_FLUSH_ERR", 6: "MW_BIND_ERR",
             7: "BAD_RESP_ERR", 8: "LOC_ACCESS_ERR", 9: "REM_INV_REQ_ERR", 10: "REM_ACCESS_ERR", 11: "REM_OP_ERR",
             12: "RETRY_EXC_ERR", 13: "RNR_RETRY_EXC_ERR", 19: "FATAL_ERR", 20: "RESP_TIMEOUT_ERR", 21: "GENERAL_ERR"}
MEMORY_ACCESS = {4, 8, 10}  # the HCA could not read or write a registered buffer: with GPUs, GPUDirect RDMA
NO_ANSWER = {12, 13, 20}    # the packets were sent and never acknowledged: the path between the ports
FLUSHED = 5                 # the queue pair was already in error: an earlier failure, not this one


def _infiniband(f: Found) -> Diagnosis:
    codes = [int(m.group(1)) for m in f.log.all(IB_COMPLETION)]
    cause = next((c for c in codes if c != FLUSHED), codes[0] if codes else None)
    if cause in MEMORY_ACCESS:
        return _gpudirect(f, cause)
    if cause in NO_ANSWER:
        return _no_answer(f, cause)
    d = Diagnosis("nccl_network", "NCCL's InfiniBand/RoCE transport failed" +
                  (f" (work completion {_status(cause)})" if cause is not None else ""), f.line)
    d.proposal = Proposal("check the IB transport: NCCL_DEBUG=INFO, then NCCL_IB_DISABLE=1 as a test", [],
                          "the INFO log names the HCA and port NCCL used (NET/IB : Using [0]mlx5_0:1/RoCE); if the run "
                          "passes with NCCL_IB_DISABLE=1 (TCP sockets, slower) the fabric setup is at fault: pick the "
                          "right HCAs (NCCL_IB_HCA=mlx5_0,mlx5_1), the RoCE GID (NCCL_IB_GID_INDEX=3), unlimited locked "
                          "memory (`ulimit -l unlimited` in the launcher's environment) and ports that `ibstat` shows "
                          "Active", env=DEBUG_ENV)
    if cause == FLUSHED:
        d.advice.append("'error 5' (WR_FLUSH_ERR) is a transfer cancelled because its queue pair had already failed: "
                        "the first completion error of another rank, or a rank that died, is the cause")
    return d


def _status(code: int) -> str:
    return f"error {code}, IBV_WC_{WC_STATUS.get(code, 'status ' + str(code))}"


def _gpudirect(f: Found, code: int) -> Diagnosis:
    """A protection or access error on the HCA's side: the NIC could not reach the buffer it was given. With GPU
    buffers that is GPUDirect RDMA - PCIe ACS on the switches between the NIC and the GPU redirects the peer-to-peer
    reads through the root complex (or an IOMMU translates them), and the NIC gets nothing."""
    d = Diagnosis("nccl_network", f"the InfiniBand/RoCE adapter could not access the buffer of a transfer "
                                  f"(work completion {_status(code)}): GPUDirect RDMA, most often", f.line)
    d.proposal = Proposal(
        "disable PCIe ACS on the nodes (BIOS, or setpci on the PCIe switches) and run the IOMMU in passthrough "
        "(iommu=pt); NCCL_NET_GDR_LEVEL=LOC first confirms it", [],
        "with GPUDirect RDMA the NIC reads and writes GPU memory across the PCIe switch; ACS sends that traffic up to "
        "the root complex, where it is refused, and the HCA reports a protection error. If the run passes with "
        "NCCL_NET_GDR_LEVEL=LOC (GPUDirect RDMA off: slower, through host memory), that is the cause - NVIDIA's "
        "NCCL troubleshooting guide gives the setpci commands. Also check that nvidia-peermem is loaded "
        "(`lsmod | grep peermem`)", env=(("NCCL_NET_GDR_LEVEL", "LOC"),) + DEBUG_ENV)
    return d


def _no_answer(f: Found, code: int) -> Diagnosis:
    """The transfer's packets were never acknowledged: the two ports cannot reach each other the way NCCL
    addressed them. On RoCE the first suspect is the GID (RoCE v1 vs v2, the address family); then the timeout
    on a large fabric, then the links."""
    d = Diagnosis("nccl_network", f"InfiniBand/RoCE transfers to a peer were never acknowledged (work completion "
                                  f"{_status(code)})", f.line)
    if not f.facts.already_set("NCCL_IB_GID_INDEX"):
        d.proposal = Proposal(
            "on RoCE, pick the RoCE v2 GID: NCCL_IB_GID_INDEX=3 (`show_gids` lists the index of each port's RoCE v2 "
            "IPv4 address)", [],
            "retry-exceeded means the packets left and no acknowledgement came back; on RoCE the default GID may be "
            "RoCE v1 or a link-local address the other node's port does not route", env=(("NCCL_IB_GID_INDEX", "3"),)
            + DEBUG_ENV)
        d.then.append(_links_and_timeout())
    else:
        d.proposal = _links_and_timeout()
        d.advice.append(f"the run already set NCCL_IB_GID_INDEX={f.facts.exported['NCCL_IB_GID_INDEX']}: check with "
                        "`show_gids` that it is the RoCE v2 entry on every node")
    return d


def _links_and_timeout() -> Proposal:
    return Proposal("check the links and give the fabric more time: `ibstat` (ports Active, the same rate), "
                    "`ibv_rc_pingpong` between the two hosts, NCCL_IB_TIMEOUT=22", [],
                    "a flapping link, a switch port or congestion without PFC drop the packets; NCCL_IB_TIMEOUT raises "
                    "the ack timeout (4.096 us x 2^timeout) for large fabrics", env=(("NCCL_IB_TIMEOUT", "22"),))


def _sockets(f: Found, title: str = "NCCL's socket transport found no usable interface or lost its peer") -> Diagnosis:
    d = Diagnosis("nccl_network", title, f.line)
    d.proposal = Proposal("pin the interface that connects the nodes: NCCL_SOCKET_IFNAME=<iface>", [],
                          "NCCL picks the first interface that is not loopback or docker; on hosts with several "
                          "(bridges, VPNs, a second NIC) it may pick one the peers cannot reach, or find none inside a "
                          "container. `ip -br addr` on each node shows the interface on the nodes' network; set "
                          "NCCL_SOCKET_IFNAME to it (a comma list when the names differ per node) on every node, and "
                          "NCCL_DEBUG=INFO shows the one it used (NET/Socket : Using [0]eth0:10.0.0.1)", env=DEBUG_ENV)
    if not f.facts.already_set("NCCL_IB_DISABLE"):
        d.advice.append("without InfiniBand add NCCL_IB_DISABLE=1 so NCCL does not probe for it")
    d.advice.append("if another rank died first (OOM, kill), that is the cause: look for the first error of every rank")
    return d


# --- a log that stops while a communicator is set up ---------------------------------------------------------

# Lines NCCL (or the framework around it) prints while it builds a communicator: its transports are chosen and
# connected there, so an error right after one, with no exception that says more, is the transport failing.
COMMUNICATOR_SETUP = re.compile(r"(Initializ\w* \w*Nccl\w*Communicator|PyNcclCommunicator|ncclCommInit\w*|"
                                r"NCCL INFO (comm 0x\w+ rank|Channel \d+/\d+|Connected all|Using network|"
                                r"Bootstrap)|Found nccl from library|is using nccl==|NCCL version \d|"
                                r"init_process_group|ProcessGroupNCCL)", re.IGNORECASE)
FAILED = re.compile(r"(\bERROR\b|Traceback \(most recent call last\)|\bfailed\b|\bError\b)")
SETUP_WINDOW = 8  # non-empty lines after the last setup line within which the error must come


def find_at_communicator(log) -> Optional[int]:
    """The first error within a few lines after the log's last communicator-setup line, when the log's final
    exception (if any) states nothing more (a cut log, a bare 'Traceback')."""
    raised = final_exception(log)
    if raised is not None and raised.message.strip():
        return None
    setup = log.last(COMMUNICATOR_SETUP)
    if setup is None:
        return None
    after = [i for i in range(setup + 1, len(log.lines)) if log.lines[i].strip()][:SETUP_WINDOW]
    return next((i for i in after if FAILED.search(log.lines[i])), None)


def diagnose_at_communicator(f: Found) -> Diagnosis:
    """The transports of one node (P2P, shared memory) or of several (sockets, IB), as the nodes say: the log's
    node count, else the preset's."""
    d = _one_node(f) if one_node(f) else diagnose_network(f)
    d.title = f"an error right after NCCL began setting up a communicator, where it connects its transports: {d.title}"
    if f.facts.nodes is None:
        d.advice.insert(0, f"the log does not say how many nodes ran; this reads it as {f.nodes} node(s), as "
                           f"{f.resolved.config.name} is - pass --set hardware.nodes=N when it was another count")
    return d

