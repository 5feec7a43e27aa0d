"""zero-train's plots: matplotlib draws them when it is there; one line says how to get it
when it is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from zero_models import run_plots


def records(steps: int, ranks: int) -> list[dict[str, object]]:
    return [{"step": s, "loss": 5.0 / (s + 1), "lr": 1e-3 * min(1, (s + 1) / 5),
             "tokens_per_s": 1000.0 + s, "rss_mib": [400.0 + r for r in range(ranks)]}
            for s in range(steps)]  # fmt: skip


@pytest.mark.parametrize(("steps", "ranks"), [(1, 1), (40, 2), (3, 4)])
def test_the_plot_is_a_png_of_three_panels(tmp_path: Path, steps: int, ranks: int) -> None:
    pytest.importorskip("matplotlib", reason="the plots extra; nox installs it")
    from matplotlib import image

    path = tmp_path / "loss.png"
    assert run_plots.write_run_plots(path, records(steps, ranks)) is None
    pixels = image.imread(path)
    assert pixels.shape[:2] == (900, 800)  # figsize 8 x 9 inches at 100 dpi
    assert pixels[..., :3].std() > 0  # something drawn


def test_a_run_resumed_on_fewer_or_more_ranks_draws_each_rank_where_it_ran(
    tmp_path: Path,
) -> None:
    """Segments of 2, then 1, then 3 ranks (once an IndexError at the end of the run)."""
    pytest.importorskip("matplotlib", reason="the plots extra; nox installs it")
    steps = records(4, 2) + records(3, 1) + records(3, 3)
    assert run_plots.write_run_plots(tmp_path / "loss.png", steps) is None
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_without_matplotlib_one_line_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_plots, "plots_available", lambda: False)
    why = run_plots.write_run_plots(tmp_path / "loss.png", records(3, 2))
    assert why is not None and "pip install 'zero-models[plots]'" in why
    assert not (tmp_path / "loss.png").exists()
