"""`python -m w4a16.bench` (what `nox -s bench` runs; also `python -m w4a16 bench`).

    python -m w4a16.bench                      the baseline set: tables, plots and JSON under --out
    python -m w4a16.bench --quick              a small subset, for a fast check
    python -m w4a16.bench --save               also store the run as a baseline under baselines/<arch>/ (only
                                               when every benchmark passed and any --compare passed)
    python -m w4a16.bench --compare            fail (exit 1) when one of our medians, relative to the same run's
                                               torch matmul, is slower than in the newest stored baseline of this
                                               set, arch and GPU by more than --threshold (10%), or when
                                               ours as a whole (geometric mean) drifted that far from any run
                                               of that baseline's chain of passing comparisons
    python -m w4a16.bench --e2e                the end-to-end TTFT / TPOT table instead of the kernel benchmarks

The kernel benchmarks are pytest-benchmark tests (tests/bench/test_kernels.py) run in a child pytest whose
stats are per-call device seconds; arguments after `--` go to that pytest (e.g. `-- -k gate_up`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from . import catalogue, results
from .timing import DEVICE_CLOCK_NAME

SET_ENV = "W4A16_BENCH_SET"
MODELS_ENV = "W4A16_BENCH_MODELS"
COLLECTED_ENV = "W4A16_BENCH_COLLECTED"  # where the child pytest writes the case keys it selected (conftest.py)
REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_TESTS = REPO_ROOT / "tests" / "bench" / "test_kernels.py"
# Fresh measurements of a regressed shape before the comparison fails (see _run_kernels).
CONFIRM_RUNS = 2
NO_GPU_MESSAGE = ("no GPU: the bench times CUDA/ROCm kernels and needs a device "
                  "(torch.cuda.is_available() is False here); nothing was measured")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_const", const="quick", dest="set",
                       help="a small subset (llama3.1-8b gate_up and down at 5 M values, every backend)")
    which.add_argument("--set", choices=catalogue.SETS, default="baseline",
                       help="which cases to run (default: baseline, the set stored and compared per arch)")
    which.add_argument("--e2e", action="store_true", help="run the end-to-end TTFT/TPOT table instead")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated model names to keep (of {', '.join(catalogue.MODELS)})")
    parser.add_argument("--save", action="store_true",
                        help="store this run under <storage>/<arch>/ if it passed (and passed --compare)")
    parser.add_argument("--compare", nargs="?", const="newest", default=None, metavar="RUN.json",
                        help="compare with the newest stored baseline of this set and arch (or the given JSON); "
                             "exit 1 past the threshold")
    parser.add_argument("--threshold", default=f"{results.DEFAULT_THRESHOLD:.0%}",
                        help="regression threshold on the median, e.g. 10%% (default) or 0.05")
    parser.add_argument("--storage", default=str(REPO_ROOT / "baselines"),
                        help="baseline storage root; runs go to <storage>/<arch>/ (default: baselines/)")
    parser.add_argument("--out", default=None,
                        help="where this run's JSON, tables and plots go (default: build/bench/<arch>/)")
    parser.add_argument("--inject-slowdown", action="store_true",
                        help="run our backends twice per timed call: only to check that --compare fails")
    parser.add_argument("--e2e-models", default=",".join(_e2e_names()),
                        help="models of the end-to-end table (default: %(default)s)")
    parser.add_argument("--no-build", action="store_true",
                        help="do not build the skinny extension when it is missing (its benchmarks then skip)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (e.g. -k gate_up)")


def _e2e_names() -> tuple[str, ...]:
    from .e2e import E2E_MODELS

    return tuple(E2E_MODELS)


def _gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _selected(set_name: str, models: list[str] | None) -> list[catalogue.Case]:
    chosen = catalogue.cases(set_name)
    return [c for c in chosen if models is None or c.model in models]


def _parse_models(text: str | None, known, what: str) -> list[str] | None:
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{what}: unknown model(s) {unknown}; known: {', '.join(known)}")
    if not names:
        raise ValueError(f"{what} {text!r}: name at least one model, of {', '.join(known)}")
    return names


def run(args: argparse.Namespace) -> int:
    try:
        threshold = results.parse_threshold(args.threshold)
        models = _parse_models(args.models, catalogue.MODELS, "--models")
        e2e_models = _parse_models(args.e2e_models, _e2e_names(), "--e2e-models")
        if args.inject_slowdown and args.save:
            raise ValueError("--inject-slowdown makes a deliberately slow run, which must never become a baseline: "
                             "drop --save")
        ignored = [option for option, given in (("--compare", args.compare is not None), ("--models", args.models),
                                                ("--inject-slowdown", args.inject_slowdown)) if given]
        if args.e2e and ignored:
            raise ValueError(f"--e2e times whole models and takes none of {', '.join(ignored)}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not _gpu_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2

    import w4a16
    from w4a16 import info

    if not args.no_build:
        _build_skinny()
    info.run(argparse.Namespace())
    arch = w4a16.arch()
    storage = Path(args.storage) / arch
    out = Path(args.out) if args.out else REPO_ROOT / "build" / "bench" / arch
    for option, directory in (("--out", out), ("--storage", storage if args.save else None)):
        try:
            if directory is not None:
                directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"error: {option} {directory}: cannot make that directory ({exc.strerror or exc})", file=sys.stderr)
            return 2
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    if args.e2e:
        return _run_e2e(e2e_models, out, storage if args.save else None, stamp)
    return _run_kernels(args, arch, models, threshold, storage, out, stamp)


def _run_kernels(args, arch, models, threshold, storage: Path, out: Path, stamp: str) -> int:
    set_name = args.set or "baseline"
    cases = _selected(set_name, models)
    if not cases:
        print("error: no cases selected", file=sys.stderr)
        return 2
    baseline = None
    if args.compare is not None:
        gpu = _device_name()
        baseline = (Path(args.compare) if args.compare != "newest"
                    else results.newest_baseline(storage, set_name, gpu=gpu))
        if baseline is None or not baseline.is_file():
            others = sorted(results.stored_gpus(storage, set_name) - {gpu})
            print(f"error: --compare: no stored baseline of set {set_name!r} measured on {gpu} under {storage}"
                  + (f" (it holds runs of {', '.join(others)}, which this GPU's times are not compared with)"
                     if others else "")
                  + f"; store one with --save --set {set_name}", file=sys.stderr)
            return 2
        try:  # read now, not after the run: a bad file must not cost the whole measurement
            base_run = results.load_run(baseline)
        except (OSError, ValueError, AttributeError) as exc:
            print(f"error: --compare {baseline}: not a readable benchmark run ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
            return 2
    json_path = out / f"{arch}-{set_name}-{stamp}.json"

    def pytest_command(json_out: Path, targets: list[str]) -> list[str]:
        return [
            sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider", "--benchmark-only",
            f"--benchmark-timer={DEVICE_CLOCK_NAME}", "--benchmark-sort=name", "--durations=8",
            f"--benchmark-json={json_out}", *_quiet_flag(), *args.pytest_args,
        ]

    env = {**os.environ, SET_ENV: set_name}
    if models:
        env[MODELS_ENV] = ",".join(models)
    if args.inject_slowdown:
        from .peers import SLOWDOWN_ENV

        env[SLOWDOWN_ENV] = "1"
        print("NOTE: --inject-slowdown: our backends run twice per timed call (a deliberate 2x regression)")
    print(f"bench: {len(cases)} cases of set {set_name!r} on {arch}; storage {storage}", flush=True)
    t0 = time.perf_counter()
    collected_path = json_path.with_name(f"{json_path.stem}-collected.json")
    rc = subprocess.call(pytest_command(json_path, [str(BENCH_TESTS)]), cwd=REPO_ROOT,
                         env={**env, COLLECTED_ENV: str(collected_path)})
    print(f"bench: pytest finished in {time.perf_counter() - t0:.0f} s with exit status {rc}", flush=True)
    if rc == 5:  # pytest's "no tests": the selection (-k ...) left nothing to measure
        print(f"error: no benchmark was selected (pytest exit status 5; its arguments: "
              f"{' '.join(args.pytest_args) or 'none'}); nothing was measured", file=sys.stderr)
        return 1
    try:
        current = results.load_run(json_path)
    except (OSError, ValueError):
        print(f"error: pytest wrote no results ({json_path})", file=sys.stderr)
        return rc or 1
    status = 0 if rc == 0 else 1
    report = None
    if baseline is not None:
        expected = _asked_for(collected_path)
        if expected is None:
            print(f"error: --compare: the benchmark run did not say which cases it selected ({collected_path}), so "
                  "a case that stopped being measured could not be told from one not asked for", file=sys.stderr)
            return 1
        comparison = results.compare(current, base_run, threshold, expected=expected)
        again_lines = []
        for attempt in range(1, CONFIRM_RUNS + 1):
            shapes = {c.key[:-1] for c in comparison.failures}
            if rc != 0 or not shapes:
                break
            # A regression must reproduce: the regressed shapes (every backend, so the anchor too) are measured
            # again in a fresh process. Identical code has read a large-M case 358 and 403 µs a minute apart
            # (H100, Llama down M = 2048, torch unchanged, the power cap active; README, "Benchmarks").
            again = json_path.with_name(f"{json_path.stem}-again{attempt}.json")
            targets = [f"{BENCH_TESTS}::{name}" for name in results.benchmark_names(json_path, shapes)]
            print(f"bench: {len(shapes)} regressed shape(s) of ours: measuring them again in a fresh process "
                  f"({attempt} of {CONFIRM_RUNS})", flush=True)
            if subprocess.call(pytest_command(again, targets), cwd=REPO_ROOT, env=env) != 0 or not again.is_file():
                print("bench: measuring again failed; the comparison stands", file=sys.stderr)
                break
            again_lines += results.keep_better(json_path, again, base_run, threshold, shapes)
            current = results.load_run(json_path)
            comparison = results.compare(current, base_run, threshold, expected=expected)
        if args.compare == "newest":
            comparison.chain = [(run.path.name, results.compare(current, run, threshold).relative_mean())
                                for run in results.baseline_chain(storage, set_name, gpu)]
        report = comparison.report()
        if again_lines:
            report = ("measured again (per shape the better measurement is kept, and stored):\n"
                      + "\n".join(again_lines) + "\n" + report)
        if not comparison.ok:
            status = 1

    tables = results.format_tables(current.records.values(), current.copy_gbps)
    device = current.machine.get("w4a16", {}).get("gpu", arch)
    header = (f"# w4a16 kernel benchmarks: {device} ({arch}), {current.datetime[:19]} UTC, set {set_name}, "
              f"copy bandwidth {current.copy_gbps or 0:.0f} GB/s\n\n"
              "µs per call (median of graph replays over a weight rotation >= 4x the last-level cache); auto GB/s counts int4 "
              "weight + scales (+ zeros) + x + y; speedup = best peer's time / auto's time.\n\n")
    text = header + tables + "\n\n" + results.summary(current.records.values()) + "\n"
    lowered = results.lowered_clock_cases(json_path)
    if lowered:  # large-M cases reach the power cap by themselves; a decode case listed here is suspect
        text += ("\ntimed at a lowered SM clock (power cap or thermal; clock after each round):\n"
                 + "\n".join(lowered) + "\n")
    print(text)
    (out / "tables.md").write_text(text)
    plots = _plots(current, out, device)
    if report is not None:
        print(f"\nbaseline: {baseline}")
        print(report)
        (out / "compare.txt").write_text(f"baseline: {baseline}\n{report}\n")
    if args.save:
        # Stored only now, after the run and the comparison: a failed or regressed run must not become the
        # baseline that the next --compare measures against.
        if status == 0:
            if args.compare == "newest":  # a link of the baseline's chain (results.baseline_chain)
                results.mark_compared(json_path, baseline)
            stored = results.store_run(json_path, storage, set_name)
            for path in [out / "tables.md", *plots]:
                shutil.copy2(path, storage / results.per_gpu_name(path.name, device))
            print(f"bench: saved {stored}")
        else:
            print("bench: NOT saved: " + ("the comparison failed" if rc == 0 else f"pytest exited with {rc}"),
                  file=sys.stderr)
    print(f"bench: results in {out}")
    return status


def _asked_for(collected_path: Path) -> list[tuple] | None:
    """The case keys the benchmark run selected (after any -k), as its conftest wrote them; None if it did not."""
    try:
        return [tuple(key) for key in json.loads(collected_path.read_text())]
    except (OSError, ValueError, TypeError):
        return None


def _device_name() -> str:
    """The GPU's name as the stored runs record it (tests/bench/conftest.py)."""
    import torch

    return torch.cuda.get_device_name()


def _build_skinny() -> None:
    """Build the skinny extension if it is missing (a fresh GPU machine), so that its benchmarks and "auto"'s
    decode route are measured rather than skipped; a failed build is reported and the run goes on."""
    try:
        from w4a16 import skinny_build

        archs = skinny_build.device_archs()
        if not archs or skinny_build.library_path(archs).exists():
            return
    except ImportError:
        return
    print("bench: building the skinny extension (w4a16.skinny_build) ...", flush=True)
    t0 = time.perf_counter()
    try:
        skinny_build.build()
    except Exception as exc:  # reported, not raised: the skinny cases then skip with the reason
        print(f"bench: skinny build failed ({type(exc).__name__}: {exc}); its cases will skip", flush=True)
        return
    print(f"bench: skinny extension built in {time.perf_counter() - t0:.0f} s", flush=True)


def _quiet_flag() -> list[str]:
    # pytest-benchmark >= 5 can drop its own wide table (ours is printed instead).
    from importlib.metadata import version

    try:
        major = int(version("pytest-benchmark").split(".")[0])
    except (ValueError, LookupError, ImportError):
        return []
    return ["--benchmark-quiet"] if major >= 5 else []


def _plots(run: results.Run, out: Path, device: str) -> list[Path]:
    try:
        from .plots import plot_models

        paths = plot_models(run.records.values(), run.copy_gbps, out, title_suffix=f", {device}")
    except ImportError as exc:
        print(f"bench: no plots ({exc}); install matplotlib")
        return []
    for path in paths:
        print(f"bench: plot {path}")
    return paths


def _run_e2e(names: list[str], out: Path, storage: Path | None, stamp: str) -> int:
    from . import e2e

    print(f"e2e: {', '.join(names)}; prompts {e2e.PROMPT_LENGTHS}, {e2e.DECODE_TOKENS} decode tokens", flush=True)
    measured = e2e.run(names, device="cuda", log=lambda m: print(m, flush=True))
    table = e2e.format_table(measured)
    device = _device_name()
    text = (f"# w4a16 end to end, batch 1: {device}, {stamp}\n\n"
            "TTFT: prefill replayed as a CUDA graph (eager beside it); TPOT: 128 greedy steps after a 128-token "
            "prompt, the decode step replayed as a CUDA graph; static KV cache; random weights.\n\n" + table + "\n")
    print(text)
    payload = {"datetime": stamp, "device": device, "results": e2e.to_json(measured)}
    (out / "e2e.md").write_text(text)
    (out / f"e2e-{stamp}.json").write_text(json.dumps(payload, indent=2))
    ok = bool(measured) and all(r.finite for r in measured)
    if not ok:
        print("e2e: no model measured, or one failed or gave non-finite logits (see above); nothing stored",
              file=sys.stderr)
    elif storage is not None:  # --save stores a run that passed only
        storage.mkdir(parents=True, exist_ok=True)
        shutil.copy2(out / "e2e.md", storage / results.per_gpu_name("e2e.md", device))
        shutil.copy2(out / f"e2e-{stamp}.json", storage / f"e2e-{stamp}.json")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m w4a16.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))
