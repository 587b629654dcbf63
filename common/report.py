"""Markdown + PNG report of a comparison (``moe-bwd compare --report DIR``).

Files written to DIR:

* ``report.md`` -- the problem, the ``--min-sqnr`` floor and whether every gradient passed it
  (when a floor was given), the operands with their metadata, one table per gradient
  (SQNR, max |err| / max |ref|, cosine, bit-identical fraction -- for dA over the routed cells
  only --, per-expert min / median / max SQNR) and the BF16 ULP-distance histograms, every
  number the one in ``comparison``;
* ``per_expert_sqnr.png`` -- per-expert SQNR of each operand against the baseline, one panel
  per expert-indexed gradient, experts sorted by their token count (shown on a second axis);
  each operand has its own marker, line style and marker size (:func:`series_style`), so
  identical series stay visible;
* ``ulp_hist.png`` -- the BF16 ULP-distance histograms, one panel per gradient;
* ``scatter.png`` -- |baseline| against |error| for a sample of elements, one panel per gradient;
  each operand has its own hollow marker, smaller for later ones (:func:`scatter_style`), and an
  operand whose sampled errors equal an earlier one's is labelled "identical to" it.

Every panel's legend sits under its x label, outside the data.

matplotlib runs with the Agg backend (no display). Each PNG is :data:`FIGSIZE` inches at
:data:`DPI`, i.e. :func:`png_size` pixels.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from common.compare import EXPERT_AXIS, GRAD_LABELS, ULP_BINS

__all__ = ["DPI", "FIGSIZE", "PLOTS", "png_size", "scatter_style", "series_style", "write_report"]

FIGSIZE = (12.0, 7.0)  # inches
DPI = 100
PLOTS = ("per_expert_sqnr.png", "ulp_hist.png", "scatter.png")
SCATTER_POINTS = 4000  # per gradient and operand: enough to see the error's shape


def png_size() -> tuple[int, int]:
    """(width, height) in pixels of every PNG the report writes."""
    return round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI)


def _fmt(v: Any, spec: str = ".2f") -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return format(v, spec)
    return str(v)


def _grid(n: int):
    cols = 2 if n == 4 else min(3, max(1, n))  # four gradients: 2 x 2
    rows = max(1, math.ceil(n / cols))
    return rows, cols


def _figure(n: int):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows, cols = _grid(n)
    fig, axes = plt.subplots(rows, cols, figsize=FIGSIZE, dpi=DPI, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return plt, fig, flat[:n]


def _save(plt, fig, path: Path) -> None:
    bottom = 0.035 * getattr(fig, "_legend_rows", 0) + 0.01  # the figure legend's rows
    fig.tight_layout(rect=(0.0, bottom, 1.0, 1.0))
    fig.savefig(path, dpi=DPI)  # no bbox_inches: the pixel size stays FIGSIZE * DPI
    plt.close(fig)


def _finite_or(v: float, fallback: float) -> float:
    return v if math.isfinite(v) else fallback


def _legends_below(fig, axes, n: int) -> None:
    """One legend for the whole figure, under the panels (every panel draws the same operands
    in the same styles; per-panel legends overlapped the panels below them), two operands per
    row; :func:`_save` leaves room for it."""
    entries: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if not entries:
        return
    ncol = min(2, max(1, n))
    fig.legend(list(entries.values()), list(entries), loc="lower center", ncol=ncol, fontsize=8,
               frameon=False, markerscale=1.5)
    fig._legend_rows = math.ceil(len(entries) / ncol)


# Per operand: marker, line style, marker size. Later operands get smaller, hollow markers and
# another dash pattern, so a series identical to an earlier one (nki-twin on nki-sim) stays
# visible inside and between the earlier one's markers.
_SERIES_STYLES = (("o", "-", 7.0), ("s", "--", 5.5), ("^", ":", 4.5), ("D", "-.", 3.5),
                  ("v", (0, (5, 1, 1, 1)), 3.0), ("x", (0, (1, 1)), 3.0))


def series_style(i: int) -> dict[str, Any]:
    """matplotlib ``plot`` keywords of the ``i``-th operand's per-expert series."""
    marker, ls, ms = _SERIES_STYLES[i % len(_SERIES_STYLES)]
    return {"marker": marker, "linestyle": ls, "markersize": ms, "markerfacecolor": "none",
            "linewidth": 1.0, "zorder": 3 + i}


def _per_expert_figure(comparison: dict, tokens_per_expert: list[int]):
    """(plt, fig) of the per-expert SQNR plot (unsaved)."""
    names = [n for n in EXPERT_AXIS if any(n in p for p in comparison["pairs"].values())]
    plt, fig, axes = _figure(max(1, len(names)))
    order = sorted(range(len(tokens_per_expert)), key=lambda e: (tokens_per_expert[e], e))
    for ax, name in zip(axes, names):
        for i, (label, pair) in enumerate(comparison["pairs"].items()):
            if name not in pair:
                continue
            vals = [pair[name]["per_expert_sqnr_db"][e] for e in order]
            finite = [_finite_or(v, math.nan) for v in vals]
            if all(math.isnan(v) for v in finite) and any(v == math.inf for v in vals):
                label = f"{label} (bit-identical: SQNR = inf)"
            ax.plot(range(len(vals)), finite, label=label, **series_style(i))
        ax.set_title(GRAD_LABELS[name], fontsize=9)
        ax.set_xlabel("expert (sorted by tokens)", fontsize=8)
        ax.set_ylabel("SQNR (dB)", fontsize=8)
        ax.tick_params(labelsize=7)
        if tokens_per_expert:
            ax2 = ax.twinx()
            ax2.bar(range(len(order)), [tokens_per_expert[e] for e in order], color="0.85",
                    zorder=0)
            ax2.set_ylabel("tokens", fontsize=8)
            ax2.tick_params(labelsize=7)
            ax.set_zorder(ax2.get_zorder() + 1)
            ax.patch.set_visible(False)
    _legends_below(fig, axes, len(comparison["pairs"]))
    fig.suptitle(f"per-expert SQNR against {comparison['baseline']}", fontsize=10)
    return plt, fig


def _plot_per_expert(path: Path, comparison: dict, tokens_per_expert: list[int]) -> None:
    plt, fig = _per_expert_figure(comparison, tokens_per_expert)
    _save(plt, fig, path)


def _plot_ulp(path: Path, comparison: dict) -> None:
    names = [n for n in GRAD_LABELS if any(n in p for p in comparison["pairs"].values())]
    plt, fig, axes = _figure(max(1, len(names)))
    labels = [b[0] for b in ULP_BINS]
    pairs = list(comparison["pairs"].items())
    width = 0.8 / max(1, len(pairs))
    for ax, name in zip(axes, names):
        for i, (label, pair) in enumerate(pairs):
            if name not in pair:
                continue
            hist = pair[name]["ulp_hist"]
            total = sum(hist.values()) or 1
            ax.bar([x + i * width for x in range(len(labels))],
                   [hist[b] / total for b in labels], width=width, label=label)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
        ax.set_xticklabels(labels, fontsize=7, rotation=45)
        ax.set_title(GRAD_LABELS[name], fontsize=9)
        ax.set_ylabel("fraction of elements", fontsize=8)
        ax.set_xlabel("BF16 ULP distance", fontsize=8)
        ax.tick_params(labelsize=7)
    _legends_below(fig, axes, len(pairs))
    fig.suptitle(f"BF16 ULP distance to {comparison['baseline']}", fontsize=10)
    _save(plt, fig, path)


def _sample(n: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if n <= k:
        return torch.arange(n)
    return torch.randint(0, n, (k,), generator=g)


def _no_error_note(ax) -> None:
    ax.text(0.5, 0.5, "no nonzero error\n(bit-identical)", ha="center", va="center",
            transform=ax.transAxes, fontsize=9)


def scatter_style(i: int) -> dict[str, Any]:
    """matplotlib ``scatter`` keywords of the ``i``-th operand: its own hollow marker, smaller for
    later operands and drawn above the earlier ones, so a series identical to an earlier one
    (nki-twin on nki-sim) shows as its markers inside the earlier one's."""
    marker, _, ms = _SERIES_STYLES[i % len(_SERIES_STYLES)]
    color = f"C{i % 10}"
    hollow = marker != "x"  # "x" has no face; it takes the colour as is
    return {"marker": marker, "s": (ms * 0.6) ** 2, "linewidths": 0.6, "alpha": 0.6,
            "facecolors": "none" if hollow else color, "edgecolors": color, "zorder": 3 + i}


def _scatter_figure(comparison: dict, grads: dict, baseline):
    """(plt, fig) of the |baseline| vs |error| scatter plot (unsaved)."""
    names = [n for n in GRAD_LABELS if getattr(baseline, n, None) is not None]
    plt, fig, axes = _figure(max(1, len(names)))
    for ax, name in zip(axes, names):
        ref = getattr(baseline, name).detach().reshape(-1).to("cpu", torch.float64)
        idx = _sample(ref.numel(), SCATTER_POINTS)
        r = ref[idx].abs()
        plotted = 0
        shown: dict[str, torch.Tensor] = {}  # label -> its sampled error, to name identical ones
        for i, (label, g) in enumerate(grads.items()):
            t = getattr(g, name, None)
            if t is None:
                continue
            o = t.detach().reshape(-1)[idx].to("cpu", torch.float64)
            err = (o - ref[idx]).abs()
            keep = (r > 0) & (err > 0) & torch.isfinite(err)
            twin = next((k for k, e in shown.items() if torch.equal(e, err)), None)
            shown.setdefault(label, err)
            n = int(keep.sum())
            plotted += n
            if twin is not None:  # its points would only cover the twin's: named, not drawn
                ax.scatter([], [], label=f"{label}: identical to {twin}", **scatter_style(i))
            elif n:
                ax.scatter(r[keep].numpy(), err[keep].numpy(), label=label, **scatter_style(i))
        if plotted:
            ax.set_xscale("log")
            ax.set_yscale("log")
        else:  # bit-identical on the sample: nothing to put on log axes
            _no_error_note(ax)
        ax.set_title(GRAD_LABELS[name], fontsize=9)
        ax.set_xlabel(f"|{comparison['baseline']}|", fontsize=8)
        ax.set_ylabel("|error|", fontsize=8)
        ax.tick_params(labelsize=7)
    _legends_below(fig, axes, len(grads))
    fig.suptitle(f"|baseline| vs |error| ({SCATTER_POINTS} sampled elements)", fontsize=10)
    return plt, fig


def _plot_scatter(path: Path, comparison: dict, grads: dict, baseline) -> None:
    plt, fig = _scatter_figure(comparison, grads, baseline)
    _save(plt, fig, path)


_ROUTED_NOTE = (
    "Bit-identical fraction and ULP histogram over the routed (token, expert) cells only: the "
    "other cells of dA are structural zeros that every backend writes exactly."
)


def _floor_lines(comparison: dict) -> list[str]:
    """The ``--min-sqnr`` verdict: the floor and whether every gradient passed."""
    floor = comparison.get("min_sqnr_db")
    if floor is None:
        return []
    failing = list(comparison.get("below_min_sqnr") or [])
    n = sum(len(p) for p in comparison["pairs"].values())
    if not failing:
        return [f"SQNR floor (--min-sqnr): **{floor:g} dB**. **PASS**: all {n} gradients of "
                f"every operand are at or above it.", ""]
    return [f"SQNR floor (--min-sqnr): **{floor:g} dB**. **FAIL**: {len(failing)} of {n} "
            "gradients are below it:", ""] + [f"- {f}" for f in failing] + [""]


def _markdown(comparison: dict, plots: list[str]) -> str:
    spec = comparison.get("spec", {})
    lines = ["# MoE expert-MLP backward: cross-backend comparison", ""]
    if spec:
        shrunk = (f" (shrunk: H, I divided by {spec.get('shrink')}, rounded to multiples of 128)"
                  if spec.get("shrink", 1) != 1 else "")
        lines += [
            f"Problem: model `{spec.get('model')}`{shrunk}, T={spec.get('tokens')} "
            f"H={spec.get('hidden')} I={spec.get('intermediate')} E={spec.get('experts')} "
            f"top_k={spec.get('top_k')}, seed {spec.get('seed')}, skew {spec.get('skew')}.",
            "",
        ]
    lines += [f"Baseline: **{comparison['baseline']}**.", ""]
    lines += _floor_lines(comparison)
    lines += ["## Operands", "",
              "| operand | backend | device | capability | versions | date (UTC) | wall (s) |",
              "|---|---|---|---|---|---|---|"]
    for label, meta in comparison.get("operands", {}).items():
        vers = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items() if v)
        wall = ", ".join(f"{k} {_fmt(float(v))}" for k, v in (meta.get("wall_s") or {}).items())
        lines.append(
            f"| {label} | {meta.get('backend', '')} | {meta.get('device_name', '')} | "
            f"{meta.get('device_capability') or ''} | {vers} | {meta.get('date_utc', '')} | "
            f"{wall} |"
        )
    lines += ["", "## Metrics against the baseline", ""]
    names = [n for n in GRAD_LABELS if any(n in p for p in comparison["pairs"].values())]
    for name in names:
        routed = any(p.get(name, {}).get("routed_only") for p in comparison["pairs"].values())
        bit = "bit-identical (routed cells)" if routed else "bit-identical"
        lines += [f"### {GRAD_LABELS[name]}", ""]
        if routed:
            lines += [_ROUTED_NOTE, ""]
        lines += ["| operand | SQNR (dB) | max\\|err\\|/max\\|ref\\| | cosine | "
                  f"{bit} | per-expert SQNR min / median / max (dB) |",
                  "|---|---|---|---|---|---|"]
        for label, pair in comparison["pairs"].items():
            if name not in pair:
                continue
            m = pair[name]
            pe = m.get("per_expert")
            per = (" / ".join(_fmt(pe[k]) for k in ("min", "median", "max")) if pe else "")
            lines.append(
                f"| {label} | {_fmt(m['sqnr_db'])} | {_fmt(m['max_rel_err'], '.3e')} | "
                f"{_fmt(m['cosine'], '.8f')} | {_fmt(m['bit_identical'], '.4f')} | {per} |"
            )
        lines.append("")
    lines += ["## BF16 ULP distance (fraction of elements)", ""]
    if any(m.get("routed_only") for p in comparison["pairs"].values() for m in p.values()):
        lines += ["dA [T,E]: fraction of the routed (token, expert) cells only.", ""]
    bins = [b[0] for b in ULP_BINS] + ["nan"]
    lines += ["| gradient | operand | " + " | ".join(bins) + " |",
              "|---|---|" + "---|" * len(bins)]
    for name in names:
        for label, pair in comparison["pairs"].items():
            if name not in pair:
                continue
            h = pair[name]["ulp_hist"]
            total = sum(h.values()) or 1
            lines.append(f"| {GRAD_LABELS[name]} | {label} | "
                         + " | ".join(_fmt(h[b] / total, ".4f") for b in bins) + " |")
    lines += ["", "## Plots", ""]
    for p in plots:
        lines += [f"![{p}]({p})", ""]
    return "\n".join(lines)


def write_report(
    directory: str | Path, comparison: dict[str, Any], grads: dict[str, Any], baseline: Any,
) -> Path:
    """Write ``report.md`` and the PNGs of :data:`PLOTS` into ``directory``; return report.md.

    Args:
        comparison: ``{"baseline": label, "spec": {...}, "operands": {label: metadata},
            "pairs": {label: compare_grads(...)}, "tokens_per_expert": [E ints]}`` (the JSON
            ``moe-bwd compare --json`` prints).
        grads: label -> :class:`~common.problem.MoEGrads` of each compared operand (scatter).
        baseline: the baseline's :class:`~common.problem.MoEGrads`.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _plot_per_expert(out / PLOTS[0], comparison, list(comparison.get("tokens_per_expert", [])))
    _plot_ulp(out / PLOTS[1], comparison)
    _plot_scatter(out / PLOTS[2], comparison, grads, baseline)
    md = out / "report.md"
    md.write_text(_markdown(comparison, list(PLOTS)) + "\n", encoding="utf-8")
    return md
