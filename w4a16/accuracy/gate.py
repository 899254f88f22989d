"""The gate rules on evaluated scores: pure functions, no lm-eval, testable on synthetic results.

Rules (stated with their numbers in regression/gates.toml):
  1. kernel vs reference: |kernel - reference| <= k * stderr(reference), at least one sample's worth (1/n), and
     the greedy outputs agree on at least `min_identical_greedy` of the samples. The two share the quantized
     weights and the prompts, so any larger difference is the kernel's. Below that agreement, where the control
     ran (the reference accumulated in float64: a more exact computation of the same model), the kernel passes
     unless it leaves the reference's greedy outputs on significantly more samples than the control does
     (`greedy_divergence_p`): in bf16 two correct computations already disagree on many generations. A control
     identical to the reference on fewer than `min_control_identical_greedy` of the samples calibrates nothing:
     then the kernel fails.
  2. quantized vs fp: fp - quantized <= tolerance (drops only), for the reference and the kernel columns.
     Without an fp score, the stored `expected` score stands in for it.
A rule that cannot be applied fails the task too: without the reference or the kernel column there is no rule 1,
and without an fp score or an `expected` one no rule 2. A run of some columns only is a measurement, not a pass.
So does a score over fewer samples than were asked for: the rules' floors and tolerances assume that count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .config import GateRules

VARIANTS = ("fp", "reference", "control", "kernel")


@dataclass(frozen=True)
class Score:
    """One variant on one task: the gated metric, its standard error, and each sample's greedy output."""

    value: float
    stderr: float
    n: int
    # Per sample, in doc order: the generated text (generate-until) or the index of the arg-max choice.
    greedy: tuple = ()

    def to_json(self) -> dict:
        return {"value": self.value, "stderr": self.stderr, "n": self.n}


@dataclass
class Verdict:
    task: str
    metric: str
    scores: dict[str, Score | None]
    identical: float | None = None  # fraction of samples with identical greedy output, kernel vs reference
    control_identical: float | None = None  # the same for the control
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def identical_fraction(a: Sequence, b: Sequence) -> float:
    if len(a) != len(b):
        raise ValueError(f"greedy outputs cover different samples: {len(a)} vs {len(b)}")
    if not a:
        raise ValueError("no greedy outputs to compare")
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def greedy_divergence_p(reference: Sequence, kernel: Sequence, control: Sequence) -> tuple[int, int, float]:
    """(kernel_only, control_only, p): the samples whose greedy output leaves the reference's under the kernel
    but not the control, and the other way round, and the one-sided exact (sign, or McNemar) test's p-value that
    the kernel leaves it this much more often than the control by chance. Samples that both or neither leave
    tell the two apart no more than a coin does."""
    if not len(reference) == len(kernel) == len(control):
        raise ValueError(f"greedy outputs cover different samples: {len(reference)}, {len(kernel)}, {len(control)}")
    kernel_only = sum(r != k and r == c for r, k, c in zip(reference, kernel, control, strict=True))
    control_only = sum(r == k and r != c for r, k, c in zip(reference, kernel, control, strict=True))
    n = kernel_only + control_only
    p = sum(math.comb(n, i) for i in range(kernel_only, n + 1)) / 2**n
    return kernel_only, control_only, p


def judge(
    task: str,
    metric: str,
    scores: dict[str, Score | None],
    rules: GateRules,
    tolerance: float,
    expected: float | None = None,
    samples: int | None = None,
) -> Verdict:
    """Apply both rules to one task's scores ({"fp", "reference", "control", "kernel"} -> Score or None if not
    run). `samples`: how many samples each score was asked to cover; a score over fewer fails."""
    unknown = set(scores) - set(VARIANTS)
    if unknown:
        raise ValueError(f"scores has unknown variant(s) {sorted(unknown)}; expected some of {VARIANTS}")
    verdict = Verdict(task, metric, {v: scores.get(v) for v in VARIANTS})
    fp, ref, control, ker = (verdict.scores[v] for v in VARIANTS)
    # Every rule below compares with ">", which is false for NaN: a NaN score or stderr must fail here instead.
    broken = [v for v, score in verdict.scores.items()
              if score is not None and not (math.isfinite(score.value) and math.isfinite(score.stderr))]
    if broken:
        verdict.failures.append(f"not a finite score or stderr: {', '.join(broken)}")
        return verdict

    short = [f"{v} {score.n}" for v, score in verdict.scores.items() if score is not None and samples is not None
             and score.n < samples]
    if short:
        verdict.failures.append(f"scored fewer samples than the {samples} asked for: {', '.join(short)}")
    missing = [v for v, score in (("reference", ref), ("kernel", ker)) if score is None]
    if missing:
        verdict.failures.append(f"not gated: no {' and no '.join(missing)} column (rule 1 compares the two)")
    if ref is not None and ker is not None:
        if ref.n != ker.n:
            verdict.failures.append(f"kernel scored {ker.n} samples, reference {ref.n}")
        else:
            allowed = max(rules.kernel_vs_reference_stderrs * ref.stderr, 1.0 / ref.n)
            diff = abs(ker.value - ref.value)
            if diff > allowed + 1e-12:
                verdict.failures.append(
                    f"kernel {ker.value:.4f} vs reference {ref.value:.4f}: |diff| {diff:.4f} > {allowed:.4f} "
                    f"({rules.kernel_vs_reference_stderrs:g} stderr, at least 1/n)"
                )
            verdict.identical = identical_fraction(ker.greedy, ref.greedy)
            if control is not None and control.n != ref.n:
                verdict.failures.append(f"control scored {control.n} samples, reference {ref.n}")
                control = None
            if control is not None:
                verdict.control_identical = identical_fraction(control.greedy, ref.greedy)
            if verdict.identical < rules.min_identical_greedy:
                below = (f"greedy outputs identical on {verdict.identical:.1%} of samples, "
                         f"below {rules.min_identical_greedy:.0%}")
                if control is None:
                    verdict.failures.append(below + " (no control run to calibrate against)")
                elif verdict.control_identical < rules.min_control_identical_greedy:
                    verdict.failures.append(
                        f"{below}, and the control, identical on {verdict.control_identical:.1%}, is below "
                        f"{rules.min_control_identical_greedy:.0%} itself: too far from the reference to calibrate "
                        "against"
                    )
                else:
                    kernel_only, control_only, p = greedy_divergence_p(ref.greedy, ker.greedy, control.greedy)
                    if p < rules.greedy_divergence_p:
                        verdict.failures.append(
                            f"{below}, and the kernel left the reference's on {kernel_only} samples the control "
                            f"kept, the control on {control_only} the kernel kept (p = {p:.3g} < "
                            f"{rules.greedy_divergence_p:g})"
                        )

    baseline, name = (fp.value, "fp") if fp is not None else (expected, "expected")
    if baseline is not None:
        for variant, score in (("reference", ref), ("kernel", ker)):
            if score is not None and baseline - score.value > tolerance + 1e-12:
                verdict.failures.append(
                    f"{variant} {score.value:.4f} dropped {baseline - score.value:.4f} below {name} "
                    f"{baseline:.4f} (tolerance {tolerance:g})"
                )
    else:
        verdict.failures.append("not gated against the fp model: no fp score and no stored expected score")
    return verdict


def format_table(rows: Sequence[tuple[str, str, Verdict]]) -> str:
    """(model, quantization, verdict) rows -> a plain-text table (task, metric, fp, reference, kernel, stderr)."""
    header = ("model", "quant", "task", "metric", "fp", "reference", "kernel", "stderr", "same greedy", "verdict")

    def cell(score: Score | None) -> str:
        return "-" if score is None else f"{score.value:.4f}"

    body = []
    for model, quant, v in rows:
        ref = v.scores["reference"] or v.scores["kernel"] or v.scores["fp"]
        body.append((
            model, quant, v.task, v.metric, cell(v.scores["fp"]), cell(v.scores["reference"]),
            cell(v.scores["kernel"]), "-" if ref is None else f"{ref.stderr:.4f}",
            "-" if v.identical is None else f"{v.identical:.0%}"
            + ("" if v.control_identical is None else f" (control {v.control_identical:.0%})"),
            "PASS" if v.passed else "FAIL",
        ))
    widths = [max(len(str(r[i])) for r in (header, *body)) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in (header, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
