"""Peer backends under a declaration other than their own, as mla-verify plug-ins for device campaigns
(``mla-verify --impl tests.peer_plugins:NAME``): what the verifier says when a declaration is wrong.

| name                      | kernel              | declared                                                    |
|---------------------------|---------------------|-------------------------------------------------------------|
| flashinfer_fp32_partials  | FlashInfer MLA, FA3 | its numerics with fp32 split outputs (it stores them bf16:  |
|                           |                     | mla_hopper.cuh's partial_o): the declaration before the     |
|                           |                     | partials check (numerics.md §5(i))                          |
"""

import dataclasses

import torch

from mla_fast import backends


def flashinfer_fp32_partials(batch):
    return backends.get_backend("flashinfer")(batch)


flashinfer_fp32_partials.numerics = lambda batch: dataclasses.replace(
    backends.BACKENDS["flashinfer"].numerics(batch), partial_dtype=torch.float32)
