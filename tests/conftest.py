"""Shared test configuration: Hypothesis profiles and hardware markers.

Profiles (`verify.testing.PROFILES`; select with HYPOTHESIS_PROFILE or --hypothesis-profile):
- ``ci``     derandomized, no deadline, no example database: the same examples on every run (the default,
  with or without CI set).
- ``dev``    random, more examples, database on: for local exploration.
- ``search`` many examples, target() phase, no shrinking: hunts worst err/bound cases (see verify.strategies).
"""

import pytest
import torch

from verify.testing import register_profiles

register_profiles()  # verify.testing.PROFILES, chosen by $HYPOTHESIS_PROFILE (default ci)


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
