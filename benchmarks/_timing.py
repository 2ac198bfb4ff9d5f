"""Shared timing helper of the benchmark scripts."""

import time


def median_time(fn, repeats: int) -> float:
    """Median seconds per call after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]
