"""Machine info for stored benchmark runs: enough to redo them and to know what they ran on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _commit() -> str:
    head = _git("rev-parse", "--short=12", "HEAD")
    if head is None:  # a copy of the tree without .git: the runner may say which commit it is
        return os.environ.get("W4A16_COMMIT", "unknown")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return head + ("-dirty" if dirty else "")


def _driver() -> str:
    if getattr(torch.version, "hip", None):
        return f"HIP {torch.version.hip}"
    if shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=20)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "unknown"


def _gpu_info() -> dict:
    import triton

    import w4a16
    from w4a16 import info
    from w4a16.bench import timing

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "arch": w4a16.arch(),
        "gpu": torch.cuda.get_device_name(),
        "multiprocessors": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "l2_bytes": timing.l2_cache_bytes(),
        "cache_bytes": timing.last_level_cache_bytes(),  # what each weight rotation exceeds 4x
        "driver": _driver(),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": _commit(),
        "source_digest": info.source_digest(),  # what was measured, where the copy's .git is stale
        # Measured once, when the first benchmark starts: the roofline every % column is read against.
        "copy_gbps": round(timing.copy_gbps(), 1),
    }


@pytest.fixture(scope="session")
def gpu_info(pytestconfig) -> dict:
    """The machine's GPU facts, measured at the start of the run (copy bandwidth included)."""
    if not hasattr(pytestconfig, "_w4a16_gpu_info"):
        pytestconfig._w4a16_gpu_info = _gpu_info()
    return pytestconfig._w4a16_gpu_info


def pytest_benchmark_update_machine_info(config, machine_info):
    if torch.cuda.is_available():
        if not hasattr(config, "_w4a16_gpu_info"):
            config._w4a16_gpu_info = _gpu_info()
        machine_info["w4a16"] = config._w4a16_gpu_info


def pytest_collection_finish(session):
    """Where python -m w4a16.bench asks (W4A16_BENCH_COLLECTED), write the case keys pytest selected, after any
    -k: --compare then knows which cases a run was asked for, so a case of ours that stops being measured fails
    as missing whatever the arguments."""
    path = os.environ.get("W4A16_BENCH_COLLECTED")
    if path:
        from w4a16.bench import results

        keys = [results.case_key(item.callspec.params["case"]) for item in session.items
                if hasattr(item, "callspec") and "case" in item.callspec.params]
        Path(path).write_text(json.dumps(keys))
