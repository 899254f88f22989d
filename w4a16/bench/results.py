"""Stored runs: pytest-benchmark JSON -> records, the per-shape tables, and the regression check.

A record is one benchmark: its extra_info (model, layer, N, K, M, group_size, dtype, symmetric, backend, ...)
and its median per-call time in seconds. The stats pytest-benchmark stores are per-call device seconds (the
bench times with `w4a16.bench.timing.device_clock`), so the median of a stored run is read straight from them.

--compare gates our backends (auto, skinny, triton, dequant_blas) against the newest stored baseline of the same
case set on this arch. Absolute times drift between runs with the machine's clocks (the torch peers moved by up to
24% between stored runs on the same H200), so a case of ours is measured against the same run's torch matmul in its
dtype (the anchor): it regresses when its time relative to the anchor grows by more than the threshold. The anchor's
change is the median of torch's current / baseline times over every case of the same dtype and phase (decode,
M <= DECODE_MAX_M, which reads memory; prefill, which computes) that both runs timed, not the one case of the same
shape and M: one torch case's own noise would pass straight into the gate (a baseline whose torch time for one
shape had read 6% slow failed the next run of unchanged code by +10.8%; over 18 pairs of consecutive stored runs of
one GPU, ours relative to the median spread less than relative to the case's own torch time in 15). A case without
an anchor of its phase in both runs is gated on its own median. Peers are compared and printed too, but do not
gate.
The comparison fails as well when a case of ours that the baseline has and this run was asked to measure was not
measured (a kernel that now refuses or skips), when a case of ours was measured that the baseline lacks (nothing
gates it: store a new baseline), when nothing of ours was compared at all, and when the two runs come from
different GPUs (one arch, e.g. sm_90, holds several).

Comparing with the newest baseline alone would ratchet: each passing run becomes the next baseline, so 9% per
round passes round after round. A run stored after a passing --compare records the baseline it passed against
(`compared_with` in its machine info); the stored runs of this GPU back to the newest one stored without a passing
comparison (a deliberate new baseline) form its chain, and against every run of the chain the geometric mean of
ours, relative to the anchor, must stay within the threshold too.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from . import metrics
from .catalogue import BACKENDS, LAYERS, OURS, PEERS, Case

KEY_FIELDS = ("model", "layer", "N", "K", "M", "dtype", "group_size", "symmetric", "backend")
DEFAULT_THRESHOLD = 0.10
DECODE_MAX_M = 8  # decode cases (M <= this) against prefill: `summary` and `lowered_clock_cases`


@dataclass(frozen=True)
class Record:
    model: str
    layer: str
    n: int
    k: int
    m: int
    dtype: str
    group_size: int
    symmetric: bool
    backend: str
    seconds: float  # median per call

    @property
    def key(self) -> tuple:
        return (self.model, self.layer, self.n, self.k, self.m, self.dtype, self.group_size, self.symmetric,
                self.backend)

    @property
    def shape_key(self) -> tuple:
        return (self.model, self.layer, self.n, self.k, self.dtype, self.group_size, self.symmetric)

    @property
    def us(self) -> float:
        return self.seconds * 1e6

    def nbytes(self) -> int:
        return metrics.case_bytes(self.backend, self.n, self.k, self.m, self.group_size, self.symmetric)


def case_key(case: Case) -> tuple:
    return (case.model, case.layer, case.n, case.k, case.m, case.dtype, case.group_size, case.symmetric,
            case.backend)


@dataclass
class Run:
    """One stored pytest-benchmark run, reduced to what the bench reads."""

    path: Path | None
    datetime: str
    machine: dict
    records: dict[tuple, Record]

    @property
    def copy_gbps(self) -> float | None:
        value = self.machine.get("w4a16", {}).get("copy_gbps")
        return float(value) if value else None


def load_run(path: str | Path) -> Run:
    """Read a pytest-benchmark JSON file; benchmarks without our extra_info are ignored."""
    path = Path(path)
    data = json.loads(path.read_text())
    records = {}
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info") or {}
        if not all(f in info for f in KEY_FIELDS):
            continue
        stats = bench.get("stats") or {}
        seconds = stats.get("median")
        if seconds is None and "us_per_call" in info:
            seconds = info["us_per_call"] / 1e6
        if seconds is None or not math.isfinite(seconds) or seconds <= 0:
            continue
        r = Record(*_info_key(info), float(seconds))
        records[r.key] = r
    return Run(path, data.get("datetime", ""), data.get("machine_info", {}), records)


def _info_key(info: dict) -> tuple:
    """A benchmark's case key (Record.key) from its extra_info."""
    return (info["model"], info["layer"], int(info["N"]), int(info["K"]), int(info["M"]), info["dtype"],
            int(info["group_size"]), bool(info["symmetric"]), info["backend"])


def _shape_of(bench: dict) -> tuple | None:
    """A benchmark's case key less the backend (the cases measured side by side), or None for a foreign one."""
    info = bench.get("extra_info") or {}
    return _info_key(info)[:-1] if all(f in info for f in KEY_FIELDS) else None


def benchmark_names(run_path: str | Path, shapes: set[tuple]) -> list[str]:
    """The test names (test_gemm[...]) of a run's benchmarks of these shapes, every backend."""
    data = json.loads(Path(run_path).read_text())
    return [b["name"] for b in data.get("benchmarks", []) if _shape_of(b) in shapes]


def lowered_clock_cases(run_path: str | Path, fraction: float = 0.97) -> list[str]:
    """Benchmarks of a run timed at a lowered SM clock: a slowdown reason (power cap, thermal) was set after one
    of its rounds and its lowest SM clock then was under `fraction` of the highest the run saw (recorded where NVML
    is readable: timing.GraphTimer). A reason set at the full clock is left out: a memory-bound decode case can
    touch the power cap at 1965 of 1980 MHz. One line per decode case (M <= DECODE_MAX_M), whose own load does
    not lower the clock, so a figure there is suspect; the prefill cases that reach the power cap by themselves
    are counted in one line."""
    benches = [b for b in json.loads(Path(run_path).read_text()).get("benchmarks", [])
               if (b.get("extra_info") or {}).get("sm_mhz_max")]
    if not benches:
        return []
    top = max(b["extra_info"]["sm_mhz_max"] for b in benches)
    lines, prefill = [], 0
    for bench in benches:
        info = bench["extra_info"]
        if not (info.get("slowed_rounds") and info["sm_mhz_min"] < fraction * top):
            continue
        if int(info.get("M", 0)) > DECODE_MAX_M:
            prefill += 1
            continue
        lines.append(f"  {bench['name']}: {info['slowed_rounds']} of {info.get('rounds', '?')} rounds slowed, "
                     f"SM {info['sm_mhz_min']}-{info['sm_mhz_max']} of {top} MHz")
    if prefill:
        lines.append(f"  and {prefill} case(s) with M > {DECODE_MAX_M}, which reach the power cap by themselves")
    return lines


def keep_better(run_path: str | Path, again_path: str | Path, baseline: Run, threshold: float,
                shapes: set[tuple]) -> list[str]:
    """Per shape, keep the better of two measurements of a run: the shape's benchmarks in `run_path` are replaced
    by those of `again_path` (the same shapes measured again) where the worst change of ours against `baseline`,
    relative to the anchor, is smaller there. Rewrites `run_path`; returns a line per shape saying what was seen."""
    first, again = load_run(run_path), load_run(again_path)

    def worst(run: Run) -> dict[tuple, float]:
        out: dict[tuple, float] = {}
        for c in compare(run, baseline, threshold).changes:
            if c.gated and c.key[:-1] in shapes:
                out[c.key[:-1]] = max(out.get(c.key[:-1], 0.0), c.relative_ratio)
        return out

    def keys(run: Run, shape: tuple) -> set[tuple]:
        return {key for key in run.records if key[:-1] == shape}

    before, after = worst(first), worst(again)
    # Only a complete measurement replaces the first: one that lacks a backend (skipped the second time) would
    # drop that backend's regression from the comparison.
    better = {s for s in shapes if s in after and after[s] < before.get(s, math.inf)
              and keys(again, s) >= keys(first, s)}
    data = json.loads(Path(run_path).read_text())
    again_benches = json.loads(Path(again_path).read_text()).get("benchmarks", [])
    data["benchmarks"] = ([b for b in data.get("benchmarks", []) if _shape_of(b) not in better]
                          + [b for b in again_benches if _shape_of(b) in better])
    Path(run_path).write_text(json.dumps(data, indent=4))
    lines = []
    for shape in sorted(shapes, key=str):
        seen = f"{before.get(shape, math.nan) - 1:+.1%}, then {after.get(shape, math.nan) - 1:+.1%}"
        lines.append(f"  {_key_text((*shape, '')).rstrip()}: worst change of ours relative to the anchor {seen}"
                     f" ({'the second kept' if shape in better else 'the first kept'})")
    return lines


def _stored(run_path: Path) -> tuple[float, str | None] | None:
    """A stored run's datetime as a timestamp and the GPU it recorded (None where it recorded none); None for a
    file that is not a pytest-benchmark run."""
    try:
        data = json.loads(run_path.read_text())
        if not isinstance(data, dict) or "benchmarks" not in data:
            return None
        stamp = datetime.fromisoformat(str(data.get("datetime", "")).replace("Z", "+00:00")).timestamp()
        machine = data.get("machine_info")
        gpu = machine.get("w4a16", {}).get("gpu") if isinstance(machine, dict) else None
        return stamp, gpu
    except (OSError, ValueError, AttributeError):
        return None


def stored_runs(storage: str | Path) -> list[Path]:
    """The pytest-benchmark runs under a storage folder (any machine-id subfolder), oldest first."""
    return [path for path, _ in _stored_with_gpus(storage)]


def _stored_with_gpus(storage: str | Path) -> list[tuple[Path, str | None]]:
    """stored_runs, each with the GPU it recorded; every file read once."""
    storage = Path(storage)
    if not storage.is_dir():
        return []
    stamped = [(info[0], str(p), p, info[1]) for p in storage.rglob("*.json") if (info := _stored(p)) is not None]
    return [(p, gpu) for _, _, p, gpu in sorted(stamped)]


def per_gpu_name(name: str, gpu: str) -> str:
    """The name under which a stored run's table or plot is kept beside the runs of other GPUs of the same arch:
    'tables.md' on an 'NVIDIA H200' -> 'tables-nvidia-h200.md'."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}-{slug}.{suffix}" if dot else f"{name}-{slug}"


def newest_baseline(storage: str | Path, set_name: str | None = None, gpu: str | None = None) -> Path | None:
    """The newest stored run of a storage folder (by the datetime pytest-benchmark recorded), or None; with
    `set_name`, the newest stored run of that case set (files NNNN_<set>.json); with `gpu`, the newest measured
    on that GPU. One arch's folder holds the runs of every GPU of that arch (an H100 and an H200 are both sm_90),
    and compare() refuses a baseline from another GPU, so --compare picks this GPU's own."""
    runs = [p for p, run_gpu in _stored_with_gpus(storage)
            if (set_name is None or _set_of(p) == set_name) and (gpu is None or run_gpu == gpu)]
    return runs[-1] if runs else None


COMPARED_WITH = "compared_with"  # machine_info["w4a16"] key of a run stored after a passing --compare


def baseline_chain(storage: str | Path, set_name: str, gpu: str) -> list[Run]:
    """The stored runs of this set and GPU from the newest one stored without a passing comparison to the newest,
    oldest first: each later one passed its comparison with the one before, so together they bound the drift that
    comparing with the newest alone would let through."""
    paths = [p for p, run_gpu in _stored_with_gpus(storage) if _set_of(p) == set_name and run_gpu == gpu]
    chain = []
    for path in reversed(paths):
        chain.append(load_run(path))
        if not chain[-1].machine.get("w4a16", {}).get(COMPARED_WITH):
            break
    return chain[::-1]


def mark_compared(run_json: str | Path, baseline: Path) -> None:
    """Record in a run's JSON the stored baseline it passed its comparison with (before it is stored)."""
    path = Path(run_json)
    data = json.loads(path.read_text())
    data.setdefault("machine_info", {}).setdefault("w4a16", {})[COMPARED_WITH] = baseline.name
    path.write_text(json.dumps(data, indent=4))


def stored_gpus(storage: str | Path, set_name: str) -> set[str]:
    """The GPUs that a storage folder holds runs of this case set from."""
    return {gpu for p, gpu in _stored_with_gpus(storage) if _set_of(p) == set_name and gpu}


def _set_of(run_path: Path) -> str:
    """The case set of a stored run, from its name (NNNN_<set>.json)."""
    return run_path.stem.split("_", 1)[-1]


def store_run(run_json: str | Path, storage: str | Path, set_name: str) -> Path:
    """Copy a run's pytest-benchmark JSON into storage as the next baseline of its set: <storage>/<machine id>/
    NNNN_<set>.json, pytest-benchmark's own naming, numbered after every run the storage holds."""
    from pytest_benchmark.utils import get_machine_id

    storage = Path(storage)
    numbers = [int(p.stem.split("_", 1)[0]) for p in stored_runs(storage) if p.stem.split("_", 1)[0].isdigit()]
    target = storage / get_machine_id() / f"{max(numbers, default=0) + 1:04d}_{set_name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(Path(run_json).read_bytes())
    return target


def parse_threshold(text: str | float) -> float:
    """'10%' -> 0.10; a bare fraction 0 < f < 1 is taken as is."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = text.strip()
        try:
            value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
        except ValueError:
            raise ValueError(f"threshold must look like '10%' or 0.1, got {text!r}") from None
        if not s.endswith("%") and value >= 1:
            raise ValueError(f"threshold {text!r} is ambiguous: write a percentage ('{s}%') or a fraction below 1")
    if not 0 < value < 10:
        raise ValueError(f"threshold must be a positive fraction (e.g. 0.1 or '10%'), got {text!r}")
    return value


def anchor_backend(dtype: str) -> str:
    """The peer a case of ours is measured against: torch's matmul in the case's dtype (cuBLAS / hipBLASLt)."""
    return f"torch_{dtype}"


# Machine-info fields (tests/bench/conftest.py) whose change between two runs the comparison reports.
SOFTWARE_FIELDS = ("torch", "triton", "cuda", "hip", "driver")


@dataclass(frozen=True)
class Change:
    key: tuple
    baseline_s: float
    current_s: float
    anchor_ratio: float | None = None  # the anchor's current / baseline time (ours only, where both runs have it)
    anchor_cases: int = 0  # how many torch cases of the case's dtype and phase the anchor is the median of

    @property
    def ratio(self) -> float:
        return self.current_s / self.baseline_s

    @property
    def relative_ratio(self) -> float:
        """The change in time relative to the anchor of the same run (the plain ratio where there is none)."""
        return self.ratio / self.anchor_ratio if self.anchor_ratio else self.ratio

    @property
    def gated(self) -> bool:
        return self.key[-1] in OURS


@dataclass
class Comparison:
    threshold: float
    changes: list[Change] = field(default_factory=list)
    missing: list[tuple] = field(default_factory=list)  # ours, in the baseline and asked for, not measured
    unbaselined: list[tuple] = field(default_factory=list)  # ours, measured, not in the baseline
    gpus: tuple[str | None, str | None] = (None, None)  # the baseline's and this run's GPU names, where recorded
    software: list[str] = field(default_factory=list)  # "torch 2.11.0 -> 2.12.0": what changed under the anchor
    chain: list[tuple[str, float]] = field(default_factory=list)  # (stored run, ours' geometric mean against it)

    @property
    def drifted(self) -> list[tuple[str, float]]:
        """The runs of the baseline's chain that ours, as a whole, are slower than by more than the threshold."""
        return [(name, ratio) for name, ratio in self.chain if ratio > 1 + self.threshold]

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if (c.relative_ratio if c.gated else c.ratio) > 1 + self.threshold]

    @property
    def failures(self) -> list[Change]:
        return [c for c in self.regressions if c.gated]

    @property
    def other_gpu(self) -> bool:
        return None not in self.gpus and self.gpus[0] != self.gpus[1]

    @property
    def ok(self) -> bool:
        gated = any(c.gated for c in self.changes)
        return (gated and not self.failures and not self.missing and not self.unbaselined and not self.other_gpu
                and not self.drifted)

    def report(self) -> str:
        lines = [f"compared {len(self.changes)} cases (threshold +{self.threshold:.0%} on the median relative to "
                 "the same run's torch matmul; our backends gate, peers are informational)"]
        ours = [c for c in self.changes if c.gated]
        if ours:
            geo = math.exp(sum(math.log(c.ratio) for c in ours) / len(ours))
            lines.append(f"ours: geometric mean time ratio {geo:.3f} (current / baseline), {self.relative_mean():.3f} "
                         f"relative to the anchor, over {len(ours)} cases")
        else:
            lines.append("NOTHING OF OURS COMPARED: this run and the baseline share no case of our backends")
        if self.software:
            lines.append("software changed since the baseline (the anchor, torch's matmul, may have moved with it): "
                         + ", ".join(self.software))
        if self.other_gpu:
            lines.append(f"OTHER GPU: the baseline was measured on {self.gpus[0]}, this run on {self.gpus[1]}; "
                         "store a baseline for this GPU (--save) or compare with one of its runs (--compare RUN.json)")
        for title, items in (("REGRESSED (ours)", self.failures),
                             ("regressed (peers, not gating)", [c for c in self.regressions if not c.gated])):
            if items:
                lines.append(f"{title}:")
                for c in sorted(items, key=lambda c: -c.relative_ratio):
                    lines.append(f"  {_key_text(c.key):60s} {c.baseline_s * 1e6:9.2f} -> {c.current_s * 1e6:9.2f} us"
                                 f"  ({c.ratio - 1:+.1%}){self._anchor_text(c)}{self._peer_context(c)}")
        if self.chain:
            worst = max(self.chain, key=lambda item: item[1])
            lines.append(f"{'DRIFTED' if self.drifted else 'chain'}: ours' geometric mean relative to the anchor "
                         f"against the {len(self.chain)} stored run(s) since {self.chain[0][0]}, the last one stored "
                         f"without a passing comparison: worst {worst[1]:.3f} ({worst[0]})")
        if self.missing:
            lines.append("MISSING (ours: in the baseline, asked for, not measured this run):")
            lines += [f"  {_key_text(k)}" for k in self.missing]
        if self.unbaselined:
            lines.append("NOT IN THE BASELINE (ours: measured, nothing to compare with; store a new baseline):")
            lines += [f"  {_key_text(k)}" for k in self.unbaselined]
        lines.append("compare: PASS" if self.ok else "compare: FAIL")
        return "\n".join(lines)

    def relative_mean(self) -> float:
        """The geometric mean of ours' time ratios relative to the anchor (1.0 with nothing of ours compared)."""
        ours = [c.relative_ratio for c in self.changes if c.gated]
        return math.exp(sum(map(math.log, ours)) / len(ours)) if ours else 1.0

    @staticmethod
    def _anchor_text(change: Change) -> str:
        if not change.gated:
            return ""
        if change.anchor_ratio is None:
            return ", no anchor: gated on its own median"
        cases = f"{change.anchor_cases} {_phase(change.key[4])} case{'s' if change.anchor_cases > 1 else ''}"
        return (f", {change.relative_ratio - 1:+.1%} relative to {anchor_backend(change.key[5])} (which moved "
                f"{change.anchor_ratio - 1:+.1%}, the median of its {cases})")

    def _peer_context(self, change: Change) -> str:
        """For a case of ours: how the peers of the same shape and M moved between the two runs. Peers moving too
        points at the machine (clocks, another tenant) rather than at the code."""
        if not change.gated:
            return ""
        peers = sorted((c for c in self.changes if not c.gated and c.key[:-1] == change.key[:-1]),
                       key=lambda c: PEERS.index(c.key[-1]) if c.key[-1] in PEERS else len(PEERS))
        if not peers:
            return ""
        return "; peers here: " + ", ".join(f"{c.key[-1]} {c.ratio - 1:+.1%}" for c in peers)


def _phase(m: int) -> str:
    """Decode (M <= DECODE_MAX_M: the time is reading the weights) or prefill (the time is computing)."""
    return "decode" if m <= DECODE_MAX_M else "prefill"


def _key_text(key: tuple) -> str:
    model, layer, n, k, m, dtype, g, sym, backend = key
    return f"{model} {layer} N={n} K={k} M={m} {dtype} g{g} {'sym' if sym else 'asym'} {backend}"


def compare(current: Run, baseline: Run, threshold: float = DEFAULT_THRESHOLD,
            expected: Iterable[tuple] | None = None) -> Comparison:
    """Medians of the cases both runs hold; `expected`: the keys this run was asked to measure."""
    facts = [run.machine.get("w4a16", {}) for run in (baseline, current)]
    result = Comparison(threshold, gpus=(facts[0].get("gpu"), facts[1].get("gpu")))
    # The anchor absorbs what moves torch too; a new torch or driver also moves the anchor itself, so say so.
    result.software = [f"{name} {facts[0][name]} -> {facts[1][name]}" for name in SOFTWARE_FIELDS
                       if facts[0].get(name) and facts[1].get(name) and facts[0][name] != facts[1][name]]

    # The anchors' changes, per (dtype, phase): torch's current / baseline time for every case both runs timed.
    anchor_changes: dict[tuple[str, str], list[float]] = {}
    for key, base in baseline.records.items():
        cur = current.records.get(key)
        if cur is not None and key[-1] == anchor_backend(key[5]):
            anchor_changes.setdefault((key[5], _phase(key[4])), []).append(cur.seconds / base.seconds)

    def anchor(key: tuple) -> tuple[float | None, int]:
        """(the median change of the anchors of the case's dtype and phase, how many there are) for a case of
        ours; (None, 0) for a peer or where there is none."""
        changes = anchor_changes.get((key[5], _phase(key[4]))) if key[-1] in OURS else None
        return (statistics.median(changes), len(changes)) if changes else (None, 0)

    for key, base in sorted(baseline.records.items()):
        cur = current.records.get(key)
        if cur is not None:
            result.changes.append(Change(key, base.seconds, cur.seconds, *anchor(key)))
    if expected is not None:
        wanted = set(expected)
        result.missing = sorted(k for k in baseline.records
                                if k[-1] in OURS and k in wanted and k not in current.records)
    result.unbaselined = sorted(k for k in current.records if k[-1] in OURS and k not in baseline.records)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Tables


@dataclass(frozen=True)
class Row:
    """One M of one shape: every backend's per-call seconds, and the headline figures of "auto"."""

    m: int
    seconds: dict[str, float]
    ours_gbps: float | None
    ours_pct_copy: float | None
    ours_tflops: float | None
    best_peer: str | None
    speedup: float | None  # best peer's time / auto's time: > 1 means auto is faster

    @property
    def ratio(self) -> float | None:
        """auto's time / the best peer's (the inverse of speedup)."""
        return None if self.speedup is None else 1 / self.speedup


def shape_rows(records: Iterable[Record], copy_gbps: float | None) -> dict[tuple, list[Row]]:
    """Per shape key, one Row per M (sorted), from a run's records."""
    by_shape: dict[tuple, dict[int, dict[str, Record]]] = {}
    for r in records:
        by_shape.setdefault(r.shape_key, {}).setdefault(r.m, {})[r.backend] = r
    out = {}
    for shape, by_m in by_shape.items():
        rows = []
        for m in sorted(by_m):
            recs = by_m[m]
            seconds = {b: recs[b].seconds for b in BACKENDS if b in recs}
            ours = recs.get("auto")
            peers = [(recs[b].seconds, b) for b in PEERS if b in recs]
            best = min(peers) if peers else None
            gb = metrics.gbps(ours.nbytes(), ours.seconds) if ours else None
            rows.append(Row(
                m, seconds, gb,
                100 * gb / copy_gbps if gb is not None and copy_gbps else None,
                metrics.tflops(ours.n, ours.k, m, ours.seconds) if ours else None,
                best[1] if best else None,
                best[0] / ours.seconds if (best and ours) else None,
            ))
        out[shape] = rows
    return out


def _shape_order(shape: tuple) -> tuple:
    model, layer, *rest = shape
    return (model, LAYERS.index(layer) if layer in LAYERS else len(LAYERS), *rest)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_tables(records: Iterable[Record], copy_gbps: float | None) -> str:
    """Markdown tables, one per shape: µs per call of every backend, then auto's GB/s, % of the measured copy
    bandwidth and TFLOP/s, the best peer and auto's speedup over it."""
    blocks = []
    for shape, rows in sorted(shape_rows(records, copy_gbps).items(), key=lambda kv: _shape_order(kv[0])):
        model, layer, n, k, dtype, g, sym = shape
        backends = [b for b in BACKENDS if any(b in r.seconds for r in rows)]
        head = ["M", *[f"{b} µs" for b in backends], "auto GB/s", "% copy bw", "auto TFLOP/s", "best peer",
                "speedup"]
        lines = [f"**{model} {layer}** N={n} K={k} {dtype} g{g} {'sym' if sym else 'asym'}", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cells = [str(r.m), *[_fmt(r.seconds[b] * 1e6 if b in r.seconds else None, ".2f") for b in backends],
                     _fmt(r.ours_gbps, ".0f"), _fmt(r.ours_pct_copy, ".0f"), _fmt(r.ours_tflops, ".2f"),
                     r.best_peer or "-", "-" if r.speedup is None else f"{r.speedup:.2f}x"]
            lines.append("| " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def summary(records: Iterable[Record]) -> str:
    """One line per model: auto's geometric-mean speedup over the best peer, for decode (M <= 8) and prefill."""
    lines = []
    by_model: dict[str, dict[str, list[float]]] = {}
    for shape, rows in shape_rows(records, None).items():
        for r in rows:
            if r.speedup is not None:
                phase = f"decode M<={DECODE_MAX_M}" if r.m <= DECODE_MAX_M else "prefill M>=16"
                by_model.setdefault(shape[0], {}).setdefault(phase, []).append(r.speedup)
    for model in sorted(by_model):
        parts = []
        for phase, values in sorted(by_model[model].items()):
            geo = math.exp(sum(math.log(v) for v in values) / len(values))
            parts.append(f"{phase}: {geo:.2f}x over {len(values)} cases")
        lines.append(f"{model:14s} auto vs best peer (geomean speedup)  " + "; ".join(parts))
    return "\n".join(lines)
