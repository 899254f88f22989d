import subprocess
import sys


def test_info_prints_arch_versions_and_backends():
    out = subprocess.run([sys.executable, "-m", "w4a16", "info"], check=True, capture_output=True, text=True).stdout
    for field in ("arch", "torch", "triton", "backends", "reference"):
        assert field in out, out
