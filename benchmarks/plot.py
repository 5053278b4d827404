"""Figures of ``kvbridge bench transfer`` and ``kvbridge bench plan`` (``--plot FILE.png``).

``transfer``: throughput (GB/s) and descriptor count against the run size (bytes per
descriptor, log axis), kvbridge's READs next to one contiguous READ of the same bytes and
a memcpy of them, as the bench measured them. ``plan``: planning time per case next to
its floor. Each drawing function returns the series it drew, the figures taken from the
rows unchanged. matplotlib is imported here only, and draws with Agg (no GUI, no pyplot
state): ``pip install 'kvbridge[plot]'``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import cycle
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError

Row = dict[str, Any]

TRANSFER_MEASURES = (
    ("gbps", "kvbridge (the plan's READs)", "tab:blue"),
    ("contiguous_gbps", "one contiguous READ, same bytes", "tab:orange"),
    ("memcpy_gbps", "memcpy of the same bytes (ceiling)", "tab:gray"),
)
MARKERS = ("o", "s", "^", "D", "v")
PLOTTED = ("plan", "transfer")


@dataclass(frozen=True)
class Series:
    """One set of drawn points: ``key`` the row field the values come from, ``x``/``y``
    the points in drawing order, ``names`` the case of each point."""

    key: str
    label: str
    x: list[float]
    y: list[float]
    names: list[str]


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ConfigError("--plot needs matplotlib: pip install 'kvbridge[plot]'") from e
    return matplotlib


def check_target(path: str | Path) -> Path:
    """Refuse, before a bench runs, a ``--plot`` that could not be written."""
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ConfigError(f"--plot: {str(path)!r} must end in .png")
    if not out.parent.is_dir():
        raise ConfigError(f"--plot: folder {str(out.parent)!r} does not exist")
    _matplotlib()
    return out


def draw(what: str, rows: list[Row], path: str | Path) -> list[Series]:
    """Draw the figure of ``bench WHAT`` from its rows into the PNG ``path``."""
    if not rows:
        raise ConfigError(f"--plot: bench {what} gave no rows to draw")
    if what == "transfer":
        return plot_transfer(rows, path)
    if what == "plan":
        return plot_plan(rows, path)
    raise ConfigError(f"--plot: bench {what} draws no figure (only {', '.join(PLOTTED)})")


def _figure(rows: int, height: float, ratios: list[int] | None = None) -> tuple[Any, Any]:
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=rows > 1, squeeze=False, height_ratios=ratios)
    return fig, [ax for (ax,) in axes]


def _size(nbytes: float, _pos: object = None) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    step = 0
    while nbytes >= 1024 and step < len(units) - 1:
        nbytes, step = nbytes / 1024, step + 1
    return f"{nbytes:g} {units[step]}"


def _case_name(row: Row) -> str:
    ids = "shuf" if row["block_ids"] == "shuffled" else "consec"
    return f"{row['layout']} {row['p_tp']}→{row['d_tp']} {ids}"


def _by_tokens(rows: list[Row]) -> dict[int, list[Row]]:
    """Rows per token count (fewest tokens first), each in the bench's order."""
    out: dict[int, list[Row]] = {}
    for row in rows:
        out.setdefault(int(row["tokens"]), []).append(row)
    return dict(sorted(out.items()))


def _points(ax: Any, key: str, label: str, rows: list[Row], style: dict[str, Any]) -> Series:
    xs = [float(r["bytes_per_descriptor"]) for r in rows]
    ys = [float(r[key]) for r in rows]
    ax.plot(xs, ys, label=label, linestyle="none", markersize=7, alpha=0.85, **style)
    return Series(key, label, xs, ys, [_case_name(r) for r in rows])


def _case_labels(rows: list[Row]) -> dict[float, str]:
    """One label per run size drawn: the cases there, block-id orders merged."""
    at: dict[float, dict[str, list[str]]] = {}
    for row in rows:
        ids = "shuf" if row["block_ids"] == "shuffled" else "consec"
        case = f"{row['layout']} {row['p_tp']}→{row['d_tp']}"
        names = at.setdefault(float(row["bytes_per_descriptor"]), {}).setdefault(case, [])
        names.extend([ids] if ids not in names else [])
    return {x: ", ".join(f"{c} {'/'.join(i)}" for c, i in cs.items()) for x, cs in at.items()}


def _name_cases(top: Any, bottom: Any, rows: list[Row]) -> None:
    """A faint vertical line through both panels at each case's run size, named on top."""
    labels = _case_labels(rows)
    for x in labels:
        for ax in (top, bottom):
            ax.axvline(x, color="0.85", linewidth=0.8, zorder=0)
    style = {"fontsize": 7, "rotation": 30, "rotation_mode": "anchor", "va": "bottom"}
    for x, label in labels.items():
        top.text(x, 1.01, label, transform=top.get_xaxis_transform(), **style)


def _size_axis(ax: Any, rows: list[Row]) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=4))
    ax.xaxis.set_major_formatter(FuncFormatter(_size))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("run size: bytes per descriptor (log)")
    sizes = [float(r["bytes_per_descriptor"]) for r in rows]
    ax.set_xlim(min(sizes) / 2, max(sizes) * 2)


def _legend(ax: Any, tokens: list[int]) -> None:
    """Colour: what was measured; marker: the request's token count."""
    from matplotlib.lines import Line2D

    def key(color: str, marker: str, label: str, fill: str) -> Any:
        return Line2D(
            [], [], color=color, marker=marker, markerfacecolor=fill, linestyle="none", label=label
        )

    handles = [key(color, "o", what, color) for _, what, color in TRANSFER_MEASURES]
    handles += [key("black", m, f"{t} tokens", "none") for t, m in zip(tokens, cycle(MARKERS))]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_transfer(rows: list[Row], path: str | Path) -> list[Series]:
    """``bench transfer``: GB/s (top) and descriptors (bottom) against the run size."""
    fig, (top, bottom) = _figure(2, 8.0, [3, 2])
    drawn: list[Series] = []
    groups = _by_tokens(rows)
    for (tokens, group), marker in zip(groups.items(), cycle(MARKERS)):
        for rank, (key, what, color) in enumerate(TRANSFER_MEASURES):
            style = {"color": color, "marker": marker, "zorder": 3 - rank}
            drawn.append(_points(top, key, f"{what}, {tokens} tokens", group, style))
        style = {"color": "tab:blue", "marker": marker, "zorder": 3}
        drawn.append(_points(bottom, "descriptors", f"kvbridge, {tokens} tokens", group, style))
    _name_cases(top, bottom, rows)
    top.set_ylabel("throughput (GB/s)")
    top.set_ylim(bottom=0)
    fig.suptitle("kvbridge bench transfer: NIXL READ, Llama-3.1-8B shapes, medians of 5")
    top.grid(True, axis="y", alpha=0.3)
    _legend(top, list(groups))
    bottom.set_yscale("log")
    bottom.set_ylim(0.5, max(float(r["descriptors"]) for r in rows) * 4)
    bottom.set_ylabel("descriptors per request")
    bottom.grid(True, axis="y", alpha=0.3)
    _size_axis(bottom, rows)
    fig.savefig(Path(path), dpi=110)
    return drawn


def _plan_name(row: Row) -> str:
    model = str(row["model"]).removeprefix("llama-3.1-")
    ids = "shuf" if row["block_ids"] == "shuffled" else "consec"
    return (
        f"{model} {row['tokens']} tok {row['p_tp']}→{row['d_tp']} {row['layout']} {ids}\n"
        f"{row['descriptors']} desc × {_size(float(row['bytes_per_descriptor']))}"
    )


def _us(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _label_values(ax: Any, xs: list[float], ys: list[float], color: str, ha: str) -> None:
    """Write each point's µs beside it: right of it (``ha="left"``) or left of it."""
    dx = 7 if ha == "left" else -7
    text = {"textcoords": "offset points", "fontsize": 7, "ha": ha, "color": color}
    for x, y in zip(xs, ys, strict=True):
        ax.annotate(_us(x), (x, y), xytext=(dx, 5), **text)


def plot_plan(rows: list[Row], path: str | Path) -> list[Series]:
    """``bench plan``: per case, kvbridge's planning time and its floor on a log axis,
    joined by a line (the time above the floor), each point labelled in µs."""
    fig, (ax,) = _figure(1, 1.4 + 0.5 * len(rows))
    names = [_plan_name(r) for r in rows]
    pos = [float(i) for i in range(len(rows))]
    plan = [float(r["plan_us"]) for r in rows]
    floor = [float(r["floor_us"]) for r in rows]
    ax.hlines(pos, floor, plan, color="0.75", linewidth=2, zorder=1)
    drawn = []
    for key, label, color, us, ha in (
        ("plan_us", "kvbridge plan", "tab:blue", plan, "left"),
        ("floor_us", "floor: bare numpy address arithmetic", "tab:gray", floor, "right"),
    ):
        ax.plot(us, pos, "o", color=color, label=label, markersize=7, zorder=2)
        _label_values(ax, us, pos, color, ha)
        drawn.append(Series(key, label, pos, us, names))
    ax.set_yticks(pos, names, fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.8)
    ax.set_xscale("log")
    ax.set_xlim(min(floor + plan) / 2, max(floor + plan) * 2)
    ax.set_xlabel("µs per request, one D rank (lowest of 5 batch medians, log)")
    ax.set_title("kvbridge bench plan: planning time per request")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.savefig(Path(path), dpi=110)
    return drawn
