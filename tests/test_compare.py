"""compare_runs: every run's eval.csv and checkpoint manifests into one table, plot and final figures."""

import json

import pandas as pd
import pytest

from tinylm.compare import (
    compare_runs,
    describe_overrides,
    differing_keys,
    final_figures,
    markdown_table,
    one_vocabulary,
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
            manifest = {"files": {}, "train_seconds": step * seconds_per_step}
            if vocab_size is not None:
                manifest["model_config"] = {"vocab_size": vocab_size}
            (run_dir / "checkpoints" / f"step_{step}.json").write_text(json.dumps(manifest))
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
