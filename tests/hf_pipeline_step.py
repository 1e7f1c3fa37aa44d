"""2-rank driver (run under the deepspeed launcher): import an HF LLaVA directory, load it into a
2-stage PipelineModule (the tied embedding through TiedLayerSpec), train on one fixed batch for
--steps steps, save a pipeline checkpoint; the last stage writes the losses to OUT/losses.json."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--kind", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    import deepspeed
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from hf_models import batch, shifted
    from mmpipe.hf.llava import import_llava, load_into_pipeline
    from mmpipe.model.builder import layer_specs, lm_loss

    deepspeed.init_distributed()
    model, _ = import_llava(args.hf)
    pipe = PipelineModule(layers=layer_specs(model.cfg), num_stages=2, loss_fn=lm_loss, partition_method="uniform",
                          seed_layers=True, base_seed=1234)
    load_into_pipeline(pipe, model)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "steps_per_print": 1000}
    engine, _, _, _ = deepspeed.initialize(model=pipe, config=ds,
                                           model_parameters=[q for q in pipe.parameters() if q.requires_grad])
    px, ids, labels = batch(args.kind)
    item = ((px, ids, torch.ones(2, dtype=torch.long)), shifted(labels))
    losses = [float(engine.train_batch(iter([item]))) for _ in range(args.steps)]
    out = Path(args.out)
    engine.save_checkpoint(str(out / "checkpoints"), tag="step%d" % args.steps)
    if engine.is_last_stage():
        (out / "losses.json").write_text(json.dumps(losses))
    dist.barrier()


if __name__ == "__main__":
    main()
