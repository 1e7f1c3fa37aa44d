"""The gemma4 family against transformers' Gemma4ForConditionalGeneration (tiny, random, built here: a 2-layer tower
at 24 px, 6 x 6 patches of 4 pooled 3 x 3 to 4 soft tokens; 5 decoder layers, every 3rd global and the last, a
6-position window, full layers 16 wide with one k = v head under proportional rotary, per-layer inputs of 8, the last
2 layers sharing the K/V of layers 1 (sliding) and 2 (full), double-wide MLPs there, logits soft-capped; the tower's
clipped linears and standardized output, as the 26B / 31B towers have):
`mmpipe import --hf` gives transformers' logits with two images a sample (bidirectional on sliding layers only); a
packed row's samples each give their logits alone; the stage schema carries per_layer from the embedding to the last
decoder layer and each K/V from its producer to its last consumer; `mmpipe export` loads back into transformers
with the same logits; what the family does not implement is one line. In-process, no launch."""
from __future__ import annotations

import json

import pytest
import torch

from mmpipe.cli import main
from mmpipe.config import ConfigError, config_from_dict, load_preset
from mmpipe.model import layer_param_counts
from mmpipe.model.builder import layer_specs
from mmpipe.model.stage import live_fields
from mmpipe.registry import family_of
from mmpipe.runtime.checkpoint import load_reference
from test_gemma3 import _tokenizer

LOGITS_TOL, TOL = 1e-4, 1e-5
IMG, BOI, EOI, VOCAB, SOFT, PX = 60, 61, 62, 64, 4, 24
KINDS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _hf_model(seed: int = 0, **text_fields):
    """transformers' model (module docstring), its text config updated by text_fields (test_gemma4_moe's experts)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
                vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, sliding_window=6,
                layer_types=KINDS, num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=30.0,
                use_bidirectional_attention="vision", max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                eos_token_id=2,
                rope_parameters={"full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                    "partial_rotary_factor": 0.25},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **text_fields)
    # a 6-entry position table: a side of 6 patches at most, so the import's square is 2 x 3 x 4 = 24 px
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=3, position_embedding_size=6,
                  standardize=True, use_clipped_linears=True)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, image_token_id=IMG, boi_token_id=BOI,
        eoi_token_id=EOI)).eval()
    with torch.no_grad():  # HF's init: norms and layer scalars at 1, the position table at 1: perturbed
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.add_(torch.randn_like(p) * 0.3)
            elif "position_embedding_table" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(8)  # std 0.02 makes attention ~uniform: the mask would hardly show
        for name, b in model.named_buffers():
            if name.endswith(("layer_scalar", "std_scale")):
                b.copy_(1 + torch.rand_like(b))
            elif name.endswith("std_bias"):
                b.copy_(torch.randn_like(b))
            elif name.endswith(("input_max", "output_max")):  # clipping that engages on the tower's activations
                b.fill_(1.5)
            elif name.endswith(("input_min", "output_min")):
                b.fill_(-1.5)
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers' model, its directory, the run `mmpipe import --hf` made of it, the imported model)."""
    d = tmp_path_factory.mktemp("gemma4")
    hf = _hf_model()
    hf.save_pretrained(d / "hf")
    _tokenizer(d / "hf")
    assert main(["import", "--hf", str(d / "hf"), "--out", str(d / "run")]) == 0
    cfg = config_from_dict(json.loads((d / "run" / "model.json").read_text()), "gemma4")
    return hf, d / "hf", d / "run", load_reference(d / "run" / "checkpoints", cfg).eval()


def _two_image_prompts(g):
    """2 prompts of 20 tokens, each with two images (BOI, 4 soft tokens, EOI), and 4 images of 24 px in [0, 1]."""
    ids = torch.randint(3, IMG, (2, 20), generator=g)
    for a in (2, 11):
        ids[:, a], ids[:, a + 1:a + 1 + SOFT], ids[:, a + 1 + SOFT] = BOI, IMG, EOI
    return ids, torch.rand(2, 2, 3, PX, PX, generator=g)


def hf_inputs(ids, px) -> dict:
    """transformers' tower inputs for square images: row-major patches (p, p, C each, convert_image_to_patches's
    order) and their (column, row) positions (its meshgrid(indexing="xy"))."""
    imgs, p = px.flatten(0, 1), 4
    n, c, s = imgs.shape[0], imgs.shape[1], PX // p
    patches = imgs.reshape(n, c, s, p, s, p).permute(0, 2, 4, 3, 5, 1).reshape(n, s * s, p * p * c)
    grid = torch.stack(torch.meshgrid(torch.arange(s), torch.arange(s), indexing="xy"), -1).reshape(1, -1, 2)
    return dict(input_ids=ids, pixel_values=patches, image_position_ids=grid.expand(n, -1, -1))


def test_import_gives_transformers_logits(imported):
    hf, _, _, model = imported
    assert [type(x).__name__ for x in model][3:12] == [
        "Gemma4Projector", "Gemma4Embed", "Gemma4SlidingBlock", "Gemma4SlidingStore", "Gemma4GlobalStore",
        "Gemma4SlidingShared", "Gemma4GlobalShared", "Gemma4FinalNorm", "TiedCall"]
    ids, px = _two_image_prompts(torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(**hf_inputs(ids, px), mm_token_type_ids=(ids == IMG).long()).logits
        causal = hf(**hf_inputs(ids, px)).logits  # no token types: no bidirectional blocks
        got = model(px, ids, torch.ones(2, 2, dtype=torch.long), torch.ones_like(ids))
    assert (got - want).abs().max().item() < LOGITS_TOL
    assert (causal - want).abs().max().item() > 100 * LOGITS_TOL  # the image blocks' attention shows


def _packed(ids, px):
    """The two prompts packed in one row of 48 (2 x 20 + 8 padding), their 4 images in its slots."""
    row = torch.zeros(1, 48, dtype=torch.long)
    row[0, :20], row[0, 20:40] = ids[0], ids[1]
    segments = torch.zeros_like(row)
    segments[0, :20], segments[0, 20:40] = 1, 2
    return px.reshape(1, 4, 3, PX, PX), row, torch.tensor([[1, 1, 2, 2]]), segments


@pytest.mark.parametrize("backend", ["auto", "dense"])
def test_packed_row_equals_each_sample_alone(imported, backend, monkeypatch):
    """The shared K/V and the per-layer inputs of a packed row keep its samples apart as the masks do."""
    monkeypatch.setenv("MMPIPE_ATTENTION", backend)
    *_, model = imported
    ids, px = _two_image_prompts(torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = model(px, ids, torch.ones(2, 2, dtype=torch.long), torch.ones_like(ids))
        packed = model(*_packed(ids, px))
    assert (packed[0, :20] - alone[0]).abs().max().item() < TOL
    assert (packed[0, 20:40] - alone[1]).abs().max().item() < TOL


def test_stage_fields_carry_per_layer_inputs_and_shared_kv():
    """gemma4-tiny's tuple leaving each layer: per_layer from the embedding through the last decoder layer, each
    type's K/V from its producer (layer 1 sliding, layer 2 full) to its last consumer (layers 3, 4): a cut anywhere
    in the decoder sends them with hidden, a cut after it or in the tower does not."""
    cfg = load_preset("gemma4-tiny")
    specs = layer_specs(cfg)
    names = [s.typename.__name__ for s in specs]
    assert names[4:10] == ["Gemma4Embed", "Gemma4SlidingBlock", "Gemma4SlidingStore", "Gemma4GlobalStore",
                           "Gemma4SlidingShared", "Gemma4GlobalShared"]
    out = [[f.name for f in fields if f.floating] for fields in
           live_fields(family_of(cfg).fields(cfg), [s.typename for s in specs])[1:]]
    assert out[:10] == [["hidden"]] * 4 + [["hidden", "per_layer"]] * 2 + [
        ["hidden", "per_layer", "kv_sliding"], ["hidden", "per_layer", "kv_sliding", "kv_full"],
        ["hidden", "per_layer", "kv_full"], ["hidden"]]


def test_export_loads_in_transformers(imported, tmp_path):
    """`mmpipe export` of the imported run: transformers' from_pretrained of it gives the run's logits."""
    from transformers import Gemma4ForConditionalGeneration
    _, _, run, model = imported
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    hf = Gemma4ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    ids, px = _two_image_prompts(torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(px, ids, torch.ones(2, 2, dtype=torch.long), torch.ones_like(ids))
        got = hf(**hf_inputs(ids, px), mm_token_type_ids=(ids == IMG).long()).logits
    assert (got - want).abs().max().item() < LOGITS_TOL


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update(enable_moe_block=True, num_experts=None, top_k_experts=2, moe_intermediate_size=16),
     "text_config.enable_moe_block: true with num_experts None"),
    (lambda t: t.update(use_bidirectional_attention="all"), "use_bidirectional_attention: 'all'"),
    (lambda t: t.update(layer_types=["full_attention"] + KINDS[1:]), "text_config.layer_types"),
])
def test_what_is_not_implemented_is_one_line(imported, tmp_path, edit, message):
    from mmpipe.hf.gemma4 import hf_gemma4_config
    hf = json.loads((imported[1] / "config.json").read_text())
    edit(hf["text_config"])
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=message):
        hf_gemma4_config(tmp_path)


def test_31b_preset_holds_the_published_tensors():
    """gemma-4-31b's parameters (the tied head once) and buffers (60 layer scalars, the tower's 2 x 1152
    standardization) are the 31,273,088,876 values a public census of google/gemma-4-31B-it's BF16 tensors counts
    (docs/gemma4.md); the card's 30.7B is the text model, ~550M the vision encoder."""
    cfg = load_preset("gemma-4-31b")
    params = sum(layer_param_counts(cfg)[:-1])  # the last, the tied head, is the embedding's matrix again
    buffers = cfg.text.n_layers + 2 * cfg.vision.dim
    assert (params, params + buffers) == (31_273_086_512, 31_273_088_876)


def test_generate_equals_transformers_greedy_batch(imported, tmp_path, capsys):
    """`mmpipe generate --checkpoint HF_DIR`, 4 square images of different sizes in one batch (each read at the
    tower's 24 px square by the family's image kind), 10 prompt positions and up to 12 new tokens, so the 6-position
    window slides and the shared layers read their producers' cached K/V: transformers' greedy generate answers the
    same for each image alone, given the same pixels."""
    from PIL import Image
    from transformers import AutoTokenizer

    from mmpipe.data.image_kinds import image_kind
    hf, d, _, model = imported
    g, argv, want = torch.Generator().manual_seed(5), ["generate", "--checkpoint", str(d), "--max-new-tokens", "12"], []
    tok = AutoTokenizer.from_pretrained(d)
    read = image_kind(model.cfg).one_image(model.cfg)
    for i, side in enumerate((24, 40, 17, 64)):
        path = tmp_path / f"{i}.png"
        Image.fromarray((torch.rand(side, side, 3, generator=g) * 255).byte().numpy()).save(path)
        argv += ["--image", str(path), "--prompt", f"<image>\nw{40 + i} w{50 + i}"]
        ids = torch.tensor([[1, 4, BOI] + [IMG] * SOFT + [EOI, 40 + i, 50 + i, 5]])
        px = read(Image.open(path).convert("RGB"))[None, None]
        with torch.no_grad():
            out = hf.generate(**hf_inputs(ids, px), mm_token_type_ids=(ids == IMG).long(), max_new_tokens=12,
                              do_sample=False)
        want.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    capsys.readouterr()
    assert main(argv) == 0
    got = [json.loads(line)["answer"] for line in capsys.readouterr().out.splitlines()]
    assert got == want
    assert len(set(got)) > 1 and max(len(a.split()) for a in got) > 6  # answers differ, and past the window


def test_a_record_with_audio_is_a_bad_record(tmp_path):
    """Gemma 4's records may carry audio (its E2B / E4B read it); this family reads images and text only, so a record
    with an 'audio' field or an <audio> marker is refused, counted and listed with its reason (unsupported_media),
    never trained as the text around it."""
    from fixtures_data import conv
    from mmpipe.data.dataset import prepare
    from mmpipe.data.export import export_shapes
    from mmpipe.run_args import TrainArgs
    from mmpipe.run_config import resolve
    from test_data_formats import write_jsonl
    export_shapes(tmp_path, "llava-json", 1)  # images/00000.png
    qa = conv("what shape is red", "circle", marker=False)
    path = write_jsonl(tmp_path / "audio.jsonl", [
        {"id": "t", "conversations": qa},
        {"id": "a", "audio": "clips/a.wav", "conversations": qa},
        {"id": "m", "conversations": conv("<audio>\nwhat is said", "circle", marker=False)},
        {"id": "i", "image": "images/00000.png", "conversations": conv("what shape is red", "circle")}])
    args = TrainArgs.from_argv(["--preset", "gemma4-tiny", "--data", str(path), "--output-dir", str(tmp_path / "run"),
                                "--tokenizer", "builtin"])
    run = resolve(args, 2)
    samples = prepare(run.data, run.model, args.output_dir, seed=0, verbose=False)
    assert samples.index.rows.tolist() == [0, 3]
    assert samples.index.stats["bad_by_kind"] == {"unsupported_media": 2}
    bad = [json.loads(line) for line in (tmp_path / "run/data/bad_records.jsonl").read_text().splitlines()]
    assert ["'audio' field" in bad[0]["reason"], "a <audio> marker" in bad[1]["reason"]] == [True, True]
    assert all("the gemma4 family reads image and video only" in b["reason"] for b in bad), bad


def test_planner_counts_the_carried_fields_at_their_sizes():
    """`mmpipe plan`'s boundary after each layer: hidden plus the carried fields at their own sizes a decoder
    position (StageField.per_position): per_layer 5 x 8 = 40, the sliding K/V 2 x 2 x 8 = 32, the full one
    2 x 1 x 16 = 32, over the row's positions; none in the tower or after the last decoder layer."""
    from mmpipe.planning.costmodel import layer_costs
    cfg = load_preset("gemma4-tiny")
    rows = layer_costs(cfg, (), text_len=24)
    seq = rows[5].tokens  # decoder positions a sample
    assert [r.carried_elems / seq for r in rows] == [0, 0, 0, 0, 40, 40, 72, 104, 72, 0, 0, 0]
    assert all(r.boundary_elems == r.out_elems + r.carried_elems for r in rows)
