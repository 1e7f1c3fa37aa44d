"""The commands: `mmpipe import` (HF LLaVA dir, moondream file) -> run dir, `mmpipe generate` from the
HF dir and from the run dir gives HF's own greedy answer, `mmpipe export` back to an HF dir and to
one safetensors file in the family's names; bad input is one error line."""
from __future__ import annotations

import pytest
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


def exported_ids(out) -> list[tuple]:
    """(bos, eos, pad) of an HF export as transformers reads them: its config's text config, and its
    generation_config.json, whose eos is where transformers' generate stops."""
    from transformers import AutoConfig, GenerationConfig
    text, gen = AutoConfig.from_pretrained(out).get_text_config(), GenerationConfig.from_pretrained(out)
    return [(c.bos_token_id, c.eos_token_id, c.pad_token_id) for c in (text, gen)]


def ids_of(tok) -> list[tuple]:
    return [(tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)] * 2


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
        assert (back(input_ids=x, pixel_values=pixels).logits - model.one_per_row(pixels, x)).abs().max().item() < 1e-4
    assert "with the run's tokenizer" in capsys.readouterr().out
    assert exported_ids(tmp_path / "back") == ids_of(tok) == [(1, 2, 0)] * 2  # the tokenizer's, stop included
    assert main(gen + ["--checkpoint", str(tmp_path / "back")]) == 0  # the run's tokenizer rode along
    assert capsys.readouterr().out.strip() == from_hf
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
    assert capsys.readouterr().err.strip() == (
        "mmpipe: error: --format hf: the moondream family has no HF model class to export to (the llava, qwen2_vl, "
        "llava_next, qwen3_vl, qwen3_5, internvl, gemma3, gemma4 families have); use --format safetensors (a LoRA "
        "run's adapters merged in)")
    assert main(["import", "--moondream", str(tmp_path / "current.safetensors"), "--out", str(tmp_path / "y")]) == 2
    assert "needs --preset" in capsys.readouterr().err


def test_exported_builtin_llava_run_is_a_checkpoint(tmp_path, capsys):
    """docs/hf.md: `mmpipe export` of a llava-tiny run (the built-in tokenizer, <image> at id 36) writes the
    tokenizer and an HF processor beside the weights, so `mmpipe generate --checkpoint OUT` answers as the
    run does and AutoProcessor expands <image> to the model's 16 positions; the files follow the umask.
    Without a tokenizer, --checkpoint is blamed (not a --tokenizer the user did not pass), in one whole line."""
    import dataclasses
    import os

    from transformers import AutoProcessor

    from conftest import write_checkpoint
    from mmpipe.data.tokenizer import builtin_tokenizer
    cfg = dataclasses.replace(load_preset("llava-tiny"), image_token_id=36).with_vocab(64)
    write_checkpoint(ReferenceModel(cfg, seed=3), tmp_path / "run")
    Image.new("RGB", (32, 32), (10, 200, 30)).save(tmp_path / "img.png")
    gen = ["generate", "--image", str(tmp_path / "img.png"), "--prompt", "what shape is red", "--max-new-tokens",
           "4", "--checkpoint"]
    assert main(gen + [str(tmp_path / "run")]) == 0
    from_run = capsys.readouterr().out
    out = tmp_path / "exported-llava"
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert "tokenizer and processor" in capsys.readouterr().out
    # the built-in tokenizer's ids (a Qwen2-shaped decoder: transformers' Qwen2Config has none of its own)
    assert exported_ids(out) == ids_of(builtin_tokenizer(image_token=True)) == [(1, 2, 0)] * 2
    assert main(gen + [str(out)]) == 0
    assert capsys.readouterr().out == from_run
    processor = AutoProcessor.from_pretrained(out)
    ids = processor(images=Image.open(tmp_path / "img.png"), text="<image> what", return_tensors="pt")["input_ids"]
    assert (ids == 36).sum().item() == cfg.vision.n_tokens == 16
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    for f in out.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith("_config.json") or f.name.endswith(".jinja"):
            f.unlink()
    assert main(gen + [str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mmpipe: error: --checkpoint: {out} holds no tokenizer") and "--tokenizer DIR" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("config_class, kind", [("Glm4vMoeConfig", "glm4v_moe"), ("PaliGemmaConfig", "paligemma")])
def test_unread_model_type_is_one_line_naming_the_read_ones(tmp_path, capsys, config_class, kind):
    """An HF directory of a model type no importer reads (transformers' own config.json of a GLM-4.5V MoE, a PaliGemma):
    `mmpipe import --hf` (and its --dry-run) and `mmpipe generate` say in one line, exit 2, that this type is not
    read (yet) and which are (mmpipe.hf.commands.hf_model_types(): the registered families' HfSide.model_types)."""
    import transformers

    from mmpipe.hf.commands import hf_model_types
    getattr(transformers, config_class)().save_pretrained(tmp_path / "hf")
    Image.new("RGB", (32, 32)).save(tmp_path / "img.png")
    read = ["gemma3", "gemma4", "internvl", "llava", "llava_next", "llava_onevision", "qwen2_5_vl", "qwen2_vl",
            "qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"]
    assert hf_model_types() == read
    want = (f"mmpipe: error: {tmp_path / 'hf' / 'config.json'}: model_type '{kind}' is not one mmpipe reads (yet); "
            f"it reads {', '.join(read)}\n")
    for cmd in (["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")],
                ["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), "--dry-run"],
                ["generate", "--checkpoint", str(tmp_path / "hf"), "--image", str(tmp_path / "img.png"),
                 "--prompt", "w7"]):
        assert main(cmd) == 2, cmd
        assert capsys.readouterr().err == want, cmd
    assert not (tmp_path / "run").exists()
