import subprocess
import sys


def test_info_prints_arch_versions_and_backends():
    out = subprocess.run([sys.executable, "-m", "w4a16", "info"], check=True, capture_output=True, text=True).stdout
    for field in ("arch", "torch", "triton", "sources", "backends", "reference"):
        assert field in out, out


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
