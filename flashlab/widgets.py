"""The sequence-length explorer: drag n from 512 to 128K tokens and watch the lesson's arithmetic move.

``explorer()`` returns an ``Explorer``, an ipywidgets box with a log-scale slider for the sequence length n
(``.seq_len``, powers of two), pickers for the GPU (``.gpu``) and the model (``.model``) from
``flashlab.calculators.roofline.GPUS`` / ``MODELS``, and the bytes per element (``.dtype``). For the current choice it
shows,
all computed by ``flashlab.calculators.roofline.prefill_cost``:

- score-matrix memory: one head's n x n matrix, one layer's (all query heads), the whole model's (if all were held);
- HBM traffic of one prompt through the whole model: naive (four passes over every score matrix) against flash
  (Q, K, V read and O written once);
- the FLOPs, and the two time bounds (memory time, compute time) for naive and for flash, with the bound that wins;
- two pictures, drawn as SVG so they redraw in place without flicker: the roofline with the naive and flash points
  on it, and the three times against n with the current n marked.

Every readout is an ``ipywidgets.HTML`` with a CSS class (``flashlab-score-memory``, ``flashlab-traffic``,
``flashlab-flops``, ``flashlab-naive-bounds``, ``flashlab-flash-bounds``, ``flashlab-plot``) so a browser test can
find it; ``explorer.readouts`` maps the same names (without ``flashlab-``) to the widgets, and ``explorer.cost`` is
the current ``PrefillCost``.
"""

from __future__ import annotations

import html
import math

import ipywidgets as widgets

from flashlab.calculators import roofline
from flashlab.calculators.roofline import format_bytes, format_flops, format_seconds

SEQ_LENS = [2**k for k in range(9, 18)]  # 512 ... 131,072 (128K): the slider's stops, one per doubling
DTYPES = [("fp16 / bf16 (2 B)", 2), ("fp32 (4 B)", 4), ("fp8 (1 B)", 1)]

NAIVE, FLASH, COMPUTE, ROOF = "#d62728", "#1f77b4", "#555555", "#222222"  # colours shared by readouts and plots
PLOT_W, PLOT_H = 430, 280  # each of the two SVG panels, in pixels: fixed, so nothing jumps when values change
CAPTION_H = 36  # the line of text under the panels


def _tokens_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else str(n)


class Explorer(widgets.VBox):
    """The explorer widget (see the module docstring). Build it with ``flashlab.widgets.explorer()``."""

    def __init__(self, seq_len: int = 8192, gpu: str = "lesson-gpu", model: str = "lesson-70b", dtype_bytes=2):
        if seq_len not in SEQ_LENS:
            raise ValueError(f"seq_len must be one of the slider's stops {SEQ_LENS}; got {seq_len!r}")
        if gpu not in roofline.GPUS:
            raise ValueError(f"unknown GPU {gpu!r}; the catalogue has {sorted(roofline.GPUS)}")
        if model not in roofline.MODELS:
            raise ValueError(f"unknown model {model!r}; the catalogue has {sorted(roofline.MODELS)}")
        if dtype_bytes not in [v for _, v in DTYPES]:
            raise ValueError(f"dtype_bytes must be one of {[v for _, v in DTYPES]}; got {dtype_bytes!r}")
        style = {"description_width": "110px"}
        self.seq_len = widgets.SelectionSlider(
            options=[(_tokens_label(n), n) for n in SEQ_LENS],
            value=seq_len,
            description="tokens n",
            continuous_update=True,
            style=style,
            layout=widgets.Layout(width="560px"),
        )
        self.seq_len.add_class("flashlab-seq-len")
        self.gpu = widgets.Dropdown(
            options=[(g.display_name or name, name) for name, g in roofline.GPUS.items()],
            value=gpu,
            description="GPU",
            style=style,
            layout=widgets.Layout(width="560px"),
        )
        self.model = widgets.Dropdown(
            options=[(m.display_name or name, name) for name, m in roofline.MODELS.items()],
            value=model,
            description="model",
            style=style,
            layout=widgets.Layout(width="560px"),
        )
        self.dtype = widgets.Dropdown(
            options=DTYPES,
            value=dtype_bytes,
            description="bytes/element",
            style=style,
            layout=widgets.Layout(width="300px"),
        )
        names = ["score-memory", "traffic", "flops", "naive-bounds", "flash-bounds"]
        labels = ["score matrix", "HBM traffic", "FLOPs", "naive: time", "flash: time"]
        self.readouts = {}
        rows = []
        for name, label in zip(names, labels, strict=True):
            value = widgets.HTML(layout=widgets.Layout(width="780px", height="24px"))
            value.add_class(f"flashlab-{name}")
            self.readouts[name] = value
            rows.append(widgets.HTML(f"<b>{label}</b>", layout=widgets.Layout(width="110px", height="24px")))
            rows.append(value)
        grid = widgets.GridBox(rows, layout=widgets.Layout(grid_template_columns="110px 790px", grid_gap="2px 8px"))
        self.plot = widgets.HTML(
            layout=widgets.Layout(width=f"{2 * PLOT_W + 20}px", height=f"{PLOT_H + CAPTION_H + 10}px")
        )
        self.plot.add_class("flashlab-plot")
        self.readouts["plot"] = self.plot
        self.cost = None
        super().__init__(
            [self.seq_len, self.gpu, self.model, self.dtype, grid, self.plot],
            layout=widgets.Layout(width="920px", padding="6px", border="1px solid #ddd"),
        )
        self.add_class("flashlab-explorer")
        for control in (self.seq_len, self.gpu, self.model, self.dtype):
            control.observe(self._update, names="value")
        self._update()

    def _update(self, change=None):
        n, gpu, model, b = self.seq_len.value, self.gpu.value, self.model.value, self.dtype.value
        cost = roofline.prefill_cost(n, model=model, gpu=gpu, dtype_bytes=b)
        self.cost = cost
        r = self.readouts
        r["score-memory"].value = (
            f"{format_bytes(cost.score_matrix_bytes)} per head &middot; "
            f"{format_bytes(cost.score_matrices_per_layer)} per layer &middot; "
            f"{format_bytes(cost.score_matrices_per_model)} whole model, if all were held at once"
        )
        r["traffic"].value = (
            f"<span style='color:{NAIVE}'>naive {format_bytes(cost.naive_traffic)}</span> vs "
            f"<span style='color:{FLASH}'>flash {format_bytes(cost.flash_traffic)}</span> "
            f"({cost.traffic_ratio:.0f}&times; less) for one prompt, all heads and layers"
        )
        r["flops"].value = f"{format_flops(cost.flops)} for one prompt (4&middot;n&sup2;&middot;d per head)"
        for name, bounds in (("naive-bounds", cost.naive), ("flash-bounds", cost.flash)):
            r[name].value = (
                f"memory {format_seconds(bounds.memory_s)}, compute {format_seconds(bounds.compute_s)} "
                f"&rarr; <b>{bounds.bound}-bound</b> (tensor cores busy {bounds.tensor_core_busy:.0%} of the time)"
            )
        self.plot.value = self._svg(cost)

    # --- the pictures ---------------------------------------------------------------------------------------------

    def _svg(self, cost) -> str:
        naive_i, flash_i = cost.naive.arithmetic_intensity, cost.flash.arithmetic_intensity
        caption = (
            f"The naive point stays at {naive_i:,.0f} FLOP/B whatever n: its FLOPs and its score traffic both grow as "
            f"n&sup2;. The flash point moves right as n grows ({flash_i:,.0f} FLOP/B now): the same FLOPs, but "
            f"traffic that grows only as n."
        )
        return (
            f"<div style='display:flex;gap:20px;width:{2 * PLOT_W + 20}px;height:{PLOT_H}px'>"
            f"{_roofline_svg(cost)}{_times_svg(cost, self.model.value, self.gpu.value, self.dtype.value)}</div>"
            f"<div style='width:{2 * PLOT_W + 20}px;height:{CAPTION_H}px;font-size:12px;line-height:16px;"
            f"color:#444'>{caption}</div>"
        )


def _log_pos(value, lo, hi, start, end):
    """Pixel position of ``value`` on a log axis running from ``lo`` (at ``start``) to ``hi`` (at ``end``)."""
    value = min(max(value, lo), hi)
    return start + (math.log10(value) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * (end - start)


class _Axes:
    """A log-log frame inside one SVG panel."""

    left, right, top, bottom = 62, PLOT_W - 12, 26, PLOT_H - 40

    def __init__(self, xlim, ylim):
        self.xlim, self.ylim = xlim, ylim

    def x(self, v):
        return _log_pos(v, *self.xlim, self.left, self.right)

    def y(self, v):
        return _log_pos(v, *self.ylim, self.bottom, self.top)

    def frame(self, title, xlabel, ylabel, xticks, yticks) -> list[str]:
        a = [
            f"<text x='{PLOT_W / 2}' y='15' text-anchor='middle' font-size='13' font-weight='bold'>"
            f"{html.escape(title)}</text>",
            f"<rect x='{self.left}' y='{self.top}' width='{self.right - self.left}' "
            f"height='{self.bottom - self.top}' fill='none' stroke='#999'/>",
            f"<text x='{(self.left + self.right) / 2}' y='{PLOT_H - 6}' text-anchor='middle' font-size='11'>"
            f"{html.escape(xlabel)}</text>",
            f"<text x='12' y='{(self.top + self.bottom) / 2}' text-anchor='middle' font-size='11' "
            f"transform='rotate(-90 12 {(self.top + self.bottom) / 2})'>{html.escape(ylabel)}</text>",
        ]
        for v, label in xticks:
            x = self.x(v)
            a.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{self.top}' y2='{self.bottom}' stroke='#eee'/>")
            a.append(f"<text x='{x:.1f}' y='{self.bottom + 14}' text-anchor='middle' font-size='10'>{label}</text>")
        for v, label in yticks:
            y = self.y(v)
            a.append(f"<line x1='{self.left}' x2='{self.right}' y1='{y:.1f}' y2='{y:.1f}' stroke='#eee'/>")
            a.append(f"<text x='{self.left - 4}' y='{y + 3:.1f}' text-anchor='end' font-size='10'>{label}</text>")
        return a

    def polyline(self, points, colour, width=2, dash="") -> str:
        pts = " ".join(f"{self.x(x):.1f},{self.y(y):.1f}" for x, y in points)
        dash = f" stroke-dasharray='{dash}'" if dash else ""
        return f"<polyline points='{pts}' fill='none' stroke='{colour}' stroke-width='{width}'{dash}/>"

    def dot(self, x, y, colour, label, dy=-8) -> str:
        cx, cy = self.x(x), self.y(y)
        anchor = "end" if cx > self.right - 110 else "start"
        dx = -10 if anchor == "end" else 10
        return (
            f"<circle cx='{cx:.1f}' cy='{cy:.1f}' r='6' fill='{colour}'/>"
            f"<text x='{cx + dx:.1f}' y='{cy + dy:.1f}' font-size='11' fill='{colour}' text-anchor='{anchor}' "
            f"stroke='white' stroke-width='3' paint-order='stroke'>"
            f"{html.escape(label)}</text>"
        )


def _powers(lo_exp, hi_exp, fmt):
    return [(10.0**e, fmt(e)) for e in range(lo_exp, hi_exp + 1)]


def _roofline_svg(cost) -> str:
    """Attainable FLOP/s against arithmetic intensity (FLOP per byte of HBM traffic), both points on it."""
    gpu = roofline.as_gpu(cost.gpu)
    peak, bw = gpu.tensor_flops, gpu.hbm_bandwidth
    ax = _Axes(xlim=(1.0, 1e6), ylim=(peak / 1e4, peak * 3))

    def attained(intensity):
        return min(peak, bw * intensity)

    lo_e, hi_e = math.ceil(math.log10(ax.ylim[0] / 1e12)), math.floor(math.log10(ax.ylim[1] / 1e12))
    parts = ax.frame(
        f"roofline: {gpu.name}",
        "arithmetic intensity (FLOP per byte of HBM traffic)",
        "attainable TFLOP/s",
        _powers(0, 6, lambda e: f"10{_sup(e)}"),
        [(10.0**e * 1e12, f"{10.0**e:g}") for e in range(lo_e, hi_e + 1)],
    )
    ridge = gpu.ridge_point
    parts.append(ax.polyline([(1.0, attained(1.0)), (ridge, peak), (1e6, peak)], ROOF, width=2.5))
    parts.append(ax.polyline([(ridge, ax.ylim[0]), (ridge, peak)], "#999", width=1, dash="4 3"))
    parts.append(
        f"<text x='{ax.x(ridge) + 4:.1f}' y='{ax.bottom - 6}' font-size='10' fill='#666'>ridge {ridge:.0f}</text>"
    )
    for bounds, colour, name, dy in ((cost.naive, NAIVE, "naive", 18), (cost.flash, FLASH, "flash", 18)):
        i = bounds.arithmetic_intensity
        parts.append(ax.dot(i, attained(i), colour, f"{name}: {i:,.0f} FLOP/B", dy=dy))
    return f"<svg width='{PLOT_W}' height='{PLOT_H}' xmlns='http://www.w3.org/2000/svg'>{''.join(parts)}</svg>"


def _times_svg(cost, model, gpu, dtype_bytes) -> str:
    """Memory time (naive, flash) and compute time for one prompt against n, with the current n marked."""
    curves = {"naive memory": [], "flash memory": [], "compute": []}
    for n in SEQ_LENS:
        c = roofline.prefill_cost(n, model=model, gpu=gpu, dtype_bytes=dtype_bytes)
        curves["naive memory"].append((n, c.naive.memory_s))
        curves["flash memory"].append((n, c.flash.memory_s))
        curves["compute"].append((n, c.naive.compute_s))
    values = [t for pts in curves.values() for _, t in pts]
    lo_e, hi_e = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    ax = _Axes(xlim=(SEQ_LENS[0] / 1.3, SEQ_LENS[-1] * 1.3), ylim=(10.0**lo_e, 10.0**hi_e))
    parts = ax.frame(
        "time for one prompt (whole model)",
        "sequence length n (tokens)",
        "seconds",
        [(n, _tokens_label(n)) for n in SEQ_LENS[::2]],
        _powers(lo_e, hi_e, lambda e: format_seconds(10.0**e, digits=1)),
    )
    for (name, pts), colour in zip(curves.items(), (NAIVE, FLASH, COMPUTE), strict=True):
        parts.append(ax.polyline(pts, colour, dash="5 3" if name == "compute" else ""))
    x = ax.x(cost.n)
    parts.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{ax.top}' y2='{ax.bottom}' stroke='#aaa' stroke-width='1'/>")
    for t, colour, label in (
        (cost.naive.memory_s, NAIVE, "naive memory"),
        (cost.flash.memory_s, FLASH, "flash memory"),
        (cost.naive.compute_s, COMPUTE, "compute"),
    ):
        parts.append(ax.dot(cost.n, t, colour, f"{label} {format_seconds(t)}", dy=4))
    return f"<svg width='{PLOT_W}' height='{PLOT_H}' xmlns='http://www.w3.org/2000/svg'>{''.join(parts)}</svg>"


def _sup(e: int) -> str:
    return str(e).translate(str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹"))


def explorer(seq_len: int = 8192, gpu: str = "lesson-gpu", model: str = "lesson-70b", dtype_bytes=2) -> Explorer:
    """The sequence-length explorer, starting at the lesson's case (8K tokens, its 70B-class model and round GPU)."""
    return Explorer(seq_len=seq_len, gpu=gpu, model=model, dtype_bytes=dtype_bytes)
