import os
import re
import subprocess
import sys

import pytest

from w4a16 import info


def test_info_prints_arch_versions_and_backends():
    out = subprocess.run([sys.executable, "-m", "w4a16", "info"], check=True, capture_output=True, text=True).stdout
    for field in ("arch", "torch", "triton", "sources", "backends", "reference"):
        assert field in out, out
    from w4a16 import arch, dispatch

    lines = out.splitlines()
    assert f"arch     {arch()}" in lines, out
    assert f"sources  {info.source_digest()} (w4a16/ and csrc/ under {info.REPO_ROOT})" in lines, out
    for backend in dispatch.BACKENDS[1:]:  # every backend but auto, with its availability
        assert any(line.startswith(f"  {backend} ") for line in lines), (backend, out)
    # what auto picks either side of this arch's skinny edge
    edge = dispatch.rules(arch()).skinny_max_m or 5
    assert f"auto picks at K=N=4096:  M=1  M={edge}  M={edge + 1}  M=128  M=2048" in lines, out


def test_source_digest_follows_the_sources_only(tmp_path):
    from w4a16 import info

    (tmp_path / "w4a16").mkdir()
    (tmp_path / "csrc").mkdir()
    (tmp_path / "w4a16" / "gemm.py").write_text("x = 1\n")
    (tmp_path / "csrc" / "kernel.cuh").write_text("// kernel\n")
    first = info.source_digest(tmp_path)
    assert len(first) == 12 and first == info.source_digest(tmp_path)
    (tmp_path / "csrc" / "PERF.md").write_text("notes\n")  # not a source
    (tmp_path / "w4a16" / "__pycache__").mkdir()
    (tmp_path / "w4a16" / "__pycache__" / "gemm.py").write_text("cache\n")
    assert info.source_digest(tmp_path) == first
    (tmp_path / "csrc" / "kernel.cuh").write_text("// kernel, changed\n")
    assert info.source_digest(tmp_path) != first
    (tmp_path / "csrc" / "kernel.cuh").write_text("// kernel\n")
    (tmp_path / "csrc" / "kernel.cuh").rename(tmp_path / "csrc" / "other.cuh")  # same bytes, another file
    assert info.source_digest(tmp_path) != first


@pytest.mark.parametrize("suffix", [".py", ".json", ".h", ".cuh", ".cu", ".cpp"])
def test_source_digest_covers_every_source_kind(tmp_path, suffix):
    (tmp_path / "w4a16" / "triton").mkdir(parents=True)
    (tmp_path / "csrc").mkdir()
    first = info.source_digest(tmp_path)
    for other in (".md", ".txt", ".sh", ".pyc"):
        (tmp_path / "w4a16" / "triton" / f"notes{other}").write_text("not a source\n")
    assert info.source_digest(tmp_path) == first
    (tmp_path / "w4a16" / "triton" / f"added{suffix}").write_text("x\n")
    assert info.source_digest(tmp_path) != first


def test_source_digest_follows_a_file_moved_between_directories(tmp_path):
    (tmp_path / "w4a16").mkdir()
    (tmp_path / "csrc").mkdir()
    (tmp_path / "w4a16" / "common.h").write_text("#pragma once\n")
    first = info.source_digest(tmp_path)
    (tmp_path / "w4a16" / "common.h").rename(tmp_path / "csrc" / "common.h")  # same name, same bytes
    assert info.source_digest(tmp_path) != first


def test_asm_refuses_the_triton_options_for_the_skinny_backend():
    """--backend skinny compiles every instantiation: a shape, dtype or format given with it would be ignored."""
    import pytest

    from w4a16.__main__ import main

    with pytest.raises(SystemExit, match=r"--m, --dtype, --symmetric/--asymmetric: the triton backend's options"):
        main(["asm", "--backend", "skinny", "--arch", "sm_90", "--m", "5", "--dtype", "bf16", "--asymmetric"])


def test_asm_names_an_out_directory_it_cannot_make(tmp_path):
    import pytest

    from w4a16.__main__ import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    for backend in ("skinny", "triton"):
        with pytest.raises(SystemExit, match=rf"--out {blocker}/asm: cannot make that directory"):
            main(["asm", "--backend", backend, "--arch", "gfx1151", "--out", str(blocker / "asm")])


def test_asm_triton_defaults_and_given_options(tmp_path, monkeypatch):
    """What --backend triton compiles when a shape option is left out: the defaults its help text names."""
    import w4a16.asm
    from w4a16.__main__ import main

    seen = []
    monkeypatch.setattr(w4a16.asm, "_run_triton", lambda args: seen.append(vars(args).copy()) or 0)
    assert main(["asm", "--backend", "triton", "--arch", "sm_90", "--out", str(tmp_path)]) == 0
    assert main(["asm", "--backend", "triton", "--arch", "gfx1201", "--m", "7", "--dtype", "bf16", "--asymmetric",
                 "--out", str(tmp_path)]) == 0
    defaults = {"m": 256, "n": 4096, "k": 4096, "dtype": "fp16", "group": 128, "symmetric": True}
    assert {name: seen[0][name] for name in defaults} == defaults
    assert {name: seen[1][name] for name in defaults} == {**defaults, "m": 7, "dtype": "bf16", "symmetric": False}


def test_asm_triton_compiles_and_summarizes_the_config_a_launch_selects(tmp_path, monkeypatch, capsys):
    """The shape, dtype, group and format given reach the compile, with the config select_config picks for them."""
    import w4a16.triton.asm as asm
    from w4a16.__main__ import main
    from w4a16.triton.configs import select_config

    # The command unsets TRITON_INTERPRET for its compile (w4a16/asm.py): monkeypatch puts it back afterwards, so
    # the tests after this one keep the interpreter.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    monkeypatch.setattr(asm, "compile_config", lambda *args: calls.append(args) or "compiled")
    monkeypatch.setattr(asm, "write_assembly", lambda compiled, arch, out, stem: out / f"{stem}.s")
    monkeypatch.setattr(asm, "summarize", lambda arch, compiled: {"arch": arch, "compiled": compiled})
    monkeypatch.setattr(asm, "summary_text", lambda info: f"summary of {info['compiled']} for {info['arch']}")
    assert main(["asm", "--backend", "triton", "--arch", "gfx1201", "--m", "7", "--n", "512", "--k", "1024",
                 "--dtype", "bf16", "--group", "32", "--asymmetric", "--out", str(tmp_path)]) == 0
    config = select_config("gfx1201", 7, 512, 1024, 32)
    assert calls == [("gfx1201", config, "bf16", 32, False)]
    out = capsys.readouterr().out
    assert f"config   {', '.join(f'{k}={v}' for k, v in config.to_json().items())}" in out
    assert "summary of compiled for gfx1201" in out


@pytest.mark.parametrize(("options", "message"), [
    (["--m", "0"], "--m must be >= 1, got 0"), (["--n", "0"], "--n must be >= 1, got 0"),
    (["--k", "-128"], "--k must be >= 1, got -128"),
    (["--k", "4160", "--group", "128"], "--k=4160 must be a multiple of --group=128"),
])
def test_asm_triton_refuses_a_shape_it_cannot_compile(tmp_path, monkeypatch, options, message):
    from w4a16.__main__ import main

    # The AOT compile needs the real JIT function: the command turns the interpreter off before anything loads.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["asm", "--backend", "triton", "--arch", "sm_90", *options, "--out", str(tmp_path)])
    assert "TRITON_INTERPRET" not in os.environ


@pytest.mark.parametrize(("arch", "missing", "message"), [
    ("sm_90", "nvcc_path", "nvcc (CUDA 12+) is needed to compile for sm_90"),
    ("gfx1201", "hip_compiler_path", "clang-19 is needed to compile for gfx1201 (apt-get install clang-19 lld-19)"),
    ("gfx1151", "hip_headers_present", "HIP headers are needed (apt-get install libamdhip64-dev)"),
])
def test_asm_skinny_without_its_compiler_says_which(tmp_path, monkeypatch, capsys, arch, missing, message):
    from w4a16 import skinny_build
    from w4a16.__main__ import main

    monkeypatch.setattr(skinny_build, missing, lambda: None)  # no path found, no headers
    if missing == "hip_headers_present":  # a compiler found (a machine without clang-19 would say that first)
        monkeypatch.setattr(skinny_build, "hip_compiler_path", lambda: "/usr/bin/clang-19")
    assert main(["asm", "--backend", "skinny", "--arch", arch, "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {message}\n" and captured.out == ""
