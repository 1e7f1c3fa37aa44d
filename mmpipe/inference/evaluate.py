"""Held-out accuracy: exact match of the greedily generated answer, per question type.

Runs the single-device reference model (the pipeline's own layers, loaded from a checkpoint) in
one process. Generation recomputes the whole (short) sequence per new token; answers are 1-2 words.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..config import ModelConfig
from ..data.image_kinds import image_kind, one_image_budget
from ..data.samples import SHAPES_TEXT_LEN, ShapesSamples
from ..data.shapes import QUESTION_TYPES, ShapesVQA
from .generate import placeholder_of, with_images
from .sampling import Sampling


@torch.no_grad()
def greedy_generate(model, pixel_values: torch.Tensor, prompts: list[list[int]], sampling: Sampling, pad_id: int,
                    text_len: int, tiling: torch.Tensor | None = None) -> list[list[int]]:
    """Batched greedy decoding with right padding: causal attention after the image prefix means
    the pads to the right of a prompt never influence it, so prompts of any length share a batch.
    sampling: a greedy one (its EOS, length bound, answer-id mask and tokenizer size: the vocabulary's padding
    past it is never picked). text_len: the input_ids width (LLaVA: the prompts' placeholders included)."""
    if not sampling.greedy:
        raise ValueError(f"greedy_generate: {sampling.describe()}: greedy decoding only (generate_batch samples)")
    n_img = model.cfg.n_image_positions  # 0 when the image is attended to, not spliced
    B = len(prompts)
    ids = torch.full((B, text_len), pad_id, dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prompts])
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    out = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    rows = torch.arange(B)
    for step in range(sampling.max_new_tokens):
        if done.all() or lengths.max() >= text_len:
            break
        logits = model.one_per_row(pixel_values, ids, None, tiling)  # [B, N_img + text_len, V]
        # text token j sits at decoder position n_img + j
        nxt = sampling.masked(logits[rows, n_img + lengths - 1], step, placeholder_of(model)).argmax(-1)
        for b in range(B):
            if not done[b]:
                if nxt[b].item() == sampling.eos_id:
                    done[b] = True
                else:
                    out[b].append(nxt[b].item())
        ids[rows, lengths] = torch.where(done, pad_id, nxt)
        lengths = lengths + 1
    return out


def evaluate(model, cfg: ModelConfig, *, seed: int, n_samples: int = 1000, blank_images: bool = False,
             batch_size: int = 250, max_new_tokens: int = 4) -> dict:
    """Accuracy overall and per question type on the held-out 'eval' split (n_samples / 5 per type)."""
    model.eval()
    # Qwen2-VL, NeXT: each image as its patches (crops) and grid, one image's budget
    held_out, kind = ShapesSamples(cfg, seed, "eval", one_image_budget(cfg)), image_kind(cfg)
    data, tok = held_out.data, held_out.tok
    dtype = next(model.parameters()).dtype
    sampling = Sampling(eos_id=tok.eos_token_id, max_new_tokens=max_new_tokens, n_tokens=len(tok))
    correct, total = defaultdict(int), defaultdict(int)
    for start in range(0, n_samples, batch_size):
        samples = [data.sample(i) for i in range(start, min(start + batch_size, n_samples))]
        images = [data.blank() if blank_images else data.render(s) for s in samples]
        inputs = [held_out.transform(im) for im in images]  # multi-crop: Crops; dynamic: (patches, grid)
        pixels, tiling, grids = kind.stack(cfg, inputs)  # multi-crop: + tiling; a kind of grids: + each grid
        pixels = pixels.to(dtype)
        # LLaVA, Qwen2-VL: the image's placeholders where training puts them (the shapes set has no marker: after BOS)
        raw = [held_out.encoder.prompt([("user", s.question)], n_images=1) for s in samples]
        prompts = [with_images(ids, cfg, at, g) for (ids, at), g in zip(raw, grids)]
        answers = greedy_generate(model, pixels, prompts, sampling, tok.pad_token_id,
                                  SHAPES_TEXT_LEN + len(prompts[0]) - len(raw[0][0]), tiling)
        for s, a in zip(samples, answers):
            total[s.qtype] += 1
            correct[s.qtype] += int(tok.decode(a, skip_special_tokens=True).strip() == s.answer)
    per_type = {q: correct[q] / total[q] for q in QUESTION_TYPES if total[q]}
    return {"accuracy": sum(correct.values()) / max(1, sum(total.values())), "per_type": per_type,
            "n": sum(total.values())}


def blind_baseline(cfg: ModelConfig, *, seed: int, n_samples: int = 50000) -> dict:
    """The best score without looking at the image: per question text, always give its most common answer."""
    data = ShapesVQA(cfg.vision.image_size, cfg.vision.patch_size, "eval", seed)
    by_question: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    qtypes: dict[str, str] = {}
    for i in range(n_samples):
        s = data.sample(i)
        by_question[s.question][s.answer] += 1
        qtypes[s.question] = s.qtype
    hits, totals = defaultdict(int), defaultdict(int)
    for q, answers in by_question.items():
        hits[qtypes[q]] += max(answers.values())
        totals[qtypes[q]] += sum(answers.values())
    return {"accuracy": sum(hits.values()) / n_samples, "per_type": {q: hits[q] / totals[q] for q in totals}}
