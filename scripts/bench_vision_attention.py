"""CPU cost of the vision tower's attention within images and windows (docs/vision_attention.md):

    python scripts/bench_vision_attention.py            # the docs' table: P = 1k .. 8k, ~10 min on 1 thread
    python scripts/bench_vision_attention.py --quick    # P = 256, 512, 3 blocks of width 256: a smoke run
    python scripts/bench_vision_attention.py --planner  # the planner's tower at 72B, P = 16384: split vs dense

Tower: Qwen2.5-VL-7B's vision blocks (width 1280, 16 heads, SwiGLU 3420, RMSNorm; --blocks of them, windowed
ones first, the last full: e.g. 3 = two windowed + one full), one row of P patches filled with images of
32 x 32 = 1024 patches (P / 1024 images, 16 windows of 8 x 8 patches each in a windowed block). For each P, two
backends in turn, each in a fresh process (so its peak memory is its own):

    split    the default: attention.Split, each image's (window's) own SDPA, equal sizes batched
    dense    MMPIPE_ATTENTION=dense: one bool [1, 1, P, P] mask per block kind, SDPA over all P^2 pairs

A case = forward + backward of the blocks (loss: sum of squares of the output); its seconds are the least of
--repeats after one warm-up call, in CPU seconds of the process (time.process_time: on one thread the work
done, which the shared machine's other load disturbs far less than wall time; the wall seconds beside), its
peak the process's resident-memory high-water mark (VmHWM) over the resident size before the first call.
Both backends' outputs and input gradients are saved and compared here (max abs difference).
torch.set_num_threads(--threads, default 1): the machine is shared.

The decoder's packed rows (dense mask against the split by sample) are scripts/bench_attention.py --packed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

IMAGE_SIDE = 32  # patches a side: 1024 patches per image, cut into 4 x 4 windows of 8 x 8 patches (--quick: 16)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def tower(width: int, blocks: int):
    """(cfg, blocks): qwen2.5-vl-7b's tower (--quick: a narrower one), windowed blocks then one full."""
    from mmpipe.config import load_preset
    from mmpipe.model.builder import bound, layer_specs
    cfg = load_preset("qwen2.5-vl-7b")
    if width != cfg.vision.dim:
        cfg = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, dim=width, ff_dim=width * 2,
                                                                    n_heads=width // 64))
    specs = layer_specs(cfg)
    full = [i for i, s in enumerate(specs) if s.module_kwargs.get("full") is True]
    windowed = [i for i, s in enumerate(specs) if s.module_kwargs.get("full") is False]
    idx = windowed[:blocks - 1] + full[:1]
    torch.manual_seed(0)
    return cfg, [bound(specs[i].build(), cfg, i) for i in idx]


def case(P: int, width: int, blocks: int, repeats: int, out: str, side: int) -> dict:
    """One backend (MMPIPE_ATTENTION as set) at P patches, in this process: P / side^2 images of side x side."""
    cfg, layers = tower(width, blocks)
    n = P // side ** 2
    grids = torch.tensor([[[1, side, side]] * n])
    ints = (torch.zeros(1, 8, dtype=torch.long), torch.ones(1, n, dtype=torch.long),
            torch.ones(1, 8, dtype=torch.long), grids)
    hidden = torch.randn(1, P, cfg.vision.dim, generator=torch.Generator().manual_seed(1))

    def step():
        for m in layers:
            m.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_()
        args = (h, *ints)
        for m in layers:
            args = m(args)
        args[0].pow(2).sum().backward()
        return args[0].detach(), h.grad
    before = _rss_kib("VmRSS")
    times, walls = [], []
    for _ in range(repeats + 1):
        t0, w0 = time.process_time(), time.perf_counter()
        y, g = step()
        times.append(time.process_time() - t0)
        walls.append(time.perf_counter() - w0)
        del y, g  # the next call's peak is its own
    y, g = step()
    torch.save({"out": y, "grad": g}, out)
    return {"seconds": min(times[1:]), "wall": min(walls[1:]), "peak_mib": (_rss_kib("VmHWM") - before) / 1024}


def run_tower(args) -> None:
    sizes = [256, 512] if args.quick else [1024, 2048, 4096, 8192]
    width, side = (256, IMAGE_SIDE // 2) if args.quick else (1280, IMAGE_SIDE)
    rows, tmp = [], tempfile.mkdtemp()
    for P in sizes:
        res = {}
        for backend in ("split", "dense"):
            path = f"{tmp}/{backend}{P}.pt"
            env = dict(os.environ, MMPIPE_ATTENTION="dense" if backend == "dense" else "auto",
                       OMP_NUM_THREADS=str(args.threads))
            cmd = [sys.executable, __file__, "--case", str(P), "--width", str(width), "--blocks", str(args.blocks),
                   "--repeats", str(args.repeats), "--threads", str(args.threads), "--out", path, "--side", str(side)]
            res[backend] = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                                     text=True).stdout.splitlines()[-1])
            print(f"  P={P} {backend}: {res[backend]}", file=sys.stderr, flush=True)
        a, b = torch.load(f"{tmp}/split{P}.pt"), torch.load(f"{tmp}/dense{P}.pt")
        diff = max((a[k] - b[k]).abs().max().item() for k in ("out", "grad"))
        rows.append((P, res["split"], res["dense"], diff))
    s0, d0 = rows[0][1]["seconds"], rows[0][2]["seconds"]
    print(f"{args.blocks} blocks of width {width} ({args.blocks - 1} windowed, 1 full), images of "
          f"{side}x{side} patches, {args.threads} thread(s), least of {args.repeats}")
    print("| P | split CPU s | split / P=first | dense CPU s | dense / P=first | dense / split | split wall s "
          "| dense wall s | split peak MiB | dense peak MiB | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for P, s, d, diff in rows:
        print(f"| {P} | {s['seconds']:.2f} | {s['seconds'] / s0:.2f}x | {d['seconds']:.2f} | {d['seconds'] / d0:.2f}x "
              f"| {d['seconds'] / s['seconds']:.2f}x | {s['wall']:.2f} | {d['wall']:.2f} | {s['peak_mib']:.0f} "
              f"| {d['peak_mib']:.0f} | {diff:.1e} |")


def run_planner(args) -> None:
    """The planner's tower of qwen2.5-vl-72b on one h100-80gb (989 TFLOP/s at 45%), bf16, one row of P = 16384
    patches holding 4 images of 1024x768 px (54 x 74 patches each): per block kind, the forward / backward ms
    per row and the activation GiB it keeps (no checkpointing), as the cost model counts the split (attention
    pairs per image and window, no mask) beside what the dense reference runs (all P^2 pairs, and keeps the
    P x P mask and the padding patches' q, k, v, out: + P^2 + (4 d + h) x padding values)."""
    from mmpipe.config import load_preset
    from mmpipe.model.costs import attention_pairs
    from mmpipe.planning.costmodel import KNOWN_DEVICES, layer_costs
    from mmpipe.planning.images import patch_row
    cfg, dev = load_preset("qwen2.5-vl-72b"), KNOWN_DEVICES["h100-80gb"]
    v, rate = cfg.vision, dev.peak_flops * dev.efficiency
    row = patch_row(cfg, 4, 16384, [(1024, 768)])
    P, pad = row.patches, row.patches - row.used
    rows = [r for r in layer_costs(cfg, (), 1024, images=4, patches=row) if r.group == "vision"][1:]  # the blocks
    kinds = {"windowed": rows[0], "full": rows[7]}  # Qwen2.5: block 7 is full
    print(f"qwen2.5-vl-72b tower, P = {P} ({row.used} used by {len(row.grids)} images of "
          f"{row.grids[0][1]} x {row.grids[0][2]} patches), h100-80gb at 45%, bf16, per row")
    print("| block | pairs: split | pairs: dense | fwd ms: split | fwd ms: dense | bwd ms: split | bwd ms: dense "
          "| act GiB: split | act GiB: dense |")
    print("|---|---|---|---|---|---|---|---|---|")
    tower = {"split": [0.0, 0.0], "dense": [0.0, 0.0]}
    for name, r in kinds.items():
        pairs = attention_pairs(v, row, name == "full")
        extra = 4.0 * v.dim * (P * P - pairs)  # forward FLOPs the dense path adds; the backward twice that
        f, b = r.fwd_flops / rate * 1e3, r.bwd_flops / rate * 1e3
        fd, bd = (r.fwd_flops + extra) / rate * 1e3, (r.bwd_flops + 2 * extra) / rate * 1e3
        act = r.act_bytes("bf16") / 2 ** 30
        act_dense = act + (P * P + (4 * v.dim + v.n_heads) * pad) * 2 / 2 ** 30
        count = sum(1 for x in rows if x.fwd_flops == r.fwd_flops)
        for k, (a, c) in (("split", (f, b)), ("dense", (fd, bd))):
            tower[k][0] += a * count
            tower[k][1] += c * count
        print(f"| {name} (x{count}) | {pairs:,} | {P * P:,} | {f:.2f} | {fd:.2f} | {b:.2f} | {bd:.2f} | {act:.2f} "
              f"| {act_dense:.2f} |")
    for k, (f, b) in tower.items():
        print(f"tower ({len(rows)} blocks), {k}: forward {f:.1f} ms, backward {b:.1f} ms per row")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--planner", action="store_true")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--case", type=int, help=argparse.SUPPRESS)  # a child: one backend at this P
    p.add_argument("--width", type=int, default=1280, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--side", type=int, default=IMAGE_SIDE, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.case:
        print(json.dumps(case(args.case, args.width, args.blocks, args.repeats, args.out, args.side)))
    elif args.planner:
        run_planner(args)
    else:
        run_tower(args)


if __name__ == "__main__":
    main()
