"""search.report: every PNG of a run, the Pareto front, and clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from pipeline.trace import Span, write_trace  # noqa: E402
from search.app import run  # noqa: E402
from search.report import ReportError, main, pareto_front, report  # noqa: E402
from tests.test_app import make_cfg  # noqa: E402

PNGS = ["loss_lr.png", "throughput.png", "migration.png", "search_progress.png", "pareto.png", "stages.png"]


def test_pareto_front() -> None:
    pts = [(10, 0.5), (5, 0.4), (20, 0.9), (15, 0.45), (5, 0.3), (30, 0.9)]
    assert pareto_front(pts) == [1, 0, 2]  # cheapest first; (15, 0.45), (5, 0.3), (30, 0.9) are dominated


def test_report_writes_every_png_of_a_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    run(make_cfg(), output_dir=out)
    run(make_cfg("search=random"), output_dir=out)  # the baseline on the same supernet: only searches
    # a two-rank trace as the pipelined engine records it (1F1B, two micro-batches, one step)
    spans = [Span(r, 3, f"{r}{k}{m}", {"F": "forward", "B": "backward"}[k], t0, d)
             for r, k, m, t0, d in [(0, "F", 0, 0.00, 0.01), (0, "F", 1, 0.01, 0.01), (1, "F", 0, 0.012, 0.01),
                                    (1, "B", 0, 0.022, 0.01), (1, "F", 1, 0.032, 0.01), (1, "B", 1, 0.042, 0.01),
                                    (0, "B", 0, 0.034, 0.01), (0, "B", 1, 0.054, 0.01)]]
    spans += [Span(1, 3, "recv", "recv-wait", 0.0, 0.012), Span(0, 3, "step", "optimizer", 0.064, 0.002)]
    write_trace(out / "trace.json", spans)
    written = report(out)
    assert [p.name for p in written] == PNGS
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000

    main([str(out), "--out", str(tmp_path / "pngs")])
    assert sorted(capsys.readouterr().out.split()) == sorted(str(tmp_path / "pngs" / n) for n in PNGS)


def test_report_of_a_directory_that_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ReportError, match="no metrics.jsonl; expected the run directory"):
        report(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path)])
    assert e.value.code == 2 and capsys.readouterr().err.startswith(f"error: {tmp_path}: no metrics.jsonl")


def test_search_progress_shows_both_searches_where_they_coincide(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Evolution and its random baseline start from the same seeded draws: the baseline must
    not hide under evolution's line (distinct colour, dash, width and markers; drawn on top)."""
    import numpy as np
    from matplotlib.colors import to_rgb

    import search.report as rep

    figs: list = []
    monkeypatch.setattr(rep, "_save", lambda fig, path: figs.append(fig))
    acc = [0.2, 0.5, 0.4, 0.6, 0.6, 0.7, 0.65, 0.8]
    evolution = [{"generation": i // 4, "val_accuracy": a, "nonfinite": False} for i, a in enumerate(acc)]
    late = [{**e, "val_accuracy": e["val_accuracy"] + 0.1 * (i >= 4)} for i, e in enumerate(evolution)]
    for random_log, same in ((late, 4), (evolution, 8)):  # apart after a generation; the same all along
        figs.clear()
        rep._search_progress(rep._plt(), {"evolution": evolution, "random": random_log}, 4, tmp_path / "p.png")
        (fig,) = figs
        ax = fig.axes[0]
        evo, rnd = (next(ln for ln in ax.lines if ln.get_label().startswith(k)) for k in ("evolution", "random"))
        assert list(evo.get_ydata()[:same]) == list(rnd.get_ydata()[:same])
        assert evo.get_color() != rnd.get_color() and evo.get_linestyle() != rnd.get_linestyle()
        assert evo.get_marker() != rnd.get_marker() and list(evo.get_markevery()) == list(rnd.get_markevery()) == [3]
        assert rnd.get_zorder() > evo.get_zorder() and rnd.get_linewidth() < evo.get_linewidth()
        assert f"coincide over the first {same} archs" in ax.get_legend().get_title().get_text()
        fig.canvas.draw()  # both colours on the canvas, even where the lines are the same
        pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(float) / 255
        seen = {k: int((np.abs(pixels - to_rgb(ln.get_color())).max(-1) < 0.08).sum()) for k, ln in
                (("evolution", evo), ("random", rnd))}
        assert min(seen.values()) > 300, seen
        import matplotlib.pyplot as plt

        plt.close(fig)
