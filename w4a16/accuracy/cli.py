"""`python -m w4a16 accuracy`: run the accuracy gate (fp vs W4A16 reference vs W4A16 kernels) with lm-eval.

Reads regression/gates.toml, evaluates each model of the suite on its tasks, prints a table, writes one JSON file
per model (to baselines/<arch>/accuracy/ for the whole gate, build/<arch>/accuracy/ for a --tasks, --limit or
--backends subset, or --out), and exits 1 when any gate fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from .config import DEFAULT_GATES, REGRESSION_DIR, Gates, ModelSpec, load_gates

ALL_BACKENDS = ("fp", "reference", "control", "kernel")
# variant -> the W4A16Linear backend it runs ("kernel" is whatever "auto" picks on this machine; "control" is the
# reference accumulated in float64, which calibrates the greedy-output rule: w4a16/accuracy/gate.py).
LINEAR_BACKEND = {"reference": "reference", "control": "reference_fp64", "kernel": "auto"}
REPO_ROOT = REGRESSION_DIR.parent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gates", type=Path, default=DEFAULT_GATES, help="the gate definition (default: %(default)s)")
    parser.add_argument("--suite", help="a [suites] entry of the gates file (default: its default_suite)")
    parser.add_argument("--model", help="comma-separated [models] entries, instead of a suite")
    parser.add_argument("--tasks", help="comma-separated subset of each model's tasks")
    parser.add_argument("--limit", type=int, help="samples per task, instead of each task's limit")
    parser.add_argument("--backends",
                        help="comma-separated subset of fp,reference,control,kernel (default: all four on a GPU; "
                             "on CPU, where the kernel column repeats the reference, all but control)")
    parser.add_argument("--out", type=Path, help="where the JSON goes (default: baselines/<arch>/accuracy/, or "
                                                 "build/<arch>/accuracy/ for a --tasks, --limit or --backends subset)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                        help="activation dtype (default: bfloat16 on a GPU, float32 on CPU)")
    parser.add_argument("--batch-size", type=int,
                        help="lm-eval batch size (default: 4 on a GPU, so decode steps take the small-M kernel "
                             "path and prefill the large-M one; 32 on CPU, where every forward dequantizes)")


def _csv(text: str | None) -> list[str] | None:
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def _select(gates: Gates, args: argparse.Namespace) -> list[ModelSpec]:
    if args.model and args.suite:
        raise ValueError("give --model or --suite, not both")
    if args.model:
        names = _csv(args.model) or []
    else:
        suite = args.suite or gates.default_suite
        if suite not in gates.suites:
            raise ValueError(f"--suite {suite!r} is not one of {sorted(gates.suites)} in {gates.path}")
        names = list(gates.suites[suite])
    unknown = [n for n in names if n not in gates.models]
    if unknown or not names:
        raise ValueError(f"--model {args.model!r}: names must be entries of {sorted(gates.models)} in {gates.path}")
    return [gates.models[n] for n in names]


def _tasks(spec: ModelSpec, wanted: list[str] | None) -> list[str]:
    if wanted is None:
        return list(spec.tasks)
    unknown = [t for t in wanted if t not in spec.tasks]
    if unknown:
        raise ValueError(f"--tasks {unknown}: model {spec.name} has tasks {list(spec.tasks)}")
    return wanted


def _machine(device, dtype) -> dict:
    import lm_eval
    import torch
    import transformers

    from w4a16 import __version__
    from w4a16.arch import arch
    from w4a16.dispatch import describe_rule

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "arch": arch(device), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or "cpu", "dtype": str(dtype).removeprefix("torch."),
        "kernel_rule": describe_rule(device, dtype), "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "lm_eval": getattr(lm_eval, "__version__", "unknown"),
        "w4a16": __version__, "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _evaluate_logged(label: str, lm, task, manager, args):
    """One evaluation, announced before and its score printed after, so a run cut short still shows its figures."""
    from . import harness

    print(f"[accuracy] {label}", flush=True)
    start = time.perf_counter()
    score = harness.evaluate(lm, task, manager, args.limit, REPO_ROOT)
    print(f"[accuracy] {label}: {score.value:.4f} +- {score.stderr:.4f} (n {score.n}, "
          f"{time.perf_counter() - start:.0f} s)", flush=True)
    return score


def _evaluate_model(spec, tasks, backends, gates, args, device, dtype, batch_size, manager):
    """All variants of one model -> [(quant label, Verdict)]."""
    from w4a16.models import set_backend

    from . import harness, loading
    from .gate import judge

    tokenizer = loading.load_tokenizer(spec)
    fp_scores: dict = {}
    fp_model = loading.load_fp(spec, device, dtype) if ("fp" in backends or spec.format == "fp") else None
    if "fp" in backends and fp_model is not None:
        lm = harness.wrap(fp_model, tokenizer, batch_size)
        for task in tasks:
            fp_scores[task] = _evaluate_logged(f"{spec.name} fp {task}", lm, gates.tasks[task], manager, args)
    if spec.format != "fp":
        del fp_model  # a checkpoint's fp model is only its baseline: free it before loading the W4A16 one
        fp_model = None

    rows = []
    quantized = [b for b in backends if b != "fp"]
    variants = loading.quantized_variants(spec, fp_model, device, dtype) if quantized else [(q, None) for q in
                                                                                           spec.quantize]
    for quant, qmodel in variants:
        scores: dict = {b: {} for b in quantized}
        if qmodel is not None:
            lm = harness.wrap(qmodel, tokenizer, batch_size)
            for variant in quantized:
                set_backend(qmodel, LINEAR_BACKEND[variant])  # the same weights and prompts for both
                for task in tasks:
                    scores[variant][task] = _evaluate_logged(f"{spec.name} {quant.label} {variant} {task}", lm,
                                                             gates.tasks[task], manager, args)
        for task in tasks:
            per_variant = {"fp": fp_scores.get(task), **{v: scores[v].get(task) for v in quantized}}
            verdict = judge(task, gates.tasks[task].metric, per_variant, gates.rules,
                            spec.tolerance_for(quant, task), spec.expected.get(task),
                            samples=args.limit or gates.tasks[task].limit)
            rows.append((quant, verdict))
    return rows


def _to_json(spec: ModelSpec, rows, machine: dict, args, backends, wall_s: float) -> dict:
    return {
        "model": spec.name, "source": spec.source, "format": spec.format, "path": spec.path,
        "machine": machine, "backends": backends, "limit": args.limit, "wall_s": round(wall_s, 1),
        "passed": all(v.passed for _, v in rows),
        "results": [{
            "quant": quant.label, "task": v.task, "metric": v.metric, "tolerance": spec.tolerance_for(quant, v.task),
            "expected": spec.expected.get(v.task),
            "scores": {name: None if s is None else s.to_json() for name, s in v.scores.items()},
            "identical_greedy": v.identical, "control_identical_greedy": v.control_identical,
            "passed": v.passed, "failures": v.failures,
        } for quant, v in rows],
    }


def run(args: argparse.Namespace) -> int:
    # Before transformers / datasets / lm-eval are imported: nothing in the gate may reach the Hub.
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(name, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from w4a16.arch import arch

    from . import harness
    from .gate import format_table

    try:
        gates = load_gates(args.gates)
        models = _select(gates, args)
        backends = _csv(args.backends)
        if backends is not None and (not backends or any(b not in ALL_BACKENDS for b in backends)):
            raise ValueError(f"--backends must be a comma-separated subset of {','.join(ALL_BACKENDS)}, "
                             f"got {args.backends!r}")
        wanted = _csv(args.tasks)
        if wanted == []:
            raise ValueError(f"--tasks must name at least one task, got {args.tasks!r}")
        plans = [(spec, _tasks(spec, wanted)) for spec in models]
        if args.limit is not None and args.limit <= 0:
            raise ValueError(f"--limit must be positive, got {args.limit}")
        if args.batch_size is not None and args.batch_size <= 0:
            raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
        if args.device is not None:
            try:
                kind = torch.device(args.device).type
            except RuntimeError:
                kind = None
            if kind not in ("cuda", "cpu"):
                raise ValueError(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():  # a GPU runner must not gate the CPU reference
        print(f"error: --device {args.device}: no GPU is visible to torch here", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    batch_size = args.batch_size if args.batch_size is not None else (4 if device.type == "cuda" else 32)
    if backends is None:  # the control calibrates kernel vs reference: nothing to calibrate where they are one
        backends = [b for b in ALL_BACKENDS if device.type == "cuda" or b != "control"]
    if device.type == "cuda" and "kernel" in backends:
        # "auto" falls back to slower routes where a kernel cannot run: the kernel column would then gate nothing.
        from w4a16.dispatch import unavailable_reason

        missing = {b: reason for b in ("skinny", "triton") if (reason := unavailable_reason(b, device, dtype))}
        if missing:
            print("error: the kernel column would not run the kernels on this GPU: "
                  + "; ".join(f"{b}: {reason}" for b, reason in missing.items()), file=sys.stderr)
            return 2
    machine = _machine(device, dtype)
    # Only the whole gate (no --tasks, --limit or --backends subset) replaces the stored results of this arch.
    partial = args.tasks is not None or args.limit is not None or args.backends is not None
    out = args.out or REPO_ROOT / ("build" if partial else "baselines") / arch(device) / "accuracy"
    kernel_note = (f'"kernel" = backend "auto": {machine["kernel_rule"]}'
                   + ("; on CPU that is the reference, so kernel repeats the reference path"
                      if device.type != "cuda" else ""))
    print(f"[accuracy] {machine['arch']} {machine['device']} {machine['dtype']}, batch {batch_size}; {kernel_note}",
          flush=True)
    manager = harness.task_manager(gates.task_dirs)

    all_rows, failed = [], False
    out.mkdir(parents=True, exist_ok=True)
    for spec, tasks in plans:
        start = time.perf_counter()
        try:
            rows = _evaluate_model(spec, tasks, backends, gates, args, device, dtype, batch_size, manager)
        except FileNotFoundError as error:
            print(f"error: {spec.name}: {error}", file=sys.stderr)
            return 2
        report = _to_json(spec, rows, machine, args, backends, time.perf_counter() - start)
        path = out / f"{spec.name}.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"[accuracy] wrote {path}", flush=True)
        all_rows += [(spec.name, quant.label, v) for quant, v in rows]
        failed |= not report["passed"]

    print()
    print(format_table(all_rows))
    print(kernel_note)
    for model, quant, v in all_rows:
        for failure in v.failures:
            print(f"FAIL {model} {quant} {v.task}: {failure}")
    print("accuracy gate: " + ("FAILED" if failed else "passed") + _smoke_note(args.limit, gates, plans))
    return 1 if failed else 0


def _smoke_note(limit: int | None, gates: Gates, plans) -> str:
    """What a --limit below the tasks' own limits makes of the verdict: the rules' one-sample floor (1/n) and the
    tolerances are set for those counts, so at fewer samples a pass says little."""
    configured = sorted({gates.tasks[task].limit for _, tasks in plans for task in tasks})
    if limit is None or limit >= configured[-1]:
        return ""
    return (f" at --limit {limit} only, below the tasks' own {', '.join(map(str, configured))} samples: "
            "a smoke run, not the gate")
