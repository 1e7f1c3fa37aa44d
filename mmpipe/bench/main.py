"""`mmpipe bench SWEEP.json`: check the whole sweep, then run each variant (and each repeat,
interleaved: all variants once, then again, so slow drift of a shared machine spreads over all),
then the peers; write results.csv / .json / .md and the plots as it goes."""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from ..config import ConfigError, fail
from . import sweep as sweep_mod
from .peak import peaks
from .peers import run_peer
from .report import write_all
from .run_variant import check, first_error, flops_per_sample, launch, measure
from .sweep import Sweep, Variant


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", help="sweep file, e.g. ds_configs/sweeps/default.json (docs/benchmarks.md)")
    p.add_argument("--output-dir", default=None, help="where results go (default: runs/bench/<sweep name>)")
    p.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    p.add_argument("--no-peers", action="store_true", help="skip the peers even if the sweep lists them")


def machine() -> dict:
    import os

    import torch
    cpu = platform.processor() or platform.machine()
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def main_bench(args: argparse.Namespace) -> int:
    try:
        sw = sweep_mod.load(args.sweep)
        only = [n for n in args.only.split(",") if n]
        unknown = [n for n in only if n not in {v.name for v in sw.variants}]
        if unknown:
            raise ConfigError(f"--only: no variant named {', '.join(unknown)} in {args.sweep}")
    except ConfigError as e:
        return fail(e)
    variants = [v for v in sw.variants if not only or v.name in only]
    out = Path(args.output_dir or f"runs/bench/{sw.name}")
    out.mkdir(parents=True, exist_ok=True)
    device, peak = peaks(sw.device, sw.peak_flops, {v.precision for v in variants} | {"fp32"})
    meta = {"sweep": args.sweep, "device": device, "peaks": peak, "steps": sw.steps, "warmup_steps": sw.warmup_steps,
            "machine": machine(),
            "command": "mmpipe bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None}
    peer_list = [] if args.no_peers else sw.peers
    plan = [(rep, v) for rep in range(sw.repeats) for v in variants] + [(rep, p) for rep in range(sw.repeats)
                                                                         for p in peer_list]
    rows, t0 = [], time.perf_counter()
    print(f"mmpipe bench: {len(variants)} variants x {sw.repeats} repeats + {len(peer_list)} peers on {device}; "
          f"results in {out}", flush=True)
    for i, (rep, item) in enumerate(plan, 1):
        def progress(msg: str, name: str = item if isinstance(item, str) else item.name) -> None:
            print(f"[bench {i}/{len(plan)} {time.perf_counter() - t0:6.0f}s] {name}: {msg}", flush=True)
        row = (run_peer_row if isinstance(item, str) else run_variant_row)(item, rep, sw, out, peak, progress)
        rows.append(row)
        progress(f"{row['samples_per_s']:.1f} samples/s, step {row['step_time_s'] * 1e3:.1f} ms, loss "
                 f"{row['final_loss']:.4f}" if row["status"] == "ok" else f"{row['status']}: {row['reason']}",
                 row["name"])
        write_all(rows, out, meta, sw.targets)  # partial results survive an interrupted sweep
    print((out / "results.md").read_text(), flush=True)
    print(f"mmpipe bench: results.csv, results.json, results.md, throughput.png, memory.png, bubble.png in {out}",
          flush=True)
    # a variant the device lacks (unsupported) or that mmpipe refuses is a recorded answer, not a failure
    broken = [r["name"] for r in rows if r["status"] not in ("ok", "unsupported", "refused")]
    if broken:
        print(f"mmpipe bench: {len(broken)} run(s) did not finish: {', '.join(broken)}", file=sys.stderr, flush=True)
    return 1 if broken else 0


def run_variant_row(v: Variant, rep: int, sw: Sweep, out: Path, peak: dict, progress) -> dict:
    """One repeat of a variant: refused / unsupported without a launch, else launched and measured."""
    row = {"kind": "variant", "repeat": rep, **v.to_dict(), "world": v.world}
    vout = out / "variants" / f"{v.name}_r{rep}"
    cannot = check(v, sw, vout)
    if cannot:
        return {**row, "status": cannot[0], "reason": cannot[1]}
    progress(f"running ({v.world} ranks)")
    return _outcome(row, v, sw, vout, peak, *launch(v, sw, vout))


def run_peer_row(name: str, rep: int, sw: Sweep, out: Path, peak: dict, progress) -> dict:
    """One repeat of a peer (transformers, torch pipelining) on the sweep's peer shape."""
    shape = sw.peer_shape()
    stages = 2 if name == "torch_pipe" else 1
    row = {"kind": "peer", "repeat": rep, **shape.to_dict(), "name": f"peer_{name}", "engine": name, "stages": stages,
           "dp": 1, "zero": None, "world": stages}
    vout = out / "peers" / f"{name}_r{rep}"
    progress("running", row["name"])
    like = Variant(name=row["name"], preset=shape.preset, stages=stages, micro=shape.micro, gas=shape.gas,
                   data_workers=shape.data_workers)
    return _outcome(row, like, sw, vout, peak, *run_peer(name, shape, sw, vout))


def _outcome(row: dict, v: Variant, sw: Sweep, vout: Path, peak: dict, rc: int, reason: str, wall: float) -> dict:
    """The row of a finished launch: measured when it wrote its summary, else why it did not."""
    row = {**row, "wall_s": round(wall, 1)}
    if (vout / "summary.json").is_file():  # the success marker: DeepSpeed can abort at exit after a good run
        try:
            return {**row, "status": "ok", "reason": "" if rc == 0 else f"exit {rc} after the summary was written",
                    **measure(v, sw, vout, flops_per_sample(v), peak.get(v.precision))}
        except (OSError, ValueError, KeyError) as e:
            return {**row, "status": "failed", "reason": f"unreadable results: {e}"}
    log = vout / "run.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    kind = "oom" if "out of memory" in text.lower() or rc in (137, -9) else "timeout" if rc == 124 else "crashed"
    return {**row, "status": kind, "reason": reason or first_error(text) + f" (exit {rc}; {log})"}
