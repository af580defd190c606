"""tinylm.pretrain.heartbeat: ranks that wait for each other through a store give up on a rank that
stops beating, never on one that is slow but beats; a world of one waits on nothing."""

import threading
import time

import pytest
import torch.distributed as dist

from tinylm.pretrain.heartbeat import Heartbeat, RankHungError


def test_a_world_of_one_posts_and_reads_its_own_values():
    heartbeat = Heartbeat(None, 0, 1, 1.0, "commit/1")
    heartbeat.post("layout", "abc")
    assert heartbeat.wait({"layout": 0}, "planning") == {"layout": "abc"}
    heartbeat.barrier("done")


def test_a_slow_rank_that_beats_is_waited_for_beyond_the_timeout():
    store, timeout_s, work_s = dist.HashStore(), 0.5, 1.6
    waiter = Heartbeat(store, 0, 2, timeout_s, "commit/7")
    worker = Heartbeat(store, 1, 2, timeout_s, "commit/7")

    def slow_rank():
        end = time.monotonic() + work_s
        while time.monotonic() < end:  # writing a large file: a beat after every piece
            worker.beat()
            time.sleep(0.05)
        worker.post("hashes/1", "done")

    thread = threading.Thread(target=slow_rank)
    start = time.monotonic()
    thread.start()
    assert waiter.wait({"hashes/1": 1}, "writing its tensors") == {"hashes/1": "done"}
    thread.join()
    assert time.monotonic() - start >= work_s > 3 * timeout_s


def test_a_rank_that_stops_beating_is_named_within_the_timeout():
    store, timeout_s = dist.HashStore(), 0.5
    waiter = Heartbeat(store, 0, 2, timeout_s, "commit/8")
    Heartbeat(store, 1, 2, timeout_s, "commit/8").beat()  # rank 1 beat once, then hung
    start = time.monotonic()
    with pytest.raises(RankHungError, match=r"rank 1 made no progress for 0\.5 s .* while rank 0 waited"):
        waiter.wait({"hashes/1": 1}, "writing its tensors")
    assert timeout_s <= time.monotonic() - start < timeout_s + 1.0


def test_phases_do_not_see_each_others_keys():
    store = dist.HashStore()
    Heartbeat(store, 1, 2, 5.0, "commit/1").post("done", "1")
    later = Heartbeat(store, 0, 2, 0.3, "commit/2")
    Heartbeat(store, 1, 2, 0.3, "commit/2")  # rank 1 never beats in this phase
    with pytest.raises(RankHungError):
        later.wait({"done": 1}, "committing")
