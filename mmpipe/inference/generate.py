"""Single-process generation with a KV cache, for every model family: `mmpipe generate`.

The model is the pipeline's own layer list (ReferenceModel). Generation splits it in two:

    encoder layers   everything before the first cache-aware layer (patch embedding, vision
                     blocks, projector): run once, on the image, as in training.
    decoder layers   the first cache-aware layer to the head (text embedding, decoder blocks,
                     LM head): run on the prompt (prefill), then on one new token at a time.

The per-layer cached-decoding interface
---------------------------------------
A layer is cache-aware when it has a method

    decode(t: StageTuple, cache: dict, start: int) -> StageTuple | Tensor

    t.hidden     prefill (start == 0): what the layer's forward would receive (the image
                 embeddings for a text embedding; the sequence for a block). Decode steps
                 (start > 0): the new positions only, [B, T_new, D] (T_new = 1); the text
                 embedding receives t.hidden = None and embeds t.input_ids, the new tokens.
    t.input_ids  prefill: the whole prompt [B, T_text]; decode steps: the new tokens [B, T_new].
    t.vision     the projected image, as in forward (cross-attention fusion), on every call.
    cache        a dict owned by this layer for this generation (empty at prefill): store K/V
                 there, [B, H_kv, T_seen, Dh]; a cross-attention layer caches the image's K/V once.
    start        absolute decoder position of t.hidden's first row: rotary positions are
                 start..start+T_new-1, and queries may see keys 0..start+T_new-1 (prefill: the
                 layer's usual mask, e.g. moondream's bidirectional BOS + image prefix).

It must return what forward would return for those positions (the head: logits [B, T_new, V]),
so cached and uncached decoding agree (tests/test_generate.py). It does so by sharing forward's
math rather than restating it: forward and decode call one function, which takes the positions
and an optional cache (forward: start 0, no cache; e.g. DecoderBlock.run, CrossAttnBlock.fuse);
a layer that works position by position (a norm, the head) decodes with forward itself. Layers of
a new family add the method; nothing here changes.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..config import ConfigError, config_from_dict, fail
from ..data.images import ImageTransform
from ..data.text import ConversationEncoder, with_placeholders
from ..data.tokenizer import load_tokenizer
from ..hf.llava import load_hf_llava
from ..model.stage import StageTuple
from ..runtime.checkpoint import load_reference


def _split(model) -> int:
    """Index of the first cache-aware layer: the encoder layers before it run once, on the image."""
    for i, layer in enumerate(model):
        if hasattr(layer, "decode"):
            return i
    raise ValueError(f"{type(model[0]).__name__}...: no layer of this model supports cached decoding")


def _pick(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: argmax at temperature 0, else a sample from the top_k."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]


@torch.no_grad()
def generate(model, pixel_values: torch.Tensor, prompt_ids: list[int], *, eos_id: int | None,
             max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
             use_cache: bool = True) -> list[int]:
    """New token ids for one image + prompt (stops after EOS, which is not returned).
    use_cache=False reruns the whole model on the growing sequence each step (the reference)."""
    model.eval()
    ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, T_prompt]
    has_image = torch.ones(1, dtype=torch.long)
    pixels = pixel_values.to(next(model.parameters()).dtype)
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    out: list[int] = []
    if not use_cache:
        for _ in range(max_new_tokens):
            nxt = _pick(model(pixels, ids, has_image)[:, -1], temperature, top_k, gen)
            if eos_id is not None and nxt.item() == eos_id:
                break
            out.append(nxt.item())
            ids = torch.cat([ids, nxt[:, None]], dim=1)
        return out
    first = _split(model)
    enc = pixels, ids, has_image
    for layer in list(model)[:first]:
        enc = layer(enc)  # the image side, once
    t = StageTuple.unpack(enc)
    decoder = list(model)[first:]
    caches: list[dict] = [{} for _ in decoder]
    start = 0
    for _ in range(max_new_tokens):
        x = t
        for layer, cache in zip(decoder, caches):
            x = layer.decode(x, cache, start)
        logits = x  # [1, T_new, V]
        start += logits.shape[1]
        nxt = _pick(logits[:, -1], temperature, top_k, gen)
        if eos_id is not None and nxt.item() == eos_id:
            break
        out.append(nxt.item())
        t = t._replace(hidden=None, input_ids=nxt[:, None])
    return out


# ---- the command -------------------------------------------------------------------------------

def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="an mmpipe run directory (model.json + checkpoints/), a checkpoints/ directory, "
                        "or a Hugging Face LlavaForConditionalGeneration directory")
    p.add_argument("--image", required=True, help="an image file")
    p.add_argument("--prompt", required=True, help="the user's question")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: the HF directory's own, else the run's tokenizer/ (written by "
                        "mmpipe import), else the built-in one)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")


def _load(path: Path, tokenizer: str | None):
    """(model, tokenizer) from an mmpipe run / checkpoints dir or an HF LLaVA directory."""
    if (path / "config.json").is_file():
        model = load_hf_llava(path)
        return model, load_tokenizer(tokenizer or str(path))
    run_dir = path if (path / "model.json").is_file() else path.parent
    ckpt = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not (run_dir / "model.json").is_file():
        raise ConfigError(f"--checkpoint: {path} holds neither model.json (an mmpipe run) nor config.json "
                          f"(an HF model)")
    cfg = config_from_dict(json.loads((run_dir / "model.json").read_text()), run_dir.name)
    if tokenizer is None and (run_dir / "tokenizer").is_dir():  # saved there by `mmpipe import`
        tokenizer = str(run_dir / "tokenizer")
    try:
        model = load_reference(ckpt, cfg)
    except FileNotFoundError as e:
        raise ConfigError(f"--checkpoint: {e}") from None
    return model, load_tokenizer(tokenizer)


def main_generate(args: argparse.Namespace) -> int:
    try:
        model, tok = _load(Path(args.checkpoint), args.tokenizer)
        if not Path(args.image).is_file():
            raise ConfigError(f"--image: {args.image} is not a file")
        from PIL import Image
        image = Image.open(args.image).convert("RGB")
    except (ConfigError, OSError) as e:
        return fail(e if isinstance(e, ConfigError) else ConfigError(f"--image: {args.image}: {e}"))
    cfg = model.cfg
    pixels = ImageTransform(cfg.vision)(image)[None]
    prompt = ConversationEncoder(tok, cfg.text.max_context).prompt_ids([("user", args.prompt)])
    prompt = prompt_with_placeholders(cfg, prompt)
    new = generate(model, pixels, prompt, eos_id=tok.eos_token_id, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_k=args.top_k, seed=args.seed, use_cache=not args.no_cache)
    print(tok.decode(new, skip_special_tokens=True).strip())
    return 0


def prompt_with_placeholders(cfg, prompt: list[int]) -> list[int]:
    """The LLaVA family reads the image from placeholder positions: N_img of them after BOS, the
    same layout as moondream's spliced image. Other families take the prompt as it is."""
    return with_placeholders(prompt, cfg)
