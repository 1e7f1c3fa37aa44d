"""How generation picks its tokens, as one value: `Sampling`, which generate, generate_batch and
greedy_generate take (mmpipe.inference.generate, .evaluate) and `mmpipe generate` / `mmpipe eval` build from
their flags and tokenizer (Sampling.from_args), instead of the same seven arguments threaded through each.

    s = Sampling(eos_id=tok.eos_token_id, max_new_tokens=16, temperature=0.7, top_k=40, seed=1)
    answer = generate(model, pixels, prompt_ids, s)
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from ..data.text import answer_id_of


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """What every generated row follows:

    eos_id          a row stops at it (EOS is not returned); None: every row gets max_new_tokens tokens
    max_new_tokens  at most this many new tokens per row
    temperature     0: greedy, the argmax (default); > 0: a draw from softmax(logits / temperature)
    top_k           a draw picks among the k most likely tokens (0: all)
    seed            every row draws from its own generator seeded with it: a row samples as it would alone
    answer_id       never produced after the first new token (moondream's prompt format, answer_id_of;
                    mmpipe.inference.generate's module docstring); None: no such mask
    n_tokens        the tokenizer's size: no id from it on is ever produced (the vocabulary's padding, in_vocab);
                    None: every id of the head
    """
    eos_id: int | None
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    answer_id: int | None = None
    n_tokens: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, tok) -> Sampling:
        """`mmpipe generate`'s and `mmpipe eval`'s decoding: their --max-new-tokens, --temperature, --top-k and
        --seed, and the tokenizer's EOS, answer id (moondream's prompt format) and size."""
        return cls(eos_id=tok.eos_token_id, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, seed=args.seed, answer_id=answer_id_of(tok), n_tokens=len(tok))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def describe(self) -> str:
        """'greedy' or 'temperature T, top-k K, seed S'."""
        return "greedy" if self.greedy else f"temperature {self.temperature}, top-k {self.top_k}, seed {self.seed}"

    def plan(self) -> str:
        """The --dry-run plans' decoding line: describe() and the length bound."""
        return f"{self.describe()}, at most {self.max_new_tokens} new tokens"

    def to_json(self) -> str | dict:
        """answers.summary.json's "decoding": "greedy" or {temperature, top_k, seed}."""
        return "greedy" if self.greedy else {"temperature": self.temperature, "top_k": self.top_k, "seed": self.seed}

    def generators(self, n: int) -> list[torch.Generator | None]:
        """One generator per row, each seeded with `seed` (None when greedy): a row samples exactly as it would
        alone."""
        return [None if self.greedy else torch.Generator().manual_seed(self.seed) for _ in range(n)]

    def masked(self, logits: torch.Tensor, step: int, placeholder: int | None = None) -> torch.Tensor:
        """logits [B, V] of new token number `step` (0: the first, from the prompt): only text ids (in_vocab; the
        model's image placeholder never), and answer_id's logit at -inf from the second token on (moondream
        masks it on its decode steps, not on the prompt's prefill)."""
        logits = in_vocab(logits, self.n_tokens, placeholder)
        if self.answer_id is None or step == 0:
            return logits
        return logits.index_fill(-1, torch.tensor([self.answer_id], device=logits.device), float("-inf"))

    def pick(self, logits: torch.Tensor, gens: list) -> torch.Tensor:
        """logits [B, V] -> token ids [B]: the argmax when greedy, else each row's draw from its own generator
        (gens, generators(B)) among its top_k."""
        if self.greedy:
            return logits.argmax(-1)
        return torch.cat([self._draw(logits[b:b + 1], g) for b, g in enumerate(gens)])

    def _draw(self, logits: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """logits [1, V] -> [1]: a sample at `temperature` from the top_k."""
        logits = logits.float() / self.temperature
        if self.top_k > 0:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]


def in_vocab(logits: torch.Tensor, n_tokens: int | None, placeholder: int | None = None) -> torch.Tensor:
    """logits [..., V] with every id that is no text token at -inf: those from n_tokens on (the vocabulary
    is padded past the tokenizer, ModelConfig.with_vocab; such an id decodes to nothing) and the LLaVA
    family's image placeholder (placeholder_of: it marks image positions, never an answer's; a run's
    tokenizer may lack it, its export's has it). n_tokens None: the logits as they are."""
    if n_tokens is None:
        return logits
    never = torch.arange(logits.shape[-1], device=logits.device) >= n_tokens
    if placeholder is not None:
        never[placeholder] = True
    return logits.masked_fill(never, float("-inf"))
