"""An op built before is reused when a reinstalled environment gives its sources new files with the same bytes
(trainer/jit_reuse.py), and rebuilt when anything it was built from changed.

Real ninja and a real compiler, on a build directory of the shape torch writes for an op (a compile rule with gcc
depfiles, a link rule to <name>.so): one source and one header, so a build takes a second, not DeepSpeed's minutes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from trainer import jit_env, jit_ops, jit_reuse

pytestmark = pytest.mark.quick

NAME = "toy_op"
NINJA = shutil.which("ninja", path=str(jit_env.environment_bin())) or shutil.which("ninja")
BUILD = """ninja_required_version = 1.3
cxx = c++
cflags = -I{src} -fPIC -O0 {extra}
rule compile
  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out
  depfile = $out.d
  deps = gcc
rule link
  command = $cxx $in -shared -o $out
build toy.o: compile {src}/toy.cpp
build {name}.so: link toy.o
default {name}.so
"""


def write_sources(src: Path, value: int) -> None:
    src.mkdir(parents=True, exist_ok=True)
    (src / "toy.h").write_text(f"#define TOY_VALUE {value}\n")
    (src / "toy.cpp").write_text('#include "toy.h"\nextern "C" int toy() { return TOY_VALUE; }\n')


def write_build(directory: Path, src: Path, extra: str = "") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "build.ninja").write_text(BUILD.format(src=src, name=NAME, extra=extra))


def ninja(directory: Path, *args: str) -> str:
    return subprocess.run([NINJA, "-C", str(directory), *args], capture_output=True, text=True, check=True).stdout


def reinstall(src: Path) -> None:
    """What a fresh virtualenv does to DeepSpeed's sources: the same bytes in new files, with later times."""
    later = time.time() + 5
    for path in src.iterdir():
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)
        os.utime(path, (later, later))


def would_rebuild(directory: Path) -> bool:
    return "no work to do" not in ninja(directory, "-n")


@pytest.fixture
def built(tmp_path):
    if NINJA is None or shutil.which("c++") is None:
        pytest.skip("needs ninja and a C++ compiler (scripts/setup.sh installs both)")
    src, directory = tmp_path / "src", tmp_path / "ext" / NAME
    write_sources(src, 1)
    write_build(directory, src)
    ninja(directory)
    jit_reuse.record(directory, NAME, NINJA)
    return src, directory


def test_what_the_build_tracks_is_recorded(built):
    src, directory = built
    manifest = json.loads((directory / jit_reuse.MANIFEST).read_text())
    assert sorted(manifest["inputs"]) == [str(src / "toy.cpp"), str(src / "toy.h")]
    assert not jit_reuse.reuse_if_unchanged(directory, NAME, NINJA)  # nothing newer: nothing to do


def test_a_reinstall_with_the_same_bytes_is_reused_not_rebuilt(built):
    src, directory = built
    library = (directory / f"{NAME}.so").read_bytes()
    reinstall(src)
    assert would_rebuild(directory)  # what ninja alone would do: the mtimes are newer
    assert jit_reuse.reuse_if_unchanged(directory, NAME, NINJA)
    assert not would_rebuild(directory)
    assert (directory / f"{NAME}.so").read_bytes() == library
    assert not jit_reuse.reuse_if_unchanged(directory, NAME, NINJA)  # the second rank finds it current


@pytest.mark.parametrize("change", ["header", "source", "flags", "missing input", "no manifest", "no library"])
def test_anything_else_is_left_to_ninja_to_rebuild(built, change):
    src, directory = built
    reinstall(src)
    if change == "header":
        write_sources(src, 2)
    elif change == "source":
        (src / "toy.cpp").write_text((src / "toy.cpp").read_text() + "// edited\n")
    elif change == "flags":
        write_build(directory, src, extra="-DEXTRA=1")  # as torch rewrites build.ninja when a flag or path changed
    elif change == "missing input":
        (src / "toy.h").unlink()
    elif change == "no manifest":
        (directory / jit_reuse.MANIFEST).unlink()
    elif change == "no library":
        (directory / f"{NAME}.so").unlink()
    assert not jit_reuse.reuse_if_unchanged(directory, NAME, NINJA)
    if change != "missing input":
        assert would_rebuild(directory)


def test_a_changed_header_is_rebuilt_into_the_library(built):
    src, directory = built
    write_sources(src, 7)
    reinstall(src)
    assert not jit_reuse.reuse_if_unchanged(directory, NAME, NINJA)
    ninja(directory)
    import ctypes
    assert ctypes.CDLL(str(directory / f"{NAME}.so")).toy() == 7


class Builder:
    name = NAME

    def sources(self):
        return ["toy.cpp"]


def test_the_announced_load_says_it_reused_the_build_and_ninja_compiles_nothing(built, monkeypatch):
    src, directory = built
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(directory.parent))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("PATH", f"{Path(NINJA).parent}:{os.environ['PATH']}")
    reinstall(src)
    compiled: list[str] = []

    def jit_load(builder, verbose=True):  # torch's part: run ninja in the op's directory
        compiled.append(ninja(directory, "-v"))
        return "module"
    lines: list[str] = []
    assert jit_ops.announced(jit_load, lines.append)(Builder()) == "module"
    assert any("reusing that build instead of rebuilding" in line for line in lines), lines
    assert "no work to do" in compiled[0], compiled
    assert lines[-1].startswith(f"op {NAME}: loaded in")
