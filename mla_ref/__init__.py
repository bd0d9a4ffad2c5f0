"""mla_ref: the readable fp64 oracle for DeepSeek MLA (naive and absorbed forms, YaRN rope, fp8, paged decode)."""

from mla_ref.decode import DecodeBatch, make_decode_batch, merge_partials, mla_decode_ref

__all__ = ["DecodeBatch", "make_decode_batch", "merge_partials", "mla_decode_ref"]
