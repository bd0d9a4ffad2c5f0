"""Shared by tests/test_planner.py and tests/test_emulate.py: the planner arguments of a drawn case."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mla_fast.planner import WorkPlan, plan_decode


@dataclass(frozen=True)
class PlanCase:
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    num_heads: int
    head_group: int
    num_workers: int
    block_n: int
    fixed_overhead: int
    max_splits: int | None
    min_tail: int = field(default=1, kw_only=True)  # keyword-only: subclasses add fields without defaults

    def plan(self, device: str = "cpu") -> WorkPlan:
        return plan_decode(
            torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            torch.tensor(self.q_lens, dtype=torch.int32, device=device),
            self.num_heads,
            self.num_workers,
            block_n=self.block_n,
            fixed_overhead=self.fixed_overhead,
            max_splits=self.max_splits,
            head_group=self.head_group,
            min_tail=self.min_tail,
        )
