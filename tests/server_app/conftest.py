"""Fixtures of the ServerApp tests that make whole in-process runs."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def learning_curve_not_rendered():
    """End-of-run learning curves are built but not rendered to PNG: rendering is about
    0.4 s of CPU of a 0.9 s tiny run. For modules that never read the image;
    ``test_results.py``, ``test_published_files.py`` and ``test_tracking.py`` render it
    and check it. Every other figure (audit, ledger) is rendered as usual."""
    from server_app import plots

    rendered = plots.save_figure

    def save_figure(figure, path: Path, fmt: str | None = None) -> Path:
        if Path(path).name == "learning_curve.png" and fmt is None:
            plots.plt.close(figure)
            return path
        return rendered(figure, path, fmt)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plots, "save_figure", save_figure)
        yield
