"""The Gluon kernels' grouped shared-memory layouts agree with what their 4-D TMA copies write.

A tile's c_kv (or a half of it) is copied one page at a time as a TMA box [8-token groups, chunks, 8 tokens, row]
with a 64- or 128-byte swizzle, and read back through a `SharedLinearLayout` (offset bit -> [token, channel],
combined by XOR). The device tests check the bits; this CPU check pins each layout's bases to the TMA model: a dense
row-major box whose 16-byte units are XORed with the row bits of their swizzle atom (CUDA's SWIZZLE_64B: address
bits 4-5 ^= bits 7-8; SWIZZLE_128B: bits 4-6 ^= bits 7-9).
"""

import itertools

import pytest

gd = pytest.importorskip("mla_fast.gluon_decode")
g8 = pytest.importorskip("mla_fast.gluon_fp8")

SWIZZLE_MASK = {64: 0b11, 128: 0b111}  # row bits (address bits 7 and up) XORed into the 16-byte unit index


def tma_offset(token: int, channel: int, chunks: int, row_bytes: int, elem_bytes: int, swizzle: int) -> int:
    """Element offset at which a [groups, chunks, 8 tokens, row_bytes] TMA box (dense, then swizzled) puts
    (token, channel) of a [64, chunks x row_bytes / elem_bytes] tile."""
    chunk, byte = divmod(channel * elem_bytes, row_bytes)
    address = ((token // 8 * chunks + chunk) * 8 + token % 8) * row_bytes + byte
    address ^= ((address >> 7) & SWIZZLE_MASK[swizzle]) << 4
    return address // elem_bytes


def layout_coord(bases, offset: int) -> tuple[int, int]:
    """[token, channel] of `offset` in a shared linear layout: the XOR of the bases of its set bits."""
    token = channel = 0
    for bit, (t, c) in enumerate(bases):
        if offset >> bit & 1:
            token, channel = token ^ t, channel ^ c
    return token, channel


@pytest.mark.parametrize("name, layout, chunks, row_bytes, elem_bytes, swizzle", [
    ("seesaw bf16 c_kv half", gd._HALF_LAYOUT, 4, 128, 2, 128),
    ("seesaw fp8 staging of a c_kv half", gd._STAGE8, 4, 64, 1, 64),
    ("gluon_fp8 c_kv tile", g8._TILE8, 4, 128, 1, 128),
])
def test_grouped_layout_reads_what_the_page_copies_write(name, layout, chunks, row_bytes, elem_bytes, swizzle):
    bases = layout.value.offset_bases
    width = chunks * row_bytes // elem_bytes  # channels of the view
    assert 2 ** len(bases) == 64 * width, name  # one offset per element
    seen = set()
    for token, channel in itertools.product(range(64), range(width)):
        offset = tma_offset(token, channel, chunks, row_bytes, elem_bytes, swizzle)
        assert layout_coord(bases, offset) == (token, channel), (name, token, channel, offset)
        seen.add(offset)
    assert seen == set(range(64 * width)), name  # a bijection onto the box's bytes


def test_the_tma_model_moves_a_swizzled_element():
    """The model is not the identity: in a 128-byte swizzle, row 1 of an atom has its 16-byte units XORed with 1."""
    assert tma_offset(1, 0, 4, 128, 1, 128) == 128 + 16
    assert tma_offset(2, 0, 4, 64, 1, 64) == 128 + 16  # 64-byte swizzle: rows 2-3 of an atom XOR unit 1
