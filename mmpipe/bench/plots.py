"""PNG plots of a sweep, one bar or point per variant (repeats folded into a median):

    throughput.png  samples/s per variant, median over repeats with the repeats' interquartile range
                    as whiskers and each repeat as a dot; grouped by PP x DP layout (one colour each),
                    fastest first within a group, peers last in their own colour; the ideal from the
                    PP=1 variant as a marker: pp1 x DP x P x m/(m+P-1) (1F1B's bound for P stages,
                    linear scaling for DP), drawn where the variant shares pp1's preset, precision and
                    checkpointing; a variant that did not run shows its status
    predicted.png   measured against the planner's prediction (mmpipe.bench.predict), log-log with
                    y = x: step time, peak memory per rank (max), and the bubble (linear)
    memory.png      peak memory per rank, per variant (median over repeats)
    bubble.png      measured bubble against 1F1B theory, per pipeline variant
"""
from __future__ import annotations

import statistics
from pathlib import Path

PEER_COLOUR = "tab:gray"
LAYOUT_COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                  "tab:cyan"]


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    i = (len(xs) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def _reference(rows: list[dict], target_spec: dict | None) -> dict | None:
    """The PP=1 variant the ideals scale from: targets.pp1, else the first ok 1 x 1 pipeline variant."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("kind") == "variant"]
    want = (target_spec or {}).get("pp1")
    cands = [r for r in ok if r["name"] == want] or [r for r in ok if r.get("stages") == 1 and r.get("dp") == 1
                                                      and r.get("engine", "pipe") == "pipe"]
    if not cands:
        return None
    name = cands[0]["name"]
    mine = [r for r in ok if r["name"] == name]
    return {**mine[0], "sps": statistics.median(r["samples_per_s"] for r in mine)}


def throughput_bars(rows: list[dict], target_spec: dict | None = None) -> list[dict]:
    """One entry per variant and peer, in plotting order: name, kind, group (PP x DP or 'peer'),
    median, q1, q3 (whiskers), repeats (each repeat's samples/s), ideal (or None), status."""
    ref = _reference(rows, target_spec)
    bars = []
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        ok = [r["samples_per_s"] for r in mine if r["status"] == "ok"]
        r0 = mine[0]
        peer = r0.get("kind") == "peer"
        bar = {"name": name, "kind": "peer" if peer else "variant", "repeats": ok, "ideal": None,
               "group": "peer" if peer else f"PP{r0.get('stages')} x DP{r0.get('dp')}",
               "status": "ok" if ok else mine[0]["status"], "median": 0.0, "q1": 0.0, "q3": 0.0}
        if ok:
            bar["median"] = statistics.median(ok)
            if len(ok) > 1:  # the spread between repeats
                bar["q1"], bar["q3"] = _quantile(ok, 0.25), _quantile(ok, 0.75)
            else:  # one repeat: its own per-step IQR around the median
                iqr = next(r.get("samples_per_s_iqr") or 0.0 for r in mine if r["status"] == "ok")
                bar["q1"], bar["q3"] = bar["median"] - iqr / 2, bar["median"] + iqr / 2
        same = ref and not peer and all(r0.get(k) == ref.get(k) for k in ("preset", "precision", "checkpointing"))
        if same and name != ref["name"]:
            p, d, m = int(r0["stages"]), int(r0["dp"]), int(r0["gas"])
            bar["ideal"] = ref["sps"] * d * p * m / (m + p - 1)  # e.g. PP=2, m=4: pp1 x 2 x 4/5 = 1.6 x pp1
        bars.append(bar)
    groups = list(dict.fromkeys(b["group"] for b in bars if b["kind"] == "variant"))
    return sorted(bars, key=lambda b: (b["kind"] == "peer", groups.index(b["group"]) if b["group"] in groups else 0,
                                       -b["median"]))


def prediction_points(rows: list[dict]) -> list[dict]:
    """Per variant with a prediction and an ok repeat: medians of measured step, peak memory and bubble
    beside the predicted ones."""
    out = []
    for name in dict.fromkeys(r["name"] for r in rows if r.get("predicted_step_time_s") is not None):
        ok = [r for r in rows if r["name"] == name and r["status"] == "ok"]
        if not ok:
            continue

        def med(key):
            xs = [r[key] for r in ok if r.get(key) is not None]
            return statistics.median(xs) if xs else None
        out.append({"name": name, "stages": ok[0]["stages"], "step": med("step_time_s"),
                    "step_pred": ok[0]["predicted_step_time_s"], "mem": med("peak_mem_mb_max"),
                    "mem_pred": ok[0]["predicted_peak_mem_mb_max"], "bubble": med("bubble_measured"),
                    "bubble_pred": ok[0]["predicted_bubble"]})
    return out


def plot_all(rows: list[dict], out: Path, target_spec: dict | None = None) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    paths = []
    for name, draw in (("throughput.png", lambda: plot_throughput(plt, throughput_bars(rows, target_spec))),
                       ("predicted.png", lambda: plot_predicted(plt, prediction_points(rows))),
                       ("memory.png", lambda: plot_memory(plt, rows)), ("bubble.png", lambda: plot_bubble(plt, rows))):
        fig = draw()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def plot_throughput(plt, bars: list[dict]):
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(bars) + 1.6))
    groups = list(dict.fromkeys(b["group"] for b in bars if b["kind"] == "variant"))
    colour = {g: LAYOUT_COLOURS[i % len(LAYOUT_COLOURS)] for i, g in enumerate(groups)} | {"peer": PEER_COLOUR}
    y = list(range(len(bars)))[::-1]  # first bar on top
    seen = set()
    for yi, b in zip(y, bars):
        label = None if b["group"] in seen else (b["group"] if b["kind"] == "variant" else "peers")
        seen.add(b["group"])
        if b["status"] != "ok":
            ax.text(0, yi, f" {b['status']}", va="center", fontsize=8, color="tab:red")
            continue
        ax.barh(yi, b["median"], color=colour[b["group"]], hatch="//" if b["kind"] == "peer" else None,
                edgecolor="white" if b["kind"] == "peer" else None, label=label,
                xerr=[[b["median"] - b["q1"]], [b["q3"] - b["median"]]], error_kw={"ecolor": "black", "capsize": 3})
        ax.plot(b["repeats"], [yi] * len(b["repeats"]), "o", color="black", markersize=3,
                label="repeats" if "rep" not in seen else None)
        seen.add("rep")
        ax.text(b["median"], yi + 0.28, f" {b['median']:.0f}", va="center", fontsize=7)
        if b["ideal"]:
            ax.plot([b["ideal"]], [yi], marker="|", markersize=18, markeredgewidth=2.5, color="crimson",
                    label="ideal from pp1: x DP x P m/(m+P-1)" if "ideal" not in seen else None)
            seen.add("ideal")
    ax.set_yticks(y, [b["name"] for b in bars], fontsize=8)
    ax.set_xlabel("samples/s (median over repeats; whiskers: IQR of repeats; dots: each repeat)")
    ax.set_title("Throughput by variant (grouped by PP x DP, fastest first)")
    ax.grid(axis="x", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing measured yet (a --collect of pending runs): no legend
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_predicted(plt, pts: list[dict]):
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    # (key, title, unit scale, log axes, label points with names)
    panels = (("step", "step time (ms)", 1e3, True, True), ("mem", "peak memory per rank, max (MiB)", 1.0, True, False),
              ("bubble", "bubble, P > 1 (idle share)", 1.0, False, True))
    for ax, (key, title, scale, log, names) in zip(axes, panels):
        sel = [p for p in pts if p[key] is not None and p[key + "_pred"] is not None
               and (not log or (p[key] > 0 and p[key + "_pred"] > 0)) and (key != "bubble" or p["stages"] > 1)]
        ax.set_title(title)
        if not sel:
            ax.text(0.5, 0.5, "nothing to compare", transform=ax.transAxes, ha="center")
            continue
        xs, ys = [p[key + "_pred"] * scale for p in sel], [p[key] * scale for p in sel]
        lo, hi = min(xs + ys), max(xs + ys)
        lo, hi = (lo / 1.5, hi * 1.5) if log else (0.0, max(hi * 1.15, 0.05))
        ax.plot([lo, hi], [lo, hi], "--", color="black", linewidth=1, label="measured = predicted")
        if key == "step":
            ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="tab:green", alpha=0.12,
                            label="within 15%")
        ax.scatter(xs, ys, color="tab:blue", zorder=3)
        ratios = [yv / x for x, yv in zip(xs, ys) if x]
        if names:  # points numbered, worst ratio first; the key in the empty lower right (y >= x mostly)
            order = sorted(zip(sel, xs, ys), key=lambda t: -(t[2] / t[1] if t[1] else 0))
            for k, (p, x, yv) in enumerate(order, 1):
                ax.annotate(str(k), (x, yv), fontsize=8, xytext=(4, 2), textcoords="offset points")
            key = "\n".join(f"{k:>2}  {p['name']:<{max(len(q['name']) for q in sel)}}  {yv / x:5.2f}x"
                            for k, (p, x, yv) in enumerate(order, 1))
            ax.text(0.97, 0.03, key, transform=ax.transAxes, ha="right", va="bottom", multialignment="left",
                    fontsize=7, family="monospace", bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "0.8"})
        elif ratios:
            ax.text(0.97, 0.03, f"{len(sel)} variants, measured/predicted {min(ratios):.1f}-{max(ratios):.1f}x",
                    transform=ax.transAxes, ha="right", fontsize=8)
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_locator(LogLocator(subs=(1, 2, 5)))
                axis.set_major_formatter(FormatStrFormatter("%g"))
                axis.set_minor_formatter(NullFormatter())
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("predicted")
        ax.set_ylabel("measured")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("Measured against mmpipe plan's prediction for each variant's layout (uncalibrated); "
                 "label: measured / predicted")
    fig.tight_layout()
    return fig


def _per_variant(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    ok = [r for r in rows if r["status"] == "ok"]
    return [(n, [r for r in ok if r["name"] == n]) for n in dict.fromkeys(r["name"] for r in ok)]


def plot_memory(plt, rows: list[dict]):
    variants = _per_variant(rows)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(variants) + 2), 4))
    ranks = max((len(r.get("peak_mem_mb_per_rank") or []) for _, rs in variants for r in rs), default=1)
    width = 0.8 / max(1, ranks)
    for i, (_, rs) in enumerate(variants):
        for k in range(ranks):
            mbs = [r["peak_mem_mb_per_rank"][k] for r in rs
                   if len(r.get("peak_mem_mb_per_rank") or []) > k and r["peak_mem_mb_per_rank"][k]]
            if mbs:
                ax.bar(i - 0.4 + width * (k + 0.5), statistics.median(mbs), width, color=f"C{k}", label=f"rank {k}")
    ax.set_xticks(range(len(variants)), [n for n, _ in variants], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("peak MiB (RSS on CPU, max allocated on GPU)")
    ax.set_title("Peak memory per rank (median over repeats)")
    handles, names = ax.get_legend_handles_labels()
    uniq = dict(zip(names, handles))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    fig.tight_layout()
    return fig


def plot_bubble(plt, rows: list[dict]):
    pipe = [(n, rs) for n, rs in _per_variant(rows) if any(r.get("bubble_measured") is not None
                                                           and (r.get("stages") or 1) > 1 for r in rs)]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(pipe) + 2), 4))
    x = range(len(pipe))
    measured = [statistics.median(r["bubble_measured"] for r in rs) for _, rs in pipe]
    theory = [rs[0]["bubble_theory"] for _, rs in pipe]
    ax.bar([i - 0.2 for i in x], measured, 0.4, label="measured (median over repeats)")
    ax.bar([i + 0.2 for i in x], theory, 0.4, label="1F1B theory (p-1)/(m+p-1)")
    ax.set_ylim(0, max(measured + theory + [0.05]) * 1.35)  # room for the legend above the bars
    ax.set_xticks(list(x), [n for n, _ in pipe], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("idle fraction of the step")
    ax.set_title("Pipeline bubble: measured vs theory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
