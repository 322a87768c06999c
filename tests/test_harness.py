"""The multi-rank harness itself: real gloo exchanges, fast failure, fake groups."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, fake_process_group, run_on_ranks


def _exchange_all_to_all(rank, world_size):
    # Rank r sends value 100*r + j to rank j; so rank r receives 100*j + r from rank j.
    send = torch.tensor([100.0 * rank + j for j in range(world_size)])
    recv = torch.empty(world_size)
    dist.all_to_all_single(recv, send)
    return recv.tolist(), torch.get_num_threads()


@pytest.mark.parametrize("world_size", [2, 4])
def test_run_on_ranks_all_to_all_single_exchanges_values(world_size):
    results = run_on_ranks(_exchange_all_to_all, world_size, timeout_s=120)
    for rank, (received, threads) in enumerate(results):
        assert received == [100.0 * j + rank for j in range(world_size)]
        assert threads == 1


def _crash_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    dist.barrier()  # rank 0 would wait here forever without the harness
    return rank


def test_run_on_ranks_crashing_rank_fails_fast_with_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_crash_on_rank_one, 2, timeout_s=120)
    elapsed_s = time.monotonic() - start
    message = str(info.value)
    assert "rank 1" in message and "deliberate failure on rank one" in message
    assert "ValueError" in message
    assert elapsed_s < 60, f"a crashing rank took {elapsed_s:.0f} s to fail the run"


def _exit_without_result(rank, world_size):
    if rank == 1:
        import os

        os._exit(3)
    dist.barrier()


def test_run_on_ranks_dead_rank_is_reported():
    with pytest.raises(RankFailure, match="exited with code 3"):
        run_on_ranks(_exit_without_result, 2, timeout_s=120)


def _hang_forever(rank, world_size):
    time.sleep(3600)


def test_run_on_ranks_hung_rank_fails_within_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="hung"):
        run_on_ranks(_hang_forever, 2, timeout_s=8)
    assert time.monotonic() - start < 40


def test_fake_process_group_supports_large_worlds():
    with fake_process_group(64, rank=5) as group:
        assert dist.get_world_size(group) == 64 and dist.get_rank(group) == 5
        x = torch.ones(64, 2)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)  # accepted, values meaningless
        assert out.shape == x.shape
    assert not dist.is_initialized()


def test_fake_process_group_rejects_bad_sizes():
    with pytest.raises(ValueError, match="world size"):
        with fake_process_group(65):
            pass
