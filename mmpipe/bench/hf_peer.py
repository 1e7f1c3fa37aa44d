"""Peer (a): transformers' LlavaForConditionalGeneration with the variant's shapes, trained by a plain
torch AdamW loop in one process, one thread (like one mmpipe CPU rank).

For a LLaVA-family preset the HF config is mmpipe.hf.llava.hf_config(cfg) (the identical model).
For a moondream-family preset (e.g. `small`) there is no HF moondream class in transformers, so the
peer is the closest LLaVA with the same shapes: a CLIP tower (dim, blocks, heads, MLP width, image
and patch size of the preset; CLS token dropped, so the same image tokens), the 2-layer GELU
projector, and a Llama decoder (dim, blocks, heads, vocab, MLP width). What differs: Llama's
SwiGLU MLP has 3 matrices where moondream's GELU MLP has 2, RMSNorm for LayerNorm, full rotary for
partial, no parallel attention; docs/benchmarks.md counts the FLOPs of both.
Inputs are mmpipe's own batches: the image positions become <image> placeholders in input_ids.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ..hf.llava import hf_config
from ..model.rows import IMAGE_SLOT
from ..registry import family_of
from ..runtime.feed import decoder_length
from ..runtime.reference import gradient_clipping, make_optimizer, make_scheduler, train_step
from ..runtime.steplog import StepLog
from .memory import write_peak
from .peer_common import batches, peer_args, peer_samples, resolved, step_counter


def hf_model_config(cfg):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    hf = family_of(cfg).hf
    if hf is not None and hf.names == "hf":
        return hf_config(cfg)
    v, t = cfg.vision, cfg.text
    vision = CLIPVisionConfig(hidden_size=v.dim, intermediate_size=v.ff_dim, num_hidden_layers=v.n_layers,
                              num_attention_heads=v.n_heads, image_size=v.image_size, patch_size=v.patch_size,
                              hidden_act="gelu")
    text = LlamaConfig(hidden_size=t.dim, intermediate_size=t.ff_dim, num_hidden_layers=t.n_layers,
                       num_attention_heads=t.n_heads, num_key_value_heads=t.n_heads, vocab_size=t.vocab_size + 1,
                       max_position_embeddings=t.max_context, tie_word_embeddings=False)
    # one extra token id serves as <image>; vision_feature_layer -1 + 'default' drops CLS: n_tokens features
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=t.vocab_size, vision_feature_layer=-1,
                       vision_feature_select_strategy="default", tie_word_embeddings=False)


def main(argv=None) -> int:
    a = peer_args(argv)
    torch.set_num_threads(1)
    from transformers import LlavaForConditionalGeneration
    run = resolved(a, 1, 1)
    hf = hf_model_config(run.model)
    torch.manual_seed(a.seed)
    model = LlavaForConditionalGeneration(hf).train()
    params = list(model.parameters())
    opt = make_optimizer(run.ds_config, params)
    sched = make_scheduler(run.ds_config, opt)  # the same LR schedule as the mmpipe variant
    clip = gradient_clipping(run.ds_config)
    samples = peer_samples(run, a.seed, a.out)
    stream, counts = batches(run, a.seed, samples=samples), step_counter(run, samples)

    def micro_loss():
        (pixels, ids, has_image, _segments), labels = next(stream)  # one sample per row, one image slot
        ids = torch.where(ids == IMAGE_SLOT, hf.image_token_id, ids)  # moondream's image block: HF's placeholders
        pixels = pixels.flatten(0, 1)[has_image.flatten() > 0]  # the used slots, in the blocks' order
        # mmpipe's labels are aligned with its logits (next-token targets per position); HF
        # shifts them itself, so hand it the targets one position later
        hf_labels = torch.full_like(labels, -100)
        hf_labels[:, 1:] = labels[:, :-1]
        return model(pixel_values=pixels, input_ids=ids, labels=hf_labels).loss

    log = StepLog(Path(a.out), run.micro * run.gas, decoder_length(run))  # e.g. 16 image + 12 text = 28 per row
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        loss = train_step(micro_loss, run.gas, params, opt, sched, clip)
        dt = time.perf_counter() - t0
        log.step(step, loss, dt, counts(step))
    log.finish(params=sum(p.numel() for p in params), hf_model="LlavaForConditionalGeneration",
               data={"text_len": run.text_len, **log.seen()})
    write_peak(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
