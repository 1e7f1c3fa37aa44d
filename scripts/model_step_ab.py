"""Forward + backward of the same micro-batch, mmpipe's `small` ReferenceModel vs the transformers
LLaVA peer with the same shapes, interleaved A/B in one process on one thread (so machine noise
hits both alike), with a per-op breakdown from torch.profiler. Isolates the model code from
engines, data loading and launchers.

    python scripts/model_step_ab.py --repeats 20
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--micro", type=int, default=16)
    a = p.parse_args()
    torch.set_num_threads(1)
    from transformers import LlavaForConditionalGeneration

    from mmpipe.bench.hf_peer import hf_model_config
    from mmpipe.bench.peer_common import batches, resolved
    from mmpipe.model.builder import ReferenceModel, lm_loss
    run = resolved("small", 1, a.micro, 1, 1)
    (pixels, ids, has), labels = next(batches(run, 0))
    mm = ReferenceModel(run.model, seed=0).train()
    hf_cfg = hf_model_config(run.model)
    hf = LlavaForConditionalGeneration(hf_cfg).train()
    n_img = run.model.n_image_positions
    hf_ids = torch.cat([torch.full((ids.shape[0], n_img), hf_cfg.image_token_id, dtype=ids.dtype), ids], 1)
    hf_labels = torch.full_like(labels, -100)
    hf_labels[:, 1:] = labels[:, :-1]

    def step_mm():
        lm_loss(mm(pixels, ids, has), labels).backward()

    def step_hf():
        hf(pixel_values=pixels, input_ids=hf_ids, labels=hf_labels).loss.backward()

    times = {"mmpipe": [], "transformers": []}
    for _ in range(3):
        step_mm(), step_hf()
    for _ in range(a.repeats):
        for name, fn in (("mmpipe", step_mm), ("transformers", step_hf)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"params: mmpipe {sum(q.numel() for q in mm.parameters())}, "
          f"transformers {sum(q.numel() for q in hf.parameters())}")
    for k, v in med.items():
        print(f"{k}: forward+backward of {a.micro} samples, median {v * 1e3:.1f} ms over {a.repeats}")
    print(f"mmpipe / transformers: {med['mmpipe'] / med['transformers']:.3f}")
    from torch.profiler import ProfilerActivity, profile
    for name, fn in (("mmpipe", step_mm), ("transformers", step_hf)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                fn()
        print(f"=== {name}: top ops by self CPU time over 5 micro-batches")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
