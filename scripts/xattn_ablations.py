"""Cross-attention family on the shapes set: one change at a time, held-out accuracy as it trains
(docs/models.md, "Learning the shapes set"). Single process on the reference model (which the
pipeline equals, tests/test_cross_attention.py), the default run's recipe: micro 16 x GAS 4 = 64
samples per step, AdamW 5e-4 betas (0.9, 0.95), clipping 1.0, WarmupCosineLR over --steps.

    python scripts/xattn_ablations.py --name base --steps 3000 --eval-every 500
    python scripts/xattn_ablations.py --name vis6 --preset-json '{"vision": {"n_layers": 6}}'
    python scripts/xattn_ablations.py --name gate20 --gate-lr 20

--kvnorm, --no-image-pos and --xattn-before I,J are experiment-only variants patched in here
(a LayerNorm on the image before its keys / values; the Projector without its learned image
positions, as the family was first built; cross-attention before other decoder blocks); they are
not model options. Writes OUTPUT/NAME/log.txt: every 50 steps the loss and tanh of each gate, at
each eval the accuracy.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from mmpipe.data.batches import StepBatches, rank_batches
from mmpipe.data.dataset import prepare
from mmpipe.inference.evaluate import evaluate
from mmpipe.model import cross_attention as xa
from mmpipe.model.builder import ReferenceModel, lm_loss
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.feed import run_dataset
from mmpipe.runtime.reference import make_optimizer, make_scheduler

ROOT = Path(__file__).resolve().parent.parent


def merge(d: dict, u: dict) -> None:
    for k, v in u.items():
        if isinstance(v, dict):
            merge(d.setdefault(k, {}), v)
        else:
            d[k] = v


def patch(args) -> None:
    if args.kvnorm:
        init0, kv0 = xa.CrossAttention.__init__, xa.CrossAttention.image_kv

        def init(self, dim, n_heads):
            init0(self, dim, n_heads)
            self.ln_kv = nn.LayerNorm(dim)
        xa.CrossAttention.__init__ = init
        xa.CrossAttention.image_kv = lambda self, image: kv0(self, self.ln_kv(image))
    if args.no_image_pos:
        from mmpipe.model import layers
        p_init = layers.Projector.__init__

        def pinit(self, cfg, **kw):  # the family's own keywords (image_pos=True) pass through
            p_init(self, cfg, **kw)  # its MLP is drawn before the positions: the same MLP weights
            if hasattr(self, "image_pos"):  # drawn, then dropped: later layers draw what they drew before
                del self.image_pos
        layers.Projector.__init__ = pinit
    if args.xattn_before:
        from mmpipe import config
        at = [int(i) for i in args.xattn_before.split(",")]
        config.ModelConfig.cross_attn_layers = property(lambda self: at)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--name", required=True)
    a.add_argument("--output-dir", default="runs/xattn")
    a.add_argument("--steps", type=int, default=1000)
    a.add_argument("--eval-every", type=int, default=250)
    a.add_argument("--eval-samples", type=int, default=250)
    a.add_argument("--lr", type=float, default=5e-4)
    a.add_argument("--gate-lr", type=float, default=1.0, help="the gates' learning rate, x --lr")
    a.add_argument("--preset-json", default="{}", help="overrides merged into small-xattn.json")
    a.add_argument("--kvnorm", action="store_true")
    a.add_argument("--no-image-pos", action="store_true")
    a.add_argument("--xattn-before", default="")
    args = a.parse_args()
    torch.set_num_threads(1)
    patch(args)
    out = Path(args.output_dir) / args.name
    out.mkdir(parents=True, exist_ok=True)
    preset = json.loads((ROOT / "mmpipe/presets/small-xattn.json").read_text())
    merge(preset, json.loads(args.preset_json))
    (out / "preset.json").write_text(json.dumps(preset, indent=1))
    run = resolve(TrainArgs(preset=str(out / "preset.json"), stages=1, steps=args.steps), world_size=1)
    model = ReferenceModel(run.model, seed=0)
    gates = [q for n, q in model.named_parameters() if n.endswith("_gate")]
    rest = [q for n, q in model.named_parameters() if not n.endswith("_gate")]
    opt = make_optimizer(run.ds_config, [{"params": rest, "lr": args.lr},
                                         {"params": gates, "lr": args.lr * args.gate_lr}])
    sched = make_scheduler(run.ds_config, opt)
    data = run_dataset(run, prepare(run.data, run.model, str(out), 0, verbose=False), train=False)
    batches = rank_batches(data, StepBatches(0, run.micro, run.gas, 0, 1))
    t0 = time.time()
    with open(out / "log.txt", "w") as log:
        for step in range(1, args.steps + 1):
            model.train()
            total = 0.0
            for _ in range(run.gas):
                inputs, labels = next(batches)
                loss = lm_loss(model(*inputs), labels)
                (loss / run.gas).backward()
                total += loss.item() / run.gas
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if step % 50 == 0:
                g = [round(float(torch.tanh(run.model.cross_attn_gate_scale * x.detach())), 3) for x in gates]
                print(step, round(total, 4), g, round(time.time() - t0), file=log, flush=True)
            if step % args.eval_every == 0:
                model.eval()
                r = evaluate(model, run.model, seed=0, n_samples=args.eval_samples)
                per_type = {k: round(x, 2) for k, x in r["per_type"].items()}
                line = f"EVAL {step} {r['accuracy']:.3f} " + json.dumps(per_type)
                print(line, file=log, flush=True)
                print(line, flush=True)


if __name__ == "__main__":
    main()
