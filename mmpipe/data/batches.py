"""Samples -> tensors, and the per-rank micro-batch stream DeepSpeed's pipeline pulls from.

Sequence layout for one sample (text_len = 12, 16 image tokens, so T = 28 decoder positions):

    text tokens    [BOS] question: what shape is red circle [EOS] [PAD] ...
    decoder input  [BOS] img_1 .. img_N question: what shape is red circle [EOS] [PAD] ...
    labels         position p holds the token p should predict (p + 1's token) for the answer
                   words and EOS, IGNORE_INDEX elsewhere: loss on answer tokens only.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torchvision.transforms import v2

from ..config import ModelConfig
from ..model.builder import IGNORE_INDEX
from .shapes import Sample, ShapesVQA
from .tokenizer import builtin_tokenizer, prompt_text

TEXT_LEN = 12  # longest shapes text, BOS + question: what colour is in the top-left + cyan + EOS, is 10 tokens


class Encoder:
    def __init__(self, cfg: ModelConfig, text_len: int = TEXT_LEN, tokenizer=None):
        self.cfg, self.text_len = cfg, text_len
        self.tok = tokenizer or builtin_tokenizer()
        v = cfg.vision
        self.transform = v2.Compose([v2.ToImage(), v2.Resize((v.image_size, v.image_size)),
                                     v2.ToDtype(torch.float32, scale=True), v2.Normalize(v.mean, v.std)])

    def pixels(self, image) -> torch.Tensor:
        return self.transform(image.convert("RGB"))  # [C, H, W], normalised

    def prompt_ids(self, question: str) -> list[int]:
        return [self.tok.bos_token_id] + self.tok(prompt_text(question), add_special_tokens=False).input_ids

    def text(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [text_len], labels [N_img + text_len]."""
        prompt = self.prompt_ids(sample.question)
        answer = self.tok(sample.answer, add_special_tokens=False).input_ids + [self.tok.eos_token_id]
        ids = prompt + answer
        if len(ids) > self.text_len:
            raise ValueError(f"sample needs {len(ids)} text tokens, more than text_len {self.text_len}")
        input_ids = torch.full((self.text_len,), self.tok.pad_token_id, dtype=torch.long)
        input_ids[:len(ids)] = torch.tensor(ids)
        n_img = self.cfg.vision.n_tokens
        labels = torch.full((n_img + self.text_len,), IGNORE_INDEX, dtype=torch.long)
        # text token j sits at decoder position n_img + j (j >= 1), and is predicted from position n_img + j - 1
        for j in range(len(prompt), len(ids)):
            labels[n_img + j - 1] = ids[j]
        return input_ids, labels


def micro_batch_indices(step: int, micro: int, gas: int, dp_rank: int, dp_size: int) -> list[list[int]]:
    """Sample indices of one optimizer step for one data-parallel rank, as gas micro-batches.
    A step consumes micro x gas x dp samples (e.g. 32 x 2 x 1 = 64), at [step * 64, (step + 1) * 64):
    micro-batch m of rank d takes the slice starting at (m * dp + d) * micro."""
    base = step * micro * gas * dp_size
    return [[base + (m * dp_size + dp_rank) * micro + i for i in range(micro)] for m in range(gas)]


def pipeline_batches(cfg: ModelConfig, *, seed: int, start_step: int, micro: int, gas: int,
                     dp_rank: int = 0, dp_size: int = 1, need_inputs: bool = True, need_labels: bool = True,
                     dtype: torch.dtype = torch.float32) -> Iterator[tuple]:
    """Endless ((pixel_values, input_ids), labels) micro-batches for one rank, starting at start_step.
    The first and last stages of a pipeline run this with the same arguments and so see the same
    micro-batches in the same order; the last stage passes need_inputs=False and renders no image."""
    data = ShapesVQA(cfg.vision.image_size, cfg.vision.patch_size, "train", seed)
    enc = Encoder(cfg)
    step = start_step
    while True:
        for idxs in micro_batch_indices(step, micro, gas, dp_rank, dp_size):
            samples = [data.sample(i) for i in idxs]
            texts = [enc.text(s) for s in samples]
            input_ids = torch.stack([t[0] for t in texts])
            labels = torch.stack([t[1] for t in texts]) if need_labels else None
            inputs = None
            if need_inputs:
                pixels = torch.stack([enc.pixels(data.render(s)) for s in samples]).to(dtype)
                inputs = (pixels, input_ids)
            yield inputs, labels
        step += 1
