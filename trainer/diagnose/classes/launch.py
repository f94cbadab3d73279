"""Launching the ranks: a launcher's argument the script does not take, a rendezvous port that cannot be bound,
ranks started without a launcher (plain `python`, mpirun without the torch variables), ssh to the hostfile's
nodes, a batch triad built for another world size, and a /dev/shm too small for the ranks (Docker's 64 MB).

Every proposal reruns the preset the way it is meant to run: with the launcher, for the preset's world size.
"""
from __future__ import annotations

import re
from typing import Optional

from ... import ds as dsc
from .. import oserror
from ..findings import Diagnosis, Found, Proposal

DEFAULT_PORT = 29500  # the deepspeed and torchrun default rendezvous port

# --- arguments the launcher passes ------------------------------------------------------------------------------

UNRECOGNIZED = re.compile(r"error: unrecognized arguments: (.+)$")
LOCAL_RANK = re.compile(r"--local[_-]rank")


def find_unrecognized(log) -> Optional[int]:
    return log.last(UNRECOGNIZED)


def diagnose_launch_args(f: Found) -> Diagnosis:
    """argparse refused arguments: --local_rank is the launcher's (deepspeed and torch.distributed.launch pass
    it to every rank); anything else is the command line's."""
    match = UNRECOGNIZED.search(f.line)
    args = match.group(1).split() if match else []
    script = (f.line.split(":", 1)[0] or "the script").strip()
    if any(LOCAL_RANK.match(a) for a in args):
        d = Diagnosis("launch_args", f"{script} does not accept --local_rank, which the launcher passes to every rank",
                      f.line)
        d.proposal = Proposal(f"let {script} accept --local_rank", [],
                              "the deepspeed launcher (and the old `python -m torch.distributed.launch`) starts each "
                              "rank as `script --local_rank=N ...`; add `parser.add_argument(\"--local_rank\", "
                              "\"--local-rank\", type=int, default=-1)` to the script's parser (torch >= 2.0's launch "
                              "spells it --local-rank), or start the ranks with `deepspeed --no_local_rank` / torchrun, "
                              "which pass it as the LOCAL_RANK environment variable. This trainer's train.py accepts "
                              "both spellings")
        return d
    d = Diagnosis("launch_args", f"{script} refused arguments it does not define: {' '.join(args)}", f.line)
    d.proposal = Proposal("fix the command line", [],
                          f"{script}'s parser has no {', '.join(a.split('=')[0] for a in args)}: a misspelt flag, a "
                          f"flag of another version of the script, or an argument meant for the launcher placed after "
                          f"the script name (launcher flags go before it). `{script} --help` lists what it takes")
    return d


# --- the rendezvous port -----------------------------------------------------------------------------------------

PORT_IN_USE = re.compile(r"(Address already in use|EADDRINUSE|errno: 98\b|failed to bind to \S+:(\d+) \(errno: 13|"
                         r"bind.*Permission denied)", re.IGNORECASE)
BOUND_PORT = re.compile(r"(?:failed to bind to \S*?:|\bport:? |master_port[= ])(\d{2,5})\b")


def diagnose_port(f: Found) -> Diagnosis:
    ports = [int(m.group(1)) for m in f.log.all(BOUND_PORT)]
    port = ports[-1] if ports else None
    privileged = port is not None and port < 1024
    new_port = DEFAULT_PORT + 1 if port in (None, DEFAULT_PORT) or privileged else port + 1
    where = f"port {port}" if port else "the rendezvous port"
    why = (f"ports below 1024 need root (errno 13): {where} cannot be bound by a user" if privileged else
           f"another process already listens on {where}: a second job on this machine, or ranks of an earlier run "
           f"that are still alive (`ss -ltnp 'sport = :{port or DEFAULT_PORT}'` names it; stop it if it is a "
           f"leftover)")
    d = Diagnosis("port_in_use", f"the rendezvous could not bind {where}", f.line)
    d.proposal = Proposal(f"rerun on another, free port: --master_port {new_port}", [],
                          f"{why}. Every job on a machine needs its own --master_port; the rank-0 TCP store binds "
                          f"it on the master node", master_port=new_port)
    return d


DEVICES_IGNORED = re.compile(r"Detected (?:CUDA|HIP|ASCEND_RT|HABANA)_VISIBLE_(?:DEVICES|MODULES)=(?P<ids>[\w,]+) but "
                             r"ignoring it because one or several of --include/--exclude/--num_gpus/--num_nodes")


def diagnose_devices_ignored(f: Found) -> Diagnosis:
    """DeepSpeed's runner drops CUDA_VISIBLE_DEVICES whenever a slot flag is given, and places ranks on GPUs 0..N-1:
    the ranks land on GPUs the user meant to leave alone (busy ones, or another job's: OOM, hangs)."""
    ids = f.match.group("ids") if f.match else DEVICES_IGNORED.search(f.log.joined(f.index)).group("ids")
    d = Diagnosis("devices_ignored", f"DeepSpeed's launcher ignored the GPUs the run named ({ids})", f.line)
    through_accelerate = bool(re.search(r"\baccelerate\b", "\n".join(f.log.lines), re.IGNORECASE))
    d.proposal = Proposal(
        f"name the GPUs with the launcher instead: deepspeed --include localhost:{ids} (and no --num_gpus)", [],
        "DeepSpeed's runner reads CUDA_VISIBLE_DEVICES only when none of --include/--exclude/--num_gpus/--num_nodes is "
        "given, and otherwise starts its ranks on GPUs 0..N-1; --include host:ids is its own way to pick them"
        + ("; the log shows accelerate: accelerate before 0.13 passed --num_gpus to DeepSpeed itself (upgrade "
           "accelerate, which honours gpu_ids)" if through_accelerate else ""))
    if through_accelerate:
        d.then.append(Proposal("or upgrade accelerate (pip install -U accelerate): from 0.13 it passes no slot flag, "
                               "so CUDA_VISIBLE_DEVICES / gpu_ids hold", [], "accelerate PR #626"))
    return d


# DeepSpeed's runner checks --include against the node's slots (a hostfile's slots=N, else the GPUs it counts); with
# CUDA_VISIBLE_DEVICES set and no slot flag it makes --include localhost:<those ids> itself, and releases before PR
# 6530 counted the GPUs with the variable still set: ids 0,2 against the two slots 0,1
NO_SLOT = re.compile(r"No slot '(?P<slot>[^']+)' specified on host '(?P<host>[^']+)'")
SET_INCLUDE = re.compile(r"Detected (?:CUDA|HIP|ASCEND_RT|HABANA)_VISIBLE_(?:DEVICES|MODULES)=(?P<ids>[\w,]+): setting "
                         r"--include")
EXPLICIT_INCLUDE = re.compile(r"(?:--include[= ]|-i )\S+")


def diagnose_no_slot(f: Found) -> Diagnosis:
    m = NO_SLOT.search(f.log.joined(f.index))
    slot, host = m.group("slot"), m.group("host")
    made = SET_INCLUDE.search(f.log.text)
    d = Diagnosis("no_slot", f"the launcher's GPU list names slot {slot}, which host {host} does not have", f.line)
    if EXPLICIT_INCLUDE.search(f.log.text) and not made:
        d.proposal = Proposal(f"name only slots {host} has in --include (0..N-1 for a node of N GPUs, or a hostfile's "
                              f"slots=N)", [], "DeepSpeed's runner checks each --include id against the host's slots: "
                              "the hostfile's slots=N, or on one node without a hostfile the GPUs it counts")
        return d
    ids = made.group("ids") if made else "IDS"
    d.proposal = Proposal(f"unset CUDA_VISIBLE_DEVICES and name the GPUs with the launcher: deepspeed --include "
                          f"{host}:{ids}", [],
                          "with CUDA_VISIBLE_DEVICES set and no slot flag, DeepSpeed's runner turns it into --include "
                          f"{host}:<those ids> and checks them against the node's slots; releases before DeepSpeed PR "
                          "6530 counted the slots with the variable still set (ids 0,2 against slots 0,1). --include "
                          "takes the GPUs' own numbers in every release")
    d.then.append(Proposal(f"or upgrade DeepSpeed (pip install -U deepspeed): its runner counts the node's GPUs before "
                           f"reading CUDA_VISIBLE_DEVICES", [], "DeepSpeed PR 6530"))
    return d


RENDEZVOUS = re.compile(r"(?:client socket has (?:failed to connect|timed out[^\n]*?while trying to connect) to "
                        r"(?:any network address of )?(?:\[(?P<host>[^\]]+)\]|\((?P<host2>[^,\s]+),))|(?:c10d|TCPStore)"
                        r"[^\n]*Cannot assign requested address")
LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}
# the store's own structure, whatever the message's wording: a connection that failed, raised where a TCP store or a
# process group is created (torchrun's c10d rendezvous, the env:// handler, a gloo group of a data loader)
CONNECT_FAILED = re.compile(r"(connect\(\) timed out|Connection refused|No route to host|Connection timed out|failed to "
                            r"connect|Connection reset|Network is unreachable)", re.IGNORECASE)
STORE_SITE = re.compile(r"(TCPStore|_create_tcp_store|_create_c10d_store|rendezvous|new_group|init_process_group|"
                        r"ProcessGroupGloo)")
GROUP_CALL = re.compile(r"\b(new_group|init_process_group)\(")
GLOO = re.compile(r"(backend\s*=\s*['\"]gloo['\"]|ProcessGroupGloo|\bGloo\b|gloo/transport)", re.IGNORECASE)
RDZV_ENDPOINT = re.compile(r"(rdzv_endpoint|c10d_rendezvous_backend|_create_tcp_store)")


def find_rendezvous(log) -> Optional[int]:
    """The store's connection failing: the message says so (RENDEZVOUS), or a connection error is raised at a
    store's or a group's creation, or a traceback cut with no message ends in a process group's creation."""
    from ..raised import final_exception
    index = log.first(RENDEZVOUS)
    if index is not None:
        return index
    raised = final_exception(log)
    if raised is None or not raised.frames:
        return None
    at_store = any(STORE_SITE.search(f"{frame.func} {frame.code or ''}") for frame in raised.frames[-3:])
    if raised.message.strip():
        return raised.index if at_store and CONNECT_FAILED.search(raised.message) else None
    last = raised.frames[-1]
    return raised.index if GROUP_CALL.search(last.code or "") else None  # cut while a group was being created


def diagnose_rendezvous(f: Found) -> Diagnosis:
    """The ranks cannot reach the rank-0 TCP store: the master address is the fix, not the port. One node (the log
    says so, or the store is on a loopback name) rendezvous on 127.0.0.1; across nodes the head's address must be
    one every node reaches, with the port open."""
    m = next(iter(f.log.all(RENDEZVOUS)), None)
    host = (m.group("host") or m.group("host2")) if m else None
    d = Diagnosis("rendezvous", f"the ranks could not reach the rendezvous store{' at ' + host if host else ''}", f.line)
    if f.log.has(GLOO):
        d.title = "a gloo process group could not connect its ranks"
        d.proposal = Proposal("set GLOO_SOCKET_IFNAME to the network interface the nodes share (e.g. "
                              "GLOO_SOCKET_IFNAME=eth0; `ip -br addr` names it)", [],
                              "gloo connects the ranks over the address its host name resolves to - on many images "
                              "127.0.1.1 from /etc/hosts, which no other node reaches; the interface pins it (NCCL's "
                              "NCCL_SOCKET_IFNAME does not apply to gloo groups)")
        return d
    if f.log.has(RDZV_ENDPOINT) and not (f.facts.single_node or host in LOOPBACK):
        d.proposal = Proposal("give torchrun's --rdzv_endpoint as the head's hostname that resolves on every node "
                              "(/etc/hosts), or its IP on the shared network, with the port open", [],
                              "the c10d rendezvous backend creates its TCP store on the endpoint's host; an agent that "
                              "cannot connect to it in 60 s fails like this. Check from a worker: `getent hosts HEAD`, "
                              "`nc -zv HEAD PORT`; a firewall or a container without --network=host blocks it")
        return d
    if f.facts.single_node or (host in LOOPBACK and not (f.facts.nodes or 0) > 1):
        d.proposal = Proposal("one node: rendezvous on the IPv4 loopback, --master_addr 127.0.0.1 (MASTER_ADDR=127.0.0.1)",
                              [], f"{host or 'the master address'} did not give the ranks an address they can "
                              "connect to (errno 99 'Cannot assign requested address': 'localhost' resolved to an "
                              "address this host cannot use, such as IPv6 ::1 with IPv6 off, or a stale /etc/hosts "
                              "entry); the ranks of one node need nothing but 127.0.0.1")
        return d
    d.proposal = Proposal("point --master_addr at the head node's address every node reaches, with the port open", [],
                          f"the store{' at ' + host if host else ''} was not reachable from this rank: use the head's "
                          "IP on the shared network (`hostname -I` on it), and check the port from a worker (`nc -zv "
                          "HEAD PORT`); a firewall or a container without --network=host blocks it")
    return d


# a log that ends inside the process group's start: the ranks never all arrived at the rendezvous
INIT_LINE = re.compile(r"(init_distributed|Initializing TorchBackend|Added key: store_based_barrier_key|Waiting in store "
                       r"based barrier|Rendezvous'ing|rendezvous(?:ing)? (?:with|for)|init_process_group|"
                       r"Distributed environment: |MASTER_ADDR=\S+ MASTER_PORT=)", re.IGNORECASE)
ERROR_LIKE = re.compile(r"(Error|Exception|Traceback|error:|FAILED|fatal|Killed|exits? with return code [^0])",
                        re.IGNORECASE)


def find_stopped_at_init(log) -> Optional[int]:
    """The last line, when the log's last lines are the process group's start and nothing in it is an error."""
    tail = [i for i, line in enumerate(log.lines) if line.strip()][-3:]
    if not tail or log.has(ERROR_LIKE) or not INIT_LINE.search(log.line(tail[-1])):
        return None
    return tail[-1]


def diagnose_stopped_at_init(f: Found) -> Diagnosis:
    """Every rank started the process group and the log stops there: they never met. The usual cause is a rank
    that was given another rendezvous port or address than the others (a launcher config's port 0 or 'random', a
    per-process MASTER_PORT), or a port another job already holds."""
    d = Diagnosis("stopped_at_init", "the log stops while the ranks start the process group: they never met at the "
                                     "rendezvous", f.line)
    d.proposal = Proposal(
        "give every rank one fixed, free rendezvous port and address: deepspeed/torchrun --master_port 29500 "
        "--master_addr <head>; in an accelerate config, main_process_port: 29500 (not 0, which lets each process pick "
        "its own)", [],
        "a rank waits in the store until all WORLD_SIZE ranks arrive; one that was told another port or address never "
        "arrives, and nothing fails until the timeout (30 min by default). `ss -ltnp 'sport = :29500'` shows another "
        "job on the port", env=(("NCCL_DEBUG", "INFO"), ("TORCH_DISTRIBUTED_DEBUG", "DETAIL")))
    d.then.append(Proposal("if the port is right: one node? --master_addr 127.0.0.1; several: the head's address "
                           "every node reaches", [], "a store bound to an address the other ranks cannot reach "
                           "waits the same way"))
    return d


# --- ranks started without a launcher ----------------------------------------------------------------------------

NO_LAUNCHER = re.compile(r"(environment variable (RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT|LOCAL_RANK) expected, but "
                         r"not set|Default process group has not been initialized|KeyError: '(RANK|LOCAL_RANK|"
                         r"WORLD_SIZE)'|env:// rendezvous: \w+ not set)")


def diagnose_no_launcher(f: Found) -> Diagnosis:
    return not_distributed(f, "torch.distributed found none of the variables a launcher sets (RANK, WORLD_SIZE, "
                              "MASTER_ADDR, MASTER_PORT): the script was started as a plain `python` process")


def diagnose_triad(f: Found) -> Diagnosis:
    r, hw = f.resolved, f.resolved.config.hardware
    if f.match is None:  # the numbers wrapped past what the recogniser joins
        return Diagnosis("batch_triad", "batch-size triad: train_batch_size != micro x accumulation x world size",
                         f.line, advice=["run `python -m trainer show PRESET` for the triad the trainer solves"])
    total, micro, accum, world = (int(x) for x in f.match.groups())
    if world == 1 and r.world_size > 1:
        return _not_distributed(f, total)
    d = Diagnosis("batch_triad", f"batch-size triad: {total} != {micro} x {accum} x {world} (world size {world})",
                  f.line)
    overrides = []
    if world != r.world_size:
        nodes = hw.nodes if world % hw.nodes == 0 else 1
        overrides += ([f"hardware.nodes={nodes}"] if nodes != hw.nodes else []) + [
            f"hardware.gpus_per_node={world // nodes}"]
    accum_for_total = dsc.accumulation(total, micro, world)
    if accum_for_total:
        overrides += [f"train.micro_batch_size={micro}", f"train.grad_accum={accum_for_total}"]
        keep = f"grad_accum {accum_for_total} keeps train_batch_size {total} at world size {world}"
    else:  # the global batch is not divisible by micro x world: no accumulation reaches it
        overrides += [f"train.micro_batch_size={micro}", f"train.grad_accum={accum}"]
        keep = (f"{total} is not divisible by micro x world size = {micro * world}, so no accumulation gives it: "
                f"train_batch_size becomes {micro * accum * world} (or choose one divisible by {micro * world})")
    d.proposal = Proposal("make the triad agree with the launched world size", overrides,
                          f"DeepSpeed requires train_batch_size = micro x accumulation x world size (the global "
                          f"world, also under AutoTP); {keep}. The trainer solves the third value from the other two "
                          f"when the DeepSpeed batch keys are 'auto'")
    return d


def _not_distributed(f: Found, total: int) -> Diagnosis:
    return not_distributed(f, "DeepSpeed saw world size 1")


def not_distributed(f: Found, why: str) -> Diagnosis:
    r = f.resolved
    d = Diagnosis("not_distributed", f"the ranks never joined one process group: {why}; preset {r.config.name} "
                                     f"needs {r.world_size} rank{'s' if r.world_size > 1 else ''}", f.line)
    d.proposal = Proposal(f"launch the {r.world_size} ranks with a launcher that sets up torch.distributed", [],
                          "world size 1 with train_batch_size built for several ranks means each process ran alone "
                          "(started by mpirun/srun or plain python without RANK/WORLD_SIZE/MASTER_ADDR, or the "
                          "DeepSpeed config was checked before the process group existed); training on one GPU is "
                          "not the fix. Start the ranks with the command below")
    d.advice += [
        "under mpirun/srun run `python -m trainer launch --preset P --nnodes N --node-rank $NODE_RANK --master-addr "
        "HEAD` once per node (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or export those from "
        "OMPI_COMM_WORLD_* / SLURM_* before starting python",
        "in your own script, call deepspeed.init_distributed() (or build TrainingArguments) before anything creates "
        "the DeepSpeed config or enters zero.Init: until then DeepSpeed reads world size 1",
    ]
    return d


SSH_HOST = [re.compile(p) for p in (r"host=(\S+) was not reachable", r"ssh -o PasswordAuthentication=no (\S+) hostname",
                                    r"^(\S+): ssh exited with exit code", r"^(\S+?): .*Permission denied")]


def diagnose_ssh(f: Found) -> Diagnosis:
    host = next((m.group(1) for p in SSH_HOST for m in f.log.all(p)), "HOST")
    host = host.split(":")[-1].strip() or "HOST"
    r = f.resolved
    d = Diagnosis("ssh_launch", f"the DeepSpeed launcher could not ssh to {host}", f.line)
    d.proposal = Proposal(f"set up passwordless ssh to {host}: ssh-copy-id {host}", [],
                          f"the launcher reaches every hostfile node (pdsh, localhost included) by ssh without a "
                          f"password: `ssh-keygen -t ed25519 -N '' -f ~/.ssh/id_ed25519` once, `ssh-copy-id {host}` "
                          f"for each node, check with `ssh -o PasswordAuthentication=no {host} hostname`, and install "
                          f"pdsh on every node")
    d.advice.append("or start each node yourself, no ssh needed: on node i run `python -m trainer launch --preset "
                    f"{r.config.name} --nnodes {r.config.hardware.nodes} --node-rank i --master-addr NODE0` (or the "
                    "same torchrun line on every node)")
    if r.config.hardware.nodes == 1:
        d.advice.append("on a single node no ssh is needed: run without --hostfile (and without --autotuning, which "
                        "launches through pdsh)")
    return d


# --- /dev/shm ----------------------------------------------------------------------------------------------------

SHM = re.compile(r"(/dev/shm|shared memory segment|posix_fallocate failed|out of shared memory|insufficient shared "
                 r"memory|Bus error|SIGBUS|Signal 7\b|exits? with return code = -7\b|exitcode\s*:\s*-7\b|"
                 r"return code -7\b)", re.IGNORECASE)


def diagnose_shm(f: Found) -> Diagnosis:
    refused = oserror.stated(f.log, f.index)
    if refused is not None and refused.kind in SHM_REFUSED:
        return _shm_refused(f, refused)
    d = Diagnosis("shm", "shared memory (/dev/shm) ran out: bus error / SIGBUS (exit -7) or NCCL's shared-memory "
                         "segment", f.line)
    d.proposal = Proposal("give the ranks a larger /dev/shm: docker run --shm-size=16g (or --ipc=host)", [],
                          "the ranks share memory through /dev/shm - NCCL's intra-node transport, DataLoader workers, "
                          "DeepSpeed's CPU all-reduce - and a container's default is 64 MB: writing past it kills "
                          "the process with SIGBUS (exit -7) or fails NCCL's segment. Check with `df -h /dev/shm`; on "
                          "Kubernetes mount an emptyDir with medium: Memory at /dev/shm; remove stale files there "
                          "(`ls /dev/shm`) left by killed jobs")
    d.then.append(Proposal("or keep NCCL off shared memory (slower intra-node traffic)", [],
                           "NCCL_SHM_DISABLE=1 makes NCCL use P2P or sockets instead of /dev/shm; it does not help "
                           "DataLoader workers (fewer num_workers does)", env=(("NCCL_SHM_DISABLE", "1"),)))
    return d


# what the system said when /dev/shm refused a segment for another reason than room
SHM_REFUSED = {
    "permission": ("let the ranks' user create files in /dev/shm: `sudo chmod 1777 /dev/shm`",
                   "/dev/shm must be writable by every user, with the sticky bit (mode 1777, as a default system "
                   "mounts it); `ls -ld /dev/shm` shows its mode. A hardened host, a container started with a "
                   "read-only or restrictive /dev/shm mount, or a rank running as another user than the files "
                   "left there by an earlier job (remove them: `ls -l /dev/shm`) refuse it"),
    "read_only": ("mount /dev/shm writable (in docker: --ipc=host or --shm-size=16g, not a read-only tmpfs)",
                  "the ranks create their shared-memory segments there; a read-only root file system must leave "
                  "/dev/shm a writable tmpfs"),
    "missing": ("mount a tmpfs at /dev/shm (in docker: --ipc=host or --shm-size=16g; on Kubernetes an emptyDir "
                "with medium: Memory)", "the system has no /dev/shm for the ranks' shared-memory segments"),
}


def _shm_refused(f: Found, refused: "oserror.OsError") -> Diagnosis:
    step, reason = SHM_REFUSED[refused.kind]
    d = Diagnosis("shm", f"/dev/shm refused a shared-memory segment: {refused.words}", f.line)
    d.proposal = Proposal(step, [], f"the system answered '{refused.words}' ({refused.line[:160]}), not a lack of "
                                    f"room, so a larger /dev/shm would not help: {reason}")
    d.then.append(Proposal("or keep NCCL off shared memory (slower intra-node traffic)", [],
                           "NCCL_SHM_DISABLE=1 makes NCCL use P2P or sockets instead of /dev/shm",
                           env=(("NCCL_SHM_DISABLE", "1"),)))
    return d
