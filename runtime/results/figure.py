"""The training-curves figure (``curves.png``): six panels, one line per run in each.

Drawn with matplotlib's object API (``matplotlib.figure.Figure`` on a ``FigureCanvasAgg``), never
pyplot: no global figure state, no display, safe in a background thread. matplotlib is imported
when a figure is drawn, not when this module is imported.

Every drawn line carries a ``gid`` saying what it is, so tests can read the data handed to
matplotlib: ``run:<label>:<series>`` for the curves (series: loss, lr, mean_dice, l1_dice,
l2_dice, throughput, mean_dice_minutes, loss_minutes), ``reached:<label>``, ``diverged:<label>``
and ``threshold``.
"""
from __future__ import annotations

import math
from typing import Sequence

from runtime.results.files import ReportError, atomic_write
from runtime.results.runs import Run
from runtime.results.scoring import diverged_epoch, elapsed_minutes, reached_epoch

MATPLOTLIB_HINT = "matplotlib is not installed: pip install matplotlib"
FIGSIZE = (12.0, 10.0)  # inches; at DPI this is the PNG's size in pixels
DPI = 100
PNG_SIZE = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))  # width, height
MINUTES_LABEL = "minutes since run_start (gaps between resumed attempts left out)"
DICE_STYLES = (("mean_dice", "-", "mean"), ("l1_dice", "--", "kidney"), ("l2_dice", ":", "tumour"))


class MissingMatplotlib(ReportError):
    """No figure without matplotlib (the summary is written all the same)."""


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as error:
        raise MissingMatplotlib(MATPLOTLIB_HINT) from error
    return Figure, FigureCanvasAgg, Line2D


def new_figure():
    """An empty figure of ``PNG_SIZE`` pixels on its own Agg canvas, with a 3x2 grid of axes."""
    Figure, FigureCanvasAgg, _ = _matplotlib()
    try:
        figure = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    except TypeError:  # matplotlib < 3.5
        figure = Figure(figsize=FIGSIZE, dpi=DPI, constrained_layout=True)
    FigureCanvasAgg(figure)
    return figure, figure.subplots(3, 2)


def build_figure(runs: Sequence[Run], threshold: float):
    """The figure for ``runs`` (several overlaid, one colour each) and the target ``threshold``.

    Panels: training loss, learning rate, evaluation Dice (mean solid, kidney dashed, tumour
    dotted) against epoch; mean Dice against run time; throughput against epoch; training loss
    against run time."""
    figure, axes = new_figure()
    panels = {"loss": axes[0][0], "lr": axes[0][1], "dice": axes[1][0], "dice_minutes": axes[1][1],
              "throughput": axes[2][0], "loss_minutes": axes[2][1]}
    for index, run in enumerate(runs):
        _draw_run(panels, run, f"C{index % 10}", threshold)
    for name in ("dice", "dice_minutes"):
        panels[name].axhline(threshold, color="0.4", linestyle="-.", linewidth=1, gid="threshold")
    _decorate(panels, runs, threshold)
    figure.suptitle(f"{len(runs)} run(s); target mean Dice {threshold:g}")
    return figure


def _draw_run(panels: dict, run: Run, color: str, threshold: float) -> None:
    label = run.label
    epochs = [p.epoch for p in run.train]
    train_minutes = elapsed_minutes([p.time for p in run.train], run.attempts)
    eval_epochs = [p.epoch for p in run.evals]
    eval_minutes = elapsed_minutes([p.time for p in run.evals], run.attempts)
    if run.train:
        losses = [p.loss for p in run.train]
        panels["loss"].plot(epochs, losses, color=color, label=label, gid=f"run:{label}:loss")
        panels["lr"].plot(epochs, [p.lr for p in run.train], color=color, gid=f"run:{label}:lr")
        panels["throughput"].plot(epochs, [p.throughput for p in run.train], color=color,
                                  gid=f"run:{label}:throughput")
        panels["loss_minutes"].plot(train_minutes, losses, color=color, gid=f"run:{label}:loss_minutes")
    else:  # still in the legend, so a run without data is seen to be there
        panels["loss"].plot([], [], color=color, label=f"{label} (no epoch yet)", gid=f"run:{label}:loss")
    for key, style, _ in DICE_STYLES:
        if run.evals:
            panels["dice"].plot(eval_epochs, [getattr(p, key) for p in run.evals], color=color,
                                linestyle=style, marker="." if key == "mean_dice" else None,
                                gid=f"run:{label}:{key}")
    if run.evals:
        panels["dice_minutes"].plot(eval_minutes, [p.mean_dice for p in run.evals], color=color,
                                    marker=".", gid=f"run:{label}:mean_dice_minutes")
    _mark_events(panels, run, color, threshold, eval_minutes)


def _mark_events(panels: dict, run: Run, color: str, threshold: float, eval_minutes: list) -> None:
    """A star where the run first reached the target, a cross where it diverged."""
    reached = reached_epoch(run.evals, threshold)
    if reached is not None:
        index = [p.epoch for p in run.evals].index(reached)
        dice = run.evals[index].mean_dice
        panels["dice"].plot([reached], [dice], marker="*", markersize=14, color=color, linestyle="none",
                            gid=f"reached:{run.label}")
        panels["dice_minutes"].plot([eval_minutes[index]], [dice], marker="*", markersize=14, color=color,
                                    linestyle="none", gid=f"reached:{run.label}")
    bad = diverged_epoch(run)
    finite_losses = [p.loss for p in run.train if p.epoch <= bad and math.isfinite(p.loss)] if bad else []
    if bad is not None and finite_losses:
        panels["loss"].plot([bad], [finite_losses[-1]], marker="x", markersize=10, color=color,
                            linestyle="none", gid=f"diverged:{run.label}")
        panels["loss"].annotate("diverged", (bad, finite_losses[-1]), color=color, fontsize="small",
                                textcoords="offset points", xytext=(4, 4))


def _decorate(panels: dict, runs: Sequence[Run], threshold: float) -> None:
    _, _, Line2D = _matplotlib()
    from matplotlib.ticker import MaxNLocator
    titles = {"loss": ("training loss", "epoch"), "lr": ("learning rate", "epoch"),
              "dice": ("evaluation Dice", "epoch"), "dice_minutes": ("evaluation mean Dice", MINUTES_LABEL),
              "throughput": ("throughput (samples/s)", "epoch"), "loss_minutes": ("training loss", MINUTES_LABEL)}
    for name, (title, xlabel) in titles.items():
        axis = panels[name]
        axis.set_title(title)
        axis.set_xlabel(xlabel)
        axis.grid(True, alpha=0.3)
        if not any(line.get_gid() and line.get_gid().startswith("run:") and len(line.get_xdata())
                   for line in axis.get_lines()):
            axis.text(0.5, 0.5, "no data", transform=axis.transAxes, ha="center", va="center", color="0.5")
    for name in ("dice", "dice_minutes"):
        panels[name].set_ylim(-0.02, 1.02)
    for name in ("loss", "lr", "dice", "throughput"):
        panels[name].xaxis.set_major_locator(MaxNLocator(integer=True))
    rates = [p.lr for run in runs for p in run.train if math.isfinite(p.lr)]
    if rates and min(rates) > 0 and max(rates) / min(rates) > 100:  # a warm-up over decades
        panels["lr"].set_yscale("log")
    if runs:
        panels["loss"].legend(fontsize="small", ncol=1 + len(runs) // 8)
    styles = [Line2D([], [], color="0.3", linestyle=style, label=name) for _, style, name in DICE_STYLES]
    styles.append(Line2D([], [], color="0.4", linestyle="-.", label=f"target {threshold:g}"))
    styles.append(Line2D([], [], color="0.3", marker="*", markersize=10, linestyle="none", label="reached"))
    panels["dice"].legend(handles=styles, fontsize="small", loc="best")


def write_figure(runs: Sequence[Run], threshold: float, path: str) -> str:
    """Draw ``runs`` into the PNG ``path`` (atomically); MissingMatplotlib when matplotlib is
    not installed."""
    figure = build_figure(runs, threshold)
    return atomic_write(path, lambda handle: figure.savefig(handle, format="png"))
