"""Reading `cuobjdump -sass` output, control bits included, for checks on how ptxas scheduled the skinny kernel.

Since Volta every SASS instruction is 128 bits, and cuobjdump prints it as two 64-bit words in comments. The high
word carries the scheduling controls that ptxas chose (bit positions as documented by the Volta/Turing
microbenchmarking papers and the open assemblers built on them):

    bits 41-44  stall cycles before the next instruction issues
    bits 46-48  the scoreboard this instruction's result sets when it completes (7: none), for variable-latency
                ops such as global loads
    bits 49-51  the scoreboard it sets when its source registers have been read (7: none)
    bits 52-57  wait mask: the instruction waits until these scoreboards (bit i = scoreboard i) are clear

A scoreboard counts the loads in flight on it and a wait waits for all of them, so which instructions wait on which
scoreboard decides how much of a load pipeline survives.
"""

from __future__ import annotations

import re
from typing import NamedTuple

NO_SCOREBOARD = 7

# "/*0120*/   LDG.E.128 R4, desc[UR4][R2.64] ;   /* 0x<low word> */" then a line "/* 0x<high word> */".
_INSTRUCTION = re.compile(r"^ +/\*([0-9a-f]{4,})\*/ +([^;\n]*); +/\* 0x[0-9a-f]{16} \*/\n +/\* 0x([0-9a-f]{16}) \*/", re.M)
_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$", re.M)
# "BRA 0x160", and the forms with a modifier or a condition before the target: "@!P1 BRA P2, 0x30",
# "BRA.DIV UR4, 0x30", "BRA.U !UP0, 0x30". (CALL.REL is not followed: a call returns.)
_BRANCH_TARGET = re.compile(r"\bBRA(?:\.\w+)* (?:[^,;]+, )*(0x[0-9a-f]+)")
# 16-byte global loads into registers (the weight stream); LDGSTS (cp.async) writes shared memory instead.
_WEIGHT_LOAD = re.compile(r"^(?:@!?U?P\w+ )?LDG\.E\S*\.128\b")
# griddepcontrol.wait: the kernel waits for the one ahead of it on the stream (programmatic dependent launch).
_GRID_WAIT = re.compile(r"^ACQBULK\b")
# Instructions that touch global memory: loads, stores, cp.async (LDGSTS), atomics and reductions, generic accesses
# and the bulk/TMA copies.
_GLOBAL_ACCESS = re.compile(r"^(?:@!?U?P\w+ )?(?:LDG|STG|LDGSTS|ATOMG|ATOM|RED|LD|ST|UBLKCP|UTMALDG|UTMASTG)\b")


class Instruction(NamedTuple):
    address: int
    text: str
    control: int  # the high 64-bit word

    @property
    def stall(self) -> int:
        return (self.control >> 41) & 0xF

    @property
    def write_scoreboard(self) -> int:
        return (self.control >> 46) & 0x7

    @property
    def wait_mask(self) -> int:
        return (self.control >> 52) & 0x3F

    def waits_on(self, scoreboard: int) -> bool:
        return bool(self.wait_mask >> scoreboard & 1)


def functions(sass: str) -> dict[str, list[Instruction]]:
    """Every function of a `cuobjdump -sass` listing: its mangled name -> its instructions in address order."""
    heads = list(_FUNCTION.finditer(sass))
    if not heads:
        raise ValueError("no 'Function :' sections: not the output of cuobjdump -sass")
    ends = [head.start() for head in heads[1:]] + [len(sass)]
    return {head.group(1): [Instruction(int(a, 16), text.rstrip(), int(high, 16))
                            for a, text, high in _INSTRUCTION.findall(sass, head.end(), end)]
            for head, end in zip(heads, ends, strict=True)}


def _loops(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The body of every backward branch (target .. branch), in address order."""
    index = {i.address: n for n, i in enumerate(instructions)}
    loops = []
    for end, branch in enumerate(instructions):
        found = _BRANCH_TARGET.search(branch.text)
        target = int(found.group(1), 16) if found else None
        if target is not None and target < branch.address and target in index:
            loops.append(instructions[index[target]:end + 1])
    return loops


def refill_waits(instructions: list[Instruction]) -> list[Instruction] | None:
    """The instructions of the weight-ring loops that wait for loads the same pass has just issued.

    A ring loop is a loop that issues 16-byte weight loads and holds no other such loop's back edge: a backward
    branch from code placed after the loops (a reduction called from the loop body) spans the loops around it, and
    is not one. A kernel may hold several ring loops (a copy per code path); each is checked. A ring whose refills
    are consumed one pass later waits for them once per pass, at or before the pass's first unit: any wait on their
    scoreboard after the pass's first refill stalls the warp on loads that were meant to stay in flight. An empty
    list is that schedule. None: the function has no loop issuing weight loads (nothing was checked).
    """
    loops = [body for body in _loops(instructions) if any(_WEIGHT_LOAD.match(i.text) for i in body)]
    back_edges = {body[-1].address for body in loops}
    rings = [body for body in loops
             if not any(body[0].address <= edge < body[-1].address for edge in back_edges)]
    if not rings:
        return None
    waits = []
    for body in rings:
        first = next(n for n, i in enumerate(body) if _WEIGHT_LOAD.match(i.text))
        scoreboards = {i.write_scoreboard for i in body if _WEIGHT_LOAD.match(i.text)}
        if NO_SCOREBOARD in scoreboards:  # a global load always sets one: the control bits were misread
            raise ValueError("a 16-byte global load in the loop sets no scoreboard: not an sm_70+ control word")
        waits += [i for i in body[first + 1:] if any(i.waits_on(s) for s in scoreboards)]
    return waits


def accesses_before_grid_wait(instructions: list[Instruction]) -> list[Instruction] | None:
    """What a kernel launched programmatically does before it waits for the kernel ahead of it: the global memory
    accesses placed before its first griddepcontrol.wait (ACQBULK), and the branches there that jump past it (a path
    that skips the wait). An empty list: every access comes after the wait. None: the function never waits."""
    first = next((n for n, i in enumerate(instructions) if _GRID_WAIT.match(i.text)), None)
    if first is None:
        return None
    wait_address = instructions[first].address
    early = []
    for i in instructions[:first]:
        target = _BRANCH_TARGET.search(i.text)
        if _GLOBAL_ACCESS.match(i.text) or (target and int(target.group(1), 16) > wait_address):
            early.append(i)
    return early
