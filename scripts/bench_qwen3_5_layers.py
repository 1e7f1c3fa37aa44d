"""CPU cost of Qwen3.5's two decoder layer kinds (mmpipe.model.qwen3_5, docs/qwen3_5.md), in one process:

    python scripts/bench_qwen3_5_layers.py --width-32k 512   # docs/qwen3_5.md's table: 2k, 8k, 32k, ~10 min
    python scripts/bench_qwen3_5_layers.py --quick     # 512 positions, 1 repeat: a smoke run, seconds

One call = forward + backward of one decoder layer (the upstream gradient random) on one packed row of L positions
holding --samples equal samples (the row's segments as --pack makes them: the linear layer restarts its convolution
and state at each, the full layer attends causally within each, CPU's split by sample):

    linear   DeltaNetBlock: (1 + w) RMSNorm, Gated DeltaNet (conv, the chunked gated delta rule), RMSNorm, SwiGLU
    full     GatedAttentionBlock: (1 + w) RMSNorm, gated attention with q / k norms and the multimodal rotary,
             RMSNorm, SwiGLU

both of the same width. Default shapes: Qwen3.5-0.8B's decoder layer (width 1024, SwiGLU 3584; attention 8 heads
over 2 kv heads of 256; Gated DeltaNet 16 key and 16 value heads of 128, conv 4); --width-32k picks a narrower layer
for 32k (head counts scaled with the width, head sizes kept): at width 1024 one 32k-position row keeps about 12 GB of
activations in the linear layer (fp32), more than a shared machine of this kind should hand one benchmark.
Repeats interleave the two layers, the order turning each repeat, so the machine's drift falls on both; per
length the median CPU seconds (time.process_time: on one thread the work done, which a shared machine's other load
disturbs less than wall time) and wall seconds of each, and linear / full. torch.set_num_threads(--threads,
default 1).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from mmpipe.config import load_preset
from mmpipe.model import ReferenceModel
from mmpipe.model import qwen3_5 as q35

# Qwen3.5-0.8B's decoder layer: width, heads, SwiGLU from THUDM/slime's scripts/models/qwen3.5-0.8B.sh; the Gated
# DeltaNet heads as checkpoints derived from it list them (huggingface.co/oopere/Qwen3.5-0.65B-Base-Rearchitected)
SHAPE = dict(dim=1024, ff_dim=3584, n_heads=8, n_kv_heads=2, attn_head_dim=256, linear_key_heads=16,
             linear_value_heads=16, linear_key_dim=128, linear_value_dim=128, linear_conv_kernel=4)


def layer_config(width: int):
    """qwen3.5-tiny's config with a decoder of one linear then one full layer of Qwen3.5-0.8B's shape, scaled to
    `width` (head counts with the width, head sizes kept)."""
    base = load_preset("qwen3.5-tiny")
    s = width / SHAPE["dim"]
    shape = dict(SHAPE, dim=width, ff_dim=int(SHAPE["ff_dim"] * s), n_heads=max(1, int(SHAPE["n_heads"] * s)),
                 n_kv_heads=max(1, int(SHAPE["n_kv_heads"] * s)),
                 linear_key_heads=max(1, int(SHAPE["linear_key_heads"] * s)),
                 linear_value_heads=max(1, int(SHAPE["linear_value_heads"] * s)))
    text = dataclasses.replace(base.text, n_layers=2, full_attention_indexes=(1,), mrope_section=(11, 11, 10),
                               vocab_size=256, max_context=1 << 16, **shape)
    cfg = dataclasses.replace(base, text=text)
    cfg.validate()
    return cfg


def row_inputs(model, L: int, samples: int):
    """The stage tuple the first decoder layer receives for a text-only packed row of `samples` equal samples."""
    cfg = model.cfg
    ids = torch.randint(3, cfg.vision_start_id, (1, L))  # text only: no vision specials, no placeholder
    segments = torch.arange(L).div(L // samples, rounding_mode="floor").add(1).clamp(max=samples)[None]
    x = (torch.randn(1, 16, cfg.vision.patch_dim), ids, torch.zeros(1, 1, dtype=torch.long), segments,
         torch.zeros(1, 1, 3, dtype=torch.long))
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, (q35.DeltaNetBlock, q35.GatedAttentionBlock)):
                return x
            x = layer(x)
    raise AssertionError("no decoder layer")


def one_call(block, x) -> tuple[float, float]:
    hidden = x[0].clone().requires_grad_()
    grad = torch.randn_like(hidden)
    c0, w0 = time.process_time(), time.perf_counter()
    out = block((hidden, *x[1:]))[0]
    out.backward(grad)
    return time.process_time() - c0, time.perf_counter() - w0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--positions", default="2048,8192,32768")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--width", type=int, default=SHAPE["dim"])
    ap.add_argument("--width-32k", type=int, default=0, help="the width at 32768 positions (0: --width)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.positions, a.repeats = "512", 1
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {a.threads} thread(s), fp32, forward + backward of one layer, "
          f"{a.samples} samples a row, median of {a.repeats}")
    print(f"{'L':>6} {'width':>5}  {'linear cpu s':>12} {'full cpu s':>10} {'linear/full':>11}  "
          f"{'linear wall s':>13} {'full wall s':>11}")
    for L in (int(p) for p in a.positions.split(",")):
        width = a.width_32k if L >= 32768 and a.width_32k else a.width
        model = ReferenceModel(layer_config(width), seed=0)
        x = row_inputs(model, L, a.samples)
        blocks = {"linear": model[[isinstance(m, q35.DeltaNetBlock) for m in model].index(True)],
                  "full": model[[isinstance(m, q35.GatedAttentionBlock) for m in model].index(True)]}
        times = {k: [] for k in blocks}
        for r in range(a.repeats):
            for name in (list(blocks) if r % 2 == 0 else list(blocks)[::-1]):
                times[name].append(one_call(blocks[name], x))
        cpu = {k: statistics.median(c for c, _ in v) for k, v in times.items()}
        wall = {k: statistics.median(w for _, w in v) for k, v in times.items()}
        print(f"{L:>6} {width:>5}  {cpu['linear']:>12.2f} {cpu['full']:>10.2f} {cpu['linear'] / cpu['full']:>11.2f}  "
              f"{wall['linear']:>13.2f} {wall['full']:>11.2f}", flush=True)
        del model, x, blocks


if __name__ == "__main__":
    main()
