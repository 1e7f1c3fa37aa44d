"""2-rank driver (run under the deepspeed launcher): import an HF LLaVA directory, load it into
mmpipe's 2-stage VLMPipeline (the partition `mmpipe train` computes, parameters marked for the
global-norm clipping, the tied embedding through TiedLayerSpec), train on one fixed batch for
--steps steps, save a pipeline checkpoint; the last stage writes the losses to OUT/losses.json.
(`mmpipe train --init-from` runs the same path on a dataset: tests/test_hf_init.py.)"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
    import dataclasses

    import torch.distributed as dist

    from hf_models import batch, shifted
    from mmpipe.hf.llava import import_llava, load_into_pipeline
    from mmpipe.model.rows import sample_rows
    from mmpipe.run_args import TrainArgs
    from mmpipe.run_config import resolve
    from mmpipe.runtime.pipeline import VLMPipeline
    from mmpipe.runtime.wire import install as install_wire

    deepspeed.init_distributed()
    model, _ = import_llava(args.hf)
    out = Path(args.out)
    (out / "model.json").write_text(json.dumps(model.cfg.to_dict()))
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "steps_per_print": 1000}
    (out / "ds.json").write_text(json.dumps(ds))
    run = resolve(TrainArgs.from_argv(["--preset", str(out / "model.json"), "--ds-config", str(out / "ds.json"),
                                "--stages", "2"]), world_size=2)
    run = dataclasses.replace(run, model=model.cfg)  # as imported (a fresh run would fit <image> to its tokenizer)
    pipe = VLMPipeline(run, seed=1234)
    load_into_pipeline(pipe, model)
    engine, _, _, _ = deepspeed.initialize(model=pipe, config=run.ds_config,
                                           model_parameters=[q for q in pipe.parameters() if q.requires_grad])
    px, ids, labels = batch(args.kind)
    install_wire(engine)  # as mmpipe train: only floats cross the stage boundary
    item = ((px, *sample_rows(model.cfg, ids)), shifted(labels))  # one sample per row
    losses = [float(engine.train_batch(iter([item]))) for _ in range(args.steps)]
    engine.save_checkpoint(str(out / "checkpoints"), tag="step%d" % args.steps)
    if engine.is_last_stage():
        (out / "losses.json").write_text(json.dumps(losses))
    dist.barrier()


if __name__ == "__main__":
    main()
