"""compare_runs: every run's eval.csv and checkpoint manifests into one table, plot and final figures."""

import json

import pandas as pd
import pytest

from tinylm.compare import compare_runs, describe_overrides, final_figures, markdown_table, write_compare


def fake_run(folder, name, losses, seconds_per_step=None):
    """An eval.csv with one row per (step, loss) and, optionally, manifests with train_seconds."""
    run_dir = folder / name
    (run_dir / "checkpoints").mkdir(parents=True)
    rows = [{"step": step, "tokens_seen": step * 100, "val_loss": loss, "val_ppl": 0, "bits_per_byte": loss / 2,
             "unigram_entropy": 5.0, "gap_to_unigram": 5.0 - loss} for step, loss in losses]
    pd.DataFrame(rows).to_csv(run_dir / "eval.csv", index=False)
    if seconds_per_step is not None:
        for step, _ in losses:
            (run_dir / "checkpoints" / f"step_{step}.json").write_text(
                json.dumps({"files": {}, "train_seconds": step * seconds_per_step}))
    return {"name": name, "eval": str(run_dir / "eval.csv"), "checkpoints": str(run_dir / "checkpoints")}


def test_every_checkpoint_of_every_run_in_run_order(tmp_path):
    runs = [fake_run(tmp_path, "default", [(10, 4.0), (20, 3.5)], 0.5),
            {**fake_run(tmp_path, "lr", [(10, 3.9), (20, 3.2)], 0.25), "overrides": {"train.lr_max": 0.01}},
            fake_run(tmp_path, "old", [(20, 3.8)])]  # manifests without train_seconds
    table = compare_runs(runs)
    assert list(table["run"]) == ["default", "default", "lr", "lr", "old"]
    assert list(table["train_seconds"].iloc[:4]) == [5.0, 10.0, 2.5, 5.0]
    assert table["train_seconds"].iloc[4] != table["train_seconds"].iloc[4]  # NaN
    assert list(table["overrides"].unique()) == ["-", "train.lr_max=0.01"]
    final = final_figures(table)
    assert list(final["run"]) == ["default", "lr", "old"]
    assert list(final["val_loss"]) == [3.5, 3.2, 3.8]
    assert final["vs_first"].tolist() == pytest.approx([0.0, -0.3, 0.3])
    text = markdown_table(final)
    assert "| lr | train.lr_max=0.01 | 20 | 2,000 | 5.0 | 3.2000 | 1.6000 | -0.3000 |" in text
    write_compare(table, tmp_path / "out" / "compare.csv", tmp_path / "out" / "compare.png")
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "out" / "compare.csv"), table, check_dtype=False)
    assert (tmp_path / "out" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_its_evaluation_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="run lost: .*eval.csv not found"):
        compare_runs([{"name": "lost", "eval": str(tmp_path / "eval.csv"), "checkpoints": str(tmp_path)}])
    (tmp_path / "eval.csv").write_text("step,loss\n1,2\n")
    with pytest.raises(ValueError, match="run bad: .* lacks the columns"):
        compare_runs([{"name": "bad", "eval": str(tmp_path / "eval.csv"), "checkpoints": str(tmp_path)}])


def test_describe_overrides():
    assert describe_overrides({}) == "-"
    assert describe_overrides({"model.d_model": 192, "model.d_ff": 512}) == "model.d_model=192 model.d_ff=512"
