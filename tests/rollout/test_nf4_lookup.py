"""The nf4 look-up in registers (scgrpo.rollout.nf4_lookup): its byte permutes, run in Python, give the table's fp32
values for every code at every position of a word, in bitsandbytes' byte order; its PTX renders each instruction
once, writes each output once and reads its input only."""

from __future__ import annotations

import re
import struct

import pytest
import torch

from scgrpo.rollout import nf4_lookup


def _bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _by_bytes(word: int) -> list[int]:
    """Weights 0-7 of a little-endian word of bitsandbytes' codes (the even weight in a byte's high nibble)."""
    codes = []
    for byte in word.to_bytes(4, "little"):
        codes += [byte >> 4, byte & 0xF]
    return [_bits(nf4_lookup.NF4[c]) for c in codes]


def test_every_code_at_every_position_of_a_word_gives_the_table_value():
    """Each of the 16 codes at each of the 8 positions, the other positions random, and 2,000 random words."""
    gen = torch.Generator().manual_seed(0)
    words = [int(w) for w in torch.randint(0, 1 << 32, (2000,), generator=gen, dtype=torch.int64)]
    for position in range(8):
        for code in range(16):
            rest = int(torch.randint(0, 1 << 32, (1,), generator=gen, dtype=torch.int64))
            shift = 4 * (position ^ 1)  # (weight 2i in byte i's high nibble)
            words.append((rest & ~(0xF << shift) | (code << shift)) & 0xFFFFFFFF)
    for word in words:
        assert nf4_lookup.emulate(word) == _by_bytes(word), hex(word)


def test_a_different_table_is_looked_up_as_given():
    """The program is built from the table it is given (no value of nf4 built in)."""
    table = tuple(float(i) * 0.25 - 1.5 for i in range(16))
    word = 0x0123ABCD
    codes = [c for b in word.to_bytes(4, "little") for c in (b >> 4, b & 0xF)]
    assert nf4_lookup.emulate(word, table) == [_bits(table[c]) for c in codes]


def test_the_values_are_bitsandbytes_nf4_table():
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    table = bnb_functional.get_4bit_type("nf4", device="cpu").float()
    assert torch.equal(table, torch.tensor(nf4_lookup.NF4, dtype=torch.float32))


def test_the_ptx_writes_each_output_once_and_only_reads_its_input():
    text = nf4_lookup.ptx()
    lines = [line for line in text.splitlines() if line not in ("{", "}") and not line.startswith(".reg")]
    assert len(lines) == len(nf4_lookup.program())
    destinations = [re.match(r"\w+\.\w+ (\S+),", line).group(1) for line in lines]
    assert sorted(d for d in destinations if d.startswith("$")) == [f"${i}" for i in range(8)]
    assert "$8" not in destinations  # (the input is never written)
    declared = int(re.search(r"%nf<(\d+)>", text).group(1))
    used = {int(n) for n in re.findall(r"%nf(\d+)", text)}
    assert used == set(range(declared))
    assert sum(line.startswith("prmt.b32") for line in lines) == 2 * (3 * 4 + 8)  # per half: 3 a plane, 8 to transpose
