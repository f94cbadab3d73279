"""Facts a log states about the run, so that advice fits the run and not an assumption: the GPU and its memory,
what was allocated when it failed, the world size and the nodes, where it ran (a container, WSL2, bare metal)
and what the user had already exported (NCCL_IB_DISABLE=1 set before the run is not advice to give again).

Each fact is None when the log does not show it; nothing here is read from the doctor's own machine.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from .logtext import Log

GPU_NAME = re.compile(r"\b(NVIDIA (?=[\w -]{0,30}\d)[A-Z][\w-]*(?: [A-Z0-9][\w-]*){0,3}|Tesla [A-Z]\d+[\w-]*|"
                      r"(?:GeForce )?RTX \w+ ?\d{3,4}\w*(?: Ti)?|A100[\w-]*|H100[\w-]*|H200|V100[\w-]*|A10G|L40S?|"
                      r"MI\d{3}X?)\b(?![\w-]*:\d+:\d+)")  # not a host named after its GPUs: NCCL's "H100-2:19989:20082" prefix
CAPACITY = re.compile(r"(?:total capacity of ([\d.]+) GiB|([\d.]+) GiB total capacity)")  # torch 2.x / 1.x OOM
NVCC = re.compile(r"(?:nvcc version\s*\.*\s*|Cuda compilation tools, release )(\d+\.\d+)")
TORCH_CUDA = re.compile(r"(?:torch cuda version\s*\.*\s*|torch(?:==|\s+version\s*\.*\s*:?\s*)\d[\w.]*\+cu)(\d+(?:\.\d+)?)")
ALLOCATED = re.compile(r"(?:Of the allocated memory )?([\d.]+) GiB (?:is )?allocated by PyTorch|([\d.]+) GiB already "
                       r"allocated")
WORLD = re.compile(r"(?:\bworld[_ ]size\b\s*[=:]\s*|\bdist_world_size=|WORLD_SIZE=|--nproc_per_node[= ])(\d+)",
                   re.IGNORECASE)
NNODES = re.compile(r"(?:--num_nodes[= ]|--nnodes[= ]|NNODES=|num_nodes=|\bnnodes=)(\d+)", re.IGNORECASE)
WORLD_INFO = re.compile(r"WORLD INFO DICT: (\{.*\})")
NCCL_HOST = re.compile(r"^\s*(?:\[\d+\]\s*)?([\w.-]+):\d+:\d+ \[\d+\] NCCL ", re.MULTILINE)  # "host:pid:tid [dev] NCCL"
RANK_ON_HOST = re.compile(r"\bRank\s+\d+\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+([\w.-]+)\s+device")  # nccl-tests' table
MPI_EXPORT = re.compile(r"(?:^|\s)-x\s+([A-Z][A-Z0-9_]*)=(['\"]?)([^\s'\"]*)\2")  # mpirun -x NAME=value
NODE_PREFIX = re.compile(r"^([\w.-]+): \[(?:20\d\d|rank\d)", re.MULTILINE)  # pdsh's "host: [2024-..." / "host: [rank3]"
CONTAINER = re.compile(r"(/\.dockerenv|\bdocker (?:run|exec|compose)\b|\bkubectl\b|\bpodman\b|singularity|apptainer|"
                       r"\benroot\b|running (?:inside|in) (?:a )?(?:docker|container)|nvcr\.io/|/workspace/)", re.IGNORECASE)
WSL = re.compile(r"(microsoft-standard-WSL2|\bWSL2?\b|/mnt/[a-z]/|\\\\wsl)", re.IGNORECASE)
# what a shell line sets: `export X=1`, `$ X=1 Y=2 deepspeed ...`, `+ X=1 torchrun ...` (not "run with X=1" in a message)
SHELL_SETTINGS = re.compile(r"^[ \t]*(?:[$+#>][ \t]*)?(?:export[ \t]+)?((?:[A-Z][A-Z0-9_]*=\S*[ \t]*(?:;[ \t]*)?(?:export[ \t]+)?)+)",
                            re.MULTILINE)
SETTING = re.compile(r"([A-Z][A-Z0-9_]*)=(['\"]?)([^\s'\";]*)\2")
NCCL_SET_BY_ENV = re.compile(r"NCCL INFO (NCCL_[A-Z0-9_]+) set by environment to (\S+)")
NCCL_INTERFACE = re.compile(r"NET/(?:Socket|IB) : Using \[\d\]([\w.-]+)(?::|/)")
# a line of a config the log shows, JSON (`"stage": 3,`) or YAML (`  zero_stage: 3`): a key and one scalar value
CONFIG_LINE = re.compile(r"^[ \t]*[\"']?([A-Za-z_][\w.-]*)[\"']?[ \t]*:[ \t]*(\"[^\"\n]*\"|'[^'\n]*'|[\w.+/-]+)[ \t]*,?[ \t]*$",
                         re.MULTILINE)
# a tool's own "error: legacy-install-failure" (pip) or "note: ..." has the shape of a config line, not its meaning
NOT_CONFIG_KEYS = {"error", "warning", "note", "hint", "info", "debug", "fatal", "critical", "exception", "traceback"}
# how the log's run sharded its model states: FSDP's strategy (HF's --fsdp, accelerate's fsdp_sharding_strategy) or
# DeepSpeed's ZeRO stage (a JSON "stage", accelerate's zero_stage, --zero_stage) and whether it offloaded
FSDP = re.compile(r"(?:--fsdp[= ]+[\"']?|fsdp_sharding_strategy:\s*|\bfsdp:\s*[\"']?)(?P<how>[\w ]*?"
                  r"(?:full_shard|shard_grad_op|hybrid_shard|no_shard|FULL_SHARD|SHARD_GRAD_OP|HYBRID_SHARD|NO_SHARD|"
                  r"\b[1-4]\b)[\w ]*)", re.IGNORECASE)
FSDP_STAGE = {"full_shard": 3, "hybrid_shard": 3, "shard_grad_op": 2, "no_shard": 0, "1": 3, "2": 2, "3": 0, "4": 3}
ZERO_STAGE = re.compile(r"(?:\"stage\"\s*:\s*|\bzero_stage\s*[:=]\s*|--zero_stage[= ]+|ZeRO[- ]?(?:stage[- ]?)?)(?P<stage>[0-3])"
                        r"\b", re.IGNORECASE)
OFFLOADED = re.compile(r"(?P<what>offload_optimizer|offload_param)(?:_device)?[\"']?\s*[:=]\s*(?:\{\s*[\"']?device"
                       r"[\"']?\s*:\s*)?[\"']?(?P<device>cpu|nvme|none)\b", re.IGNORECASE)
IFACE_ADDR = re.compile(r"^\d+: ([\w.@-]+?)(?:@\w+)?: <[A-Z,_]*UP", re.MULTILINE)  # `ip addr`'s interface lines


@dataclass
class LogFacts:
    gpu: Optional[str] = None
    gpu_memory_gb: Optional[float] = None
    allocated_gb: Optional[float] = None
    world_size: Optional[int] = None
    nodes: Optional[int] = None
    environment: Optional[str] = None       # 'container', 'WSL2' or None (not shown)
    exported: dict = field(default_factory=dict)  # NAME -> value the user set before the run
    interfaces: list = field(default_factory=list)  # network interfaces the log shows in use or up
    cuda_toolkit: Optional[str] = None      # nvcc's release (ds_report, `nvcc --version`)
    torch_cuda: Optional[str] = None        # the CUDA torch was built with (ds_report, a +cuXYZ wheel)
    config_values: dict = field(default_factory=dict)  # key -> value of a config the log shows (JSON or YAML)
    sharding: Optional[dict] = None  # {"stage", "offload_optimizer", "offload_param", "how"}: what the log's run used

    @property
    def single_node(self) -> bool:
        """True only when the log shows one node (a node count of 1, or a world on one host)."""
        return self.nodes == 1

    def already_set(self, name: str, value: Optional[str] = None) -> bool:
        return name in self.exported and (value is None or self.exported[name] == value)

    def configured(self, key: str) -> Optional[str]:
        """The value the log's own config gives `key` (lower case, unquoted), or None when it shows none."""
        value = self.config_values.get(key)
        return value.strip("'\"").lower() if value is not None else None

    def as_json(self) -> dict:
        return {key: value for key, value in vars(self).items() if value not in (None, {}, [])}


def read_facts(log: Log) -> LogFacts:
    """The facts, each read by one search of the log's first and last lines (Log.ends: where a log states its
    setting and its end; a fixed cost in a log of any length): the first GPU, capacity, world size and
    environment the log names, the last allocation."""
    text = log.ends()
    facts = LogFacts()
    first = {name: pattern.search(text) for name, pattern in (("gpu", GPU_NAME), ("capacity", CAPACITY),
                                                                ("world", WORLD), ("nnodes", NNODES),
                                                                ("world_info", WORLD_INFO))}
    facts.gpu = first["gpu"].group(1).strip() if first["gpu"] else None
    capacity = first["capacity"]
    facts.gpu_memory_gb = float(capacity.group(1) or capacity.group(2)) if capacity else None
    if (nvcc := NVCC.search(text)):
        facts.cuda_toolkit = nvcc.group(1)
    if (torch_cuda := TORCH_CUDA.search(text)):
        built = torch_cuda.group(1)  # "121" from a wheel tag is 12.1
        facts.torch_cuda = built if "." in built else f"{built[:-1]}.{built[-1]}"
    allocated = None
    for allocated in ALLOCATED.finditer(text):
        pass
    facts.allocated_gb = float(allocated.group(1) or allocated.group(2)) if allocated else None
    facts.world_size = int(first["world"].group(1)) if first["world"] else None
    hosts = {m.group(1) for m in NODE_PREFIX.finditer(text)} | {m.group(1) for m in RANK_ON_HOST.finditer(text)}
    if first["nnodes"]:
        facts.nodes = int(first["nnodes"].group(1))
    elif first["world_info"]:  # {'host1': [0, 1], 'host2': [0, 1]}
        facts.nodes = len(re.findall(r"'[^']+':", first["world_info"].group(1))) or None
    elif len(hosts) > 1:
        facts.nodes = len(hosts)
    elif len({m.group(1) for m in NCCL_HOST.finditer(text)}) == 1:
        # every rank's NCCL lines: one host - unless NCCL counts more ranks than the devices it shows (one node's
        # paste of a larger world: as many nodes as it takes at that many devices each)
        facts.nodes = _nodes_beyond_the_host(text) or 1
    facts.environment = "WSL2" if WSL.search(text) else "container" if CONTAINER.search(text) else None
    for m in MPI_EXPORT.finditer(text):
        facts.exported.setdefault(m.group(1), m.group(3))
    for shell in SHELL_SETTINGS.finditer(text):
        for m in SETTING.finditer(shell.group(1)):
            facts.exported.setdefault(m.group(1), m.group(3))
    for m in NCCL_SET_BY_ENV.finditer(text):
        facts.exported.setdefault(m.group(1), m.group(2).rstrip("."))
    facts.sharding = _sharding(text)
    for m in CONFIG_LINE.finditer(text):
        if m.group(1).lower() not in NOT_CONFIG_KEYS:
            facts.config_values[m.group(1)] = m.group(2)
    for pattern in (NCCL_INTERFACE, IFACE_ADDR):
        for m in pattern.finditer(text):
            if m.group(1) not in facts.interfaces:
                facts.interfaces.append(m.group(1))
    return facts


NCCL_DEVICE = re.compile(r"^\s*(?:\[\d+\]\s*)?[\w.-]+:\d+:\d+ \[(\d+)\] NCCL ", re.MULTILINE)
NRANKS = re.compile(r"\bnranks (\d+)")


def _nodes_beyond_the_host(text: str) -> Optional[int]:
    """Nodes when NCCL says the world has more ranks than the devices one host's lines show (a paste of one node's
    log): the world over the devices per node, which the highest device index bounds from below."""
    counts = [int(m.group(1)) for m in NRANKS.finditer(text)]
    devices = {int(m.group(1)) for m in NCCL_DEVICE.finditer(text)}
    if not counts or len(devices) < 2:  # one device's lines are one rank's: they say nothing of a node's size
        return None
    per_node = max(len(devices), max(devices) + 1)
    return -(-max(counts) // per_node) if max(counts) > per_node else None


def _sharding(text: str) -> Optional[dict]:
    """How the log's run held its model states, when the log shows it: FSDP's strategy as the ZeRO stage it equals
    (full_shard = 3, shard_grad_op = 2; an `offload` word offloads both) or DeepSpeed's stage and offload devices."""
    fsdp = FSDP.search(text)
    if fsdp:
        how = fsdp.group("how").strip()
        word = next((w for w in re.findall(r"[A-Za-z_]+|\d", how.lower()) if w in FSDP_STAGE), None)
        if word is not None:
            offload = "cpu" if "offload" in how.lower() else "none"
            return {"stage": FSDP_STAGE[word], "offload_optimizer": offload, "offload_param": offload,
                    "how": f"FSDP {how}"}
    stage = ZERO_STAGE.search(text)
    if not stage:
        return None
    devices = {m.group("what").lower(): m.group("device").lower() for m in OFFLOADED.finditer(text)}
    return {"stage": int(stage.group("stage")), "offload_optimizer": devices.get("offload_optimizer", "none"),
            "offload_param": devices.get("offload_param", "none"), "how": f"ZeRO stage {stage.group('stage')}"
            + "".join(f" + {k} to {v}" for k, v in devices.items() if v != "none")}
