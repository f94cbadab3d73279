"""The accelerator table as data (trainer/accelerators.yaml): every card people rent plans, aliases mean their card,
an unknown name lists the close ones, a bad entry names the file, the accelerator and the key, and torch's device
names find their row."""
from __future__ import annotations

import pytest

from trainer import hardware
from trainer.errors import ConfigError, UserError
from trainer.plan.decide import make_plan
from trainer.plan.inputs import build_inputs
from trainer.plan.report import plan_to_json

RENTED = ["b200", "h200", "h100-80g", "h100-pcie", "h800", "h20", "a100-80g", "a100-80g-pcie", "a100-40g",
          "a100-40g-pcie", "a800-80g", "l40s", "l4", "a10g", "a6000", "rtx3090", "rtx4090", "rtx5090", "v100-16g",
          "v100-32g", "mi300x", "mi250x"]


def test_the_table_covers_the_cards_people_rent_with_their_sources():
    assert set(RENTED) | {"cpu"} == set(hardware.GPUS)
    for name in RENTED:
        g = hardware.GPUS[name]
        assert 0 < g.usable_gib <= g.memory_gb and g.peak_tflops > 0 and g.source, name
        assert g.vendor in ("nvidia", "amd") and g.interconnect in ("nvlink", "pcie", "infinity-fabric"), name
    assert not hardware.GPUS["v100-32g"].bf16 and hardware.GPUS["mi300x"].rocm and hardware.GPUS["h100-80g"].fp8_tflops


@pytest.mark.parametrize("gpu", ["b200", "h800", "a800-80g", "l4", "a10g", "a6000", "rtx3090", "rtx5090", "mi300x"])
def test_a_7b_lora_plans_on_every_rented_card(gpu):
    """The issue's list: `plan --model 7b --gpu G --gpus-per-node 8 --task lora --json` answers with a plan that fits
    and a launch line of this project."""
    plan = plan_to_json(make_plan(build_inputs({"model": "7b", "gpu": gpu, "gpus_per_node": 8, "task": "lora"})))
    assert plan["fits"] and plan["hardware"]["gpu"] == gpu
    assert " train.py --preset " in plan["launch"] and f"hardware.gpu={gpu}" in plan["launch"]


@pytest.mark.parametrize("typed,name", [("h100", "h100-80g"), ("H100-80G", "h100-80g"), ("a100", "a100-80g"),
                                        ("A100_PCIe", "a100-80g-pcie"), ("4090", "rtx4090"), ("rtx 3090", "rtx3090")])
def test_aliases_mean_their_card(typed, name):
    assert hardware.gpu_named(typed, "--gpu").name == name


def test_a_preset_may_name_its_card_by_an_alias():
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    assert resolve(load_preset("7b_8xa100", ["hardware.gpu=a100"])).config.hardware.gpu == "a100-80g"


def test_an_unknown_card_lists_the_close_ones_and_where_to_add_one():
    with pytest.raises(UserError) as err:
        hardware.gpu_named("mi300", "--gpu")
    message = str(err.value)
    assert "--gpu: unknown GPU type 'mi300' (did you mean 'mi300x'?)" in message
    assert "trainer/accelerators.yaml" in message
    with pytest.raises(UserError, match="did you mean 'rtx4090' or 'rtx5090' or 'rtx3090'"):
        hardware.gpu_named("rtx4080", "--gpu")


@pytest.mark.parametrize("device,name", [
    ("NVIDIA H100 80GB HBM3", "h100-80g"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
    ("NVIDIA H20", "h20"), ("NVIDIA A100-SXM4-40GB", "a100-40g"), ("NVIDIA A100-PCIE-40GB", "a100-40g-pcie"),
    ("NVIDIA A100 80GB PCIe", "a100-80g-pcie"), ("NVIDIA A100-SXM4-80GB", "a100-80g"), ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"), ("NVIDIA A10G", "a10g"), ("NVIDIA RTX A6000", "a6000"), ("Tesla V100-SXM2-16GB", "v100-16g"),
    ("AMD Instinct MI300X", "mi300x"), ("NVIDIA GeForce RTX 3090", "rtx3090"), ("NVIDIA B200", "b200")])
def test_torch_device_names_find_their_row(device, name):
    assert hardware.gpu_of_device(device).name == name


GOOD = """accelerators:
  - {name: x1, vendor: nvidia, description: X1, memory_gb: 24, usable_gib: 23.5, bf16_tflops: 100, fp16_tflops: 100,
     interconnect: pcie, source: X1 data sheet}
"""


def test_a_good_file_loads(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text(GOOD)
    assert hardware.load_accelerators(path)["x1"].memory_bytes == int(23.5 * 2**30)


@pytest.mark.parametrize("change,fragments", [
    (("memory_gb: 24", "memroy_gb: 24"), ["accelerators[0] (x1).memroy_gb", "did you mean 'memory_gb'",
                                          "accelerators[0] (x1).memory_gb: missing"]),
    (("bf16_tflops: 100", "bf16_tflops: fast"), ["accelerators[0] (x1).bf16_tflops"]),
    (("vendor: nvidia", "vendor: intel"), ["accelerators[0] (x1).vendor", "'intel'"]),
    (("usable_gib: 23.5", "usable_gib: 30"), ["accelerators[0] (x1).usable_gib: 30.0 is more than memory_gb 24.0"]),
    (("source: X1 data sheet", "source: ''"), ["accelerators[0] (x1).source: name the data sheet"]),
])
def test_a_bad_entry_names_the_file_the_accelerator_and_the_key(tmp_path, change, fragments):
    path = tmp_path / "acc.yaml"
    path.write_text(GOOD.replace(*change))
    with pytest.raises(ConfigError) as err:
        hardware.load_accelerators(path)
    message = str(err.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_a_name_twice_is_refused(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text(GOOD + GOOD.split("\n", 1)[1].replace("name: x1", "name: x2, aliases: [x1]"))
    with pytest.raises(ConfigError, match=r"accelerators\[1\] \(x2\): 'x1' is already the name or an alias of 'x1'"):
        hardware.load_accelerators(path)


def test_the_plan_says_what_rocm_changes():
    plan = make_plan(build_inputs({"model": "7b", "gpu": "mi300x", "gpus_per_node": 8, "task": "lora"}))
    note = next(n for n in plan.notes if n.startswith("ROCm"))
    assert "RCCL" in note and "NCCL_*" in note and "hipcc" in note
    assert not any(n.startswith("ROCm") for n in
                   make_plan(build_inputs({"model": "7b", "gpu": "h100", "gpus_per_node": 8, "task": "lora"})).notes)
