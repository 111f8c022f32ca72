"""The nf4 table looked up in registers: eight codes of one 32-bit word into their eight fp32 values, with byte
permutes (PTX ``prmt``) and no memory access.

A ``prmt`` picks each of its four output bytes from the eight bytes of two registers, by a 3-bit selector a byte
(one nibble of a third register). The 16 fp32 values of the table are 64 bytes: for each byte plane ``j`` of an
fp32 value (bits ``8j`` to ``8j + 7``) two registers hold plane ``j`` of entries 0-7 and two of entries 8-15. Four
codes of a 16-bit half of the word are four selectors as they lie (their high bits masked off); one permute a plane
gives plane ``j`` of the four values for codes below 8, one for codes from 8, and a third picks between the two by
each code's high bit; eight more permutes transpose the four planes into four fp32 values. In bitsandbytes' byte
order (two codes a byte, the even weight's in the high nibble) a half ``[b0, b1]`` holds the codes of weights 1, 0,
3, 2 in its nibbles from the lowest.

:func:`program` is the instruction list; :func:`ptx` renders it for ``tl.inline_asm_elementwise`` (outputs
``$0``-``$7``: the fp32 bits of weights 0-7 of the word; inputs ``$8``: the word, ``$9``-``$24``: the planes);
:func:`emulate` runs it in Python (the tests check it against the table for every code). About 5 permutes a
weight; with the scale's multiply and the rounding, a step of the matmul's loop is 10-11 instructions a weight
(sm_90 SASS of tiles of 128 or 256 rows by 64 weights at 8 warps).
"""

from __future__ import annotations

import functools
import struct

NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
"""bitsandbytes' nf4 values (``bitsandbytes.functional.get_4bit_type("nf4")``), as fp32"""

Instruction = tuple  # (op, destination, *sources): op "and", "shr", "or", "prmt"


def table_bits(table=NF4) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in table]


def plane_registers(table=NF4) -> list[int]:
    """For each byte plane ``j`` (0-3): plane ``j`` of entries 0-3, 4-7, 8-11, 12-15, one byte an entry, the
    lowest entry in the lowest byte (16 words, ``j``-major)."""
    bits = table_bits(table)
    words = []
    for j in range(4):
        for first in (0, 4, 8, 12):
            words.append(sum(((bits[first + i] >> (8 * j)) & 0xFF) << (8 * i) for i in range(4)))
    return words


PLANES_IN = 9
"""The first of the 16 input operands that hold :func:`plane_registers` (``$9``-``$24``): the kernel loads them
once, so that they stay in registers (as immediates, ptxas moves each into a register at every use)"""


@functools.cache
def program(table=NF4) -> tuple[Instruction, ...]:
    """The instructions: the planes (:func:`plane_registers`) are the inputs ``$9``-``$24``, then each half's."""
    ops: list[Instruction] = []
    plane = lambda i: f"${PLANES_IN + i}"  # noqa: E731
    outputs = {}
    for half, shift in ((0, 0), (1, 16)):
        r = lambda name, half=half: f"{name}{half}"  # noqa: E731 - the half's own registers
        if shift:
            ops += [("shr", r("s"), "$8", shift), ("and", r("s"), r("s"), 0x7777)]
        else:
            ops.append(("and", r("s"), "$8", 0x7777))  # four selectors: the codes less their high bit
        ops += [("shr", r("h"), "$8", shift + 1), ("and", r("h"), r("h"), 0x4444), ("or", r("h"), r("h"), 0x3210)]
        for j in range(4):  # plane j of the four values: below 8, from 8, and each code's choice of the two
            ops += [("prmt", r(f"lo{j}_"), plane(4 * j), plane(4 * j + 1), r("s")),
                    ("prmt", r(f"hi{j}_"), plane(4 * j + 2), plane(4 * j + 3), r("s")),
                    ("prmt", r(f"p{j}_"), r(f"lo{j}_"), r(f"hi{j}_"), r("h"))]
        ops += [("prmt", r("t0_"), r("p0_"), r("p1_"), 0x5140), ("prmt", r("t1_"), r("p0_"), r("p1_"), 0x7362),
                ("prmt", r("t2_"), r("p2_"), r("p3_"), 0x5140), ("prmt", r("t3_"), r("p2_"), r("p3_"), 0x7362)]
        # value i of the half (its nibble i): bytes i of the four planes; nibbles 0-3 are weights 1, 0, 3, 2
        for nibble, (a, b, sel) in enumerate((("t0_", "t2_", 0x5410), ("t0_", "t2_", 0x7632),
                                              ("t1_", "t3_", 0x5410), ("t1_", "t3_", 0x7632))):
            weight = 4 * half + (nibble ^ 1)
            outputs[weight] = f"${weight}"
            ops.append(("prmt", outputs[weight], r(a), r(b), sel))
    return tuple(ops)


def _registers(ops) -> list[str]:
    names = []
    for op in ops:
        for name in op[1:]:
            if isinstance(name, str) and not name.startswith("$") and name not in names:
                names.append(name)
    return names


@functools.cache
def ptx(table=NF4) -> str:
    """:func:`program` as PTX in a scope of its own."""
    ops = program(table)
    regs = {name: f"%nf{i}" for i, name in enumerate(_registers(ops))}
    name = lambda v: regs.get(v, v) if isinstance(v, str) else hex(v)  # noqa: E731
    lines = ["{", f".reg .b32 %nf<{len(regs)}>;"]
    for op, dst, *srcs in ops:
        kind = "u32" if op == "shr" else "b32"
        lines.append(f"{op}.{kind} {name(dst)}, {', '.join(name(s) for s in srcs)};")
    lines.append("}")
    return "\n".join(lines)


def _prmt(a: int, b: int, selector: int) -> int:
    pool = a | (b << 32)
    out = 0
    for i in range(4):
        sel = (selector >> (4 * i)) & 0xF
        if sel & 8:
            raise ValueError("sign-replicating selectors are not used")
        out |= ((pool >> (8 * sel)) & 0xFF) << (8 * i)
    return out


def emulate(word: int, table=NF4) -> list[int]:
    """The fp32 bits :func:`program` gives for one 32-bit ``word``, weights 0-7."""
    regs: dict[str, int] = {"$8": word & 0xFFFFFFFF}
    regs.update({f"${PLANES_IN + i}": w for i, w in enumerate(plane_registers(table))})
    value = lambda v: regs[v] if isinstance(v, str) else v  # noqa: E731
    for op, dst, *srcs in program(table):
        s = [value(v) for v in srcs]
        regs[dst] = {"and": lambda: s[0] & s[1], "or": lambda: s[0] | s[1],
                     "shr": lambda: s[0] >> s[1], "prmt": lambda: _prmt(*s)}[op]() & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(8)]
