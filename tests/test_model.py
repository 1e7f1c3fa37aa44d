"""The model definition: shapes, masks, the stage contract, presets on the meta device, generation."""
from __future__ import annotations

import torch

from mmpipe.config import load_preset
from mmpipe.data.samples import SHAPES_TEXT_LEN, ShapesSamples
from mmpipe.inference.evaluate import greedy_generate
from mmpipe.model import ReferenceModel, StageTuple, layer_param_counts, layer_specs
from mmpipe.model.attention import prefix_lm_mask


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


def test_prefix_mask_is_bidirectional_over_bos_and_image_then_causal():
    m = prefix_lm_mask(6, 3, torch.device("cpu"))
    assert m[0, 2] and m[1, 2]  # BOS and image see the whole prefix
    assert not m[2, 3] and not m[3, 4]  # nothing sees the future text
    assert m[5].all() and m[3, :4].all()


def test_stage_tuple_floats_first_and_no_mask_on_the_wire():
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg)
    x = model[0]((torch.randn(2, 3, 32, 32), torch.randint(0, 40, (2, 16)), torch.ones(2, dtype=torch.long)))
    for layer in list(model)[1:-1]:
        assert len(x) == 3 and x[0].is_floating_point() and x[1].dtype == x[2].dtype == torch.long
        assert x[0].dim() == 3 and x[1].shape == (2, 16) and x[2].shape == (2,)
        x = layer(x)
    assert StageTuple(*x).hidden.shape == (2, cfg.vision.n_tokens + 16, cfg.text.dim)


def test_text_after_the_prefix_cannot_see_the_future():
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg).eval()
    pix, ids = torch.randn(1, 3, 32, 32), torch.randint(4, 40, (1, 16))
    ids2 = ids.clone()
    ids2[0, 10:] = 0
    a, b = model(pix, ids), model(pix, ids2)
    n = cfg.vision.n_tokens
    assert torch.allclose(a[0, : n + 10], b[0, : n + 10], atol=1e-6)
    assert not torch.allclose(a[0, n + 10:], b[0, n + 10:])


def test_image_tokens_change_the_logits():
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg).eval()
    ids = torch.randint(4, 40, (1, 16))
    assert not torch.allclose(model(torch.randn(1, 3, 32, 32), ids), model(torch.randn(1, 3, 32, 32), ids))


def test_batched_generation_equals_one_at_a_time():
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg, seed=5).eval()
    held_out = ShapesSamples(cfg, 0, "eval")
    data, tok = held_out.data, held_out.tok
    samples = [data.sample(i) for i in range(10)]  # prompts of different lengths
    pix = torch.stack([held_out.transform(data.render(s)) for s in samples])
    prompts = [held_out.encoder.prompt_ids([("user", s.question)]) for s in samples]
    args = (tok.eos_token_id, tok.pad_token_id, 3, SHAPES_TEXT_LEN)
    batched = greedy_generate(model, pix, prompts, *args)
    single = [greedy_generate(model, pix[i:i + 1], [p], *args)[0] for i, p in enumerate(prompts)]
    assert batched == single and any(batched)


def test_text_only_samples_ignore_the_image_and_leave_others_alone():
    """has_image = 0 hides the image positions: any pixels give the same text logits, equal to a
    model that never saw an image there; samples with images in the same batch are unchanged."""
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg, seed=2).eval()
    ids = torch.randint(4, 40, (2, 12))
    n = cfg.vision.n_tokens
    mixed = torch.tensor([1, 0])
    a = model(torch.randn(2, 3, 32, 32), ids, mixed)
    b = model(torch.randn(2, 3, 32, 32), ids, mixed)
    assert torch.allclose(a[1, 1 + n:], b[1, 1 + n:], atol=1e-6)  # text positions of the text-only sample
    assert not torch.allclose(a[0, 1 + n:], b[0, 1 + n:], atol=1e-3)  # the other one still sees its image
    pix = torch.randn(2, 3, 32, 32)
    both = model(pix, ids, torch.ones(2, dtype=torch.long))
    assert torch.allclose(model(pix, ids, mixed)[0], both[0], atol=1e-6)


def test_text_only_samples_send_no_gradient_to_the_vision_tower():
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg, seed=2)
    logits = model(torch.randn(2, 3, 32, 32), torch.randint(4, 40, (2, 12)), torch.zeros(2, dtype=torch.long))
    logits[:, 1 + cfg.vision.n_tokens:].sum().backward()
    vision = [p.grad for layer in model if layer.group == "vision" for p in layer.parameters()]
    assert all(g is None or g.abs().max() == 0 for g in vision)
