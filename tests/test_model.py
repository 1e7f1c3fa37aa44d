"""The model definition: shapes, masks, the stage contract, presets on the meta device, generation."""
from __future__ import annotations

import subprocess
import sys

import torch

from mmpipe.config import load_preset
from mmpipe.data.samples import SHAPES_TEXT_LEN, ShapesSamples
from mmpipe.inference.evaluate import greedy_generate
from mmpipe.inference.sampling import Sampling
from mmpipe.model import ReferenceModel, StageTuple, layer_param_counts, layer_specs
from mmpipe.model.attention import row_mask
from mmpipe.model.rows import IMAGE_SLOT, sample_rows


def test_large_presets_build_on_meta_without_memory():
    cfg = load_preset("moondream-2b")
    assert cfg.vision.n_tokens == 729 and cfg.prefix_len == 730 and cfg.text.rotary_dim == 32
    assert cfg.text.vocab_size == 51200
    counts = layer_param_counts(cfg)
    assert len(counts) == 1 + 27 + 1 + 1 + 1 + 24 + 1
    assert 1.8e9 < sum(counts) < 1.9e9  # moondream2 is ~1.86B parameters
    with torch.device("meta"):
        layer = layer_specs(cfg)[30].build()
    assert all(p.is_meta for p in layer.parameters())
    assert 0.55e9 < sum(layer_param_counts(load_preset("moondream-0.5b"))) < 0.6e9


def test_resolving_a_run_counts_parameters_without_their_values():
    """Every process that resolves a run (the front door, each rank) counts each layer's parameters on
    the meta device with shapes only (mmpipe.model.builder.shapes_only): the same counts as building
    them there with their initialisation, for every preset, and in a fresh process neither
    torch._dynamo (which meta initialisation ops import) nor torchvision (which only image-decoding
    processes need) is imported by a whole dry run: ~5 s of CPU per process, paid by every launch."""
    for name in ("tiny", "tiny-xattn", "moondream-0.5b", "llava-tiny", "llava-1.5-7b", "qwen-tiny", "qwen2-vl-2b"):
        cfg = load_preset(name)  # every layer class of every family (Qwen2 and 2.5 towers, CLIP and SigLIP)
        with torch.device("meta"):
            plain = [sum(p.numel() for p in s.build().parameters()) for s in layer_specs(cfg)]
        assert layer_param_counts(cfg) == plain, name
    code = ("import sys; from mmpipe.cli import main; "
            "rc = main(['train', '--preset', 'tiny', '--stages', '2', '--lora', '2', '--dry-run']); "
            "print('imported', rc, [m for m in ('torch._dynamo', 'torchvision') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "imported 0 []" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_prefix_mask_is_bidirectional_over_bos_and_image_then_causal():
    segments = torch.tensor([[1, 1, 1, 1, 1, 1, 2, 2, 0]])
    prefix = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 0, 0]]).bool()  # sample 1: BOS + 2 image; sample 2: BOS
    m = row_mask(segments, prefix)[0, 0]
    assert m[0, 2] and m[1, 2]  # BOS and image see the whole prefix
    assert not m[2, 3] and not m[3, 4]  # nothing sees the future text
    assert m[5, :6].all() and m[3, :4].all()
    assert not m[6, :6].any() and m[7, 6:8].all() and not m[7, :6].any()  # never across samples
    assert m[8, 8] and not m[8, :8].any()  # padding sees padding only


def test_stage_tuple_floats_first_and_no_mask_on_the_wire():
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg)
    ints = sample_rows(cfg, torch.randint(0, 40, (2, 16)))
    n, L = cfg.vision.n_tokens, cfg.vision.n_tokens + 16
    assert (ints[0][:, 1:1 + n] == IMAGE_SLOT).all() and ints[1].shape == (2, 1) and (ints[2] == 1).all()
    x = model[0]((torch.randn(2, 1, 3, 32, 32), *ints))
    for layer in list(model)[1:-1]:
        assert len(x) == 4 and x[0].is_floating_point() and all(t.dtype == torch.long for t in x[1:])
        assert x[0].dim() == 3 and x[1].shape == (2, L) and x[2].shape == (2, 1) and x[3].shape == (2, L)
        x = layer(x)
    assert StageTuple.unpack(x).hidden.shape == (2, L, cfg.text.dim)


def test_text_after_the_prefix_cannot_see_the_future():
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg).eval()
    pix, ids = torch.randn(1, 3, 32, 32), torch.randint(4, 40, (1, 16))
    ids2 = ids.clone()
    ids2[0, 10:] = 0
    a, b = model(pix, *sample_rows(cfg, ids)), model(pix, *sample_rows(cfg, ids2))
    n = cfg.vision.n_tokens
    assert torch.allclose(a[0, : n + 10], b[0, : n + 10], atol=1e-6)
    assert not torch.allclose(a[0, n + 10:], b[0, n + 10:])


def test_image_tokens_change_the_logits():
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg).eval()
    ints = sample_rows(cfg, torch.randint(4, 40, (1, 16)))
    assert not torch.allclose(model(torch.randn(1, 3, 32, 32), *ints), model(torch.randn(1, 3, 32, 32), *ints))


def test_batched_generation_equals_one_at_a_time():
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg, seed=5).eval()
    held_out = ShapesSamples(cfg, 0, "eval")
    data, tok = held_out.data, held_out.tok
    samples = [data.sample(i) for i in range(10)]  # prompts of different lengths
    pix = torch.stack([held_out.transform(data.render(s)) for s in samples])
    prompts = [held_out.encoder.prompt_ids([("user", s.question)]) for s in samples]
    args = (Sampling(eos_id=tok.eos_token_id, max_new_tokens=3), tok.pad_token_id, SHAPES_TEXT_LEN)
    batched = greedy_generate(model, pix, prompts, *args)
    single = [greedy_generate(model, pix[i:i + 1], [p], *args)[0] for i, p in enumerate(prompts)]
    assert batched == single and any(batched)


def test_text_only_samples_ignore_the_image_and_leave_others_alone():
    """A text-only sample has no image block: any pixels give the same logits, its text follows BOS at
    position 1 (as moondream's own text-only prompt), and samples with images in the same batch are
    unchanged."""
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg, seed=2).eval()
    ids = torch.randint(4, 40, (2, 12))
    n = cfg.vision.n_tokens
    mixed = sample_rows(cfg, ids, torch.tensor([1, 0]))
    assert (mixed[0][1, :12] == ids[1]).all() and (mixed[2][1, 12:] == 0).all()
    a = model(torch.randn(2, 3, 32, 32), *mixed)
    b = model(torch.randn(2, 3, 32, 32), *mixed)
    assert torch.allclose(a[1, :12], b[1, :12], atol=1e-6)  # the text-only sample
    assert not torch.allclose(a[0, 1 + n:], b[0, 1 + n:], atol=1e-3)  # the other one still sees its image
    alone = model(torch.randn(1, 3, 32, 32), *sample_rows(cfg, ids[1:], torch.tensor([0])))
    assert alone.shape[1] == 12 and torch.allclose(a[1, :12], alone[0], atol=1e-5)
    pix = torch.randn(2, 3, 32, 32)
    both = model(pix, *sample_rows(cfg, ids))
    assert torch.allclose(model(pix, *mixed)[0], both[0], atol=1e-6)


def test_text_only_samples_send_no_gradient_to_the_vision_tower():
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg, seed=2)
    logits = model(torch.randn(2, 3, 32, 32), *sample_rows(cfg, torch.randint(4, 40, (2, 12)), torch.zeros(2)))
    logits.sum().backward()
    vision = [p.grad for layer in model if layer.group == "vision" for p in layer.parameters()]
    assert all(g is None or g.abs().max() == 0 for g in vision)
