"""The `ladder:` section: its runs spend each budget within half a step (FLOPs counted by torch's own
counter on the built model), leave out what they must with a line, and refuse a ladder the fits
cannot use with one line naming the key. The data-order seed beside it."""

import re
import subprocess
import sys

import pandas as pd
import pytest
import torch
import yaml
from helpers import ROOT, final_payload, logged_losses, pretrain_ok, write_tiny_config
from torch.utils.flop_counter import FlopCounterMode

from tinylm.config import ConfigError, data_hash, ladder_of, run_configs, run_hash, seed_runs, weight_config
from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy

SHAPES = [
    {"d_model": 16, "num_layers": 1},
    {"d_model": 32, "num_layers": 1},
    {"d_model": 32, "num_layers": 2},
]


def raw_config(**ladder) -> dict:
    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    raw["tokenizer"]["vocab_size"] = 300
    raw["model"].update(context_length=16)
    raw["train"].update(batch_size=4, world_size=1)
    raw["ladder"] = {"budgets": [1.0e9, 2.0e9, 4.0e9, 8.0e9], "shapes": SHAPES, "head_size": 16, **ladder}
    return raw


def counted_flops_per_token(cfg) -> float:
    """Training FLOPs of one token of the run's model, as torch's FlopCounterMode counts one step."""
    model = Transformer(vocab_size=cfg.tokenizer.vocab_size, **vars(cfg.model))
    model.set_fast_attention(False)  # explicit matmuls for the scores, which the counter sees
    T = cfg.model.context_length
    ids = torch.randint(0, cfg.tokenizer.vocab_size, (1, T + 1))
    with FlopCounterMode(display=False) as counter:
        cross_entropy(model(ids[:, :-1]), ids[:, 1:]).backward()
    return counter.get_total_flops() / T


def test_each_run_spends_its_budget_within_half_a_step():
    raw = raw_config()
    configs = run_configs(raw)
    plan, _ = ladder_of(raw)
    assert len(plan.runs) == 12  # every shape at every budget: nothing is left out here
    for run in plan.runs:
        cfg = configs[run.name]
        per_step = counted_flops_per_token(cfg) * cfg.train.batch_size * cfg.model.context_length
        spent = cfg.train.max_iters * per_step
        assert abs(spent - run.budget) <= per_step / 2, run.name
        assert run.flops == pytest.approx(spent, rel=1e-12)
        assert run.tokens == cfg.train.max_iters * cfg.train.batch_size * cfg.model.context_length


def test_shapes_follow_the_rule_unless_given_and_name_their_runs():
    shapes = [*SHAPES, {"d_model": 48, "num_layers": 1, "num_heads": 2, "d_ff": 100}]
    raw = raw_config(shapes=shapes, warmup_fraction=0.1)
    configs = run_configs(raw)
    for name, cfg in configs.items():
        if name == "default":
            continue
        m = cfg.model
        if m.d_model == 48:
            assert name.endswith("_d48L1h2f100") and (m.num_heads, m.d_ff) == (2, 100)
            continue
        assert name.endswith(f"_d{m.d_model}L{m.num_layers}")
        assert m.num_heads == m.d_model // 16
        # The rule's d_ff: the smallest multiple of 8 at or above 8/3 d_model.
        assert m.d_ff == min(f for f in range(8, 10 * m.d_model, 8) if 3 * f >= 8 * m.d_model)
        assert cfg.train.warmup_iters == round(0.1 * cfg.train.max_iters)
    assert "C1e9_d16L1" in configs and "C8e9_d32L2" in configs


def test_runs_too_short_or_too_long_are_left_out_with_a_line():
    shapes = [
        {"d_model": d, "num_layers": n}
        for d, n in [(16, 1), (16, 2), (32, 1), (32, 2), (48, 1), (48, 2), (64, 2)]
    ]
    raw = raw_config(shapes=shapes, min_steps=40, max_tokens=40_000)
    plan, _ = ladder_of(raw)
    cfg = run_configs(raw_config(shapes=shapes))  # every run, nothing left out
    kept = {run.name for run in plan.runs}
    for name, c in cfg.items():
        if name == "default":
            continue
        tokens = c.train.max_iters * c.train.batch_size * c.model.context_length
        should_keep = c.train.max_iters >= 40 and tokens <= 40_000
        assert (name in kept) == should_keep, name
        if not should_keep:
            (line,) = [line for line in plan.left_out if f" {name} left out" in line]
            assert ("ladder.min_steps = 40" in line) == (c.train.max_iters < 40)
            assert ("ladder.max_tokens = 40,000" in line) == (c.train.max_iters >= 40)
    assert 0 < len(plan.left_out) < len(cfg) - 1


def test_ladder_runs_are_seeded_and_share_the_data():
    raw = {**raw_config(), "seeds": [0, 1]}
    seeded = seed_runs(raw)
    assert seeded["C1e9_d16L1.s1"].config == "C1e9_d16L1"
    configs = run_configs(raw)
    assert configs["C2e9_d32L2.s1"].train.seed == 1
    assert {data_hash(c) for c in configs.values()} == {data_hash(configs["default"])}
    overridden = run_configs(raw_config(overrides={"tokenizer.vocab_size": 280}))
    assert overridden["default"].tokenizer.vocab_size == 300
    assert overridden["C1e9_d16L1"].tokenizer.vocab_size == 280
    # The plan counts FLOPs at the overridden vocabulary: its runs still spend their budgets.
    run = ladder_of(raw_config(overrides={"tokenizer.vocab_size": 280}))[0].runs[0]
    cfg = overridden[run.name]
    per_step = counted_flops_per_token(cfg) * cfg.train.batch_size * cfg.model.context_length
    assert abs(cfg.train.max_iters * per_step - run.budget) <= per_step / 2


@pytest.mark.parametrize(
    "ladder, runs, message",
    [
        ({"budgets": [1.0e9, 2.0e9, 4.0e9]}, {}, "ladder.budgets: 3 budgets are too few"),
        ({"budgets": [1.0e9, 2.0e9, 4.0e9], "holdout": False}, {}, None),
        ({"shapes": SHAPES[:2]}, {}, "ladder.shapes: 2 shapes are too few"),
        ({"budgets": [1.0e9, 1.0000001e9, 4.0e9, 8.0e9]}, {}, "ladder.budgets: must be positive numbers"),
        ({"budgets": [-1.0e9, 2.0e9, 4.0e9, 8.0e9]}, {}, "ladder.budgets: must be positive numbers"),
        ({"budgets": [1.0e3, 2.0e9, 4.0e9, 8.0e9]}, {}, "ladder.budgets: 1e+03 FLOPs: 0 of the shapes"),
        ({"head_size": 32}, {}, "ladder.shapes[0]: d_model 16 / ladder.head_size 32 is not a whole number"),
        ({"shapes": [*SHAPES, SHAPES[0]]}, {}, "ladder.shapes[3]: d16L1 is given twice"),
        ({"shapes": [*SHAPES, {"d_model": 64}]}, {}, "ladder.shapes[3].num_layers: missing"),
        ({"shapes": [*SHAPES, {"d_model": 64, "layers": 2}]}, {}, "ladder.shapes[3].layers: unknown key"),
        ({"budgets": ["1e9", 2.0e9, 4.0e9, 8.0e9]}, {}, "write 1.0e+9"),
        ({}, {"C1e9_d16L1": {"train.lr_max": 0.01}}, "runs.C1e9_d16L1: is also a run of ladder:"),
        ({}, {"r": {"ladder.min_steps": 3}}, "runs.r: ladder.min_steps: the ladder is the main config's"),
        ({"overrides": {"model.d_ff": "x"}}, {}, "ladder.overrides: model.d_ff: expected an integer"),
    ],
)
def test_a_ladder_the_fits_cannot_use_is_one_line_naming_the_key(ladder, runs, message):
    raw = raw_config(**ladder)
    raw["runs"] = runs
    if message is None:
        assert len(ladder_of(raw)[0].runs) == 9
        return
    with pytest.raises(ConfigError) as e:
        run_configs(raw)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_data_seed_equal_to_the_seed_or_null_is_the_same_run():
    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    base = run_configs(raw)["default"]
    assert "data_seed" not in weight_config(base)["train"]
    raw["train"]["data_seed"] = raw["train"]["seed"]
    assert run_hash(run_configs(raw)["default"]) == run_hash(base)
    raw["train"]["data_seed"] = raw["train"]["seed"] + 1
    other = run_configs(raw)["default"]
    assert run_hash(other) != run_hash(base)
    assert (
        other.train.data_order_seed == raw["train"]["seed"] + 1
        and base.train.data_order_seed == base.train.seed
    )


def test_seed_key_repeats_the_data_order_alone():
    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    raw.update(seeds=[0, 3], seed_key="train.data_seed", runs={"wide": {"model.d_ff": 400}})
    configs = run_configs(raw)
    assert list(configs) == ["default", "default.d0", "default.d3", "wide.d0", "wide.d3"]
    assert {c.train.seed for c in configs.values()} == {0}
    assert configs["wide.d3"].train.data_seed == 3
    assert seed_runs(raw)["wide.d3"] == ("wide", 3)
    assert run_hash(configs["default.d0"]) == run_hash(configs["default"])  # seed 0 is the data seed 0
    for bad, message in [
        ({"seed_key": "train.lr_max"}, "seed_key: 'train.lr_max' is not one of"),
        ({"seeds": None}, "seeds: expected"),
    ]:
        with pytest.raises(ConfigError, match=message):
            run_configs({**raw, **bad})
    no_seeds = {k: v for k, v in raw.items() if k != "seeds"}
    with pytest.raises(
        ConfigError, match="seed_key: names the key seeds: sets, and this config has no seeds:"
    ):
        run_configs(no_seeds)
    raw["runs"] = {"wide": {"train.data_seed": 5}}
    with pytest.raises(ConfigError, match="runs.wide: train.data_seed is set here and by seeds"):
        run_configs(raw)


def test_the_flop_count_needs_no_torch():
    """The Snakefile imports tinylm.config, which counts the ladder's FLOPs: tinylm.flops imports no torch."""
    import subprocess
    import sys

    code = "import sys, tinylm.config, tinylm.flops; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_data_seed_moves_the_data_order_and_keeps_the_initialisation(tiny_data, tmp_path):
    """Two steps at a learning rate too small to move the weights far from their initialisation: a data
    seed equal to the seed is the same run bit for bit; another data seed keeps the initialisation (the
    weights stay within the two updates' reach) but trains on other batches (another first loss); another
    seed with the same data order starts elsewhere."""
    finals, first_losses = {}, {}
    for name, seed, data_seed in [("a", 0, None), ("b", 0, 0), ("c", 0, 1), ("d", 1, 0)]:
        config = write_tiny_config(
            tmp_path / f"{name}.yaml",
            train=dict(
                world_size=1,
                max_iters=2,
                warmup_iters=1,
                lr_max=1e-6,
                lr_min=1e-7,
                seed=seed,
                data_seed=data_seed,
                checkpoint_interval=2,
            ),
        )
        stderr = pretrain_ok(tiny_data, config, tmp_path / name)
        first_losses[name] = logged_losses(stderr)[1]
        finals[name] = final_payload(tmp_path / name)["model"]
    for key, value in finals["a"].items():
        assert torch.equal(value, finals["b"][key]), key
    assert first_losses["a"] == first_losses["b"] and first_losses["a"] != first_losses["c"]
    reach = max((finals["a"][k] - finals["c"][k]).abs().max().item() for k in finals["a"])
    assert 0 < reach < 1e-4
    apart = max((finals["a"][k] - finals["d"][k]).abs().max().item() for k in finals["a"])
    assert apart > 1e-2


# A ladder of tiny runs through the real workflow: 3 budgets x 3 shapes on the tiny config (batch 8 x
# context 16 = 128 tokens a step, vocab 300), on the embedded corpus.
TINY_LADDER = {
    "budgets": [2.0e8, 4.0e8, 8.0e8],
    "shapes": SHAPES,
    "head_size": 16,
    "min_steps": 4,
    "holdout": False,
    "bootstrap": 20,
    "predict": [1.0e10],
}


@pytest.mark.slow
def test_a_ladder_goes_through_the_dag_to_its_scaling_laws(tmp_path):
    (tmp_path / "config").mkdir()
    train = {"world_size": 1, "checkpoint_interval": 1000, "val_interval": 1000}  # one checkpoint, the last
    write_tiny_config(tmp_path / "config" / "config.yaml", train=train, evaluate={"threads": 1})
    (tmp_path / "ladder.yaml").write_text(yaml.safe_dump({"ladder": TINY_LADDER}))

    def snakemake(*args):
        command = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "workflow" / "Snakefile"),
                   "--directory", str(tmp_path), "--cores", "2", "results/scaling_laws/fits.csv",
                   "--configfile", str(tmp_path / "ladder.yaml"), *args]  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, timeout=600)

    dry = snakemake("--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    planned = dict(re.findall(r"^  (C\S+)\s+\S+\s+\S+\s+(\d+)\s", dry.stderr, flags=re.MULTILINE))
    assert len(planned) == 9, dry.stderr
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", dry.stdout, flags=re.MULTILINE))
    assert (jobs["pretrain"], jobs["evaluate"], jobs["scaling_laws"], jobs["train_tokenizer"]) == (
        "9",
        "9",
        "1",
        "1",
    )
    proc = snakemake()
    for run, steps in planned.items():  # every run trained its planned steps and was evaluated at the end
        table = pd.read_csv(tmp_path / "results" / "runs" / run / "eval.csv")
        assert int(table["step"].iloc[-1]) == int(steps)
        assert int(table["tokens_seen"].iloc[-1]) == int(steps) * 8 * 16
    log = (tmp_path / "results" / "logs" / "scaling_laws.log").read_text()
    if proc.returncode == 0:  # the fits and their files
        fits = pd.read_csv(tmp_path / "results" / "scaling_laws" / "fits.csv")
        assert {"alpha", "beta", "N_opt_b"} <= set(fits["quantity"])
        points = pd.read_csv(tmp_path / "results" / "scaling_laws" / "points.csv")
        assert sorted(points["run"]) == sorted(planned)
        assert (tmp_path / "results" / "scaling_laws" / "scaling_laws.png").is_file()
    else:  # runs this small may miss a minimum: the stage then says so in one line
        assert "interior minimum" in log.strip().splitlines()[-1], log
