"""compare_runs: every run's eval.csv and checkpoint manifests into one table, plot and final figures."""

import json
import math
import statistics

import numpy as np
import pandas as pd
import pytest
import scipy.stats

from tinylm.checkpoint import FORMAT
from tinylm.compare import (
    WITHIN_SPREAD_MARK,
    compare_runs,
    describe_overrides,
    differing_keys,
    final_figures,
    markdown_table,
    mean,
    mean_curves,
    one_vocabulary,
    sample_std,
    seed_figures,
    seeds_csv_path,
    table_cells,
    write_compare,
)


def fake_run(folder, name, losses, seconds_per_step=None, vocab_size=None, **extra):
    """An eval.csv with one row per (step, loss) and, optionally, manifests with train_seconds and
    the vocabulary."""
    run_dir = folder / name
    (run_dir / "checkpoints").mkdir(parents=True)
    rows = [
        {
            "step": step,
            "tokens_seen": step * 100,
            "val_loss": loss,
            "val_ppl": 0,
            "bits_per_byte": loss / 2,
            "unigram_entropy": 5.0,
            "gap_to_unigram": 5.0 - loss,
        }
        for step, loss in losses
    ]
    pd.DataFrame(rows).to_csv(run_dir / "eval.csv", index=False)
    if seconds_per_step is not None:
        for step, _ in losses:
            manifest = {"format": FORMAT, "files": {}, "train_seconds": step * seconds_per_step}
            if vocab_size is not None:
                manifest["model_config"] = {"vocab_size": vocab_size}
            if "parent_checkpoint" in extra:
                manifest["parent_checkpoint"] = extra["parent_checkpoint"]
            (run_dir / "checkpoints" / f"step_{step}.json").write_text(json.dumps(manifest))
            (run_dir / "checkpoints" / f"step_{step}.pt").touch()  # compare reads the manifests only
    return {
        "name": name,
        "eval": str(run_dir / "eval.csv"),
        "checkpoints": str(run_dir / "checkpoints"),
        **extra,
    }


def test_every_checkpoint_of_every_run_in_run_order(tmp_path):
    runs = [
        fake_run(tmp_path, "default", [(10, 4.0), (20, 3.5)], 0.5, 300),
        fake_run(tmp_path, "lr", [(10, 3.9), (20, 3.2)], 0.25, 300, overrides={"train.lr_max": 0.01}),
        fake_run(tmp_path, "old", [(20, 3.8)]),
    ]  # manifests without train_seconds
    table = compare_runs(runs)
    assert list(table["run"]) == ["default", "default", "lr", "lr", "old"]
    assert list(table["train_seconds"].iloc[:4]) == [5.0, 10.0, 2.5, 5.0]
    assert table["train_seconds"].iloc[4] != table["train_seconds"].iloc[4]  # NaN
    assert list(table["overrides"].unique()) == ["-", "train.lr_max=0.01"]
    final = final_figures(table)
    assert list(final["run"]) == ["default", "lr", "old"]
    assert list(final["val_loss"]) == [3.5, 3.2, 3.8]
    assert final["vs_first"].tolist() == pytest.approx([0.0, -0.15, 0.15])  # in bits per byte
    text = markdown_table(final)
    assert "| lr | train.lr_max=0.01 | 20 | 2,000 | 5.0 | 3.2000 | 1.6000 | -0.1500 |" in text
    write_compare(table, tmp_path / "out" / "compare.csv", tmp_path / "out" / "compare.png")
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "out" / "compare.csv"), table, check_dtype=False)
    assert (tmp_path / "out" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_branch_says_which_checkpoint_it_started_from(tmp_path):
    parent = "results/runs/const/checkpoints/step_20.pt"
    runs = [
        fake_run(tmp_path, "const", [(10, 4.0), (20, 3.5)], 0.5),
        fake_run(tmp_path, "cool", [(30, 3.4)], 0.5, parent_checkpoint=parent),
    ]
    table = compare_runs(runs)
    assert list(table["started_from"]) == ["-", "-", parent]


def test_the_table_shows_only_the_keys_that_differ(tmp_path):
    values = [
        {"train.lr_max": 0.006, "model.d_ff": 344, "train.seed": 0},
        {"train.lr_max": 0.03, "model.d_ff": 344, "train.seed": 0},
        {"train.lr_max": 0.006, "model.d_ff": 48, "train.seed": 0},
    ]
    runs = [
        fake_run(tmp_path, name, [(10, 4.0)], 1.0, 300, values=v, overrides={})
        for name, v in zip(["default", "lr", "narrow"], values, strict=True)
    ]
    assert differing_keys(runs) == ["train.lr_max", "model.d_ff"]
    final = final_figures(compare_runs(runs))
    # The first run shows its value of every key that differs, the others where they differ from it.
    assert list(final["differs"]) == [
        "train.lr_max=0.006 model.d_ff=344",
        "train.lr_max=0.03",
        "model.d_ff=48",
    ]
    assert "train.seed" not in markdown_table(final)


def test_runs_of_different_vocabularies_are_compared_by_bits_per_byte_only(tmp_path):
    runs = [
        fake_run(tmp_path, "default", [(10, 4.0)], 1.0, 4096),
        fake_run(tmp_path, "small", [(10, 3.0)], 1.0, 2048, overrides={"tokenizer.vocab_size": 2048}),
    ]
    table = compare_runs(runs)
    assert list(table["vocab_size"]) == [4096, 2048] and not one_vocabulary(table)
    text = markdown_table(final_figures(table))
    assert (
        "val_loss" not in text
        and "| small | tokenizer.vocab_size=2048 | 10 | 1,000 | 10.0 | 1.5000 | -0.5000 |" in text
    )
    assert one_vocabulary(table.iloc[:1]) and one_vocabulary(
        compare_runs([fake_run(tmp_path, "x", [(1, 1.0)])])
    )


def test_a_run_without_its_evaluation_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="run lost: .*eval.csv not found"):
        compare_runs([{"name": "lost", "eval": str(tmp_path / "eval.csv"), "checkpoints": str(tmp_path)}])
    (tmp_path / "eval.csv").write_text("step,loss\n1,2\n")
    with pytest.raises(ValueError, match="run bad: .* lacks the columns"):
        compare_runs([{"name": "bad", "eval": str(tmp_path / "eval.csv"), "checkpoints": str(tmp_path)}])


def test_describe_overrides():
    assert describe_overrides({}) == "-"
    assert describe_overrides({"model.d_model": 192, "model.d_ff": 512}) == "model.d_model=192 model.d_ff=512"


# Seeds: a configuration trained once per seed (the runs <config>.s<seed> of a sweep with `seeds:`)


def seeded_runs(folder, finals, steps=(10, 20)):
    """fake_run per (config, seed): `finals` maps a config to its seeds' final losses; earlier steps
    have a loss 1.0 higher. Each config overrides train.lr_max with a value of its own."""
    runs = []
    for i, (config, losses) in enumerate(finals.items()):
        for seed, loss in enumerate(losses):
            history = [(step, loss + (1.0 if step != steps[-1] else 0.0)) for step in steps]
            runs.append(
                fake_run(
                    folder,
                    f"{config}.s{seed}",
                    history,
                    0.5 + 0.01 * seed,
                    300,
                    config=config,
                    seed=seed,
                    overrides={"train.lr_max": 0.001 * (i + 1)} if i else {},
                    values={"train.lr_max": 0.001 * (i + 1)},
                )
            )
    return runs


def test_mean_and_sample_std_are_numpys_with_ddof_1():
    rng = np.random.default_rng(7)
    for n in (2, 3, 5, 17):
        values = list(rng.normal(3.0, 0.1, size=n))
        assert mean(values) == pytest.approx(np.mean(values), rel=1e-12)
        assert sample_std(values) == pytest.approx(np.std(values, ddof=1), rel=1e-12)
        assert sample_std(values) == pytest.approx(statistics.stdev(values), rel=1e-12)
    assert math.isnan(sample_std([2.0])) and math.isnan(mean([]))


def test_each_configuration_gets_the_mean_and_spread_of_its_seeds_final_figures(tmp_path):
    finals = {"default": [4.00, 4.06, 3.97], "lr": [3.80, 3.95], "one": [3.50]}
    table = compare_runs(seeded_runs(tmp_path, finals))
    assert list(table["config"].unique()) == list(finals)
    assert list(table["seed"]) == [
        seed for losses in finals.values() for seed in range(len(losses)) for _ in "ab"
    ]
    figures = seed_figures(table).set_index("config")
    last = table.groupby("run", sort=False).tail(1)  # each seed's final checkpoint, from compare.csv's rows
    for config, group in last.groupby("config", sort=False):
        got = figures.loc[config]
        assert got["num_seeds"] == len(group) and got["seeds"] == " ".join(map(str, group["seed"]))
        assert got["step"] == 20 and got["train_seconds_mean"] == pytest.approx(
            np.mean(group["train_seconds"])
        )
        for column in ("val_loss", "bits_per_byte"):
            assert got[f"{column}_mean"] == pytest.approx(np.mean(group[column]), rel=1e-12)
            if len(group) > 1:
                assert got[f"{column}_std"] == pytest.approx(np.std(group[column], ddof=1), rel=1e-12)
            else:
                assert math.isnan(got[f"{column}_std"])
        first = last[last["config"] == "default"]["bits_per_byte"]
        assert got["vs_first"] == pytest.approx(np.mean(group["bits_per_byte"]) - np.mean(first), abs=1e-12)
    # The first configuration shows every key that differs, on every seed's rows.
    assert set(table[table["config"] == "default"]["differs"]) == {"train.lr_max=0.001"}

    write_compare(table, tmp_path / "out" / "compare.csv", tmp_path / "out" / "compare.png")
    written = pd.read_csv(tmp_path / "out" / "compare_seeds.csv")
    assert seeds_csv_path(tmp_path / "out" / "compare.csv") == tmp_path / "out" / "compare_seeds.csv"
    pd.testing.assert_frame_equal(
        written.drop(columns=["within_spread", "seeds"]),
        seed_figures(table).drop(columns=["within_spread", "seeds"]),
        check_dtype=False,
        atol=1e-6,
    )
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "out" / "compare.csv"), table, check_dtype=False)
    assert (tmp_path / "out" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_difference_within_the_spread_is_marked(tmp_path):
    # "close" differs from the first by less than the spread, "far" by more; "single" has no spread.
    finals = {
        "default": [4.00, 4.10, 3.90],
        "close": [4.05, 4.15, 3.97],
        "far": [3.00, 3.02, 2.98],
        "single": [4.0],
    }
    figures = seed_figures(compare_runs(seeded_runs(tmp_path, finals)))
    bpb = {config: np.array(losses) / 2 for config, losses in finals.items()}  # fake_run: loss / 2
    expected = [None] + [
        bool(
            abs(np.mean(v) - np.mean(bpb["default"]))
            <= np.hypot(np.std(v, ddof=1), np.std(bpb["default"], ddof=1))
        )
        if len(v) > 1
        else None
        for v in list(bpb.values())[1:]
    ]
    assert expected == [None, True, False, None]  # the constructed table has one of each
    assert list(figures["within_spread"]) == expected
    # Welch's t-test written out: t = (mean_a - mean_b) / sqrt(va/na + vb/nb), the Welch-Satterthwaite
    # degrees of freedom, and the two tails of Student's t.
    for (config, values), p in zip(list(bpb.items())[1:], list(figures["p_welch"])[1:], strict=True):
        if len(values) < 2:
            assert pd.isna(p), config  # empty in the CSV
            continue
        first = bpb["default"]
        va, vb = np.var(values, ddof=1) / len(values), np.var(first, ddof=1) / len(first)
        t = (np.mean(values) - np.mean(first)) / np.sqrt(va + vb)
        dof = (va + vb) ** 2 / (va**2 / (len(values) - 1) + vb**2 / (len(first) - 1))
        assert p == pytest.approx(2 * scipy.stats.t.sf(abs(t), dof), rel=1e-9), config
    assert pd.isna(figures["p_welch"].iloc[0])
    assert figures["p_welch"].iloc[2] < 0.01 < figures["p_welch"].iloc[1]  # "far" differs, "close" not
    head, cells, _ = table_cells(figures, with_loss=True)
    assert head[0] == "config" and "seeds" in head
    marked = [row[-1].endswith(f" {WITHIN_SPREAD_MARK}") for row in cells]
    assert marked == [x is True for x in expected]
    std = np.std(bpb["close"], ddof=1)
    assert cells[1][head.index("bits/byte")] == f"{np.mean(bpb['close']):.4f} ± {std:.4f}"
    assert cells[3][head.index("bits/byte")] == f"{bpb['single'][0]:.4f}"


def test_the_curves_are_the_seeds_mean_at_each_step(tmp_path):
    finals = {"default": [4.00, 4.10], "lr": [3.80]}
    table = compare_runs(seeded_runs(tmp_path, finals, steps=(10, 20, 30)))
    curves = mean_curves(table, "tokens_seen", "val_loss")
    for (config, step), group in table.groupby(["config", "step"]):
        row = curves[(curves["config"] == config) & (curves["step"] == step)].iloc[0]
        assert row["val_loss"] == pytest.approx(np.mean(group["val_loss"]))
        assert row["num_seeds"] == len(group)
        if len(group) > 1:
            assert row["val_loss_std"] == pytest.approx(np.std(group["val_loss"], ddof=1))
    assert list(curves["config"].unique()) == ["default", "lr"]


def test_one_seed_per_configuration_is_the_table_of_runs(tmp_path):
    runs = [
        fake_run(tmp_path, "default", [(10, 4.0), (20, 3.5)], 0.5, 300),
        fake_run(tmp_path, "lr", [(10, 3.9), (20, 3.2)], 0.25, 300, overrides={"train.lr_max": 0.01}),
    ]
    table = compare_runs(runs)
    assert list(table["config"]) == list(table["run"]) and table["seed"].isna().all()
    figures = seed_figures(table)
    final = final_figures(table)
    assert list(figures["config"]) == list(final["run"]) and (figures["num_seeds"] == 1).all()
    assert list(figures["bits_per_byte_mean"]) == list(final["bits_per_byte"])
    assert list(figures["vs_first"]) == list(final["vs_first"])
    assert figures["bits_per_byte_std"].isna().all() and list(figures["within_spread"]) == [None, None]
    head, cells, _ = table_cells(figures, with_loss=True)
    assert head[0] == "run" and "seeds" not in head
    assert cells[1] == ["lr", "train.lr_max=0.01", "20", "5.0", "3.2000", "1.6000", "-0.1500"]
    write_compare(table, tmp_path / "compare.csv", None)
    written = pd.read_csv(tmp_path / "compare_seeds.csv", keep_default_na=False)
    assert (written["bits_per_byte_std"] == "").all() and (written["within_spread"] == "").all()


def test_seeds_that_end_at_different_steps_are_refused(tmp_path):
    runs = seeded_runs(tmp_path, {"default": [4.0]}) + [
        fake_run(tmp_path, "default.s1", [(10, 4.1)], 0.5, 300, config="default", seed=1)
    ]
    with pytest.raises(ValueError, match=r"config default: .*default.s0 at 20, default.s1 at 10"):
        seed_figures(compare_runs(runs))
