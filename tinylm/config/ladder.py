"""The `ladder:` section: an IsoFLOP sweep (Chinchilla's first and third approaches) as named runs.

For each compute budget C (FLOPs, counted as tinylm/flops.py counts them: 6 per matmul weight per
token, plus attention) and each shape of the family, the run `C<budget>_d<d_model>L<num_layers>`
trains that shape for the steps that spend C:

    steps = round(C / (flops_per_token(shape) * batch_size * context_length))

so a run spends its budget to within half a step. A shape whose run would take fewer than
`min_steps` steps, or more than `max_tokens` tokens, is left out, with a line saying so
(`ladder_plan`). Every other key is the main config's; the runs are added to those of `runs:` and
repeated per seed under `seeds:` (tinylm/config/runs.py), so they share the corpus, the tokenizer and
the token files. The stage `scaling-laws` (tinylm/scaling_laws.py) fits the laws from their
evaluations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from tinylm.flops import flops_per_token, matmul_weights
from tinylm.keys import ConfigError, key

LADDER_KEY = "ladder"
SHAPE_KEYS = ("d_model", "num_layers", "num_heads", "d_ff")
MIN_POINTS = 3  # a parabola needs three points: budgets of the power laws, shapes of each budget


@dataclass
class LadderConfig:
    """IsoFLOP ladder: named runs over compute budgets x shapes, fitted by stage `scaling-laws`"""

    budgets: list[float] = key(
        factory=list,
        help="compute budgets in FLOPs (6 per matmul weight per token, plus attention); `[]` = no ladder",
        more="Each budget trains every shape that can spend it, for round(C / (FLOPs per token x "
        "batch_size x context_length)) steps. At least 3 (4 with `holdout`); written as numbers "
        "with a dot and a signed exponent, e.g. `2.0e+12` (YAML reads 2e12 as text)",
    )
    shapes: list[dict] = key(
        factory=list,
        help="each `{d_model: D, num_layers: L}`; `num_heads`, `d_ff` by the rule below unless given",
        more="At least 3 of them must spend each budget (a parabola needs three points). The run "
        "`C2e12_d64L2` is the shape d_model 64, 2 layers at budget 2e12; a shape that sets `num_heads` "
        "or `d_ff` off the rule adds `h<heads>` or `f<d_ff>` to its name",
    )
    overrides: dict = key(
        factory=dict,
        help="dotted keys every ladder run sets over the main config, e.g. `{tokenizer.vocab_size: 1024}`",
        more="As a run of `runs:` does; the main config (the run `default`) keeps its own values, so a "
        "ladder with its own tokenizer gets its own data files (results/data/<hash>/) and leaves the "
        "default run's alone",
    )
    head_size: int = key(32, lo=2, help="the rule's head size: `num_heads` = `d_model` / `head_size`")
    d_ff_multiple: int = key(
        8, lo=1, help="the rule's `d_ff`: 8/3 `d_model` rounded up to a multiple of this (128 -> 344)"
    )
    min_steps: int = key(
        1, lo=1, help="a shape that would train fewer steps than this at a budget is left out"
    )
    max_tokens: int | None = key(
        None,
        lo=1,
        help="a shape that would train on more tokens than this is left out; `null` = no limit",
        more="e.g. train.npy's token count times the epochs you allow; stage `scaling-laws` reports each "
        "run's epochs",
    )
    warmup_fraction: float = key(
        0.05, lo=0.0, hi=0.5, help="each run's `train.warmup_iters`, as a share of its steps (rounded)"
    )
    isoflop_shapes: int | None = key(
        None,
        lo=3,
        help="each budget's parabola through this many shapes nearest (in log N) its best one; `null` = all",
        more="The shape of lowest mean loss over its seeds and its nearest neighbours: a parabola is a "
        "good description of the loss near its minimum only, and shapes far to one side pull its vertex "
        "off (`scaling-laws` says when a budget has no interior minimum)",
    )
    holdout: bool = key(
        True,
        help="fit without the largest budget too, and check what that fit predicts for it",
        more="The report gives the held-out budget's predicted compute-optimal size and best loss beside "
        "what its runs measured",
    )
    predict: list[float] = key(
        factory=list, help="budgets (FLOPs) whose compute-optimal size, tokens and loss are predicted"
    )
    bootstrap: int = key(
        1000, lo=0, help="bootstrap resamples of the runs for the intervals; `0` = no intervals"
    )
    bootstrap_seed: int = key(0, lo=0, help="seed of the bootstrap's resampling")
    confidence: float = key(0.9, lo=0.0, hi=1.0, lo_open=True, hi_open=True, help="the intervals' coverage")


class LadderRun(NamedTuple):
    """One run of the ladder: its name, budget, shape and how long it trains."""

    name: str
    budget: float  # the FLOPs asked for
    shape: dict[str, int]  # d_model, num_layers, num_heads, d_ff
    parameters: int  # matmul weights, N of C = 6 N D (tinylm/flops.py)
    steps: int
    warmup_iters: int
    tokens: int  # D = steps x batch_size x context_length
    flops: float  # what the run spends: tokens x FLOPs per token

    @property
    def overrides(self) -> dict[str, Any]:
        """The run's shape and length as dotted keys (over the main config and `ladder.overrides`)."""
        return {
            **{f"model.{k}": v for k, v in self.shape.items()},
            "train.max_iters": self.steps,
            "train.warmup_iters": self.warmup_iters,
        }


class LadderPlan(NamedTuple):
    runs: list[LadderRun]  # budget by budget, shape by shape
    left_out: list[str]  # one line per shape left out at a budget, saying why


def budget_label(budget: float) -> str:
    """A budget as it appears in run names: 1e12, 2.5e12, 3e9 (no '+', which a run name may not hold)."""
    exponent = math.floor(math.log10(budget))
    mantissa = round(budget / 10**exponent, 6)
    if mantissa >= 10:  # 9.9999999e11 rounds up to 10e11: say 1e12
        mantissa, exponent = mantissa / 10, exponent + 1
    return f"{mantissa:g}e{exponent}"


def shape_of(entry: Any, ladder: LadderConfig, where: str) -> tuple[str, dict[str, int]]:
    """(name, {d_model, num_layers, num_heads, d_ff}) of one entry of `ladder.shapes`, by the rule
    where it leaves num_heads or d_ff out; a ConfigError names `where` (ladder.shapes[i])."""
    if not isinstance(entry, dict):
        raise ConfigError(
            f"{where}: expected a mapping such as {{d_model: 64, num_layers: 2}}, got {entry!r}"
        )
    unknown = sorted(set(entry) - set(SHAPE_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (a shape has {', '.join(SHAPE_KEYS)})")
    for name in SHAPE_KEYS:
        value = entry.get(name)
        if name in entry and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ConfigError(f"{where}.{name}: expected an integer >= 1, got {value!r}")
    for name in ("d_model", "num_layers"):
        if name not in entry:
            raise ConfigError(f"{where}.{name}: missing (every shape names d_model and num_layers)")
    d_model, num_layers = entry["d_model"], entry["num_layers"]
    if "num_heads" not in entry and d_model % ladder.head_size:
        raise ConfigError(
            f"{where}: d_model {d_model} / ladder.head_size {ladder.head_size} is not a whole number of "
            f"heads; give the shape its num_heads or pick another d_model"
        )
    rule_heads = d_model // ladder.head_size
    rule_d_ff = ladder.d_ff_multiple * -(-8 * d_model // (3 * ladder.d_ff_multiple))  # ceil, in integers
    num_heads, d_ff = entry.get("num_heads", rule_heads), entry.get("d_ff", rule_d_ff)
    name = f"d{d_model}L{num_layers}"
    name += "" if num_heads == rule_heads else f"h{num_heads}"
    name += "" if d_ff == rule_d_ff else f"f{d_ff}"
    return name, dict(d_model=d_model, num_layers=num_layers, num_heads=num_heads, d_ff=d_ff)


def ladder_plan(ladder: LadderConfig, batch_size: int, context_length: int, vocab_size: int) -> LadderPlan:
    """The runs of `ladder` (none when it has no budgets) and the lines of what it leaves out.

    The other arguments are the main config's with `ladder.overrides` applied
    (tinylm/config/runs.py): the shape, steps and warmup of each run come from here, everything
    else from that config. Refused with one line
    naming the key: fewer than 3 budgets (4 with `holdout`) or shapes, a budget given twice, a shape
    given twice or whose rule gives a non-integer head count, and a budget that fewer than 3 shapes
    can spend.
    """
    if not ladder.budgets:
        return LadderPlan([], [])
    least = MIN_POINTS + ladder.holdout
    if len(ladder.budgets) < least:
        raise ConfigError(
            f"ladder.budgets: {len(ladder.budgets)} budgets are too few: the power laws N_opt(C) and "
            f"D_opt(C) need at least {MIN_POINTS}"
            + (", and ladder.holdout one more to hold out" if ladder.holdout else "")
        )
    labels = [budget_label(b) if b > 0 else "" for b in ladder.budgets]
    if any(b <= 0 for b in ladder.budgets) or len(set(labels)) != len(labels):
        raise ConfigError(
            f"ladder.budgets: must be positive numbers of FLOPs, distinct in their first 6 digits (they "
            f"name the runs), got {ladder.budgets}"
        )
    if len(ladder.shapes) < MIN_POINTS:
        raise ConfigError(
            f"ladder.shapes: {len(ladder.shapes)} shapes are too few: each budget's parabola needs at least "
            f"{MIN_POINTS}"
        )
    shapes: dict[str, dict[str, int]] = {}
    for i, entry in enumerate(ladder.shapes):
        name, shape = shape_of(entry, ladder, f"ladder.shapes[{i}]")
        if name in shapes:
            raise ConfigError(f"ladder.shapes[{i}]: {name} is given twice")
        shapes[name] = shape
    tokens_per_step = batch_size * context_length
    runs, left_out = [], []
    for budget in sorted(ladder.budgets):
        spending = []
        for shape_name, shape in shapes.items():
            sizes = {**shape, "context_length": context_length, "vocab_size": vocab_size}
            per_step = flops_per_token(sizes) * tokens_per_step
            steps = round(budget / per_step)
            run = f"C{budget_label(budget)}_{shape_name}"
            if steps < ladder.min_steps:
                left_out.append(
                    f"ladder: {run} left out: {budget:.3g} FLOPs are {budget / per_step:.3g} steps of it, "
                    f"fewer than ladder.min_steps = {ladder.min_steps}"
                )
                continue
            tokens = steps * tokens_per_step
            if ladder.max_tokens is not None and tokens > ladder.max_tokens:
                left_out.append(
                    f"ladder: {run} left out: {budget:.3g} FLOPs are {tokens:,} tokens of it, more than "
                    f"ladder.max_tokens = {ladder.max_tokens:,}"
                )
                continue
            warmup = round(ladder.warmup_fraction * steps)
            spending.append(
                LadderRun(run, budget, shape, matmul_weights(sizes), steps, warmup, tokens, steps * per_step)
            )
        if len(spending) < MIN_POINTS:
            raise ConfigError(
                f"ladder.budgets: {budget:.3g} FLOPs: {len(spending)} of the shapes can spend it "
                f"({', '.join(r.name for r in spending) or 'none'}), fewer than the {MIN_POINTS} a parabola "
                f"needs; change the budget, ladder.shapes, ladder.min_steps or ladder.max_tokens"
            )
        runs.extend(spending)
    return LadderPlan(runs, left_out)


def ladder_table(plan: LadderPlan) -> str:
    """The plan as a few lines for the terminal: each run's budget, shape, N, steps and tokens."""
    lines = [f"ladder: {len(plan.runs)} runs (each repeated per seed under seeds:)"]
    lines.append(f"  {'run':<24} {'budget':>9} {'N':>10} {'steps':>6} {'tokens':>11} {'spent/budget':>12}")
    for run in plan.runs:
        lines.append(
            f"  {run.name:<24} {run.budget:>9.3g} {run.parameters:>10,} {run.steps:>6} {run.tokens:>11,} "
            f"{run.flops / run.budget:>12.3f}"
        )
    return "\n".join([*lines, *plan.left_out])
