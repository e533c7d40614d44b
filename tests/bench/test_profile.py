"""bench profile's critical path: each kernel is charged what it adds to the stream, so overlapping kernels
(programmatic dependent launch) are not counted twice and the charges add up to the step."""
import pytest

from tokenmill.bench.profile import critical_path


def by_name(rows):
    return {r["name"]: r for r in rows}


def test_serial_kernels_are_charged_their_end_after_the_previous_end() -> None:
    """Gaps count toward the kernel after them; the first event of the window has nothing before it."""
    rows = by_name(critical_path([("a", 0, 10_000), ("b", 12_000, 20_000), ("c", 20_000, 25_000)], 1, 10))
    assert rows["a"]["us_per_call"] == 0.0
    assert rows["b"]["us_per_call"] == pytest.approx(10.0)  # 2 us idle + 8 us running
    assert rows["c"]["us_per_call"] == pytest.approx(5.0)
    assert rows["b"]["duration_us"] == pytest.approx(8.0)


def test_overlapping_kernels_are_charged_only_their_tail() -> None:
    """A kernel launched early (PDL) that waits inside runs long, but adds only what ends after the one before;
    one that ends inside another adds nothing and does not move the end back."""
    events = [("qkv", 0, 10_000), ("attn", 2_000, 14_000), ("copy", 3_000, 6_000), ("o", 5_000, 15_000)]
    rows = by_name(critical_path(events, 1, 10))
    assert rows["attn"]["us_per_call"] == pytest.approx(4.0)
    assert rows["attn"]["duration_us"] == pytest.approx(12.0)
    assert rows["copy"]["us_per_call"] == 0.0
    assert rows["o"]["us_per_call"] == pytest.approx(1.0)


def test_charges_add_up_to_the_window_per_step() -> None:
    """Over steps of the same kernels, a step's charges sum to the window from the first end to the last, over
    the number of steps; calls are counted a step; rows come largest first and `top` cuts them."""
    events, t = [], 0
    for _ in range(4):
        for name, run, gap in (("gemv", 7_000, 500), ("attn", 3_000, -1_000), ("norm", 1_000, 0), ("gemv", 6_000, 0)):
            start = t + gap
            events.append((name, start, start + run))
            t = start + run
    rows = critical_path(events, 4, 10)
    total_ms = sum(r["ms_per_step"] for r in rows)
    assert total_ms == pytest.approx((events[-1][2] - events[0][2]) / 1e6 / 4)
    assert [r["name"] for r in rows] == ["gemv", "attn", "norm"]
    assert by_name(rows)["gemv"]["calls_per_step"] == 2
    assert [r["name"] for r in critical_path(events, 4, 1)] == ["gemv"]
