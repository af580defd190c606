"""Scaling laws from a ladder's runs (stage `scaling-laws`): IsoFLOP parabolas, power laws, the
parametric law, bootstrap intervals and a prediction checked on a held-out budget.

The points are the ladder's runs (tinylm/config/ladder.py), one per (budget C, shape, seed): N the
shape's matmul weights (tinylm/flops.py), D its training tokens, L the final checkpoint's exact
validation loss (nats per token, the last row of its eval.csv). From them:

- per budget, a parabola L = p0 (ln N)^2 + p1 ln N + p2 through its points (every seed), np.polyfit
  (with `ladder.isoflop_shapes`, through the points of that many shapes nearest its best one);
  its minimum is N_opt(C) and L_opt(C), and D_opt(C) is a line ln D = q0 ln N + q1 through the same
  points at ln N_opt (Chinchilla's first approach, the IsoFLOP profiles). A budget whose parabola
  opens downwards, or whose minimum lies outside its shapes' range of N, has no interior minimum:
  it is said and left out of the power laws;
- N_opt = a C^b and D_opt = c C^d, straight lines in log-log (scipy.stats.linregress);
- L(N, D) = E + A / N^alpha + B / D^beta, Chinchilla's third approach: the Huber loss
  (delta = 1e-3) of log L against log-sum-exp(a - alpha ln N, b - beta ln D, e) over every point,
  minimised by L-BFGS-B (scipy.optimize.minimize) from a grid of starting points, the best kept
  (A = e^a, B = e^b, E = e^e);
- intervals by bootstrap: the points resampled with replacement within each budget (each budget
  keeps its number of points, so that each parabola keeps its support), every fit made again, and
  the percentile interval of each quantity at `ladder.confidence`; resamples where a fit fails
  (too few distinct shapes, no interior minimum) are counted and left out;
- a held-out budget (`ladder.holdout`): everything fitted again without the largest budget, whose
  compute-optimal N and best loss that fit predicts (N from the power law, the loss from the
  parametric law at the power laws' N and D) beside what its own parabola measured.

Predictions at a budget C take N_opt and D_opt from the power laws and the loss from the parametric
law at them. Everything is deterministic for a given `ladder.bootstrap_seed`.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import optimize, special, stats

from tinylm.eval_table import read_eval
from tinylm.io import atomic_path

HUBER_DELTA = 1e-3  # Chinchilla's
# Starting points of the parametric fit (a = ln A, b = ln B, e = ln E, alpha, beta); the best of
# them on the data seeds L-BFGS-B, several times (STARTS_KEPT).
START_GRID = {
    "a": [0.0, 5.0, 10.0, 15.0, 20.0],
    "b": [0.0, 5.0, 10.0, 15.0, 20.0],
    "e": [-1.0, 0.0, 1.0],
    "alpha": [0.1, 0.3, 0.6, 1.0],
    "beta": [0.1, 0.3, 0.6, 1.0],
}
STARTS_KEPT = 8  # the grid's best points on the data, each refined by L-BFGS-B
PARAMETRIC = ["E", "A", "alpha", "B", "beta"]


@dataclass(frozen=True)
class IsoFLOP:
    """One budget's parabola and its minimum (NaN where it has no interior minimum)."""

    budget: float
    num_points: int
    num_shapes: int
    coefficients: tuple[float, float, float]  # of (ln N)^2, ln N, 1
    n_opt: float
    d_opt: float
    loss_opt: float
    interior: bool
    n_range: tuple[float, float]  # the smallest and largest N of the points it is fitted to


@dataclass(frozen=True)
class Laws:
    """Every fit of one set of points: the parabolas, the power laws and the parametric law."""

    isoflops: list[IsoFLOP]
    n_law: tuple[float, float]  # (a, b): N_opt = a C^b
    d_law: tuple[float, float]  # (c, d): D_opt = c C^d
    parametric: dict[str, float]  # E, A, alpha, B, beta

    def values(self) -> dict[str, float]:
        """Every fitted quantity by name (what fits.csv lists)."""
        alpha, beta = self.parametric["alpha"], self.parametric["beta"]
        return {
            "N_opt_a": self.n_law[0],
            "N_opt_b": self.n_law[1],
            "D_opt_c": self.d_law[0],
            "D_opt_d": self.d_law[1],
            **self.parametric,
            "parametric_N_exponent": beta / (alpha + beta),  # N_opt ~ C^(beta / (alpha + beta)), C = 6 N D
        }

    def predict(self, budget: float) -> dict[str, float]:
        """N_opt, D_opt (the power laws) and the loss there (the parametric law) at `budget` FLOPs."""
        n = self.n_law[0] * budget ** self.n_law[1]
        d = self.d_law[0] * budget ** self.d_law[1]
        return {"n_opt": n, "d_opt": d, "loss": parametric_loss(self.parametric, n, d)}


class FitError(ValueError):
    """The points do not support a fit (too few budgets with an interior minimum, ...)."""


def parametric_loss(p: dict[str, float], n: Any, d: Any) -> Any:
    """L(N, D) = E + A / N^alpha + B / D^beta."""
    return p["E"] + p["A"] / np.power(n, p["alpha"]) + p["B"] / np.power(d, p["beta"])


def fit_isoflop(budget: float, n: np.ndarray, d: np.ndarray, loss: np.ndarray) -> IsoFLOP:
    """The parabola of one budget's points in ln N, its minimum and D there; see the module doc."""
    log_n = np.log(n)
    shapes = len(np.unique(n))
    n_range = (float(n.min()), float(n.max()))
    if shapes < 3:
        raise FitError(f"budget {budget:.3g}: {shapes} distinct shapes, a parabola needs 3")
    coefficients = np.polyfit(log_n, loss, 2)
    curvature = coefficients[0]
    vertex = -coefficients[1] / (2 * curvature) if curvature > 0 else math.nan
    interior = bool(curvature > 0 and log_n.min() <= vertex <= log_n.max())
    if not interior:
        return IsoFLOP(
            budget, len(n), shapes, tuple(coefficients), math.nan, math.nan, math.nan, False, n_range
        )
    slope, intercept = np.polyfit(log_n, np.log(d), 1)
    return IsoFLOP(
        budget,
        len(n),
        shapes,
        tuple(float(c) for c in coefficients),
        float(np.exp(vertex)),
        float(np.exp(slope * vertex + intercept)),
        float(np.polyval(coefficients, vertex)),
        True,
        n_range,
    )


def power_law(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(k, exponent) of y = k x^exponent, a least-squares line in log-log (scipy.stats.linregress)."""
    line = stats.linregress(np.log(x), np.log(y))
    return float(np.exp(line.intercept)), float(line.slope)


def _huber_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray):
    """Sum of Huber losses of log-sum-exp(a - alpha ln N, b - beta ln D, e) - ln L, and its gradient
    in theta = (a, b, e, alpha, beta). Written out in numpy (scipy.special's logsumexp and huber give
    the same values, a test checks, at several times the cost inside L-BFGS-B's thousands of calls)."""
    a, b, e, alpha, beta = theta
    t0, t1 = a - alpha * log_n, b - beta * log_d
    top = np.maximum(np.maximum(t0, t1), e)
    w0, w1, w2 = np.exp(t0 - top), np.exp(t1 - top), np.exp(e - top)
    total = w0 + w1 + w2
    residual = top + np.log(total) - log_loss
    small = np.abs(residual) <= HUBER_DELTA
    value = np.where(small, 0.5 * residual**2, HUBER_DELTA * (np.abs(residual) - 0.5 * HUBER_DELTA)).sum()
    slope = np.clip(residual, -HUBER_DELTA, HUBER_DELTA) / total  # dHuber/dresidual, over the softmax's sum
    g0, g1, g2 = slope * w0, slope * w1, slope * w2
    gradient = np.array([g0.sum(), g1.sum(), g2.sum(), -(g0 * log_n).sum(), -(g1 * log_d).sum()])
    return value, gradient


def _grid_starts() -> np.ndarray:
    return np.array(list(itertools.product(*START_GRID.values())), dtype=np.float64)


def fit_parametric(
    n: np.ndarray,
    d: np.ndarray,
    loss: np.ndarray,
    extra_starts: list[np.ndarray] | None = None,
    kept: int = STARTS_KEPT,
) -> dict[str, float]:
    """E, A, alpha, B, beta of L(N, D) = E + A / N^alpha + B / D^beta (Chinchilla's third approach).

    The objective is evaluated at every point of START_GRID (and `extra_starts`, e.g. the fit on all
    the data when fitting a bootstrap resample); the `kept` best are refined by L-BFGS-B and the
    lowest end point wins. The exponents are kept in [0, 3].
    """
    log_n, log_d, log_loss = np.log(n), np.log(d), np.log(loss)
    starts = _grid_starts()
    if extra_starts:
        starts = np.vstack([starts, *extra_starts])
    # The objective at every start at once: terms [3, starts, points].
    terms = np.stack(
        [
            starts[:, :1] - starts[:, 3:4] * log_n,
            starts[:, 1:2] - starts[:, 4:5] * log_d,
            np.broadcast_to(starts[:, 2:3], (len(starts), len(log_n))),
        ]
    )
    residual = special.logsumexp(terms, axis=0) - log_loss
    values = special.huber(HUBER_DELTA, residual).sum(axis=1)  # at every start at once
    best = None
    bounds = [(None, None), (None, None), (None, None), (0.0, 3.0), (0.0, 3.0)]
    order = np.argsort(values, kind="stable")[:kept]
    if extra_starts:  # always refined, whatever their rank on the grid
        order = np.union1d(order, np.arange(len(starts) - len(extra_starts), len(starts)))
    for start in starts[order]:
        result = optimize.minimize(
            _huber_objective, start, args=(log_n, log_d, log_loss), jac=True, method="L-BFGS-B", bounds=bounds
        )
        if best is None or result.fun < best.fun:
            best = result
    a, b, e, alpha, beta = best.x
    return {
        "E": float(np.exp(e)),
        "A": float(np.exp(a)),
        "alpha": float(alpha),
        "B": float(np.exp(b)),
        "beta": float(beta),
    }


def _theta(parametric: dict[str, float]) -> np.ndarray:
    p = parametric
    return np.array([math.log(p["A"]), math.log(p["B"]), math.log(p["E"]), p["alpha"], p["beta"]])


def nearest_shapes(group: pd.DataFrame, window: int | None) -> pd.DataFrame:
    """The points of one budget whose N is among the `window` shapes nearest, in ln N, to the shape
    of lowest mean loss over its seeds (None: every point)."""
    if window is None:
        return group
    mean = group.groupby("n")["loss"].mean()
    best = np.log(mean.idxmin())
    distance = pd.Series(np.abs(np.log(mean.index.to_numpy()) - best), index=mean.index)
    kept = distance.sort_values(kind="stable").index[:window]
    return group[group["n"].isin(kept)]


def fit_laws(
    points: pd.DataFrame, window: int | None = None, start: Laws | None = None, quiet: bool = True
) -> Laws:
    """Every fit of `points` (columns budget, n, d, loss); each budget's parabola through the points of
    its `window` shapes nearest its best (`nearest_shapes`; None: all of them). `start`: a fit whose
    parametric law seeds this one's too. Raises FitError when fewer than 3 budgets have an interior
    minimum."""
    isoflops = []
    for budget, group in points.groupby("budget", sort=True):
        near = nearest_shapes(group, window)
        isoflops.append(fit_isoflop(budget, *(near[c].to_numpy() for c in ("n", "d", "loss"))))
    interior = [iso for iso in isoflops if iso.interior]
    if not quiet:
        for iso in isoflops:
            if not iso.interior:
                print(
                    f"scaling-laws: budget {iso.budget:.3g}: no interior minimum (the loss keeps falling "
                    f"towards one end of its shapes); left out of the power laws",
                    file=sys.stderr,
                )
    if len(interior) < 3:
        raise FitError(
            f"{len(interior)} budgets have an interior minimum, the power laws need 3 "
            f"(budgets: {', '.join(f'{iso.budget:.3g}' for iso in isoflops)})"
        )
    budgets = np.array([iso.budget for iso in interior])
    n_law = power_law(budgets, np.array([iso.n_opt for iso in interior]))
    d_law = power_law(budgets, np.array([iso.d_opt for iso in interior]))
    # A resample starts from the full fit's law and the grid's 2 best points.
    extra, kept = ([_theta(start.parametric)], 2) if start is not None else (None, STARTS_KEPT)
    columns = (points[c].to_numpy() for c in ("n", "d", "loss"))
    parametric = fit_parametric(*columns, extra_starts=extra, kept=kept)
    return Laws(isoflops, n_law, d_law, parametric)


def bootstrap(
    points: pd.DataFrame,
    laws: Laws,
    samples: int,
    seed: int,
    budgets: list[float],
    window: int | None = None,
    label: str = "",
) -> tuple[pd.DataFrame, int]:
    """Each quantity of `Laws.values` and each prediction at `budgets`, over `samples` resamples of
    the points within each budget; (one row per resample that fitted, the number that failed)."""
    rng = np.random.default_rng(seed)
    groups = [group.index.to_numpy() for _, group in points.groupby("budget", sort=True)]
    rows, failed = [], 0
    for i in range(samples):
        chosen = np.concatenate([rng.choice(index, size=len(index), replace=True) for index in groups])
        try:
            resampled = fit_laws(points.loc[chosen].reset_index(drop=True), window, start=laws)
        except FitError:
            failed += 1
            continue
        row = resampled.values()
        for budget in budgets:
            row.update({f"{k}@{budget:g}": v for k, v in resampled.predict(budget).items()})
        rows.append(row)
        if (i + 1) % max(1, samples // 10) == 0:
            print(f"scaling-laws: bootstrap{label} {i + 1}/{samples} ({failed} failed)", file=sys.stderr)
    return pd.DataFrame(rows), failed


def read_points(runs: list[dict], train_tokens: int | None = None) -> pd.DataFrame:
    """One row per run: run, config, seed, budget, n, d, steps, loss (its final exact validation loss)
    and epochs (d / train_tokens, when that is known).

    `runs`: [{"name", "config", "seed", "budget", "parameters", "tokens", "steps", "eval"}, ...], as
    the workflow's rule gives them. A run whose eval.csv does not end at its last step has not
    finished: refused, naming the file.
    """
    rows = []
    for run in runs:
        table = read_eval(run["eval"])
        if table.empty or int(table["step"].iloc[-1]) != int(run["steps"]):
            last = "no step" if table.empty else f"its last step is {int(table['step'].iloc[-1])}"
            raise ValueError(f"{run['eval']}: {last}, the run trains {run['steps']} steps; finish the run")
        rows.append(
            {
                "run": run["name"],
                "config": run.get("config", run["name"]),
                "seed": run.get("seed"),
                "budget": float(run["budget"]),
                "n": float(run["parameters"]),
                "d": float(run["tokens"]),
                "steps": int(run["steps"]),
                "loss": float(table["val_loss"].iloc[-1]),
                "bits_per_byte": float(table["bits_per_byte"].iloc[-1]),
                "epochs": float(run["tokens"]) / train_tokens if train_tokens else math.nan,
            }
        )
    return pd.DataFrame(rows)


def interval(samples: pd.Series, confidence: float) -> tuple[float, float]:
    """The percentile interval of `samples` at `confidence` (NaN, NaN without samples)."""
    values = samples.dropna().to_numpy()
    if len(values) == 0:
        return math.nan, math.nan
    tail = 50 * (1 - confidence)
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


@dataclass(frozen=True)
class Report:
    """What the stage writes: the tables of fits.csv, isoflop.csv, predictions.csv and points.csv,
    and the fits they come from (for the figure)."""

    fits: pd.DataFrame
    isoflop: pd.DataFrame
    predictions: pd.DataFrame
    points: pd.DataFrame
    laws: dict[str, Laws]  # "all" and, with a held-out budget, "holdout"
    confidence: float  # the intervals' coverage


def scaling_laws(points: pd.DataFrame, ladder: Any) -> Report:
    """Every fit of the stage, with intervals, for `points` (`read_points`) and `ladder` (the
    LadderConfig: isoflop_shapes, holdout, predict, bootstrap, bootstrap_seed, confidence)."""
    budgets = sorted(points["budget"].unique())
    fits = {"all": points}
    if ladder.holdout:
        held_out = budgets[-1]
        fits["holdout"] = points[points["budget"] < held_out].reset_index(drop=True)
    predict = sorted(set(ladder.predict) | ({budgets[-1]} if ladder.holdout else set()))
    fit_rows, iso_rows, prediction_rows, laws = [], [], [], {}
    for name, subset in fits.items():
        try:
            law = fit_laws(subset, ladder.isoflop_shapes, quiet=False)
        except FitError as e:
            raise FitError(f"fit {name!r}: {e}") from None
        laws[name] = law
        samples, failed = bootstrap(
            subset, law, ladder.bootstrap, ladder.bootstrap_seed, predict, ladder.isoflop_shapes, f" ({name})"
        )
        ok = len(samples)
        for quantity, value in law.values().items():
            lo, hi = interval(samples[quantity], ladder.confidence) if ok else (math.nan, math.nan)
            fit_rows.append(
                {
                    "fit": name,
                    "quantity": quantity,
                    "value": value,
                    "lo": lo,
                    "hi": hi,
                    "resamples": ok,
                    "failed": failed,
                }
            )
        for iso in law.isoflops:
            iso_rows.append(
                {
                    "fit": name,
                    "budget": iso.budget,
                    "points": iso.num_points,
                    "shapes": iso.num_shapes,
                    "n_min": iso.n_range[0],
                    "n_max": iso.n_range[1],
                    "interior": iso.interior,
                    "n_opt": iso.n_opt,
                    "d_opt": iso.d_opt,
                    "loss_opt": iso.loss_opt,
                    "tokens_per_parameter": iso.d_opt / iso.n_opt,
                }
            )
        for budget in predict:
            row = {"fit": name, "budget": budget, "held_out": name == "holdout" and budget == budgets[-1]}
            for quantity, value in law.predict(budget).items():
                key = f"{quantity}@{budget:g}"
                lo, hi = interval(samples[key], ladder.confidence) if ok else (math.nan, math.nan)
                row.update({quantity: value, f"{quantity}_lo": lo, f"{quantity}_hi": hi})
            prediction_rows.append(row)
    predictions = pd.DataFrame(prediction_rows)
    # What the largest budget measured, beside every prediction of it.
    largest = nearest_shapes(points[points["budget"] == budgets[-1]], ladder.isoflop_shapes)
    measured = fit_isoflop(budgets[-1], *(largest[c].to_numpy() for c in ("n", "d", "loss")))
    best = points[points["budget"] == budgets[-1]]["loss"].min()
    at_largest = predictions["budget"] == budgets[-1]
    predictions["measured_n_opt"] = np.where(at_largest, measured.n_opt, math.nan)
    predictions["measured_loss_opt"] = np.where(at_largest, measured.loss_opt, math.nan)
    predictions["measured_best_loss"] = np.where(at_largest, best, math.nan)
    predictions["n_opt_error"] = predictions["n_opt"] / predictions["measured_n_opt"] - 1
    predictions["loss_error"] = predictions["loss"] - predictions["measured_loss_opt"]
    return Report(
        pd.DataFrame(fit_rows), pd.DataFrame(iso_rows), predictions, points, laws, ladder.confidence
    )


def summary(report: Report) -> str:
    """A few lines for the terminal: the exponents with their intervals and the held-out check."""
    lines = []
    confidence = f"{100 * report.confidence:g} % bootstrap interval"
    for name in report.laws:
        fits = report.fits[report.fits["fit"] == name].set_index("quantity")
        title = "all budgets" if name == "all" else "without the largest budget"
        resamples, failed = int(fits["resamples"].iloc[0]), int(fits["failed"].iloc[0])
        lines.append(f"scaling laws ({title}; {resamples} resamples, {failed} without a fit left out):")
        for quantity in ("N_opt_b", "D_opt_d", "alpha", "beta", "E"):
            row = fits.loc[quantity]
            lines.append(
                f"  {quantity:>8} = {row['value']:.4g}  [{row['lo']:.4g}, {row['hi']:.4g}] {confidence}"
            )
    held = report.predictions[report.predictions["held_out"]]
    for _, row in held.iterrows():
        predicted = (
            f"held-out budget {row['budget']:.3g}: predicted N_opt {row['n_opt']:,.0f} "
            f"[{row['n_opt_lo']:,.0f}, {row['n_opt_hi']:,.0f}], loss {row['loss']:.4f} "
            f"[{row['loss_lo']:.4f}, {row['loss_hi']:.4f}]"
        )
        if math.isnan(row["measured_n_opt"]):
            measured = f"measured: no interior minimum, best run {row['measured_best_loss']:.4f}"
        else:
            measured = (
                f"measured N_opt {row['measured_n_opt']:,.0f} ({100 * row['n_opt_error']:+.1f} %), loss "
                f"{row['measured_loss_opt']:.4f} ({row['loss_error']:+.4f} nats; best run "
                f"{row['measured_best_loss']:.4f})"
            )
        lines.append(f"{predicted}; {measured}")
    return "\n".join(lines)


def write_report(
    report: Report, paths: dict[str, str | os.PathLike], plot_path: str | os.PathLike | None
) -> None:
    """Each table at its path (keys fits, isoflop, predictions, points), and the figure, atomically."""
    for name, path in paths.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path, suffix=".csv") as tmp:
            getattr(report, name).to_csv(tmp, index=False, float_format="%.6g")
    if plot_path is not None:
        plot(report, plot_path)


def plot(report: Report, path: str | os.PathLike) -> None:
    """Three panels: the IsoFLOP curves with their minima, the frontier N_opt(C) with the power law
    (and the held-out fit's extrapolation), and the parametric law's contours over (N, D) with the
    points and the compute-optimal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, law = report.points, report.laws["all"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5), dpi=100, layout="constrained")
    budgets = sorted(points["budget"].unique())
    span = np.geomspace(min(budgets) / 2, max([*budgets, *report.predictions["budget"]]) * 1.5, 50)
    _isoflop_panel(axes[0], law, points, budgets, plt.get_cmap("viridis"))
    _frontier_panel(axes[1], report, span)
    _parametric_panel(axes[2], law, points, span)
    fig.suptitle(f"tinylm scaling ladder: {len(points)} runs over {len(budgets)} budgets")
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", metadata={"Software": None})
    plt.close(fig)


def _isoflop_panel(ax, law, points: pd.DataFrame, budgets: list[float], colours) -> None:
    """Each budget's points and fitted parabola over log N, with its minimum when it is interior."""
    for i, iso in enumerate(law.isoflops):
        colour = colours(i / max(1, len(budgets) - 1))
        here = points[points["budget"] == iso.budget]
        ax.scatter(here["n"], here["loss"], color=colour, s=14, label=f"C = {iso.budget:.3g}")
        grid = np.linspace(*np.log(iso.n_range), 100)  # over the shapes it is fitted to
        ax.plot(np.exp(grid), np.polyval(iso.coefficients, grid), color=colour, lw=1)
        if iso.interior:
            ax.scatter(
                [iso.n_opt], [iso.loss_opt], color=colour, marker="*", s=120, edgecolor="black", zorder=3
            )
    ax.set_xscale("log")
    ax.set_xlabel("N (matmul weights)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title("IsoFLOP profiles (★ the parabola's minimum)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")


def _frontier_panel(ax, report: Report, span: np.ndarray) -> None:
    """N_opt of each parabola against compute, the power law, and the held-out fit's prediction."""
    law, held = report.laws["all"], report.laws.get("holdout")
    iso = [i for i in law.isoflops if i.interior]
    ax.scatter([i.budget for i in iso], [i.n_opt for i in iso], color="black", label="N_opt of each parabola")
    a, b = law.n_law
    ax.plot(span, a * span**b, color="C0", label=f"N_opt = {a:.3g} C^{b:.3f} (all budgets)")
    if held is not None:
        a, b = held.n_law
        ax.plot(span, a * span**b, color="C1", ls="--", label=f"without the largest: C^{b:.3f}")
        row = report.predictions[report.predictions["held_out"]].iloc[0]
        ax.errorbar(
            [row["budget"]],
            [row["n_opt"]],
            yerr=[[row["n_opt"] - row["n_opt_lo"]], [row["n_opt_hi"] - row["n_opt"]]],
            color="C1",
            marker="o",
            capsize=4,
            label="its prediction for the largest budget",
        )
    fits = report.fits[report.fits["fit"] == "all"].set_index("quantity")
    lo, hi = fits.loc["N_opt_b", ["lo", "hi"]]
    ax.set_title(f"compute-optimal size: exponent {b:.3f}" if held is None else "compute-optimal size")
    ax.text(
        0.02,
        0.95,
        f"exponent (all): {law.n_law[1]:.3f} [{lo:.3f}, {hi:.3f}]",
        transform=ax.transAxes,
        va="top",
        fontsize=9,
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compute C (FLOPs)")
    ax.set_ylabel("N_opt")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, which="both")


def _parametric_panel(ax, law, points: pd.DataFrame, span: np.ndarray) -> None:
    """The parametric law's contours over (N, D), the runs, and the compute-optimal line."""
    p = law.parametric
    n_grid = np.geomspace(points["n"].min() / 2, points["n"].max() * 2, 120)
    d_grid = np.geomspace(points["d"].min() / 2, points["d"].max() * 2, 120)
    nn, dd = np.meshgrid(n_grid, d_grid)
    contours = ax.contour(nn, dd, parametric_loss(p, nn, dd), levels=12, cmap="magma", linewidths=0.8)
    ax.clabel(contours, fontsize=7, fmt="%.2f")
    ax.scatter(points["n"], points["d"], c=points["loss"], cmap="magma", s=14, edgecolor="black", lw=0.3)
    a, b = law.n_law
    c, d = law.d_law
    ax.plot(a * span**b, c * span**d, color="C0", label="compute-optimal (power laws)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(n_grid[0], n_grid[-1])
    ax.set_ylim(d_grid[0], d_grid[-1])
    ax.set_xlabel("N (matmul weights)")
    ax.set_ylabel("D (training tokens)")
    ax.set_title(
        f"L = {p['E']:.3g} + {p['A']:.3g}/N^{p['alpha']:.3f} + {p['B']:.3g}/D^{p['beta']:.3f}", fontsize=10
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
