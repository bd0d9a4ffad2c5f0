"""mla_fast: the fast path (planner, CPU emulation, Triton kernel, peer adapters). Imports are lazy: no triton here."""

from importlib import import_module

_EXPORTS = {
    "plan_decode": "mla_fast.planner",
    "WorkPlan": "mla_fast.planner",
    "run_plan_reference": "mla_fast.emulate",
}

__all__ = sorted([*_EXPORTS, "decode"])


def decode(batch, *, backend: str = "triton", plan=None, out=None, lse=None):
    """MLA decode of a DecodeBatch -> (out [T, H, L], lse [T, H] fp32 natural log); see mla_fast.triton_decode.

    backend: "triton" (the persistent split-KV kernels, with the batch's default config `triton_decode.batch_config`:
    on an H100/H200 bf16 batches with more than 16 packed rows per program run the Gluon seesaw kernel,
    mla_fast.gluon_decode; fp8 caches at q_len <= 4 the Gluon fp8 kernel, mla_fast.gluon_fp8, with fp8 score MMAs
    for fp8 q, where it needs at most 2 programs of up to 16 packed (query row x head) rows per worker (16 or 32
    heads at q_len 1, 16 at q_len 2; 12 rows per program at q_len 3) or its programs x cache tokens stay under
    `triton_decode.gluon_fp8_max_program_tokens`; other fp8 caches the seesaw kernel on fp16 operands, up to 64
    packed rows per program, 48 at q_len 3). plan: a WorkPlan from triton_decode.make_plan(batch,
    batch_config(batch, max q_len)) (None: planned here, one host sync). out / lse: optional preallocated outputs:
    out bf16 [T, H, L], or fp32 when the batch runs the Triton kernel (the Gluon kernels write bf16), returned as
    given; lse fp32 [T, H] (`triton_decode.check_outputs`).
    """
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' (the other backends, e.g. 'emulated', 'ref' and the peers, "
                         f"run through mla_fast.backends.get_backend(name).run(batch)), got {backend!r}")
    from mla_fast.triton_decode import decode as triton_decode

    return triton_decode(batch, plan=plan, out=out, lse=lse)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mla_fast' has no attribute {name!r}")
