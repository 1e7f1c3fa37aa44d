"""The commands: `mmpipe import` (HF LLaVA dir, moondream file) -> run dir, `mmpipe generate` from the
HF dir and from the run dir gives HF's own greedy answer, `mmpipe export` back to an HF dir and to
one safetensors file in the family's names; bad input is one error line."""
from __future__ import annotations

import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import LlavaForConditionalGeneration

from hf_models import save_hf, word_tokenizer
from mmpipe.cli import main
from mmpipe.config import load_preset
from mmpipe.data.images import ImageTransform
from mmpipe.hf.commands import save_run
from mmpipe.hf.llava import import_llava
from mmpipe.hf.moondream import key_map
from mmpipe.model import ReferenceModel
from mmpipe.runtime.checkpoint import load_reference

TEMPLATE = "{{ bos_token }}{% for m in messages %}w4 {{ m['content'] }} {% endfor %}w5"


def _tokenizer(path):
    return word_tokenizer(path, TEMPLATE)


def test_import_generate_export_llava(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    hf = save_hf("siglip_llama", hf_dir)
    tok = _tokenizer(hf_dir)
    Image.new("RGB", (32, 32), (10, 200, 30)).save(tmp_path / "img.png")
    gen = ["generate", "--image", str(tmp_path / "img.png"), "--prompt", "w7 w8", "--max-new-tokens", "6"]
    assert main(gen + ["--checkpoint", str(hf_dir)]) == 0
    from_hf = capsys.readouterr().out.strip()
    # HF's own greedy decoding of the same prompt: BOS, the 16 placeholders, the templated text
    model, _ = import_llava(hf_dir)
    pixels = ImageTransform(model.cfg.vision)(Image.open(tmp_path / "img.png"))[None]
    ids = [1] + [99] * 16 + tok("w4 w7 w8 w5", add_special_tokens=False).input_ids
    out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=6, do_sample=False,
                      eos_token_id=2)
    assert from_hf == tok.decode(out[0, len(ids):], skip_special_tokens=True).strip()

    run = tmp_path / "run"
    assert main(["import", "--hf", str(hf_dir), "--out", str(run)]) == 0
    assert "tokenizer saved" in capsys.readouterr().out
    assert main(gen + ["--checkpoint", str(run)]) == 0  # the tokenizer import saved in run/tokenizer
    assert capsys.readouterr().out.strip() == from_hf

    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "back")]) == 0
    back = LlavaForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        assert (back(input_ids=x, pixel_values=pixels).logits - model(pixels, x)).abs().max().item() < 1e-4
    assert main(["export", "--checkpoint", str(run), "--format", "safetensors",
                 "--out", str(tmp_path / "m.safetensors")]) == 0
    flat = load_file(str(tmp_path / "m.safetensors"))
    assert len(flat) == len(model.state_dict()) and "model.language_model.layers.1.mlp.up_proj.weight" in flat


def test_moondream_export_import_and_refusals(tmp_path, capsys):
    model = ReferenceModel(load_preset("tiny"), seed=8)
    save_run(model, tmp_path / "run")
    for layout in ("current", "legacy"):
        f = tmp_path / f"{layout}.safetensors"
        assert main(["export", "--checkpoint", str(tmp_path / "run"), "--format", "safetensors", "--layout", layout,
                     "--out", str(f)]) == 0
        assert sorted(load_file(str(f))) == sorted(key_map(model.cfg, layout).values())
        assert main(["import", "--moondream", str(f), "--preset", "tiny", "--out", str(tmp_path / layout)]) == 0
        again = load_reference(tmp_path / layout / "checkpoints", model.cfg)
        for k, v in model.state_dict().items():
            assert torch.equal(v, again.state_dict()[k]), (layout, k)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip() == ("mmpipe: error: --format hf: only the LLaVA family has an HF model "
                                               "class; use --format safetensors for the moondream family (a LoRA "
                                               "run's adapters merged in)")
    assert main(["import", "--moondream", str(tmp_path / "current.safetensors"), "--out", str(tmp_path / "y")]) == 2
    assert "needs --preset" in capsys.readouterr().err
