"""Generation: the KV-cached loop produces exactly the tokens of the uncached one (greedy and
sampled, moondream family; the LLaVA family is checked in test_hf_llava.py), batched generation
the tokens of one record at a time (moondream, cross-attention, LLaVA; image and text-only rows;
each row stopping at its own EOS), and `mmpipe generate` answers from a checkpoint directory in one
process, one pair or many."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from PIL import Image

from conftest import ROOT, write_checkpoint
from mmpipe.cli import main
from mmpipe.config import load_preset
from mmpipe.data.image_kinds import image_kind
from mmpipe.data.text import ConversationEncoder
from mmpipe.data.tokenizer import builtin_tokenizer
from mmpipe.inference.generate import generate, generate_batch
from mmpipe.inference.sampling import Sampling
from mmpipe.model import ReferenceModel


def _model():
    cfg = load_preset("tiny").with_vocab(len(builtin_tokenizer()))
    return ReferenceModel(cfg, seed=5)


def test_cached_equals_uncached_greedy_and_sampled():
    model = _model()
    torch.manual_seed(0)
    pixels = torch.randn(1, 3, 32, 32)
    for prompt in ([1, 7, 9], [1, 4, 11, 12, 13, 5]):
        greedy = [generate(model, pixels, prompt, Sampling(eos_id=None, max_new_tokens=12), use_cache=c)
                  for c in (True, False)]
        assert len(greedy[0]) == 12 and greedy[0] == greedy[1]
        sampled = [generate(model, pixels, prompt, Sampling(eos_id=None, max_new_tokens=12, temperature=1.5, top_k=20,
                                                            seed=3), use_cache=c) for c in (True, False)]
        assert sampled[0] == sampled[1]
    # sampling really samples: another seed gives another continuation for at least one of 4 seeds
    runs = {tuple(generate(model, pixels, [1, 7, 9], Sampling(eos_id=None, max_new_tokens=12, temperature=1.5, seed=s)))
            for s in range(4)}
    assert len(runs) > 1


def test_stops_at_eos():
    model = _model()
    pixels = torch.randn(1, 3, 32, 32)
    free = generate(model, pixels, [1, 7], Sampling(eos_id=None, max_new_tokens=8))
    stop = free[3]
    first = free.index(stop)
    assert generate(model, pixels, [1, 7], Sampling(eos_id=stop, max_new_tokens=8)) == free[:first]


def test_cli_generates_from_a_checkpoint_dir(tmp_path, capsys):
    model = _model()
    write_checkpoint(model, tmp_path)
    Image.new("RGB", (40, 30), (200, 30, 30)).save(tmp_path / "red.png")
    cmd = [sys.executable, "-m", "mmpipe.cli", "generate", "--checkpoint", str(tmp_path), "--image",
           str(tmp_path / "red.png"), "--prompt", "what shape is red", "--max-new-tokens", "5"]
    cached = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)  # the real command line
    assert cached.returncode == 0, cached.stderr[-2000:]
    assert main(cmd[3:] + ["--no-cache"]) == 0
    assert capsys.readouterr().out == cached.stdout and cached.stdout.strip()
    assert main(cmd[3:5] + [str(tmp_path / "nope")] + cmd[6:]) == 2
    assert capsys.readouterr().err.startswith("mmpipe: error: --checkpoint:")


# ---- batched generation: the same answers as one record at a time ----------------------------------

def _family_model(preset: str):
    """tiny (moondream), tiny-xattn (cross-attention fusion, its gates opened: at 0, as initialised,
    the image would not count), llava-tiny (<image> placeholders, the built-in tokenizer's id 36, as a
    fresh LLaVA run on it gets)."""
    cfg = load_preset(preset)
    if image_kind(cfg).markers:
        cfg = dataclasses.replace(cfg, image_token_id=len(builtin_tokenizer(image_token=True)) - 1)
    model = ReferenceModel(cfg.with_vocab(64), seed=5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_gate"):
                param.fill_(0.7)
    return model


def _requests(cfg):
    """8 prompts: lengths 3, 4 and 6 (so buckets of several rows and of one), image and text-only mixed."""
    texts = [[1, 7, 9], [1, 4, 11, 12], [1, 8, 9], [1, 4, 11, 12, 13, 5], [1, 7, 10], [1, 5, 6, 7], [1, 7, 9],
             [1, 9, 9]]
    has_image = [True, True, False, True, True, False, True, False]
    prompts = [image_kind(cfg).with_images(t, cfg, None) if h else t for t, h in zip(texts, has_image)]
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(len(texts), 3, cfg.vision.image_size, cfg.vision.image_size, generator=g)
    pixels[[not h for h in has_image]] = 0  # text-only: the zero image training gives them
    return pixels, prompts, has_image


@pytest.mark.parametrize("preset", ["tiny", "tiny-xattn", "llava-tiny"])
def test_batched_equals_one_at_a_time(preset):
    model = _family_model(preset)
    pixels, prompts, has_image = _requests(model.cfg)
    greedy = Sampling(eos_id=None, max_new_tokens=6)
    one = [generate(model, pixels[i:i + 1], p, greedy, has_image=h) for i, (p, h) in enumerate(zip(prompts, has_image))]
    assert generate_batch(model, pixels, prompts, greedy, has_image=has_image, batch_size=3) == one
    assert [len(a) for a in one] == [6] * 8 and len({tuple(a) for a in one}) > 1
    # the text-only rows really are text-only: with the image flag on, their answers differ somewhere
    kind = image_kind(model.cfg)
    assert one[2] != generate(model, pixels[0:1], kind.with_images(prompts[2], model.cfg, None), greedy) or \
        one[5] != generate(model, pixels[0:1], kind.with_images(prompts[5], model.cfg, None), greedy)
    # each row stops at its own EOS: a token some rows produce and others do not
    eos = one[0][2]
    stopped = [a[:a.index(eos)] if eos in a else a for a in one]
    assert any(len(a) < 6 for a in stopped) and generate_batch(
        model, pixels, prompts, Sampling(eos_id=eos, max_new_tokens=6), has_image=has_image, batch_size=8) == stopped
    assert stopped == [generate(model, pixels[i:i + 1], p, Sampling(eos_id=eos, max_new_tokens=6), has_image=h)
                       for i, (p, h) in enumerate(zip(prompts, has_image))]
    # sampled: every row draws from its own generator seeded like generate's
    sampled = Sampling(eos_id=None, max_new_tokens=6, temperature=1.5, top_k=20, seed=3)
    assert generate_batch(model, pixels, prompts, sampled, has_image=has_image, batch_size=4) == [
        generate(model, pixels[i:i + 1], p, sampled, has_image=h) for i, (p, h) in enumerate(zip(prompts, has_image))]
    # and uncached, recomputing the whole sequence, agrees for the text-only rows too
    assert generate(model, pixels[2:3], prompts[2], greedy, has_image=False, use_cache=False) == one[2]


def test_cli_generates_many_in_batches(tmp_path, capsys):
    model = _model()
    write_checkpoint(model, tmp_path)
    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]
    for k, c in enumerate(colours):
        Image.new("RGB", (40, 30), c).save(tmp_path / f"im{k}.png")
    questions = ["what shape is red", "what colour is the circle", "how many shapes are there"]
    base = ["generate", "--checkpoint", str(tmp_path), "--max-new-tokens", "5"]
    single = []
    for k, q in enumerate(questions):  # the documented single-image form, one at a time
        assert main(base + ["--image", str(tmp_path / f"im{k}.png"), "--prompt", q]) == 0
        single.append(capsys.readouterr().out.strip())
    (tmp_path / "more.jsonl").write_text(json.dumps({"image": "im2.png", "prompt": questions[2]}) + "\n"
                                         + json.dumps({"prompt": questions[0]}) + "\n")
    pairs = [a for k in range(2) for a in ("--image", str(tmp_path / f"im{k}.png"), "--prompt", questions[k])]
    assert main(base + pairs + ["--records", str(tmp_path / "more.jsonl"), "--batch-size", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["answer"] for x in lines[:3]] == single and [x["prompt"] for x in lines] == questions + questions[:1]
    assert lines[2]["image"] == str(tmp_path / "im2.png") and lines[3]["image"] is None
    # the text-only record: the prompt alone, no image (what generate gives with has_image=False)
    tok = builtin_tokenizer()
    prompt = ConversationEncoder(tok, 64).prompt_ids([("user", questions[0])])
    want = generate(model, torch.zeros(1, 3, 32, 32), prompt, Sampling(eos_id=tok.eos_token_id, max_new_tokens=5),
                    has_image=False)
    assert lines[3]["answer"] == tok.decode(want, skip_special_tokens=True).strip()
    # refusals: one line each, exit 2
    assert main(base + ["--image", str(tmp_path / "im0.png")]) == 2
    assert capsys.readouterr().err.startswith("mmpipe: error: --image / --prompt:")
    (tmp_path / "bad.jsonl").write_text('{"image": "im0.png"}\n')
    assert main(base + ["--records", str(tmp_path / "bad.jsonl")]) == 2
    assert capsys.readouterr().err.startswith(f"mmpipe: error: --records: {tmp_path / 'bad.jsonl'}:1:")


def test_never_picks_an_id_past_the_tokenizer(tmp_path, capsys):
    """The vocabulary is padded past the tokenizer (ModelConfig.with_vocab: the built-in tokenizer's 36
    ids in 64): a padded id decodes to nothing, so generation never picks one (greedy or sampled, cached
    or not, one row or batched), and `mmpipe generate --records` answers a text-only record with words;
    an empty answer says why on stderr."""
    tok = builtin_tokenizer()
    n, word = len(tok), 9  # 9: "circle"
    model = ReferenceModel(load_preset("tiny").with_vocab(64), seed=5)
    assert model.cfg.text.vocab_size > n
    with torch.no_grad():
        model[-1].linear.bias[n:] = 100.0  # the padding would win every pick...
        model[-1].linear.bias[word] = 50.0  # ...over the best real token
    pixels, prompt = torch.zeros(1, 3, 32, 32), [1, 7, 9]
    assert all(t >= n for t in generate(model, pixels, prompt, Sampling(eos_id=None, max_new_tokens=3),
                                        has_image=False))
    for use_cache, sampled in ((True, {}), (False, {}), (True, dict(temperature=1.5, top_k=70, seed=1))):
        assert generate(model, pixels, prompt, Sampling(eos_id=None, max_new_tokens=3, n_tokens=n, **sampled),
                        has_image=False, use_cache=use_cache) == [word] * 3
    assert generate_batch(model, pixels.repeat(2, 1, 1, 1), [prompt, prompt],
                          Sampling(eos_id=None, max_new_tokens=3, n_tokens=n), has_image=[False, False]
                          ) == [[word] * 3] * 2
    write_checkpoint(model, tmp_path)
    (tmp_path / "text.jsonl").write_text(json.dumps({"prompt": "what shape is red"}) + "\n")
    base = ["generate", "--checkpoint", str(tmp_path), "--records", str(tmp_path / "text.jsonl"),
            "--max-new-tokens", "2"]
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["answer"] == "circle circle"
    with torch.no_grad():
        model[-1].linear.bias[tok.eos_token_id] = 200.0
    write_checkpoint(model, tmp_path / "eos")
    assert main(base[:2] + [str(tmp_path / "eos")] + base[3:]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["answer"] == "" and "empty answer: the model's first new token was EOS" in err


def test_qwen_image_the_processor_refuses_is_one_line(tmp_path, capsys):
    """A Qwen2-VL-family checkpoint given a 2000x5 image (an aspect over the processor's 200:1): one line naming
    the image and the kind training and eval count it as (bad_aspect, the data side's own check), exit 2, not
    transformers' ValueError."""
    from mmpipe.data.patches import default_patch_budget, patch_rule
    from mmpipe.data.records import BadRecord
    cfg = load_preset("qwen-tiny")
    write_checkpoint(ReferenceModel(cfg, seed=0), tmp_path / "run")
    Image.new("RGB", (2000, 5), (200, 30, 30)).save(tmp_path / "thin.png")
    with pytest.raises(BadRecord) as data_side:
        patch_rule(cfg, default_patch_budget(cfg.vision, 1)).grid(2000, 5)
    assert data_side.value.kind == "bad_aspect"
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--image", str(tmp_path / "thin.png"),
                 "--prompt", "what colour"]) == 2
    err = capsys.readouterr().err
    assert err == f"mmpipe: error: --image: {tmp_path / 'thin.png'}: {data_side.value.reason}; bad_aspect: give an " \
                  f"image the model's image processor takes (crop or pad it)\n"
