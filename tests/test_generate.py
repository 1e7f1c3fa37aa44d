"""Generation: the KV-cached loop produces exactly the tokens of the uncached one (greedy and
sampled, moondream family; the LLaVA family is checked in test_hf_llava.py), and `mmpipe generate`
answers from a checkpoint directory in one process."""
from __future__ import annotations

import json
import subprocess
import sys

import torch
from PIL import Image

from conftest import ROOT
from mmpipe.cli import main
from mmpipe.config import load_preset
from mmpipe.data.tokenizer import builtin_tokenizer
from mmpipe.inference.generate import generate
from mmpipe.model import ReferenceModel


def _model():
    cfg = load_preset("tiny").with_vocab(len(builtin_tokenizer()))
    return ReferenceModel(cfg, seed=5)


def test_cached_equals_uncached_greedy_and_sampled():
    model = _model()
    torch.manual_seed(0)
    pixels = torch.randn(1, 3, 32, 32)
    for prompt in ([1, 7, 9], [1, 4, 11, 12, 13, 5]):
        greedy = [generate(model, pixels, prompt, eos_id=None, max_new_tokens=12, use_cache=c) for c in (True, False)]
        assert len(greedy[0]) == 12 and greedy[0] == greedy[1]
        sampled = [generate(model, pixels, prompt, eos_id=None, max_new_tokens=12, temperature=1.5, top_k=20,
                            seed=3, use_cache=c) for c in (True, False)]
        assert sampled[0] == sampled[1]
    # sampling really samples: another seed gives another continuation for at least one of 4 seeds
    runs = {tuple(generate(model, pixels, [1, 7, 9], eos_id=None, max_new_tokens=12, temperature=1.5, seed=s))
            for s in range(4)}
    assert len(runs) > 1


def test_stops_at_eos():
    model = _model()
    pixels = torch.randn(1, 3, 32, 32)
    free = generate(model, pixels, [1, 7], eos_id=None, max_new_tokens=8)
    stop = free[3]
    first = free.index(stop)
    assert generate(model, pixels, [1, 7], eos_id=stop, max_new_tokens=8) == free[:first]


def test_cli_generates_from_a_checkpoint_dir(tmp_path, capsys):
    model = _model()
    # a checkpoint in DeepSpeed's pipeline layout, as `mmpipe train` leaves it
    (tmp_path / "model.json").write_text(json.dumps(model.cfg.to_dict()))
    tag = tmp_path / "checkpoints" / "step1"
    tag.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step1")
    for i, layer in enumerate(model):
        torch.save(layer.state_dict(), tag / f"layer_{i:02d}-model_states.pt")
    Image.new("RGB", (40, 30), (200, 30, 30)).save(tmp_path / "red.png")
    cmd = [sys.executable, "-m", "mmpipe.cli", "generate", "--checkpoint", str(tmp_path), "--image",
           str(tmp_path / "red.png"), "--prompt", "what shape is red", "--max-new-tokens", "5"]
    cached = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)  # the real command line
    assert cached.returncode == 0, cached.stderr[-2000:]
    assert main(cmd[3:] + ["--no-cache"]) == 0
    assert capsys.readouterr().out == cached.stdout and cached.stdout.strip()
    assert main(cmd[3:5] + [str(tmp_path / "nope")] + cmd[6:]) == 2
    assert capsys.readouterr().err.startswith("mmpipe: error: --checkpoint:")
