"""Shared timing helper of the benchmark scripts."""

import time


def median(values) -> float:
    """The middle value (the upper one of an even count: always a measured value)."""
    values = sorted(values)
    return values[len(values) // 2]


def median_time(fn, repeats: int) -> float:
    """Median seconds per call after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)
