"""The tied-head flag read as transformers reads it, for every reader (issue 53 item 5).

transformers ties a composite model's head by the top-level config's tie_word_embeddings alone; the Qwen2-VL /
Qwen2.5-VL and LLaVA configs copy a text_config True onto a False top level when built, the Qwen3-VL, Qwen3-VL-MoE,
Qwen3.5 and LLaVA-NeXT ones do not; and where the config ties but the file holds a head that differs from the
embedding, from_pretrained leaves them untied. Each tiny model is saved by transformers with the two flags
disagreeing, both ways, then loaded by transformers and imported by mmpipe: the same tie, the same logits."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as T

import llava_next_models
from hf_models import llava_config
from mmpipe.hf.commands import hf_reader
from mmpipe.model.builder import split_aux
from qwen3_5_models import qwen3_5_config
from qwen3_models import qwen3_config
from qwen_models import qwen_config
from test_moe import moe_config

FAMILIES = {"qwen2_5_vl": (lambda: qwen_config("qwen2_5"), T.Qwen2_5_VLForConditionalGeneration),
            "qwen3_vl": (qwen3_config, T.Qwen3VLForConditionalGeneration),
            "qwen3_vl_moe": (moe_config, T.Qwen3VLMoeForConditionalGeneration),
            "qwen3_5": (qwen3_5_config, T.Qwen3_5ForConditionalGeneration),
            "llava": (lambda: llava_config("siglip_llama"), T.LlavaForConditionalGeneration),
            "llava_next": (lambda: llava_next_models.hf_config("next"), T.LlavaNextForConditionalGeneration)}
IDS = torch.tensor([[5, 17, 33, 9, 60, 41]])
UNTIED_NOTE = "read untied, as transformers loads it"


def save(family: str, top: bool, text: bool, out, edit_top: bool | None = None):
    """The family's tiny model with tie_word_embeddings `top` at the top level and `text` in text_config, saved by
    transformers (a tied one without lm_head.weight); edit_top: config.json's top-level flag rewritten afterwards
    (the file keeps the weights saved under `top`)."""
    make, cls = FAMILIES[family]
    cfg = make()
    cfg.tie_word_embeddings, cfg.text_config.tie_word_embeddings = top, text  # set after __post_init__'s copy
    torch.manual_seed(0)
    cls(cfg).eval().save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["tie_word_embeddings"], saved["text_config"]["tie_word_embeddings"]) == (top, text)
    if edit_top is not None:
        saved["tie_word_embeddings"] = edit_top
        (out / "config.json").write_text(json.dumps(saved))
    return cls


def text_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """mmpipe's logits [T, V] for a text-only prompt: one row, one empty image slot (the family's stage inputs)."""
    v, none = model.cfg.vision, torch.zeros(1, 1, dtype=torch.long)
    if model.cfg.family == "llava":
        return model.one_per_row(torch.zeros(1, v.channels, v.image_size, v.image_size), ids, none[0])[0]
    if model.cfg.family == "llava_next":
        pixels, tiling = torch.zeros(1, 1, v.channels, v.image_size, v.image_size), torch.zeros(1, 1, 4)
    else:  # the Qwen families: one merge unit of zero patches, an empty grid
        pixels, tiling = torch.zeros(1, v.merge_size ** 2, v.patch_dim), torch.zeros(1, 1, 3)
    return split_aux(model(pixels, ids, none, torch.ones_like(ids), tiling.long()))[0][0]


def assert_imported_as_transformers_loads(cls, d) -> tuple[bool, list[str]]:
    """mmpipe's import of d ties as transformers' from_pretrained does and gives its logits; (tied, notes)."""
    hf = cls.from_pretrained(d).eval()
    head, embed = hf.lm_head.weight, hf.get_input_embeddings().weight
    tied = head.data_ptr() == embed.data_ptr()
    assert tied or (head - embed).abs().max() > 0.01  # a wrong tie would change the logits
    got = hf_reader(d)(d)
    model = got.model().eval()
    assert model.cfg.text.tie_embeddings == tied
    with torch.no_grad():
        want, mine = hf(input_ids=IDS).logits[0], text_logits(model, IDS)
    assert (mine - want).abs().max() < 1e-4
    return tied, got.report.notes


@pytest.mark.parametrize("family", FAMILIES)
def test_top_false_text_true_loads_untied(family, tmp_path):
    """Top False, text_config True (Qwen3-VL-MoE's text default), saved untied: transformers loads it untied, by the
    flag (Qwen3 families, LLaVA-NeXT) or because the file's head differs from the embedding although the copied
    flag ties (Qwen2.5-VL, LLaVA), and mmpipe imports it so, where it refused both before."""
    cls = save(family, top=False, text=True, out=tmp_path)
    tied, notes = assert_imported_as_transformers_loads(cls, tmp_path)
    assert not tied
    copies_text_flag = family in ("qwen2_5_vl", "llava")
    assert any(UNTIED_NOTE in n for n in notes) == copies_text_flag


@pytest.mark.parametrize("family", FAMILIES)
def test_top_true_text_false_loads_tied(family, tmp_path):
    """Top True, text_config False, saved tied (no lm_head.weight in the file): tied in both (Qwen3-VL-MoE's head
    then the tied MoE head, mmpipe.model.moe.TiedMoeHead, where mmpipe refused it before)."""
    cls = save(family, top=True, text=False, out=tmp_path)
    tied, notes = assert_imported_as_transformers_loads(cls, tmp_path)
    assert tied and not any(UNTIED_NOTE in n for n in notes)


def test_moe_top_true_over_a_distinct_head_loads_untied(tmp_path):
    """Qwen3-VL-MoE, top True and text False over a file with its own head: transformers loads it untied (the weights
    differ), and so does mmpipe, with a note."""
    cls = save("qwen3_vl_moe", top=False, text=False, out=tmp_path / "head", edit_top=True)
    tied, notes = assert_imported_as_transformers_loads(cls, tmp_path / "head")
    assert not tied and any(UNTIED_NOTE in n for n in notes)
