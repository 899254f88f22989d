"""A/B timing of versions of the sm_90 skinny kernel in one device round, without torch or the extension build.

    python3 tests/csrc/ab_skinny.py bc516bf HEAD          # csrc/ at two revisions
    python3 tests/csrc/ab_skinny.py HEAD . --passes 3     # "." is the working tree's csrc/
    python3 tests/csrc/ab_skinny.py HEAD . --layer llama_gate_up
    python3 tests/csrc/ab_skinny.py old/ .                 # a directory holding a csrc/ (no git history needed)
    python3 tests/csrc/ab_skinny.py . tests/csrc/variants/*.patch   # the working tree's csrc/ with each patch
    python3 tests/csrc/ab_skinny.py --export DIR tests/csrc/variants/bound-no-meta-loads.patch  # DIR/csrc, patched
    python3 tests/csrc/ab_skinny.py . .+TIME_SKINNY_TMA  # "+NAME": the harness built with -DNAME (here the TMA probe)
    python3 tests/csrc/ab_skinny.py .+TIME_SKINNY_TMA .+TIME_SKINNY_TMA+TMA_STAGES=8   # several: -D for each

Each version's csrc/ is built into tests/csrc/time_skinny.cu (the working tree's, so every version runs the same
cases, checks and timer; the builds run in parallel, about 10 s each). The binaries then run in turn, `--passes`
times each, interleaved so that a drift of the machine's clock or temperature reaches every version alike; a case's
time is its best pass. The table gives µs per version, each against the first (a last row: the geometric mean of
each version's ratios, and their range), and flags a case whose reference check failed (time_skinny.cu checks
sampled rows of every case against float64) or whose checksum differs from the first version's (same arithmetic in
the same order gives the same checksum). Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "csrc" / "time_skinny.cu"
NVCC_FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90"]

# One timed case of time_skinny.cu: "<name> M=<m> <us> us  checksum <a> <b>  check <verdict>".
_LINE = re.compile(r"^(?P<name>\S.*?)\s+M=(?P<m>\d+)\s+(?P<us>[0-9.]+) us\s+checksum (?P<checksum>\S+ \S+)"
                   r"\s+check (?P<check>.*)$")


@dataclass(frozen=True)
class Case:
    us: float
    checksum: str
    check_ok: bool
    check: str


def parse(output: str) -> dict[str, Case]:
    """{"<name> M=<m>": Case} for every timed line of one run's output (skipped cases are left out)."""
    cases = {}
    for line in output.splitlines():
        match = _LINE.match(line.strip())
        if match:
            cases[f"{match['name']} M={match['m']}"] = Case(float(match["us"]), match["checksum"],
                                                            match["check"].startswith("ok"), match["check"])
    return cases


def best_of(passes: list[dict[str, Case]]) -> dict[str, Case]:
    """Per case, the fastest pass; the case fails its check if any pass failed it."""
    best = {}
    for key in dict.fromkeys(k for run in passes for k in run):
        cases = [run[key] for run in passes if key in run]
        fastest = min(cases, key=lambda case: case.us)
        failed = [case for case in cases if not case.check_ok]
        best[key] = Case(fastest.us, fastest.checksum, False, failed[0].check) if failed else fastest
    return best


def table(names: list[str], results: list[dict[str, Case]]) -> tuple[str, bool]:
    """A markdown table of µs per case and version (ratios to the first version), and whether every check passed."""
    lines = ["| case | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    all_ok = True
    for key in dict.fromkeys(k for result in results for k in result):
        first = results[0].get(key)
        cells = []
        for result in results:
            case = result.get(key)
            if case is None:
                cells.append("-")
                continue
            cell = f"{case.us:.2f}"
            if first is not None and case is not first:
                cell += f" ({case.us / first.us:.3f}x)"
                if case.checksum != first.checksum:
                    cell += " sum differs"
            if not case.check_ok:
                cell += f" **{case.check}**"
                all_ok = False
            cells.append(cell)
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    # One line to read each version by: the geometric mean of its ratios to the first, and their range.
    summary = ["-"]
    for result in results[1:]:
        ratios = [result[k].us / results[0][k].us for k in result if k in results[0]]
        summary.append(f"{math.prod(ratios) ** (1 / len(ratios)):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}x)"
                       if ratios else "-")
    lines.append("| geometric mean (range) | " + " | ".join(summary) + " |")
    return "\n".join(lines), all_ok


def export_csrc(version: str, into: Path) -> Path:
    """The csrc/ directory of a version, to build against: "." is the working tree's, a .patch file is the working
    tree's with that patch applied (tests/csrc/variants: prepared variants travel as patches, so a copy of the
    repository without its history can time them), a directory holding a csrc/ is taken as it is, anything else is
    a git revision."""
    if version == ".":
        return ROOT / "csrc"
    if version.endswith(".patch"):
        return apply_patch(Path(version), into)
    if Path(version).is_dir():
        if not (Path(version) / "csrc" / "skinny_mma.cuh").is_file():
            raise SystemExit(f"{version} is a directory without csrc/skinny_mma.cuh: give a git revision, ., or a "
                             "directory holding a csrc/")
        return Path(version).resolve() / "csrc"
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", version, "csrc"], check=True,
                             capture_output=True).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "csrc"


# In a patch's description (the text before its first diff): the patch it was made against, if not the kernel itself.
_BASE = re.compile(r"^Applies on top of (\S+\.patch)", re.M)


def patch_chain(patch: Path) -> list[Path]:
    """The patches to apply, in order, for `patch`: the one its description names as its base ("Applies on top
    of X.patch", next to it), that one's base first, and so on, then `patch` itself."""
    base = _BASE.search(patch.read_text().split("\ndiff --git", 1)[0])
    return ([*patch_chain(patch.parent / base.group(1))] if base else []) + [patch]


def apply_patch(patch: Path, into: Path) -> Path:
    """A copy of the working tree's csrc/ under `into`, with `patch` (a diff of csrc/ made by git) applied, after
    the patches it builds on (patch_chain)."""
    shutil.copytree(ROOT / "csrc", into / "csrc")
    # Inside a repository (a temporary directory under a checkout, as nox's is) git apply would apply the patch
    # relative to that repository and skip, without a word, the paths outside the current directory: stop its
    # search for a repository at `into`.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(into.resolve().parent)}
    for step in patch_chain(patch):
        done = subprocess.run(["git", "apply", str(step.resolve())], cwd=into, capture_output=True, text=True,
                              env=env)
        if done.returncode:
            raise SystemExit(f"{step} does not apply to the working tree's csrc/ (rebase it onto the current "
                             f"kernel, or delete it with its csrc/PERF.md entry):\n{done.stderr}")
    return into / "csrc"


# A version's "+NAME" or "+NAME=NUMBER" suffixes: build the harness with -DNAME[=NUMBER] for each (time_skinny.cu's
# TIME_SKINNY_TMA times the TMA probe of tma_skinny.cuh instead of the kernel).
_DEFINES = re.compile(r"^(?P<version>.+?)(?P<defines>(?:\+[A-Z][A-Z0-9_]*(?:=[0-9]+)?)+)$")


def split_define(version: str) -> tuple[str, list[str]]:
    """(the version without its "+NAME" suffixes, the nvcc flags they ask for)."""
    match = _DEFINES.match(version)
    if not match:
        return version, []
    return match["version"], [f"-D{name}" for name in match["defines"].split("+")[1:]]


def build(csrc: Path, binary: Path, flags: list[str]) -> None:
    result = subprocess.run(["nvcc", *NVCC_FLAGS, *flags, f"-I{csrc}", f"-I{HARNESS.parent}", "-o", str(binary),
                             str(HARNESS)], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"building against {csrc} failed:\n{result.stdout}{result.stderr}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="+",
                        help="git revisions of csrc/, . for the working tree, patches of it (.patch), or directories "
                             "holding a csrc/; any of them with +NAME or +NAME=NUMBER suffixes: the harness "
                             "built with -DNAME[=NUMBER] for each")
    parser.add_argument("--passes", type=int, default=2, help="runs of each binary, interleaved (default 2)")
    parser.add_argument("--layer", help="one layer at M = 1 only (TIME_SKINNY_LAYER)")
    parser.add_argument("--export", metavar="DIR", type=Path,
                        help="write the one version given (a patch) into DIR/csrc instead of timing anything")
    args = parser.parse_args(argv)
    if args.export:
        if len(args.versions) != 1 or not args.versions[0].endswith(".patch"):
            parser.error("--export takes one version, a .patch file")
        print(apply_patch(Path(args.versions[0]), args.export))
        return 0
    if args.passes < 1:
        parser.error(f"--passes must be >= 1, got {args.passes}")
    env = dict(os.environ, **({"TIME_SKINNY_LAYER": args.layer} if args.layer else {}))
    with tempfile.TemporaryDirectory(prefix="ab_skinny_") as tmp:
        work = Path(tmp)
        binaries = [work / f"time_skinny_{i}" for i in range(len(args.versions))]
        versions = [split_define(v) for v in args.versions]
        sources = [export_csrc(v, work / f"src_{i}") for i, (v, _) in enumerate(versions)]
        with concurrent.futures.ThreadPoolExecutor() as pool:
            list(pool.map(build, sources, binaries, [flags for _, flags in versions]))
        runs: list[list[dict[str, Case]]] = [[] for _ in binaries]
        for p in range(args.passes):
            for i, binary in enumerate(binaries):
                done = subprocess.run([str(binary)], capture_output=True, text=True, env=env)
                print(f"pass {p + 1}, {args.versions[i]}: exit {done.returncode}", file=sys.stderr)
                cases = parse(done.stdout)
                if not cases:
                    raise SystemExit(f"{args.versions[i]} timed nothing:\n{done.stdout}{done.stderr}")
                runs[i].append(cases)
    names = [Path(v).stem if v.endswith(".patch") else v for v in args.versions]
    text, all_ok = table(names, [best_of(r) for r in runs])
    print(text)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
