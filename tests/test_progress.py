"""Progress lines of long work: the first within seconds, then one a minute, the same in a log file."""

import re

from tinylm import progress
from tinylm.progress import Progress


def test_lines_come_after_the_first_seconds_then_once_a_minute(monkeypatch, capsys):
    clock = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    shown = Progress("[encode] train.txt", total=200e6, unit="B")
    for _ in range(200):  # 1 MB a second
        clock[0] += 1.0
        shown.update(1e6)
    lines = capsys.readouterr().err.splitlines()
    assert [re.search(r" in (\d+) s", line).group(1) for line in lines] == ["5", "65", "125", "185"]
    assert lines[0] == "[encode] train.txt: 5.0 MB of 200.0 MB (2 %) in 5 s, 1.0 MB/s, 195 s left"
    assert "\r" not in "".join(lines)


def test_quick_work_says_nothing_and_a_disabled_one_never_speaks(monkeypatch, capsys):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    quick = Progress("[evaluate] windows", total=10, unit="windows")
    silent = Progress("[evaluate] windows", total=10, unit="windows", enabled=False)
    for _ in range(10):  # 4 s in all
        clock[0] += 0.4
        quick.update()
    for _ in range(10):
        clock[0] += 10.0
        silent.update()
    assert capsys.readouterr().err == ""


def test_unknown_total_gives_the_amount_and_rate_only(monkeypatch, capsys):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    shown = Progress("[corpus] download x", total=None, unit="B")
    clock[0] = 6.0
    shown.update(3e9)
    assert capsys.readouterr().err == "[corpus] download x: 3.0 GB in 6 s, 500.0 MB/s\n"


def test_tokenizer_training_reports_its_merges_as_it_goes(tmp_path, monkeypatch, capsys):
    """A clock that moves 1 s per reading: train_bpe's merges report their progress by time."""
    from tinylm.tokenizer import train_bpe

    clock = [0.0]

    def tick():
        clock[0] += 1.0
        return clock[0]

    monkeypatch.setattr(progress.time, "perf_counter", tick)
    path = tmp_path / "t.txt"
    path.write_text("the cat sat on the mat; the dog ate the hat. " * 50)
    train_bpe(path, 300, ["<|endoftext|>"], num_workers=1)
    merges = [line for line in capsys.readouterr().err.splitlines() if "[train-tokenizer] merges:" in line]
    assert merges and re.search(r"merges: [\d,]+ merges of 43 merges \(\d+ %\)", merges[0]), merges
