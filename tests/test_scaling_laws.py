"""Stage `scaling-laws` against truth: losses drawn from a known L(N, D) with noise are fitted back to
its exponents, the IsoFLOP minima to the law's own compute-optimal frontier, and the objective to
scipy's own logsumexp and Huber loss; the stage end to end on eval.csv files."""

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from scipy import optimize, special

from tinylm import scaling_laws as sl
from tinylm.eval_table import COLUMNS

# A law of Chinchilla's form with exponents like Chinchilla's own (Hoffmann et al. 2022, approach 3).
TRUE = {"E": 1.8, "A": 400.0, "alpha": 0.34, "B": 1400.0, "beta": 0.28}
BUDGETS = [1e15, 4e15, 1.6e16, 6.4e16]


def optimal_n(law: dict, budget: float) -> float:
    """The law's compute-optimal N at C = 6 N D, by brute force over a fine grid of N."""
    n = np.geomspace(1e3, 1e12, 200_001)
    return float(n[np.argmin(sl.parametric_loss(law, n, budget / (6 * n)))])


def synthetic_points(noise: float, seed: int = 0, seeds: int = 2) -> pd.DataFrame:
    """Seven shapes per budget around the true optimum (1/8x to 8x), D = C / 6N, each loss times
    exp(N(0, noise)) per seed."""
    rng = np.random.default_rng(seed)
    rows = []
    for budget in BUDGETS:
        for factor in np.geomspace(1 / 8, 8, 7):
            n = optimal_n(TRUE, budget) * factor
            d = budget / (6 * n)
            for _ in range(seeds):
                loss = sl.parametric_loss(TRUE, n, d) * np.exp(rng.normal(0, noise))
                rows.append({"budget": budget, "n": n, "d": d, "loss": loss})
    return pd.DataFrame(rows)


def ladder(**keys) -> SimpleNamespace:
    defaults = dict(
        isoflop_shapes=None, holdout=True, predict=[2.56e17], bootstrap=40, bootstrap_seed=0, confidence=0.9
    )
    return SimpleNamespace(**{**defaults, **keys})


def test_the_objective_is_scipys_logsumexp_and_huber_with_its_gradient():
    rng = np.random.default_rng(1)
    log_n, log_d, log_loss = rng.uniform(9, 15, 40), rng.uniform(12, 20, 40), rng.uniform(0.5, 2.0, 40)
    for theta in [np.array([5.0, 6.0, 0.5, 0.3, 0.4]), np.array([1.0, 9.0, 0.7, 0.1, 0.6])]:
        value, gradient = sl._huber_objective(theta, log_n, log_d, log_loss)
        terms = np.stack([theta[0] - theta[3] * log_n, theta[1] - theta[4] * log_d, np.full(40, theta[2])])
        expected = special.huber(sl.HUBER_DELTA, special.logsumexp(terms, axis=0) - log_loss).sum()
        assert value == pytest.approx(expected, rel=1e-12)
        numeric = optimize.approx_fprime(
            theta, lambda t: sl._huber_objective(t, log_n, log_d, log_loss)[0], 1e-7
        )
        np.testing.assert_allclose(gradient, numeric, rtol=1e-4, atol=1e-8)


def test_a_parabola_through_exact_points_has_its_vertex_and_flags_a_missing_minimum():
    n = np.geomspace(1e4, 1e6, 5)
    vertex = np.log(8e4)
    loss = 0.3 * (np.log(n) - vertex) ** 2 + 3.0
    d = 1e12 / (6 * n)
    iso = sl.fit_isoflop(1e12, n, d, loss)
    assert iso.interior
    assert iso.n_opt == pytest.approx(8e4, rel=1e-9)
    assert iso.loss_opt == pytest.approx(3.0, rel=1e-9)
    assert iso.d_opt == pytest.approx(1e12 / (6 * 8e4), rel=1e-9)
    falling = sl.fit_isoflop(1e12, n, d, 5.0 - 0.1 * np.log(n))  # keeps falling: no interior minimum
    assert not falling.interior and np.isnan(falling.n_opt)
    with pytest.raises(sl.FitError, match="2 distinct shapes"):
        sl.fit_isoflop(1e12, n[[0, 0, 1]], d[[0, 0, 1]], loss[[0, 0, 1]])


def test_the_window_keeps_the_shapes_nearest_the_best_and_brings_a_lopsided_minimum_inside():
    """Shapes from 1x to 64x the optimum, a loss that rises steeply on the large side: the parabola
    through all of them puts its vertex below the smallest shape; through the 4 nearest the best it
    finds the minimum between the first two."""
    n = 1e5 * 2.0 ** np.arange(7)
    loss = 3.0 + 0.02 * (np.log(n / 1.3e5)) ** 2 + 0.05 * np.maximum(0, np.log(n / 2e5)) ** 1.2
    group = pd.DataFrame({"budget": 1e12, "n": np.repeat(n, 2), "d": np.repeat(1e12 / (6 * n), 2),
                          "loss": np.repeat(loss, 2) + np.tile([0.0, 0.001], 7)})  # fmt: skip
    near = sl.nearest_shapes(group, 4)
    best = n[np.argmin(loss)]
    expected = sorted(n, key=lambda x: abs(np.log(x / best)))[:4]  # brute force
    assert sorted(near["n"].unique()) == sorted(expected) and len(near) == 8
    assert sl.nearest_shapes(group, None) is group
    everything = sl.fit_isoflop(1e12, *(group[c].to_numpy() for c in ("n", "d", "loss")))
    windowed = sl.fit_isoflop(1e12, *(near[c].to_numpy() for c in ("n", "d", "loss")))
    assert windowed.interior and n[0] <= windowed.n_opt <= n[1]
    assert windowed.n_range == (min(expected), max(expected))
    vertex = np.exp(-everything.coefficients[1] / (2 * everything.coefficients[0]))
    assert not everything.interior and vertex < n[0]


def test_known_exponents_are_fitted_back_from_noisy_losses():
    """0.5 % noise on the loss: alpha and beta within 0.03, E within 3 %, the IsoFLOP frontier's exponent
    within 0.02 of the law's own beta / (alpha + beta), and its N_opt within 10 % of the brute-force
    optimum at every budget."""
    laws = sl.fit_laws(synthetic_points(noise=0.005))
    p = laws.parametric
    assert p["alpha"] == pytest.approx(TRUE["alpha"], abs=0.03)
    assert p["beta"] == pytest.approx(TRUE["beta"], abs=0.03)
    assert p["E"] == pytest.approx(TRUE["E"], rel=0.03)
    exponent = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])
    assert laws.n_law[1] == pytest.approx(exponent, abs=0.02)
    assert laws.d_law[1] == pytest.approx(1 - exponent, abs=0.02)
    for iso in laws.isoflops:
        assert iso.interior
        assert iso.n_opt == pytest.approx(optimal_n(TRUE, iso.budget), rel=0.10)


def test_noise_free_losses_give_the_law_itself():
    p = sl.fit_laws(synthetic_points(noise=0.0, seeds=1)).parametric
    for name, value in TRUE.items():
        assert p[name] == pytest.approx(value, rel=0.02), name


def test_bootstrap_intervals_cover_the_truth_and_the_held_out_budget_is_predicted():
    points = synthetic_points(noise=0.005)
    report = sl.scaling_laws(points, ladder())
    fits = report.fits.set_index(["fit", "quantity"])
    for quantity in ("alpha", "beta"):
        lo, hi = fits.loc[("all", quantity), ["lo", "hi"]]
        assert lo <= TRUE[quantity] <= hi, (quantity, lo, hi)
        assert hi - lo < 0.2
    assert (report.fits["resamples"] + report.fits["failed"] == 40).all()
    held = report.predictions[report.predictions["held_out"]].iloc[0]
    assert held["budget"] == BUDGETS[-1]
    truth = optimal_n(TRUE, BUDGETS[-1])
    assert held["n_opt"] == pytest.approx(truth, rel=0.15)
    assert held["n_opt_lo"] <= held["n_opt"] <= held["n_opt_hi"]
    true_best = sl.parametric_loss(TRUE, truth, BUDGETS[-1] / (6 * truth))
    assert held["loss"] == pytest.approx(true_best, rel=0.01)
    assert held["measured_n_opt"] == pytest.approx(truth, rel=0.15)
    assert held["n_opt_error"] == pytest.approx(held["n_opt"] / held["measured_n_opt"] - 1)
    # The same seed gives the same intervals.
    again = sl.scaling_laws(points, ladder())
    pd.testing.assert_frame_equal(report.fits, again.fits)


def test_too_few_budgets_with_a_minimum_is_one_line():
    points = synthetic_points(noise=0.0, seeds=1)
    keep = points["budget"].isin(BUDGETS[:2])
    with pytest.raises(sl.FitError, match="2 budgets have an interior minimum, the power laws need 3"):
        sl.fit_laws(points[keep])


def write_eval(path, steps: int, loss: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    row = {c: 0.0 for c in COLUMNS} | {
        "step": steps,
        "tokens_seen": steps * 64,
        "val_loss": loss,
        "bits_per_byte": loss / 3,
    }
    pd.DataFrame([row], columns=COLUMNS).to_csv(path, index=False)


def test_the_stage_writes_its_tables_and_figure_and_refuses_an_unfinished_run(tmp_path):
    points = synthetic_points(noise=0.005, seeds=1)
    runs = []
    for i, row in points.iterrows():
        steps = 10 + i
        write_eval(tmp_path / f"r{i}" / "eval.csv", steps, row["loss"])
        runs.append(
            {
                "name": f"r{i}",
                "config": f"r{i}",
                "seed": 0,
                "budget": row["budget"],
                "parameters": row["n"],
                "tokens": row["d"],
                "steps": steps,
                "eval": str(tmp_path / f"r{i}" / "eval.csv"),
            }
        )
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    cfg = json.dumps({"ladder": {"bootstrap": 20, "predict": [1.0e17]}})
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "tinylm",
        "scaling-laws",
        "--config-json",
        cfg,
        "--runs-json",
        f"@{tmp_path / 'runs.json'}",
        "--output-dir",
        str(out),
    ]
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "held-out budget 6.4e+16: predicted N_opt" in proc.stderr
    fits = pd.read_csv(out / "fits.csv")
    assert set(fits["fit"]) == {"all", "holdout"}
    assert {"alpha", "beta", "E", "N_opt_b", "D_opt_d"} <= set(fits["quantity"])
    predictions = pd.read_csv(out / "predictions.csv")
    assert sorted(predictions["budget"].unique()) == [6.4e16, 1e17]
    assert len(pd.read_csv(out / "isoflop.csv")) == 4 + 3
    assert len(pd.read_csv(out / "points.csv")) == len(points)
    assert (out / "scaling_laws.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert subprocess.run(command, capture_output=True, text=True).returncode == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # byte-identical on rerun

    runs[3]["steps"] = 99
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 1
    expected = f"{runs[3]['eval']}: its last step is 13, the run trains 99 steps; finish the run"
    assert proc.stderr.strip().splitlines()[-1] == f"tinylm scaling-laws: error: {expected}"
