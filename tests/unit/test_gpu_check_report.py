"""gpu-check's report of GPU time: per method the median of the CUDA-event times its
timed transfers reported (never the cold one), printed beside wall time, and the
contiguous copy back to back; nothing where no transfer reported one (the CPU half)."""

from __future__ import annotations

from benchmarks.gpu_check.driver import Sample
from benchmarks.gpu_check.report import _gpu_lines, _row


def sample(method: str, rep: int, seconds: float, **detail: float) -> Sample:
    return Sample(method, "", 0, rep, seconds, 1 << 20, 1, 0.0, 0.0, 0, 1 << 20, dict(detail))


def test_gpu_time_is_the_median_of_timed_transfers_beside_wall_time() -> None:
    kernel = [sample("kernel", 0, 9.0, gpu_ms=50.0)] + [
        sample("kernel", i, 0.002, gpu_ms=g) for i, g in enumerate((0.7, 0.5, 0.6), 1)
    ]
    copy = [sample("copy", 0, 1.0, gpu_ms=9.0, back_to_back_ms=8.0)] + [
        sample("copy", i, 0.001, gpu_ms=0.4, back_to_back_ms=b) for i, b in ((1, 0.31), (2, 0.3))
    ]
    rows = [_row("kernel", "", kernel), _row("copy", "", copy)]
    assert rows[0]["gpu_ms"] == 0.6 and rows[1]["back_to_back_ms"] == 0.305
    (line,) = _gpu_lines(rows)
    assert "kernel 0.600 (wall 2.000)" in line
    assert "contig copy 0.400 (wall 1.000)" in line and "back to back 0.305" in line


def test_no_gpu_line_where_no_transfer_reported_gpu_time() -> None:
    rows = [_row("kernel", "", [sample("kernel", 1, 0.002)])]
    assert rows[0]["gpu_ms"] is None and _gpu_lines(rows) == []
