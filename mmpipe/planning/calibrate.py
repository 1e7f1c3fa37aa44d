"""`mmpipe plan --calibrate RESULTS.json`: fit the planner's time terms to what a sweep measured,
report the fit and the held-back variants before and after, and save a device profile that
`mmpipe plan --device-profile FILE` (and nothing else) then uses.

The planner's step time of a layout (mmpipe.planning.layout) is linear in the terms fitted:

    step = S x (slot_flops_s / efficiency[precision] + p2p + o_slot) + allreduce_bytes / bw + o_step
           S = m + P - 1 slots, slot_flops_s = the slowest stage's FLOPs per micro-batch / peak FLOP/s

so with u = 1 / efficiency the fit is ordinary least squares in (u per precision, o_slot, o_step,
and 1 / the all-reduce's bandwidth, which scales allreduce's bytes).

Each variant's equation is divided by its measured step, so the fit minimises the squared
RELATIVE error (a 10 ms miss on a 100 ms step weighs what 100 ms on 1 s does). The two overheads
are kept >= 0 (a negative one has no physical meaning): the exact solution over the four
active sets {both free, o_slot = 0, o_step = 0, both 0}, the best that is feasible.

Which variants: the sweep's pipeline-engine variants (engine 'pipe'; the 'dp' engine's ZeRO-2/3
traffic is not in the model) with at least one ok repeat, one equation each, at the median step
over their ok repeats. Held back (`--hold-out a,b`; default: the last two the fit
can speak for, see default_hold_out) are predicted before and after, never fitted. The all-reduce's
bandwidth is fitted only when a fitted variant has DP > 1 (else it keeps the device's link).

ZB-H1 variants (a sweep's `"schedule": "zb-h1"`) are predicted by replaying the schedule's order
(costmodel.replayed_step_seconds), not by that formula, so they are not in the least squares.
After it, they fit one more term, the split overhead o_w: seconds per W instruction (one per
micro-batch on each stage with W work) that splitting the backward costs beyond its FLOPs. For each
fitted zb-h1 variant, o_w is the value whose calibrated prediction equals its measured step (the
prediction grows with o_w; bisection; 0 when even o_w = 0 predicts slower than measured); the
profile keeps their median. That is what lets `mmpipe plan --schedule both` rank the schedules as
this machine does.
"""
from __future__ import annotations

import math
import os
import statistics
from dataclasses import replace

from ..config import ConfigError, ModelConfig, load_preset, read_json
from ..data.args import DataArgs
from ..data.dataset import resolve_data
from .costmodel import KNOWN_DEVICES, Device, Shape
from .layout import CPU_EFFICIENCY, CPU_LINK, Layout, Training, predict_layout
from .schedule_registry import BASELINE, row_schedule

PROFILE_KIND = "mmpipe-device-profile"
PRECISIONS = ("fp32", "bf16", "fp16")
CHECK_SOURCE = "mmpipe check"  # a profile's fit.source when `mmpipe check` wrote it (mmpipe.check.profile)


# ---- the sweep's results --------------------------------------------------------------------------

def read_results(path: str) -> dict:
    """A `mmpipe bench` results.json, checked enough to predict from: meta (device, peaks) and rows."""
    data = read_json(path, f"--calibrate: {path}", "not found (give a `mmpipe bench` results.json)")
    meta = data.get("meta") if isinstance(data, dict) else None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("peaks"), dict) or not isinstance(rows, list) \
            or not all(isinstance(r, dict) and "name" in r and "status" in r for r in rows):
        raise ConfigError(f"--calibrate: {path}: not a `mmpipe bench` result (needs 'meta' with 'device' and "
                          f"'peaks', and 'rows' with 'name' and 'status')")
    return data


def results_device(meta: dict, precision: str) -> Device | None:
    """The device a sweep ran on, as the uncalibrated planner sees it: the sweep's own peak per rank
    at the precision (the one its MFU column uses), the table's link and default efficiency
    (KNOWN_DEVICES; `--device cpu`'s on CPU; 0.45 and a PCIe-class link for a GPU outside the
    table), no memory limit (the run happened; mmpipe train cuts
    its stages without one). None when the sweep recorded no peak for the precision."""
    peak = (meta.get("peaks") or {}).get(precision)
    if not isinstance(peak, (int, float)) or peak <= 0:
        return None
    name = str(meta.get("device") or "cpu")
    if name == "cpu":
        base = Device(name, 0.0, 0.0, CPU_LINK, efficiency=CPU_EFFICIENCY)
    else:  # a GPU outside the table ('unknown-gpu' with the sweep's peak_flops): PCIe-class link, as l40s
        base = KNOWN_DEVICES.get(name) or Device(name, 0.0, 0.0, KNOWN_DEVICES["l40s"].link)
    return Device(name, float(peak), math.inf, base.link, base.efficiency)


def text_len_of(cfg: ModelConfig) -> int:
    """The built-in data's text length for the preset: what every bench variant trains on."""
    return resolve_data(DataArgs(), cfg).text_len


def predict_row(row: dict, device: Device, cache: dict | None = None) -> Layout:
    """The planner's layout for a bench row's variant fields (preset, stages, dp, zero, precision,
    micro, gas, checkpointing, partition, text_len, max_images, schedule, freeze, ep). ZeRO 2/3 (the 'dp'
    engine) are planned as ZeRO-1: the planner has no ZeRO-2/3 terms (their memory is then an upper
    bound, their traffic missing). text_len None: the built-in data's for the preset (a measured row
    carries its run's); max_images: a row's image slots (rows, --pack: micro counts rows, as `mmpipe
    plan --max-images`); freeze: the variant's --freeze groups, comma-separated ('' or absent: none); ep: its
    --ep (absent: 1, rows from before the axis); tp: its --tp (absent: 1), planned as one TP rank of the stage
    (planning.tensor_parallel); sp: its --sp (absent: 1), one SP rank (planning.sequence_parallel)."""
    cache = {} if cache is None else cache
    preset = row.get("preset") or "small"
    if preset not in cache:
        cfg = load_preset(preset)
        cache[preset] = (cfg, text_len_of(cfg))
    cfg, default_len = cache[preset]
    text_len = int(row.get("text_len") or default_len)
    shape = Shape(int(row["stages"]), int(row["dp"]), int(row["micro"]), int(row["gas"]), int(row.get("ep") or 1),
                  int(row.get("tp") or 1), int(row.get("sp") or 1))
    training = Training(row["precision"], min(int(row.get("zero") or 0), 1), device, row_schedule(row.get("schedule")),
                        str(row.get("partition") or "balanced"), bool(row.get("checkpointing")),
                        tuple(g for g in str(row.get("freeze") or "").split(",") if g))
    return predict_layout(cfg, shape, training, text_len, int(row.get("max_images") or 1))


def replayed(row: dict) -> bool:
    """Whether a bench row ran a schedule the planner replays (ZB-H1), not the baseline's closed form
    the least squares fits (rows from before the column ran the baseline, 1f1b)."""
    return row_schedule(row.get("schedule")) is not BASELINE


def fittable(rows: list[dict]) -> dict[str, dict]:
    """name -> one representative row (its variant fields) + 'measured': the median step over its ok
    repeats, for the pipeline-engine variants with at least one ok repeat, in sweep order."""
    out = {}
    for r in rows:
        if r.get("kind", "variant") != "variant" or r.get("engine", "pipe") != "pipe" or r["status"] != "ok":
            continue
        out.setdefault(r["name"], {**r, "steps": []})["steps"].append(float(r["step_time_s"]))
    return {n: {**r, "measured": statistics.median(r["steps"])} for n, r in out.items()}


# ---- the fit ---------------------------------------------------------------------------------------

def terms(layout: Layout, link: float) -> dict:
    """The step's pieces, from a layout predicted at efficiency 1 with no overheads: slots, the compute
    seconds at peak on the critical path, the p2p seconds, and the all-reduce's bytes (2 (d-1)/d x
    gradient bytes: its seconds x the link it was predicted on)."""
    st = layout.step
    return {"slots": st["slots"], "flop_s": st["slots"] * st["slot_s"], "p2p_s": st["slots"] * st["p2p_s"],
            "allreduce_bytes": st["allreduce_s"] * link}


def step_from_terms(t: dict, precision: str, params: dict) -> float:
    """The calibrated step: the same formula as costmodel.pipeline_step_seconds with the fitted terms."""
    return (t["flop_s"] / params["efficiency"][precision] + t["slots"] * params["microbatch_overhead_s"]
            + t["p2p_s"] + t["allreduce_bytes"] / params["allreduce_link"] + params["step_overhead_s"])


def fit(samples: list[dict], link: float) -> dict:
    """Least squares on relative error. samples: {'precision', 'measured', 'terms'}. Fits u = 1/efficiency
    per precision, the per-slot and per-step overheads (>= 0), and, when a fitted variant has DP > 1,
    the all-reduce's bandwidth (else it stays `link`, the uncalibrated one). Returns
    {'efficiency': {precision: e}, 'microbatch_overhead_s', 'step_overhead_s', 'allreduce_link', 'fitted'}."""
    import numpy as np
    precs = sorted({s["precision"] for s in samples}, key=PRECISIONS.index)
    dp_term = any(s["terms"]["allreduce_bytes"] > 0 for s in samples)
    names = [f"efficiency {p}" for p in precs] + ["per-slot overhead", "per-step overhead"] + (
        ["all-reduce bandwidth"] if dp_term else [])
    if len(samples) < len(names):
        raise ConfigError(f"--calibrate: {len(samples)} variant(s) to fit {len(names)} parameters "
                          f"({', '.join(names)}); hold out fewer or sweep more variants")
    k = len(precs)
    a = np.zeros((len(samples), len(names)))
    y = np.zeros(len(samples))
    for i, s in enumerate(samples):
        t, w = s["terms"], 1.0 / s["measured"]  # each equation / its measured step: relative error
        a[i, precs.index(s["precision"])] = t["flop_s"] * w
        a[i, k], a[i, k + 1] = t["slots"] * w, w
        if dp_term:
            a[i, k + 2] = t["allreduce_bytes"] * w
        y[i] = (s["measured"] - t["p2p_s"] - (0.0 if dp_term else t["allreduce_bytes"] / link)) * w
    best = None
    for free in ((True, True), (True, False), (False, True), (False, False)):  # which overheads are fitted
        cols = [c for c in range(len(names)) if c < k or c >= k + 2 or free[c - k]]
        x, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        full = np.zeros(len(names))
        full[cols] = x
        if (full[:k] <= 0).any() or (full[k:k + 2] < 0).any() or (dp_term and full[k + 2] <= 0):
            continue
        err = float(((a @ full - y) ** 2).sum())
        if best is None or err < best[0] - 1e-15:
            best = (err, full)
    if best is None:
        raise ConfigError("--calibrate: no fit with a positive efficiency for every precision and a positive "
                          "all-reduce bandwidth (the measured steps do not grow with FLOPs or bytes); check the "
                          "sweep's results")
    full = best[1]
    return {"efficiency": {p: float(1.0 / full[i]) for i, p in enumerate(precs)},
            "microbatch_overhead_s": float(full[k]), "step_overhead_s": float(full[k + 1]),
            "allreduce_link": float(1.0 / full[k + 2]) if dp_term else link, "fitted": names}


def default_hold_out(cand: dict[str, dict], k: int = 2) -> list[str]:
    """The last k variants (sweep order) the fit can still speak for without them: another variant of
    the same precision stays in the fit (its efficiency), for DP > 1 another DP > 1 variant (the
    all-reduce's bandwidth), for a zb-h1 variant another zb-h1 variant (the split overhead).
    Holding back the only variant of a kind tests nothing the fit learnt."""
    names, held = list(cand), []

    def covered(n):
        rest = [m for m in names if m not in held and m != n]
        sched = row_schedule(cand[n].get("schedule"))
        return any(cand[m]["precision"] == cand[n]["precision"] and not replayed(cand[m]) for m in rest) and (
            int(cand[n]["dp"]) == 1 or any(int(cand[m]["dp"]) > 1 for m in rest)) and (
            sched is BASELINE or any(row_schedule(cand[m].get("schedule")) is sched for m in rest))
    for n in reversed(names):
        if len(held) < k and covered(n):
            held.append(n)
    return held[::-1]


def _checked_hold_out(cand: dict, hold_out: list[str] | None, source: str) -> list[str]:
    """--hold-out (None: default_hold_out): every name an ok pipeline variant, and every precision
    held back still has a fitted 1f1b variant to take its efficiency from."""
    if hold_out is None:
        hold_out = default_hold_out(cand)
    unknown = [n for n in hold_out if n not in cand]
    if unknown:
        raise ConfigError(f"--hold-out: {', '.join(unknown)} is not a pipeline variant with an ok run in {source} "
                          f"(valid: {', '.join(cand)})")
    prec = {n: cand[n]["precision"] for n in cand}
    fitted = [n for n in cand if n not in hold_out]
    orphans = [n for n in hold_out if prec[n] not in {prec[m] for m in fitted if not replayed(cand[m])}]
    if orphans:
        raise ConfigError(f"--hold-out: {', '.join(orphans)} would leave no {prec[orphans[0]]} variant to fit its "
                          f"efficiency; hold back another")
    return hold_out


def calibrate(data: dict, hold_out: list[str] | None, source: str = "") -> dict:
    """Fit on the sweep's pipeline variants minus the held-back ones; predictions before/after for all."""
    meta = data["meta"]
    cand = fittable(data["rows"])
    if not cand:
        raise ConfigError(f"--calibrate: {source}: no pipeline variant with an ok run to fit")
    names = list(cand)
    prec = {n: cand[n]["precision"] for n in names}
    hold_out = _checked_hold_out(cand, hold_out, source)
    cache, out = {}, []
    for n in names:
        dev = results_device(meta, prec[n])
        if dev is None:
            raise ConfigError(f"--calibrate: {source}: meta.peaks has no {prec[n]} peak for variant {n}")
        before = predict_row(cand[n], dev, cache)
        unit = predict_row(cand[n], replace(dev, efficiency=1.0), cache)
        out.append({"name": n, "precision": prec[n], "measured": cand[n]["measured"], "held_out": n in hold_out,
                    "before": before.step["step_s"], "terms": terms(unit, dev.link), "stages": cand[n]["stages"],
                    "dp": cand[n]["dp"], "micro": cand[n]["micro"], "gas": cand[n]["gas"]})
    link = out and results_device(meta, out[0]["precision"]).link  # the device's link: every precision's is the same
    one = [s for s in out if not replayed(cand[s["name"]])]
    if not one:
        raise ConfigError(f"--calibrate: {source}: no 1f1b pipeline variant with an ok run to fit (zb-h1 variants "
                          f"only fit the split overhead, on top of the 1f1b fit)")
    params = fit([s for s in one if not s["held_out"]], link)
    zb = [s for s in out if replayed(cand[s["name"]])]
    lacking = [s["name"] for s in zb if s["precision"] not in params["efficiency"]]
    if lacking:
        raise ConfigError(f"--calibrate: {source}: zb-h1 variant {lacking[0]} has no fitted 1f1b variant of its "
                          f"precision to take the efficiency from")
    params["split_overhead_s"], params["split_fitted"] = fit_split(
        [s for s in zb if not s["held_out"] and row_schedule(cand[s["name"]].get("schedule")).split_backward],
        cand, meta, params, cache)
    for s in one:
        s["after"] = step_from_terms(s["terms"], s["precision"], params)
    for s in zb:  # the replay with the calibrated terms and the fitted split overhead; no leave-one-out
        s["after"], s["loo"] = zb_step(cand[s["name"]], meta, params, params["split_overhead_s"], cache), None
    # leave-one-out over every 1f1b variant (held-back ones included): fit on all the others, predict it;
    # shows which variants the terms can speak for when nothing like them is fitted
    for s in one:
        rest = [t for t in one if t is not s]
        try:
            s["loo"] = step_from_terms(s["terms"], s["precision"], fit(rest, link)) \
                if s["precision"] in {t["precision"] for t in rest} else None
        except ConfigError:
            s["loo"] = None

    def errors(sel, key):
        rel = [s[key] / s["measured"] - 1 for s in out if s["held_out"] == sel]
        return {"rms": math.sqrt(sum(e * e for e in rel) / len(rel)) if rel else None,
                "max_abs": max((abs(e) for e in rel), default=None)}
    return {"params": params, "variants": out, "fit_error": errors(False, "after"),
            "fit_error_before": errors(False, "before"), "held_out_error": errors(True, "after"),
            "held_out_error_before": errors(True, "before"), "device": meta.get("device"),
            "peaks": {p: meta["peaks"][p] for p in params["efficiency"]}, "machine": meta.get("machine"),
            "source": source}


def calibrated_device(meta: dict, precision: str, params: dict, split: float) -> Device:
    dev = results_device(meta, precision)
    return replace(dev, efficiency=params["efficiency"][precision], microbatch_overhead=params["microbatch_overhead_s"],
                   step_overhead=params["step_overhead_s"], allreduce_link=params["allreduce_link"],
                   split_overhead=split)


def zb_step(row: dict, meta: dict, params: dict, split: float, cache: dict) -> float:
    """A zb-h1 variant's calibrated step with split overhead `split` seconds per W."""
    return predict_row(row, calibrated_device(meta, row["precision"], params, split), cache).step["step_s"]


def fit_split(samples: list[dict], cand: dict, meta: dict, params: dict, cache: dict) -> tuple[float, bool]:
    """(split overhead per W, fitted?): the median over the zb-h1 samples of the o_w >= 0 that makes each
    one's calibrated prediction its measured step (module docstring); (0, False) without any. Every
    sample's precision has an efficiency (calibrate refuses a zb-h1 variant without a 1f1b one)."""
    found = []
    for s in samples:
        row = cand[s["name"]]
        lo, hi = 0.0, s["measured"]  # a W costing a whole step is beyond any split's price
        if zb_step(row, meta, params, lo, cache) >= s["measured"]:
            found.append(0.0)
            continue
        if zb_step(row, meta, params, hi, cache) < s["measured"]:
            found.append(hi)
            continue
        for _ in range(40):  # to ~1e-12 of a step
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if zb_step(row, meta, params, mid, cache) < s["measured"] else (lo, mid)
        found.append((lo + hi) / 2)
    return (statistics.median(found), True) if found else (0.0, False)


# ---- device profiles -------------------------------------------------------------------------------

def profile_of(result: dict) -> dict:
    """The device profile JSON a calibration writes."""
    name = str(result["device"] or "cpu")
    base = KNOWN_DEVICES.get(name)
    memory = base.memory if base else float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return {"kind": PROFILE_KIND, "version": 1, "device": name, "peak_flops": result["peaks"],
            "efficiency": result["params"]["efficiency"],
            "microbatch_overhead_s": result["params"]["microbatch_overhead_s"],
            "step_overhead_s": result["params"]["step_overhead_s"],
            "split_overhead_s": result["params"]["split_overhead_s"],
            "memory_bytes": memory, "link_bytes_per_s": base.link if base else CPU_LINK,
            "allreduce_bytes_per_s": result["params"]["allreduce_link"],
            "fit": {"source": result["source"], "fitted": [s["name"] for s in result["variants"] if not s["held_out"]],
                    "held_out": [s["name"] for s in result["variants"] if s["held_out"]],
                    "rms_rel_error": result["fit_error"]["rms"],
                    "held_out_rms_rel_error": result["held_out_error"]["rms"]},
            "machine": result["machine"]}


def load_profile(path: str) -> dict:
    """A device profile written by --calibrate, checked field by field."""
    where = f"--device-profile: {path}"
    prof = read_json(path, where, "not found (mmpipe check writes one in its --output-dir; mmpipe plan --calibrate "
                                 "RESULTS.json writes one from a sweep)")
    if not isinstance(prof, dict) or prof.get("kind") != PROFILE_KIND:
        raise ConfigError(f"{where}: not a device profile (no \"kind\": \"{PROFILE_KIND}\"; write one with "
                          f"mmpipe plan --calibrate RESULTS.json)")

    def positive(v, zero_ok=False):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (
            v >= 0 if zero_ok else v > 0)
    for key in ("peak_flops", "efficiency"):
        table = prof.get(key)
        if not isinstance(table, dict) or not table or any(k not in PRECISIONS or not positive(v)
                                                           for k, v in table.items()):
            raise ConfigError(f"{where}: {key} must map precisions ({', '.join(PRECISIONS)}) to positive numbers, "
                              f"got {table!r}")
    prof.setdefault("split_overhead_s", 0.0)  # profiles written before zb-h1 calibration: a free split
    for key, zero_ok in (("microbatch_overhead_s", True), ("step_overhead_s", True), ("split_overhead_s", True),
                         ("memory_bytes", False), ("link_bytes_per_s", False), ("allreduce_bytes_per_s", False)):
        if not positive(prof.get(key), zero_ok):
            raise ConfigError(f"{where}: {key} must be a {'non-negative' if zero_ok else 'positive'} number, "
                              f"got {prof.get(key)!r}")
    missing = [k for k in prof["efficiency"] if k not in prof["peak_flops"]]
    if missing:
        raise ConfigError(f"{where}: efficiency for {', '.join(missing)} has no peak_flops entry")
    prof["_path"] = path
    return prof


def from_check(prof: dict) -> bool:
    """Whether `mmpipe check` measured this profile (on a run's own ranks, at that run's one precision)."""
    return isinstance(prof.get("fit"), dict) and prof["fit"].get("source") == CHECK_SOURCE


def profile_precision(prof: dict) -> str:
    """The precision `mmpipe plan --device-profile` plans at without --precision: plan's default bf16 where the
    profile holds it, else the profile's one precision (a profile `mmpipe check` wrote on fp32 ranks plans at
    fp32); ConfigError in one line for a profile of several precisions that lacks bf16."""
    held = list(prof["efficiency"])
    if "bf16" in held or len(held) == 1:
        return "bf16" if "bf16" in held else held[0]
    raise ConfigError(f"--device-profile: {prof['_path']}: calibrated for {', '.join(held)}: give --precision "
                      f"(one of them)")


def profile_device(prof: dict, precision: str) -> Device:
    """The calibrated Device for a precision the profile was fitted on."""
    if precision not in prof["efficiency"]:
        held = ", ".join(prof["efficiency"])
        # the way to a profile at another precision depends on what wrote this one: check measures the run's own
        # precision (its DeepSpeed config), a calibration fits the precisions its sweep ran
        again = (f"rerun mmpipe check with a {precision} --ds-config" if from_check(prof) else
                 f"calibrate on a sweep with {precision} variants")
        instead = " or ".join(f"--precision {k}" for k in prof["efficiency"])
        raise ConfigError(f"--device-profile: {prof['_path']}: calibrated for {held} only, not --precision "
                          f"{precision} (plan with {instead}, or {again})")
    return Device(f"{prof['device']} (calibrated)", float(prof["peak_flops"][precision]), float(prof["memory_bytes"]),
                  float(prof["link_bytes_per_s"]), float(prof["efficiency"][precision]),
                  microbatch_overhead=float(prof["microbatch_overhead_s"]),
                  step_overhead=float(prof["step_overhead_s"]), allreduce_link=float(prof["allreduce_bytes_per_s"]),
                  split_overhead=float(prof["split_overhead_s"]))


def report(result: dict) -> str:
    """The calibration as text: fitted parameters, fit error, each variant before -> after."""
    p = result["params"]
    lines = [f"calibrated on {result['source']} ({result['device']}; "
             + ", ".join(f"{k} peak {v / 1e9:.1f} GFLOP/s" for k, v in result["peaks"].items()) + ")",
             "fitted: " + ", ".join(f"efficiency {k} {v:.3f}" for k, v in p["efficiency"].items())
             + f", per-slot overhead {p['microbatch_overhead_s'] * 1e3:.2f} ms, per-step overhead "
               f"{p['step_overhead_s'] * 1e3:.2f} ms, all-reduce {p['allreduce_link'] / 1e6:.1f} MB/s"
             + ("" if "all-reduce bandwidth" in p["fitted"] else " (not fitted: no DP > 1 variant in the fit)")
             + (f", zb-h1 split overhead {p['split_overhead_s'] * 1e3:.2f} ms per W" if p["split_fitted"]
                else ", zb-h1 split overhead not fitted (no zb-h1 variant in the fit): 0"),
             f"{'variant':<16} {'PPxDP':>5} {'mb x m':>7} {'prec':>5} {'measured ms':>11} {'before ms':>9} "
             f"{'meas/pred':>9} {'after ms':>9} {'meas/pred':>9} {'LOO ms':>7} {'meas/LOO':>8}  role"]
    for s in result["variants"]:
        loo = (f"{s['loo'] * 1e3:>7.1f} {s['measured'] / s['loo']:>8.3f}" if s.get("loo") else f"{'-':>7} {'-':>8}")
        lines.append(f"{s['name']:<16} {s['stages']}x{s['dp']:<3} {str(s['micro']) + 'x' + str(s['gas']):>7} "
                     f"{s['precision']:>5} {s['measured'] * 1e3:>11.1f} {s['before'] * 1e3:>9.1f} "
                     f"{s['measured'] / s['before']:>9.3f} {s['after'] * 1e3:>9.1f} {s['measured'] / s['after']:>9.3f}"
                     f" {loo}  {'HELD OUT' if s['held_out'] else 'fit'}")

    def pct(e):
        return "-" if e["rms"] is None else f"rms {e['rms']:.1%}, max {e['max_abs']:.1%}"
    lines.append(f"fit error (relative, fitted variants): before {pct(result['fit_error_before'])}; "
                 f"after {pct(result['fit_error'])}")
    lines.append(f"held-out error: before {pct(result['held_out_error_before'])}; "
                 f"after {pct(result['held_out_error'])}")
    lines.append("(meas/pred: measured / predicted step; LOO: predicted by a fit on every other variant)")
    return "\n".join(lines)
