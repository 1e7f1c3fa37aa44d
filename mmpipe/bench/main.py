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


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", help="sweep file, e.g. ds_configs/sweeps/default.json (docs/benchmarks.md)")
    p.add_argument("--output-dir", default=None, help="where results go (default: runs/bench/<sweep name>)")
    p.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    p.add_argument("--no-peers", action="store_true", help="skip the peers even if the sweep lists them")


def _progress(i: int, n: int, label: str, t0: float, msg: str) -> None:
    print(f"[bench {i}/{n} {time.perf_counter() - t0:6.0f}s] {label}: {msg}", flush=True)


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
    from . import sweep as sweep_mod
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
    from . import peers as peers_mod
    from .peak import peaks
    from .report import write_all
    from .run_variant import check, flops_per_sample, launch, measure
    device, peak = peaks(sw.device, sw.peak_flops, {v.precision for v in variants} | {"fp32"})
    meta = {"sweep": args.sweep, "device": device, "peaks": peak, "steps": sw.steps, "warmup_steps": sw.warmup_steps,
            "machine": machine(), "command": "mmpipe bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None}
    peer_list = [] if args.no_peers else sw.peers
    plan = [(rep, v) for rep in range(sw.repeats) for v in variants] + [(rep, p) for rep in range(sw.repeats)
                                                                         for p in peer_list]
    rows, t0 = [], time.perf_counter()
    print(f"mmpipe bench: {len(variants)} variants x {sw.repeats} repeats + {len(peer_list)} peers on {device}; "
          f"results in {out}", flush=True)
    for i, (rep, item) in enumerate(plan, 1):
        if isinstance(item, str):
            shape = sw.peer_shape()
            row = {"kind": "peer", "repeat": rep, **shape.to_dict()}
            row["name"], row["engine"] = f"peer_{item}", item
            row["stages"], row["dp"], row["zero"] = (2 if item == "torch_pipe" else 1), 1, None
            row["world"] = row["stages"]
            vout = out / "peers" / f"{item}_r{rep}"
            _progress(i, len(plan), row["name"], t0, "running")
            rc, reason, wall = peers_mod.run_peer(item, shape, sw, vout)
            vlike = sweep_mod.Variant(name=row["name"], preset=shape.preset, stages=row["stages"], micro=shape.micro,
                                      gas=shape.gas, data_workers=shape.data_workers)
        else:
            v = item
            row = {"kind": "variant", "repeat": rep, **v.to_dict(), "world": v.world}
            vout = out / "variants" / f"{v.name}_r{rep}"
            vlike = v
            cannot = check(v, sw, vout)
            if cannot:
                row.update(status=cannot[0], reason=cannot[1])
                rows.append(row)
                _progress(i, len(plan), v.name, t0, row["status"] + ": " + row["reason"])
                write_all(rows, out, meta, sw.targets)
                continue
            _progress(i, len(plan), v.name, t0, f"running ({v.world} ranks)")
            rc, reason, wall = launch(v, sw, vout)
        row["wall_s"] = round(wall, 1)
        if (vout / "summary.json").is_file():  # the success marker: DeepSpeed can abort at exit after a good run
            try:
                row.update(status="ok", reason="" if rc == 0 else f"exit {rc} after the summary was written",
                           **measure(vlike, sw, vout, flops_per_sample(vlike), peak.get(vlike.precision)))
            except (OSError, ValueError, KeyError) as e:
                row.update(status="failed", reason=f"unreadable results: {e}")
        else:
            from .run_variant import _first_error
            log = vout / "run.log"
            text = log.read_text(errors="replace") if log.is_file() else ""
            kind = "oom" if "out of memory" in text.lower() or rc in (137, -9) else "timeout" if rc == 124 else "crashed"
            row.update(status=kind, reason=reason or _first_error(text) + f" (exit {rc}; {log})")
        rows.append(row)
        msg = (f"{row['samples_per_s']:.1f} samples/s, step {row['step_time_s'] * 1e3:.1f} ms, loss "
               f"{row['final_loss']:.4f}" if row["status"] == "ok" else f"{row['status']}: {row['reason']}")
        _progress(i, len(plan), row["name"], t0, msg)
        write_all(rows, out, meta, sw.targets)  # partial results survive an interrupted sweep
    res = write_all(rows, out, meta, sw.targets)
    print((out / "results.md").read_text(), flush=True)
    print(f"mmpipe bench: results.csv, results.json, results.md, throughput.png, memory.png, bubble.png in {out}",
          flush=True)
    # a variant the device lacks (unsupported) or that mmpipe refuses is a recorded answer, not a failure
    broken = [r["name"] for r in rows if r["status"] not in ("ok", "unsupported", "refused")]
    if broken:
        print(f"mmpipe bench: {len(broken)} run(s) did not finish: {', '.join(broken)}", file=sys.stderr, flush=True)
    return 1 if broken or res is None else 0
