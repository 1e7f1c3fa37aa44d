"""results.csv, results.json and results.md: one row per run (variant x repeat, and each peer).
The CSV columns are documented in docs/benchmarks.md; tests check the two agree."""
from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from . import predict
from .plots import plot_all

# rates: samples_per_s counts real samples (a packed row holds several), useful_tokens_per_s their own
# decoder positions (no padding), positions_per_s every computed position (rows x positions per row / s)
COLUMNS = ["name", "kind", "repeat", "status", "reason", "preset", "engine", "stages", "dp", "ep", "tp", "sp", "zero",
           "precision", "micro", "gas", "checkpointing", "partition", "data_workers", "pack", "max_images", "text_len",
           "schedule", "freeze", "world",
           "train_batch", "measured_steps", "samples_per_s", "samples_per_s_iqr", "useful_tokens_per_s",
           "useful_tokens_per_s_iqr", "positions_per_s", "positions_per_s_iqr", "padding_share", "step_time_s",
           "peak_mem_mb_max", "peak_mem_mb_per_rank", "bubble_measured", "bubble_theory", "stage_imbalance",
           "parts", "stage_idle", "stage_forward_ms_per_micro", "stage_backward_ms_per_micro", "achieved_flops", "mfu",
           "final_loss", "wall_s", *predict.COLUMNS]


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list):
        return ";".join(_fmt(x) for x in v)
    return str(v)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k)) for k in COLUMNS})


def medians(rows: list[dict]) -> dict[str, dict]:
    """name -> the median over its successful repeats of step time and throughput."""
    out = {}
    for name in dict.fromkeys(r["name"] for r in rows):
        ok = [r for r in rows if r["name"] == name and r["status"] == "ok"]
        if ok:
            out[name] = {"step_time_s": statistics.median(r["step_time_s"] for r in ok),
                         "samples_per_s": statistics.median(r["samples_per_s"] for r in ok), "repeats": len(ok),
                         "step_time_all": [r["step_time_s"] for r in ok]}
    return out


def targets(rows: list[dict], spec: dict | None) -> list[dict]:
    """The project's targets, from the medians. spec names the variants playing each role:
    {"pp1": NAME, "pp2": NAME, "hf_base": NAME (mmpipe on the HF peer's shapes)}."""
    if not spec:
        return []
    med = medians(rows)
    out = []

    def get(n):
        return med.get(n) if n else None
    pp1, pp2 = get(spec.get("pp1")), get(spec.get("pp2"))
    if pp1 and pp2:
        m = next(r["gas"] for r in rows if r["name"] == spec["pp2"])
        ideal = 2 * m / (m + 1)
        speed = pp1["step_time_s"] / pp2["step_time_s"]
        out.append({"target": "PP=2 speedup over PP=1 >= 0.95 x ideal 1F1B 2m/(m+1)",
                    "measured": f"{speed:.3f}x (ideal {ideal:.3f}x, m={m})", "ratio": speed / ideal,
                    "threshold": 0.95, "met": speed / ideal >= 0.95})
    hf, base = get("peer_hf"), get(spec.get("hf_base"))
    if hf and base:
        r = base["step_time_s"] / hf["step_time_s"]
        out.append({"target": "mmpipe PP=1 step <= 0.9 x transformers loop", "measured":
                    f"{base['step_time_s'] * 1e3:.1f} ms vs {hf['step_time_s'] * 1e3:.1f} ms", "ratio": r,
                    "threshold": 0.9, "met": r <= 0.9})
    tp = get("peer_torch_pipe")
    if tp and pp2:
        r = pp2["samples_per_s"] / tp["samples_per_s"]
        out.append({"target": "mmpipe PP=2 throughput >= torch.distributed.pipelining 1F1B", "measured":
                    f"{pp2['samples_per_s']:.1f} vs {tp['samples_per_s']:.1f} samples/s", "ratio": r,
                    "threshold": 1.0, "met": r >= 1.0})
    zb = get("peer_torch_pipe_zb")
    if tp and zb:  # torch's own zero-bubble gain, to set beside mmpipe's zb-h1 (docs/schedules.md)
        r = zb["samples_per_s"] / tp["samples_per_s"]
        out.append({"target": "torch.distributed.pipelining ZBV zero-bubble >= its 1F1B", "measured":
                    f"{zb['samples_per_s']:.1f} vs {tp['samples_per_s']:.1f} samples/s", "ratio": r,
                    "threshold": 1.0, "met": r >= 1.0})
    return out


def markdown(rows: list[dict], tgt: list[dict], meta: dict) -> str:
    def f(v, prec=3):
        if v is None or v == "":
            return "-"
        if isinstance(v, float):
            return f"{v:.{prec}g}"
        return str(v)
    peaks = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" if v else f"{k} ?" for k, v in meta["peaks"].items())
    peaks = f"peak {peaks} per rank" if peaks else "peak not measured yet: no run has finished"
    lines = [f"Sweep `{meta['sweep']}` on {meta['device']} ({peaks}), "
             f"{meta['steps']} steps, first {meta['warmup_steps']} excluded.", "",
             "| variant | rep | status | PP | DP | ZeRO | prec | micro x GAS | ckpt | rows | samples/s (IQR) | "
             "useful tokens/s | positions/s | padding | step ms | peak MB/rank | bubble meas / 1F1B | GFLOP/s | MFU | "
             "final loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r["status"] == "ok"
        lines.append("| " + " | ".join([
            r["name"], str(r.get("repeat", "")), "ok" if ok else f"{r['status']}: {str(r.get('reason', ''))[:80]}",
            f(r.get("stages")), f(r.get("dp")), f(r.get("zero")), f(r.get("precision")),
            f"{r.get('micro')} x {r.get('gas')}", "yes" if r.get("checkpointing") else "no", _rows(r),
            f"{r['samples_per_s']:.1f} ({r['samples_per_s_iqr']:.1f})" if ok else "-",
            f"{r['useful_tokens_per_s']:.0f}" if ok and r.get("useful_tokens_per_s") is not None else "-",
            f"{r['positions_per_s']:.0f}" if ok and r.get("positions_per_s") is not None else "-",
            f"{r['padding_share']:.1%}" if ok and r.get("padding_share") is not None else "-",
            f"{r['step_time_s'] * 1e3:.1f}" if ok else "-",
            "/".join(f(x, 4) for x in r.get("peak_mem_mb_per_rank") or []) or "-",
            f"{f(r.get('bubble_measured'))} / {f(r.get('bubble_theory'))}" if ok else "-",
            f"{r['achieved_flops'] / 1e9:.2f}" if ok and r.get("achieved_flops") else "-",
            f"{r['mfu']:.1%}" if ok and r.get("mfu") else "-", f(r.get("final_loss"), 4)]) + " |")
    lines += prediction_table(rows, meta)
    if tgt:
        lines += ["", "| target | measured | ratio | threshold | met |", "|---|---|---|---|---|"]
        for t in tgt:
            lines.append(f"| {t['target']} | {t['measured']} | {t['ratio']:.3f} | {t['threshold']} | "
                         f"{'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _rows(r: dict) -> str:
    """What a row holds: '1 sample' (the classic layout), 'M img' (image slots), 'packed, M img'."""
    images = r.get("max_images") or 1
    if r.get("pack"):
        return f"packed, {images} img"
    return f"{images} img" if images > 1 else "1 sample"


def prediction_table(rows: list[dict], meta: dict) -> list[str]:
    """Per variant (medians over its ok repeats): measured beside the planner's prediction, and the ratio."""
    lines = ["", predict.describe(meta), "",
             "| variant | PP x DP | micro x GAS | step ms meas / pred | meas/pred | bubble meas / pred | "
             "peak MB/rank (max) meas / pred | meas/pred |", "|---|---|---|---|---|---|---|---|"]

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    for name in dict.fromkeys(r["name"] for r in rows if r.get("kind") == "variant"):
        mine = [r for r in rows if r["name"] == name]
        ok = [r for r in mine if r["status"] == "ok"]
        r0 = mine[0]
        if r0.get("predicted_step_time_s") is None:
            continue
        meas = {k: med(r.get(k) for r in ok) for k in ("step_time_s", "bubble_measured", "peak_mem_mb_max",
                                                         "step_time_ratio", "peak_mem_ratio")}
        lines.append("| " + " | ".join([
            name, f"{r0['stages']} x {r0['dp']}", f"{r0['micro']} x {r0['gas']}",
            f"{f(meas['step_time_s'] and meas['step_time_s'] * 1e3, '.1f')} / {r0['predicted_step_time_s'] * 1e3:.1f}",
            f"**{f(meas['step_time_ratio'], '.2f')}**" if ok else r0["status"],
            f"{f(meas['bubble_measured'], '.2f')} / {r0['predicted_bubble']:.2f}",
            f"{f(meas['peak_mem_mb_max'], '.0f')} / {r0['predicted_peak_mem_mb_max']:.1f}",
            f(meas["peak_mem_ratio"], ".1f")]) + " |")
    return lines


def write_all(rows: list[dict], out: Path, meta: dict, target_spec: dict | None, plots: bool = True) -> dict:
    """results.csv / .json / .md, and the PNGs unless `plots` is False (a sweep's rows in between: drawing
    them costs ~1.3 s of CPU a time, more than a tiny variant's training)."""
    rows = predict.add_predictions(rows, meta)  # at report time: collected results get them too
    tgt = targets(rows, target_spec)
    write_csv(rows, out / "results.csv")
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "targets": tgt,
                                                  "medians": medians(rows)}, indent=2) + "\n")
    (out / "results.md").write_text(markdown(rows, tgt, meta))
    if plots:
        plot_all(rows, out, target_spec)
    return {"targets": tgt, "rows": rows}
