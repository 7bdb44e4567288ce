"""The benches' PNG plots, drawn for real by matplotlib from results made up here.

matplotlib is the `bench` extra, which `make install` includes: without it a
laptop skips these, CI fails them.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from bench.plots import compare_plots, priority_plot, soak_plot
from bench.soak_report import MIB, Sample, soak_verdict
from bench.stats import Record
from bench.workloads import PriorityClass
from tests.harness import in_ci

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DPI = 110
"""What `bench.output.plot` saves at: the pixel size is the figure size times this."""


@pytest.fixture(autouse=True)
def _matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if in_ci():
            pytest.fail("matplotlib is required in CI (pip install -e '.[bench]')")
        pytest.skip("matplotlib not installed")


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, which a valid PNG holds right after its signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


FIRST, SECOND = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)
"""matplotlib's first two default line and bar colours (C0, C1): one per series drawn."""
TARGET_RED = (0xFF, 0x00, 0x00)


def colours(path: Path) -> set[tuple[int, int, int]]:
    """Every colour the image holds. Axes and labels alone give a few hundred shades
    of grey; a series shows as its own colour."""
    from PIL import Image

    with Image.open(path) as image:
        found = image.convert("RGB").getcolors(maxcolors=1 << 22)
    assert found is not None
    return {colour for _, colour in found}


def _records(label: str, ttfb_s: float, gap_s: float) -> list[Record]:
    return [
        Record(
            label="all",
            request_id=f"{label}-{i}",
            start_s=float(i),
            status=200,
            ttfb_s=ttfb_s * (1 + i / 10),
            total_s=ttfb_s * 3,
            events=3,
            expected_events=3,
            gaps_s=(gap_s, gap_s * 1.1),
        )
        for i in range(20)
    ]


def test_compare_draws_a_ttfb_cdf_and_for_streams_a_gap_cdf(tmp_path: Path) -> None:
    samples = {
        "direct": _records("direct", 0.001, 0.020),
        "pylon": _records("pylon", 0.0015, 0.021),
    }
    small = tmp_path / "small"
    small.mkdir()
    compare_plots(small, "small", samples)
    assert sorted(p.name for p in small.iterdir()) == ["ttfb_cdf.png"]

    compare_plots(tmp_path, "stream", samples)
    for name in ("ttfb_cdf.png", "gap_cdf.png"):
        assert png_size(tmp_path / name) == (8 * DPI, 5 * DPI)
        assert {FIRST, SECOND} <= colours(tmp_path / name), f"{name} lacks a path's curve"


def test_priority_draws_one_panel_per_backend(tmp_path: Path) -> None:
    classes = [PriorityClass("p9", 9, 0.5), PriorityClass("unconfigured", None, 0.5)]

    def run(backend: str, policy: str, starved: bool) -> dict[str, object]:
        rows = [
            {"class": "p9", "ttft_p50_s": 0.05, "ttft_p50_starved": False},
            {"class": "unconfigured", "ttft_p50_s": None, "ttft_p50_starved": starved},
        ]
        return {"backend": backend, "policy": policy, "classes": rows}

    runs = [
        run(backend, policy, starved=policy == "i32max")
        for backend in ("vllm", "sglang")
        for policy in ("ceiling", "i32max")
    ]
    priority_plot(tmp_path, backends=["vllm", "sglang"], classes=classes, runs=runs, cap_s=2.0)
    path = tmp_path / "priority_ttft.png"
    assert png_size(path) == (2 * 5 * DPI, 5 * DPI)
    assert {FIRST, SECOND} <= colours(path), "a policy's bars are missing"


def test_soak_draws_rss_with_its_trend_and_the_target(tmp_path: Path) -> None:
    samples = [Sample(60.0 * i, 70 * MIB + i * MIB // 4) for i in range(1, 9)]
    windows = [{"proxy_peak_rss_bytes": s.rss_bytes + 2 * MIB} for s in samples]
    verdict = soak_verdict(samples, window_peaks=[w["proxy_peak_rss_bytes"] for w in windows])
    soak_plot(tmp_path, samples, windows=windows, verdict=verdict)
    path = tmp_path / "soak_rss.png"
    assert png_size(path) == (8 * DPI, 5 * DPI)
    # RSS (C0), peak (C1), the trend (C2) and the target in red.
    assert {FIRST, SECOND, TARGET_RED} <= colours(path)
