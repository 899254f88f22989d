"""`python -m w4a16 <command>`: each command lives in its own module with `add_arguments` and `run`."""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, one-line help); modules are imported only when their command runs.
COMMANDS = {
    "info": ("w4a16.info", "print the architecture, versions and the usable backends"),
    "bench": ("w4a16.bench.cli", "kernel and end-to-end benchmarks against stored baselines (GPU)"),
    "accuracy": ("w4a16.accuracy.cli", "lm-eval accuracy gate: fp vs W4A16 reference vs W4A16 kernels"),
    "asm": ("w4a16.asm", "compile a kernel ahead of time for gfx1151/gfx1201/sm_90 and summarise its assembly"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m w4a16", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    parsers = {name: sub.add_parser(name, help=text, description=text) for name, (_, text) in COMMANDS.items()}
    command = next((a for a in argv if not a.startswith("-")), None)
    module = importlib.import_module(COMMANDS[command][0]) if command in COMMANDS else None
    if module is not None:
        module.add_arguments(parsers[command])
    args = parser.parse_args(argv)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
