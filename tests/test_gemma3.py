"""The gemma3 family against transformers' Gemma3ForConditionalGeneration (tiny, random, built here; 3 decoder
layers, every 3rd global, a 6-position sliding window, linear RoPE scaling on the global layer, 4 soft tokens per
image): `mmpipe import --hf` gives transformers' logits with two images a sample (their tokens bidirectional); a
packed row's samples each give their logits alone, on the CPU split, the dense mask and FlexAttention's rule, and
the row's mask for one sample is transformers' own; greedy generation (sliding layers keeping their window) equals
transformers' for 4 images of different sizes in one batch through transformers' Gemma3Processor; PP=2 cut inside
the tower, packed rows, equals the single-device reference and moved every weight; the presets have the published
parameter counts. One launch."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from conftest import EQUIV_STEPS, Run, assert_weights_moved, mmpipe_train
from mmpipe.cli import main
from mmpipe.config import ConfigError, config_from_dict, load_preset
from mmpipe.model import layer_param_counts
from mmpipe.model.attention import document_block_mask, row_attention, row_mask, sample_split
from mmpipe.model.gemma3 import image_blocks
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference

LOGITS_TOL, TOL = 1e-4, 1e-5
IMG, BOI, EOI, VOCAB = 60, 61, 62, 64
WINDOW, SOFT = 6, 4  # sliding window; soft tokens per image: 32 px / 4 = 8 x 8 patches pooled 2 x 2
TEMPLATE = ("{{ bos_token }} {% for m in messages %}{% if m['role'] == 'user' %}w4 {{ m['content'] }} w5 "
            "{% else %}{{ m['content'] }} {{ eos_token }} {% endif %}{% endfor %}")
# layers: 0 VisionEmbed, 1-2 TowerBlock, 3 Gemma3Projector, 4 Gemma3Embed, 5-6 sliding, 7 global, 8 norm, 9 head
CUT = "2"


def _hf_model(seed: int = 0):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=VOCAB, sliding_window=WINDOW, sliding_window_pattern=3,
                query_pre_attn_scalar=12, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=4, vision_use_head=False)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=SOFT, image_token_index=IMG,
        boi_token_index=BOI, eoi_token_index=EOI)).eval()
    with torch.no_grad():  # HF's init leaves norms at 0 (x (1 + w)), biases and the projection at 0: perturbed
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "mm_input" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(8)  # std 0.02 makes attention ~uniform: the mask would hardly show
    return model


def _tokenizer(path):
    """Word-level w0..w63 (BOS w1, EOS w2, pad w0), with Gemma 3's image tokens at IMG, BOI and EOI."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    special = {IMG: "<image_soft_token>", BOI: "<start_of_image>", EOI: "<end_of_image>"}
    vocab = {special.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="w1", eos_token="w2", pad_token="w0", unk_token="w3",
        additional_special_tokens=list(special.values()),
        extra_special_tokens={"image_token": special[IMG], "boi_token": special[BOI], "eoi_token": special[EOI]})
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers' model, its directory, the run `mmpipe import --hf` made of it, the imported model)."""
    d = tmp_path_factory.mktemp("gemma3")
    hf = _hf_model()
    hf.save_pretrained(d / "hf")
    _tokenizer(d / "hf")
    assert main(["import", "--hf", str(d / "hf"), "--out", str(d / "run")]) == 0
    cfg = config_from_dict(json.loads((d / "run" / "model.json").read_text()), "gemma3")
    return hf, d / "hf", d / "run", load_reference(d / "run" / "checkpoints", cfg).eval()


def _two_image_prompts(g):
    """2 prompts of 20 tokens, each with two images (BOI, 4 soft tokens, EOI) and 8 pixel images."""
    ids = torch.randint(3, IMG, (2, 20), generator=g)
    for a in (2, 11):
        ids[:, a], ids[:, a + 1:a + 1 + SOFT], ids[:, a + 1 + SOFT] = BOI, IMG, EOI
    return ids, torch.randn(2, 2, 3, 32, 32, generator=g)


def test_import_gives_transformers_logits(imported):
    hf, _, _, model = imported
    assert [type(x).__name__ for x in model][3:10] == ["Gemma3Projector", "Gemma3Embed", "Gemma3SlidingBlock",
                                                       "Gemma3SlidingBlock", "Gemma3Block", "Gemma3FinalNorm",
                                                       "TiedCall"]
    ids, px = _two_image_prompts(torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=px.flatten(0, 1), token_type_ids=(ids == IMG).long()).logits
        causal = hf(input_ids=ids, pixel_values=px.flatten(0, 1)).logits  # no token types: no bidirectional blocks
        got = model(px, ids, torch.ones(2, 2, dtype=torch.long), torch.ones_like(ids))
    assert (got - want).abs().max().item() < LOGITS_TOL
    assert (causal - want).abs().max().item() > 100 * LOGITS_TOL  # the image blocks' attention shows


def _packed(ids, px):
    """The two prompts packed in one row of 48 (2 x 20 + 8 padding), their 4 images in its slots."""
    row = torch.zeros(1, 48, dtype=torch.long)
    row[0, :20], row[0, 20:40] = ids[0], ids[1]
    segments = torch.zeros_like(row)
    segments[0, :20], segments[0, 20:40] = 1, 2
    return px.reshape(1, 4, 3, 32, 32), row, torch.tensor([[1, 1, 2, 2]]), segments


@pytest.mark.parametrize("backend", ["auto", "dense"])
def test_packed_row_equals_each_sample_alone(imported, backend, monkeypatch):
    """On CPU auto is the split by sample, each sample's SDPA under its own mask (image blocks, window)."""
    monkeypatch.setenv("MMPIPE_ATTENTION", backend)
    *_, model = imported
    ids, px = _two_image_prompts(torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = model(px, ids, torch.ones(2, 2, dtype=torch.long), torch.ones_like(ids))
        packed = model(*_packed(ids, px))
    assert (packed[0, :20] - alone[0]).abs().max().item() < TOL
    assert (packed[0, 20:40] - alone[1]).abs().max().item() < TOL


def test_row_mask_is_transformers_mask_and_every_path_keeps_it():
    """For one sample, row_mask with the image blocks (and a window) is transformers' Gemma 3 mask (full and
    sliding layers); in a packed row, the split's per-sample masks and FlexAttention's rule are row_mask's."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )
    ids, _ = _two_image_prompts(torch.Generator().manual_seed(3))
    one = ids[:1]
    cfg = Gemma3TextConfig(sliding_window=WINDOW, num_hidden_layers=3, sliding_window_pattern=3)
    cfg._attn_implementation = "sdpa"
    theirs = create_masks_for_vision_model(cfg, torch.zeros(1, 20, 8), None, None, torch.arange(20)[None],
                                           get_block_sequence_ids_for_mask((one == IMG).long()))
    blocks, seg = image_blocks(one, IMG), torch.ones_like(one)
    assert torch.equal(row_mask(seg, blocks=blocks), theirs["full_attention"])
    assert torch.equal(row_mask(seg, blocks=blocks, window=WINDOW), theirs["sliding_attention"])
    _, row, _, segments = _packed(ids, torch.zeros(2, 2, 3, 32, 32))
    blocks = image_blocks(row, IMG)
    for window in (None, WINDOW):
        dense = row_mask(segments, blocks=blocks, window=window)
        assert torch.equal(dense[0, 0, :20, :20], row_mask(seg, blocks=image_blocks(one, IMG), window=window)[0, 0])
        from mmpipe.model.attention import dense_of
        assert torch.equal(dense_of(document_block_mask(segments, blocks=blocks, window=window)), dense)
        split = sample_split(segments, blocks, window)
        q, k, v = (torch.randn(1, 2, 48, 8, generator=torch.Generator().manual_seed(s)) for s in (4, 5, 6))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        assert (split.attend(q, k, v) - want).abs().max().item() < 1e-6
    assert isinstance(row_attention(segments, blocks=blocks, window=WINDOW).masks, list)  # CPU: the split


def _images():
    """4 images of different sizes and aspect ratios."""
    g = torch.Generator().manual_seed(5)
    return [Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy())
            for h, w in ((32, 32), (20, 50), (64, 40), (17, 23))]


def test_generate_equals_transformers_greedy_batch(imported, tmp_path, capsys):
    """`mmpipe generate --checkpoint HF_DIR` with 4 images of different sizes in one batch (the family's image kind:
    transformers' Gemma3ImageProcessor, each block bracketed by <start_of_image> / <end_of_image>; 11 prompt positions,
    up to 12 new tokens, so the sliding layers' 6-position window slides and their cache keeps its last 5) answers
    what transformers' greedy generate answers on Gemma3Processor's inputs for each image alone."""
    hf, d, _, _ = imported
    paths, texts = [], []
    for i, im in enumerate(_images()):
        paths.append(tmp_path / f"{i}.png")
        im.save(paths[-1])
        texts.append(f"w{40 + i} w{50 + i}")  # no w1x / w2x words: "w1" is BOS and "w2" EOS to the tokenizer
    argv = ["generate", "--checkpoint", str(d), "--max-new-tokens", "12"]
    for path, text in zip(paths, texts):
        argv += ["--image", str(path), "--prompt", f"<image>\n{text}"]
    capsys.readouterr()
    assert main(argv) == 0
    got = [json.loads(line)["answer"] for line in capsys.readouterr().out.splitlines()]
    proc = _processor(d)
    want = []
    for im, text in zip(_images(), texts):
        inputs = proc(images=[[im]], text=[f"w1 w4 <start_of_image> {text} w5"], return_tensors="pt")
        assert inputs["input_ids"].shape[1] == 5 + SOFT + 2
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=12, do_sample=False)
        want.append(proc.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    assert got == want
    assert len(set(got)) > 1 and max(len(a.split()) for a in got) > 6  # answers differ, and past the window


def _processor(d):
    from transformers import AutoTokenizer, Gemma3ImageProcessor, Gemma3Processor
    tok = AutoTokenizer.from_pretrained(d)
    return Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok,
                           image_seq_length=SOFT)


def test_bad_configs_are_one_line(imported, tmp_path):
    _, d, run, _ = imported
    data = json.loads((run / "model.json").read_text())
    with pytest.raises(ConfigError, match=r"vision.mm_tokens: 5 must be a square"):
        config_from_dict(data | {"vision": data["vision"] | {"mm_tokens": 5}}, "bad")
    hf = json.loads((d / "config.json").read_text())
    hf["text_config"]["final_logit_softcapping"] = 30.0
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(hf))
    from mmpipe.hf.gemma3 import hf_gemma3_config
    with pytest.raises(ConfigError, match="final_logit_softcapping: 30.0: logit soft-capping is not implemented"):
        hf_gemma3_config(bad)


def _records(d) -> str:
    """16 LLaVA records, a 32 px image each and a question / answer of 1-3 words: two fit a packed row."""
    g = torch.Generator().manual_seed(0)
    (d / "img").mkdir()
    lines = []
    for i in range(16):
        Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).byte().numpy()).save(d / "img" / f"{i}.png")
        q, a = (torch.randint(40, IMG, (1 + i % 3,), generator=g).tolist() for _ in range(2))  # no w1x: BOS w1
        lines.append(json.dumps({"image": f"img/{i}.png", "conversations": [
            {"from": "human", "value": "<image>\n" + " ".join(f"w{t}" for t in q)},
            {"from": "gpt", "value": " ".join(f"w{t}" for t in a)}]}) + "\n")
    (d / "data.jsonl").write_text("".join(lines))
    return str(d / "data.jsonl")


@pytest.fixture(scope="module")
def trained(imported, equivalence_config, tmp_path_factory):
    """The one launch: PP=2 from the imported run, packed rows of 2 image slots, cut inside the tower; and its
    single-device reference."""
    run = imported[2]
    d = tmp_path_factory.mktemp("gemma3_train")
    args = ["--init-from", str(run), "--data", _records(d), "--text-len", "14", "--pack", "--max-images", "2",
            "--ds-config", str(equivalence_config), "--steps", str(EQUIV_STEPS), "--eval-samples", "0", "--seed", "3"]
    rc = resolve(TrainArgs.from_argv(args + ["--stages", "1"]), world_size=1)
    reference = train_reference(rc, seed=3, steps=EQUIV_STEPS, out_dir=str(d / "ref"))
    pp2 = Run(d / "pp2", mmpipe_train(["--output-dir", str(d / "pp2"), *args, "--stages", "2", "--partition", CUT],
                                      MMPIPE_WIRE_LOG=str(d / "pp2"))).check()
    return rc.model, reference, pp2


def test_pp2_packed_equals_reference(imported, trained, equivalence_config):
    cfg, (ref_model, ref_losses), pp2 = trained
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-3  # it trained
    assert pp2.summary["parts"] == [0, 2, 10]
    for step, want in enumerate(ref_losses, start=1):
        assert pp2.losses[step] == pytest.approx(want, abs=TOL), step
    model = load_reference(pp2.out / "checkpoints", cfg)
    # but the tower's key biases: softmax cancels q.b_k, so their gradient is 0 in exact arithmetic and Adam scales
    # its rounding noise (~1e-10) into steps of the learning rate's order: 9e-5 apart here, the rest within 5e-7
    ref = ref_model.state_dict()
    diffs = {k: (v - ref[k]).abs().max().item() for k, v in model.state_dict().items() if not k.endswith("k_proj.bias")
             or not k.startswith(("1.", "2."))}
    assert max(diffs.values()) < TOL, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    init = load_reference(imported[2] / "checkpoints", cfg)
    assert_weights_moved(model, init, TOL, no_gradient=("k_proj.bias",))
    pp2.assert_only_floats_crossed(per_forward=1)
    micro = json.loads(equivalence_config.read_text())["train_micro_batch_size_per_gpu"]
    shapes = {shape for kind, _, shape in pp2.wire(0) if kind == "data"}
    assert shapes == {f"{micro * 2}x64x16"}, shapes  # 2 image slots a row, 8 x 8 patches of the 16-wide tower


def test_presets_have_published_parameter_counts():
    """google/gemma-3-{4b,12b,27b}-it config.json shapes: transformers' Gemma3ForConditionalGeneration of them holds
    these parameters, the model cards' 4.3B, 12.2B and 27.4B (docs/gemma3.md)."""
    for name, total in (("gemma-3-4b", 4_300_079_472), ("gemma-3-12b", 12_187_325_040),
                        ("gemma-3-27b", 27_432_406_640)):
        cfg = load_preset(name)
        assert cfg.vision.n_tokens == 4096 and cfg.vision.n_features == 256
        counts = layer_param_counts(cfg)  # the last, the tied head, is the embedding's matrix again
        assert sum(counts[:-1]) == total, name


def test_export_loads_in_transformers(trained, tmp_path, capsys):
    """`mmpipe export` of the trained run (streamed layer by layer, mmpipe.hf.gemma3's names and config): transformers'
    Gemma3ForConditionalGeneration.from_pretrained of it gives the run's logits, two images a sample, and its image
    processor is transformers' Gemma3ImageProcessor at the model's size."""
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration
    cfg, _, pp2 = trained
    assert main(["export", "--checkpoint", str(pp2.out), "--out", str(tmp_path / "hf")]) == 0
    hf = Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.text_config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert type(AutoImageProcessor.from_pretrained(tmp_path / "hf")).__name__.startswith("Gemma3ImageProcessor")
    model = load_reference(pp2.out / "checkpoints", cfg).eval()
    ids, px = _two_image_prompts(torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=px.flatten(0, 1), token_type_ids=(ids == IMG).long()).logits
        got = model(px, ids, torch.ones(2, 2, dtype=torch.long), torch.ones_like(ids))
    assert (got - want).abs().max().item() < LOGITS_TOL


def test_activation_rules_match_what_autograd_keeps():
    """gemma3-tiny's projector and decoder blocks: act_elems (mmpipe.model.gemma3's rules) equals the floats autograd
    keeps per sample on a one-sample row without an image; with an image block (or a window that cuts) the CPU split
    keeps that sample's own float mask too, L^2 more, which the rule leaves out (CUDA keeps a BlockMask)."""
    from mmpipe.model import layer_specs
    from mmpipe.model.builder import bound
    from mmpipe.model.rows import sample_rows
    from mmpipe.planning.costmodel import layer_costs
    from test_plan import _saved_floats_per_sample
    cfg = load_preset("gemma3-tiny")
    rows = layer_costs(cfg, (), 12)
    L = rows[-1].tokens  # one bracketed image block (6) + 12 text

    def make(shape, image):
        def inputs(batch):
            ids = torch.full((batch, L), 5, dtype=torch.long)
            if image:
                ids[:, 1], ids[:, 2:2 + SOFT], ids[:, 2 + SOFT] = BOI, IMG, EOI
            return torch.randn(batch, *shape, requires_grad=True), *sample_rows(cfg, ids)
        return inputs
    checked = 0
    for i, (spec, row) in enumerate(zip(layer_specs(cfg), rows)):
        if row.name == "Gemma3Projector":
            layer, shape = bound(spec.build(), cfg, i), (cfg.vision.n_tokens, cfg.vision.dim)
            assert _saved_floats_per_sample(layer, make(shape, False)) == row.act_elems
        elif row.name in ("Gemma3Block", "Gemma3SlidingBlock"):
            layer, shape = bound(spec.build(), cfg, i), (L, cfg.text.dim)
            masked = row.name == "Gemma3SlidingBlock"  # the 6-position window cuts an 18-position row
            assert _saved_floats_per_sample(layer, make(shape, False)) == row.act_elems + masked * L * L
            assert _saved_floats_per_sample(layer, make(shape, True)) == row.act_elems + L * L
        else:
            continue
        checked += 1
    assert checked == 4
