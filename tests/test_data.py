"""get_batch and load_tokens: shifted targets, uniform window starts, memmaps read lazily."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from tinylm.data import get_batch, load_tokens


def test_targets_are_inputs_shifted_by_one():
    tokens = np.random.default_rng(0).permutation(1000).astype(np.uint16)  # distinct values
    x, y = get_batch(tokens, batch_size=8, context_length=16, device="cpu")
    assert x.shape == y.shape == (8, 16)
    assert x.dtype == y.dtype == torch.int64
    assert x.device.type == "cpu"
    for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):
        start = int(np.flatnonzero(tokens == row_x[0])[0])
        np.testing.assert_array_equal(row_x, tokens[start : start + 16])
        np.testing.assert_array_equal(row_y, tokens[start + 1 : start + 17])


def test_values_above_int16_survive():
    tokens = np.arange(65000, 65100, dtype=np.uint16)
    x, y = get_batch(tokens, batch_size=4, context_length=10, device="cpu")
    assert x.min() >= 65000 and y.max() < 65100
    torch.testing.assert_close(y, x + 1)


def test_start_positions_cover_the_whole_valid_range_uniformly():
    n, context_length = 60, 8
    tokens = np.arange(n, dtype=np.uint16)  # token value = its position
    num_starts = n - context_length  # valid starts 0 .. n - context_length - 1
    g = torch.Generator().manual_seed(0)
    counts = np.zeros(n, dtype=np.int64)
    for _ in range(250):
        x, _ = get_batch(tokens, batch_size=64, context_length=context_length, device="cpu", generator=g)
        np.add.at(counts, x[:, 0].numpy(), 1)
    assert counts[num_starts:].sum() == 0, "a window ran past the end"
    observed = counts[:num_starts]
    assert (observed > 0).all(), "some valid start positions never drawn"
    # Chi-square against uniform: with 51 degrees of freedom the statistic has mean 51 and std
    # about 10; 51 + 10 * 10 is far in the tail (p < 1e-12), so this fails only for a biased sampler.
    expected = observed.sum() / num_starts
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert chi2 < (num_starts - 1) + 10 * np.sqrt(2 * (num_starts - 1))


def test_batches_are_reproducible_from_a_generator():
    tokens = np.random.default_rng(0).integers(0, 1000, size=5000).astype(np.uint16)

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return [get_batch(tokens, 4, 32, "cpu", generator=g) for _ in range(3)]

    for (x1, y1), (x2, y2) in zip(draw(7), draw(7), strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(draw(7)[0][0], draw(8)[0][0])


def test_too_short_array_is_refused():
    with pytest.raises(ValueError, match="context_length"):
        get_batch(np.arange(8, dtype=np.uint16), batch_size=2, context_length=8, device="cpu")


def _resident_kib_of_mapping(path: str) -> int:
    """Resident memory (KiB) of this process's mappings of `path`, from /proc/self/smaps."""
    total, in_mapping = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping header line
                in_mapping = fields[-1] == path
            elif in_mapping and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_memmap_input_is_read_only_where_sampled(tmp_path):
    path = tmp_path / "tokens.npy"
    n = 32 * 1024 * 1024  # 64 MiB of uint16
    np.save(path, np.arange(n, dtype=np.int64).astype(np.uint16))
    tokens = load_tokens(path)
    assert isinstance(tokens, np.memmap) and not tokens.flags.writeable
    real_path = os.path.realpath(path)

    g = torch.Generator().manual_seed(0)
    x, y = get_batch(tokens, batch_size=2, context_length=64, device="cpu", generator=g)
    torch.testing.assert_close(y[:, :-1], x[:, 1:])
    # Two windows touch two or three pages. The kernel may map a whole large folio (up to 2 MiB)
    # per fault, but that is still far from the 64 MiB a whole-array copy would make resident.
    resident = _resident_kib_of_mapping(real_path)
    assert resident <= 16 * 1024, f"{resident} KiB of the token file resident after one batch"
    np.asarray(tokens).sum()  # reading everything does make it resident: the probe works
    assert _resident_kib_of_mapping(real_path) > 32 * 1024


def test_load_tokens_checks_dtype_and_shape(tmp_path):
    good = tmp_path / "good.npy"
    np.save(good, np.arange(10, dtype=np.uint16))
    assert load_tokens(good).dtype == np.uint16

    wrong_dtype = tmp_path / "int32.npy"
    np.save(wrong_dtype, np.arange(10, dtype=np.int32))
    with pytest.raises(ValueError, match="int32.npy"):
        load_tokens(wrong_dtype)

    two_d = tmp_path / "two_d.npy"
    np.save(two_d, np.zeros((2, 5), dtype=np.uint16))
    with pytest.raises(ValueError, match="two_d.npy"):
        load_tokens(two_d)

    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"not a numpy file")
    with pytest.raises(ValueError, match="garbage.npy"):
        load_tokens(garbage)

    pickled = tmp_path / "pickled.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="pickled.npy"):
        load_tokens(pickled)


def test_load_tokens_checks_ids_against_the_vocabulary(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.array([0, 5, 299], dtype=np.uint16))
    assert len(load_tokens(path, vocab_size=300)) == 3
    with pytest.raises(
        ValueError, match=r"t\.npy: token id 299 is outside the tokenizer's vocabulary of 299"
    ):
        load_tokens(path, vocab_size=299)


# ---------------------------------------------------------------- training batches and mixtures


def _batches(tokens, weights, rank=0, world_size=1, accum=1, seed=3):
    from tinylm.data import TrainBatches

    return TrainBatches(tokens, weights, seed, 8, 6, rank, world_size, accum, torch.device("cpu"))


def _global_batch(tokens, weights, step, world_size, accum):
    """Every rank's micro-batches of `step`, in rank-major order: the global batch as trained."""
    parts = [
        _batches(tokens, weights, rank, world_size, accum).get(step, micro)
        for rank in range(world_size)
        for micro in range(accum)
    ]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def test_one_token_file_gives_the_batches_of_global_batch_starts():
    from tinylm.data import global_batch_starts, num_window_starts

    tokens = np.arange(500, dtype=np.uint16)
    for step in (1, 7):
        x, y = _batches([tokens], [1.0]).get(step, 0)
        starts = global_batch_starts(3, step - 1, 8, num_window_starts(tokens, 6))
        assert torch.equal(x[:, 0], starts) and torch.equal(y, x + 1)


def test_a_mixture_draws_each_sequence_whole_from_one_file_the_same_at_any_layout():
    # Two files whose ids say where they come from: file 0 holds 0..399, file 1 holds 1000..1599.
    tokens = [np.arange(400, dtype=np.uint16), np.arange(1000, 1600, dtype=np.uint16)]
    weights = [0.25, 0.75]
    for step in range(1, 6):
        x, y = _global_batch(tokens, weights, step, 1, 1)
        assert torch.equal(y, x + 1)  # consecutive tokens of one file
        from_second = x[:, 0] >= 1000
        assert torch.all((x >= 1000) == from_second[:, None])  # never across files
        assert torch.all(x[~from_second] + 7 <= 400) and torch.all(x[from_second] + 7 <= 1600)
        for world_size, accum in ((2, 1), (2, 2), (1, 4)):
            other = _global_batch(tokens, weights, step, world_size, accum)
            assert torch.equal(other[0], x) and torch.equal(other[1], y), (world_size, accum)
    again = _global_batch(tokens, weights, 3, 1, 1)[0]
    assert torch.equal(again, _global_batch(tokens, weights, 3, 1, 1)[0])
    assert not torch.equal(again, _global_batch(tokens, weights, 4, 1, 1)[0])


def test_a_mixture_draws_its_files_by_their_weights():
    from scipy.stats import binomtest

    from tinylm.data import mixture_batch_starts

    counts, draws = np.zeros(2, dtype=int), 0
    for step in range(400):
        sources, starts = mixture_batch_starts(11, step, 64, [100, 50], [1.0, 3.0])
        counts += np.bincount(sources.numpy(), minlength=2)
        draws += len(sources)
        assert torch.all(starts[sources == 1] < 50) and torch.all(starts >= 0)
    assert binomtest(int(counts[1]), draws, 0.75).pvalue > 1e-3, counts
    # Starts are uniform over each file's windows: the second file's mean start near (50 - 1) / 2.
    sources, starts = mixture_batch_starts(11, 0, 20000, [100, 50], [1.0, 3.0])
    assert abs(starts[sources == 1].double().mean().item() - 24.5) < 1.0
