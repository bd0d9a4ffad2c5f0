"""notebooks/fp8_error_analysis.ipynb executes headless at the CI size, its own assertions included.

The notebook asserts the claims its text makes (deterministic bounds hold, split error flat within the merge bound,
unscaled e4m3 P worse than P x256 on sink data, coherent rounding beyond the first-order RMS estimate, no growth of
the error with ln N); a failing claim fails this test with the cell's traceback.
"""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "fp8_error_analysis.ipynb"


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_notebook_executes_at_ci_size(monkeypatch, tmp_path):
    monkeypatch.setenv("MLA_NB_SIZE", "ci")
    monkeypatch.setenv("MLA_NB_SUMMARY", str(tmp_path / "summary.png"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # small fp64 ops: a second thread only adds contention on 2 cores
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError on any failing cell or assertion
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 7  # one figure per section (6) + the summary
    assert (tmp_path / "summary.png").stat().st_size > 0


# ---- verify.analysis helpers the notebook relies on ------------------------------------------------------------


def test_p_rounding_to_fp32_stays_within_one_fp32_unit_of_the_oracle():
    from mla_ref.decode import mla_decode_ref
    from verify import analysis as A

    _, exact = A.fp8_case("sink", 256, seed=0, heads=4).materialize()
    out, lse = A.decode_p_rounded(exact, "fp32")
    ref_out, ref_lse = mla_decode_ref(exact)
    # |Σ (p̃ - p) v| / l <= 2**-24 Σ p |v|: one fp32 rounding of each weight, plus the fp64 arithmetic around it:
    # the 256-token sums of P·v here and in the oracle, 256 fp64 units each
    assert A.error_stats(out, lse, ref_out, ref_lse, A.softmax_pv(exact))["err_rel"] <= 2**-24 + 2 * 256 * 2**-53
    # lse does not see the rounding: the same fp64 formula up to summation order: l's 256 additions (256 units
    # relative, so absolute in log l) and one ulp of the log
    assert (lse - ref_lse).abs().max() <= 256 * 2**-53 + 2**-52 * ref_lse.abs().max()
    e4m3 = A.error_stats(*A.decode_p_rounded(exact, "e4m3fn"), ref_out, ref_lse, A.softmax_pv(exact))["err_rel"]
    assert e4m3 > 2**-24  # a coarser P format is visible


def test_log_fit_recovers_a_known_slope_and_its_interval():
    import numpy as np

    from verify import analysis as A

    n = np.array([64, 128, 256, 512, 1024, 2048] * 3)
    noise = np.random.default_rng(0).normal(0.0, 1e-3, n.size)  # local generator
    fit = A.log_fit(n, 0.05 + 0.01 * np.log(n) + noise)
    assert fit["ci"][0] <= 0.01 <= fit["ci"][1] and not fit["contains_zero"]
    exact = A.log_fit(n, 0.05 + 0.01 * np.log(n))  # no noise: the slope and a zero-width interval up to fp64
    fp64_fit = 4 * n.size * 2**-53  # the fit's n-term sums (4 per point), on values below 1: absolute fp64 units
    assert abs(exact["slope"] - 0.01) <= fp64_fit and exact["ci"][1] - exact["ci"][0] <= fp64_fit
