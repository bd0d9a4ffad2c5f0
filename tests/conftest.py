"""Shared test configuration: Hypothesis profiles and hardware markers.

Profiles (select with HYPOTHESIS_PROFILE or --hypothesis-profile):
- ``ci``     derandomized, no deadline, no example database: the same examples on every run (the default,
  with or without CI set).
- ``dev``    random, more examples, database on: for local exploration.
- ``search`` many examples, target() phase, no shrinking: hunts worst err/bound cases (see verify.strategies).
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "search",
    deadline=None,
    max_examples=5_000,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
    suppress_health_check=list(HealthCheck),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available() and torch.version.hip is None
    has_rocm = torch.cuda.is_available() and torch.version.hip is not None
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    skip_rocm = pytest.mark.skip(reason="needs ROCm and amd-aiter (none here)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "rocm" in item.keywords and not has_rocm:
            item.add_marker(skip_rocm)
