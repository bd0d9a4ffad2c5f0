"""`python -m mla_ref`: a two-part demo of the oracle.

1. One MLA layer with DeepSeek-V3 head dims (small hidden size, 4 heads), naive vs absorbed form in fp64.
2. A paged decode step of the same layer through ``mla_decode_ref``, and an fp8 (e4m3fn) round trip of its cache.
"""

import argparse
import dataclasses

import torch
from rich.console import Console
from rich.table import Table

from mla_ref.config import MLAConfig
from mla_ref.decode import make_decode_batch, mla_decode_ref
from mla_ref.fp8 import FORMATS, dequantize, quantize
from mla_ref.mla import MLAWeights, absorb_output, absorbed_query, latent_cache_row, mla_forward, project_q


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="python -m mla_ref", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)  # --help only
    console = Console()
    cfg = dataclasses.replace(MLAConfig.deepseek_v3(), hidden_size=256, num_heads=4)
    w = MLAWeights.random(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    S = 48
    x = torch.randn(1, S, cfg.hidden_size, generator=g, dtype=torch.float64)  # [1, S, D]
    pos = torch.arange(S)  # [S]
    naive = mla_forward(x, w, cfg, pos, mode="naive")  # [1, S, D]
    absorbed = mla_forward(x, w, cfg, pos, mode="absorbed")  # [1, S, D]
    rel = ((naive - absorbed).abs().max() / naive.abs().max()).item()

    # decode the last token against the cache of all S tokens (paged, page size 16, NaN in unused slots)
    q_nope, q_pe = project_q(x[0, -1:], w, cfg, pos[-1:])  # [1, H, 128], [1, H, 64]
    q = absorbed_query(q_nope, q_pe, w)  # [1, H, 576]
    cache = latent_cache_row(x[0], w, cfg, pos)  # [S, 576]
    batch = make_decode_batch(q, [cache], sm_scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank,
                              page_size=16, generator=g)
    o_latent, lse = mla_decode_ref(batch)  # [1, H, 512], [1, H]
    o_heads = absorb_output(o_latent, w)  # [1, H, 128]
    o_prefill = mla_forward(x, w, cfg, pos, mode="naive")  # [1, S, D]
    decode_rel = ((o_heads.flatten(-2) @ w.wo.T - o_prefill[0, -1:]).abs().max() / o_prefill.abs().max()).item()

    table = Table(title=f"MLA oracle, DeepSeek-V3 head dims (σ = {cfg.softmax_scale:.7f}), fp64")
    table.add_column("check")
    table.add_column("max rel. difference", justify="right")
    table.add_row("naive vs absorbed prefill", f"{rel:.2e}")
    table.add_row("paged decode (absorbed) vs prefill, last token", f"{decode_rel:.2e}")
    console.print(table)

    fp8 = Table(title="fp8 round trip of the latent cache (per-tensor dynamic scale, saturating)")
    for col in ("format", "scale", "max |err| / (u|x| + η·s)", "max rel err (|x| > 1e-2)"):
        fp8.add_column(col, justify="right")
    for name in ("e4m3fn", "e4m3fnuz", "e5m2"):
        fmt = FORMATS[name]
        x8, s = quantize(cache, name)  # [S, 576] fp8, [] fp32
        back = dequantize(x8, s)  # [S, 576] fp64
        err = (back - cache).abs()  # [S, 576]
        budget = fmt.u * cache.abs() + fmt.eta * s.double()  # [S, 576] element error model, numerics.md §4
        big = cache.abs() > 1e-2
        fp8.add_row(name, f"{s.item():.3e}", f"{(err / budget).max().item():.3f}",
                    f"{(err[big] / cache.abs()[big]).max().item():.4f}")
    console.print(fp8)


if __name__ == "__main__":
    main()
