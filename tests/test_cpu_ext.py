"""Where the C++ extension builds: one folder per source contents, CPU and torch installation, whatever path the
sources lie at, compiling a copy of csrc/ that is written once (cpu_ext.build_folder, stage_sources)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from anychip import envs
from anychip.kernels import cpu_ext


@pytest.fixture
def csrc_copy(tmp_path, monkeypatch):
    """csrc/ copied to a checkout somewhere else, and cpu_ext pointed at it."""

    def point_at(name: str):
        copy = tmp_path / name / "csrc"
        shutil.copytree(cpu_ext.CSRC, copy)
        monkeypatch.setattr(cpu_ext, "CSRC", copy)
        return copy

    return point_at


def test_the_folder_depends_on_the_sources_not_on_where_they_lie(csrc_copy, tmp_path):
    home = cpu_ext.build_folder(tmp_path / "builds")
    csrc_copy("checkout-a")
    assert cpu_ext.build_folder(tmp_path / "builds") == home
    b = csrc_copy("checkout-b")
    assert cpu_ext.build_folder(tmp_path / "builds") == home
    (b / "w4a8_cpu.cpp").write_text((b / "w4a8_cpu.cpp").read_text() + "\n// edited\n")
    assert cpu_ext.build_folder(tmp_path / "builds") != home


def test_another_torch_installation_builds_apart(tmp_path, monkeypatch):
    home = cpu_ext.build_folder(tmp_path)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert cpu_ext.build_folder(tmp_path) != home


def test_sources_are_staged_once_and_never_touched_again(csrc_copy, tmp_path):
    csrc = csrc_copy("checkout")
    build = cpu_ext.build_folder(tmp_path)
    src = cpu_ext.stage_sources(build)
    names = sorted(p.name for p in csrc.glob("*.[ch]*"))
    assert sorted(p.name for p in src.iterdir()) == names
    for name in names:
        assert (src / name).read_bytes() == (csrc / name).read_bytes()
    stamps = {name: (src / name).stat().st_mtime_ns for name in names}
    os.utime(csrc / "w4a8_cpu.cpp")  # a checkout's fresh time stamps (git) must not reach the staged copy
    cpu_ext.stage_sources(build)
    assert {name: (src / name).stat().st_mtime_ns for name in names} == stamps


def test_the_loaded_extension_was_built_from_the_staged_copy():
    cpu_ext.load(envs.build_dir())  # the folder every route loads from (the first load in a process decides)
    build = cpu_ext.build_folder(envs.build_dir())
    assert (build / "src" / "w4a8_cpu.cpp").read_bytes() == cpu_ext.SOURCE.read_bytes()
    assert any(build.glob("*.so"))


def test_a_first_build_says_so_before_its_minute_of_compiling(tmp_path, monkeypatch, capsys):
    """probe 49: a first engine start sat silent for a minute while the kernels compiled."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: "module")
    assert cpu_ext._build(tmp_path) == "module"
    assert "compiling the CPU kernels for this machine" in capsys.readouterr().err
    (cpu_ext.build_folder(tmp_path) / "anychip_w4a8_cpu.so").write_bytes(b"")
    cpu_ext._build(tmp_path)
    assert "compiling" not in capsys.readouterr().err
