"""`mmpipe eval --objective dpo`: preference accuracy on a held-out pair file (issue 56, item 4).

    mmpipe eval --objective dpo --checkpoint runs/dpo --data held_out_pairs.jsonl --out eval/pairs.jsonl

The pairs are read as training reads them (mmpipe.data.preference: TRL's or LLaVA's shape, bad pairs counted with
their reason and left out), in file order. Each side's log-prob is the sum over its answer tokens
(mmpipe.model.dpo.row_logps, the rows one sample each as `mmpipe eval` builds them), and:

    accuracy            the share of pairs whose chosen answer the model gives the higher log-prob (pi_c > pi_r)
    margin              the mean of pi_c - pi_r over the pairs (nats)

With --reference RUN also TRL's rewards on the same pairs (rewards/chosen = beta (pi_c - ref_c), ...,
rewards/accuracies the share with rewards/chosen > rewards/rejected), as training logs them. Written: one line per
pair (its pair number in the file, both log-probs, correct) to --out, the summary beside it (NAME.summary.json).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, fail
from ..data.batches import rank_batches
from ..data.dataset import prepare
from ..data.packing import sample_rowset
from ..data.preference import describe_pairs, pair_source
from ..model.dpo import REWARDS, rewards, row_logps
from .generate import load_checkpoint


def _pairs(args, cfg, opts):
    """The file's good pairs in file order (position 2j / 2j + 1: pair j's chosen / rejected), the index under
    --out's folder's data/."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    samples = prepare(dataclasses.replace(opts, pairs=True), cfg, out.parent, seed=0, verbose="always")
    samples.ordered = True  # file order, no shuffle: position p is good side p
    print(f"mmpipe: {describe_pairs(samples.index.stats)}", flush=True)
    return samples


@torch.no_grad()
def side_logps(model, samples, cfg, text_len: int, batch: int) -> np.ndarray:
    """[2 P]: every side's summed answer log-prob, position order."""
    model.eval()
    n = len(samples.index)
    sampler = [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]
    rows = sample_rowset(samples, cfg, text_len, need_images=True, need_labels=True)
    dtype = next(model.parameters()).dtype
    out = []
    for inputs, labels in rank_batches(rows, sampler, dtype=dtype):
        out.append(row_logps(model(*inputs), labels).double())
    return torch.cat(out).numpy()


def main_eval_dpo(args, checked) -> int:
    """checked(args) -> (model config, weights, DataOptions): scoring._checked, eval's own flag checks."""
    try:
        if args.beta <= 0:
            raise ConfigError(f"--beta: {args.beta} must be > 0 (DPO's KL weight; TRL's default 0.1)")
        cfg, _, opts = checked(args)
        pair_source(opts.spec)  # one line where the data holds no pairs
        if args.dry_run:
            print(f"mmpipe: eval --objective dpo: {cfg.name}, pairs of {Path(opts.name).resolve()}, reference "
                  f"{args.reference or 'none (log-prob accuracy only)'}; out {Path(args.out).resolve()}")
            return 0
        samples = _pairs(args, cfg, opts)
        model, _ = load_checkpoint(Path(args.checkpoint))
        ref = load_checkpoint(Path(args.reference))[0] if args.reference else None
    except ConfigError as e:
        return fail(e)
    t0 = time.perf_counter()
    batch = args.batch_size + args.batch_size % 2
    lp = side_logps(model, samples, cfg, opts.text_len, batch)
    pc, pr = lp[0::2], lp[1::2]
    lines = [{"pair": int(samples.index.rows[2 * j]) // 2, "chosen_logp": float(pc[j]), "rejected_logp": float(pr[j]),
              "correct": bool(pc[j] > pr[j])} for j in range(len(pc))]
    summary = {"objective": "dpo", "pairs": len(pc), "accuracy": float(np.mean(pc > pr)) if len(pc) else 0.0,
               "margin": float(np.mean(pc - pr)) if len(pc) else 0.0, "bad_pairs": samples.index.stats["pair_records"]
               - len(pc)}
    if ref is not None:
        rl = side_logps(ref, samples, cfg, opts.text_len, batch)
        got = rewards(*(torch.from_numpy(x) for x in (pc, pr, rl[0::2], rl[1::2])), beta=args.beta)
        summary.update({k: float(got[k]) for k in REWARDS}, beta=args.beta, reference=str(args.reference))
        for line, c, r in zip(lines, rl[0::2], rl[1::2]):
            line.update(ref_chosen_logp=float(c), ref_rejected_logp=float(r))
    summary["pairs_per_s"] = len(pc) / max(time.perf_counter() - t0, 1e-9)
    out = Path(args.out)
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary_file = out.with_name(out.stem + ".summary.json")
    summary_file.write_text(json.dumps(summary, indent=2) + "\n")
    trl = (f"; rewards/accuracies {summary['rewards/accuracies']:.3f}, rewards/margins "
           f"{summary['rewards/margins']:.4f} against {args.reference}" if ref is not None else "")
    print(f"mmpipe: eval: preference accuracy {summary['accuracy']:.3f} ({sum(x['correct'] for x in lines)}/{len(pc)} "
          f"pairs with the chosen answer more likely), mean margin {summary['margin']:.4f} nats{trl}; "
          f"{summary['bad_pairs']} bad pairs skipped; pairs in {out}, summary in {summary_file}", flush=True)
    return 0
