"""The arithmetic behind the ring all-reduce and bus bandwidth."""

import pytest

from course_utils.collectives import bandwidths, bytes_sent_per_rank, chunk_bounds


@pytest.mark.parametrize("numel, world", [(10, 3), (1, 4), (7, 7), (1001, 8), (0, 2)])
def test_chunks_cover_the_buffer_and_differ_by_at_most_one(numel, world):
    bounds = chunk_bounds(numel, world)
    assert len(bounds) == world and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_ring_traffic_approaches_twice_the_buffer():
    assert bytes_sent_per_rank("all_reduce", 100, 2) == pytest.approx(100)
    assert bytes_sent_per_rank("all_reduce", 100, 8) == pytest.approx(175)
    assert bytes_sent_per_rank("all_reduce", 100, 1024) < 200


def test_bus_bandwidth_follows_nccl_tests():
    alg, bus = bandwidths("all_reduce", 4 * 10**9, 2.0, 4)
    assert alg == pytest.approx(2.0) and bus == pytest.approx(3.0)
    alg, bus = bandwidths("all_gather", 10**9, 1.0, 4)
    assert bus == pytest.approx(0.75)
