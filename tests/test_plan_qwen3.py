"""The planner and cost model count Qwen3-VL's DeepStack sets (issue 41): a stage boundary between the merger that
makes a set and the decoder add that reads it sends it, [P / 4, D_text] floats per row, beside hidden; no boundary
after decoder layer 2's add sends any. The counts are the real stage tuples' (the layers run here), the bytes
those the layout's p2p time uses, and `--partition balanced` is free to cut inside the tower and between the
decoder's first layers. In-process, no launches."""
from __future__ import annotations

import pytest
import torch

from mmpipe.config import load_preset
from mmpipe.model import ReferenceModel
from mmpipe.model import qwen3_vl as q3
from mmpipe.model.builder import layer_specs
from mmpipe.planning.costmodel import BYTES, KNOWN_DEVICES, Shape, layer_costs
from mmpipe.planning.images import patch_row
from mmpipe.planning.layout import Training, plan_layout
from mmpipe.planning.partition import compute_parts

P, IMAGES, TEXT = 128, 4, 48  # qwen3-vl-tiny's row: --max-patches, --max-images, --text-len
L = 2 * IMAGES + P // 4 + TEXT  # 88 decoder positions: 2 brackets per slot, 32 merged tokens, the text


def _table(preset: str, freeze: tuple[str, ...] = (), p: int = P, images: int = IMAGES, text: int = TEXT,
           sizes=None):
    cfg = load_preset(preset)
    return cfg, layer_costs(cfg, freeze, text, images=images, patches=patch_row(cfg, images, p, sizes))


def _row(cfg):
    """One row of qwen3-vl-tiny's shape: two 8 x 8-patch images filling the P = 128 patches (64 + 64), 2 of 4
    slots unused, their 2 x 16 merged tokens' placeholders among 88 positions of one sample."""
    torch.manual_seed(0)
    pixels = torch.randn(1, P, 3 * 2 * 16 * 16)
    tiling = torch.tensor([[[1, 8, 8], [1, 8, 8], [0, 0, 0], [0, 0, 0]]])
    has_image = torch.tensor([[1, 1, 0, 0]])
    ids = torch.randint(3, 150, (1, L))
    ids[0, 1:2 + 16], ids[0, 20:20 + 16] = cfg.image_token_id, cfg.image_token_id
    ids[0, 1 + 16] = 5  # two image blocks of 16, not one of 33
    return pixels, ids, has_image, torch.ones(1, L, dtype=torch.long), tiling


def test_boundary_elements_are_the_real_stage_tuples_floats():
    """After every layer of qwen3-vl-tiny, the cost model's boundary elements per row (what a cut there sends
    forward, and its gradient back) are the float elements of the tuple the layer really returns: hidden plus each
    DeepStack set made and not yet added, 32 x 64 = 2048 each. So a cut inside the tower after the second merger
    sends 128 x 32 + 2 x 2048 = 8192, one before decoder layer 0's add 88 x 64 + 3 x 2048 = 11776, one after decoder
    layer 2's add 88 x 64 = 5632 alone."""
    cfg, rows = _table("qwen3-vl-tiny")
    kinds = [s.typename for s in layer_specs(cfg)]
    model = ReferenceModel(cfg, seed=0).eval()
    x = _row(cfg)
    sent = []
    with torch.no_grad():
        for layer in model:
            x = layer(x)
            sent.append(sum(t.numel() for t in x if t.is_floating_point()) if isinstance(x, tuple) else x.numel())
    assert [r.boundary_elems for r in rows[:-1]] == sent[:-1]  # the head's output is the logits, never sent
    s = 32 * 64
    after = {name: rows[i].boundary_elems for i, name in ((kinds.index(q3.DEEPSTACK_MERGERS[1]), "merger 1"),
                                                         (kinds.index(q3.DEEPSTACK_ADDS[0]) - 1, "decoder 0"),
                                                         (kinds.index(q3.DEEPSTACK_ADDS[2]), "add 2"))}
    assert after == {"merger 1": 128 * 32 + 2 * s, "decoder 0": L * 64 + 3 * s, "add 2": L * 64}
    last_add = kinds.index(q3.DEEPSTACK_ADDS[2])
    assert all(r.carried_elems == 0 for r in rows[last_add:])  # dropped: no later stage pays for a set
    assert [r.carried_elems // s for r in rows[:last_add]] == [0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 2, 2, 1, 1]
    # the layout's p2p time is the busiest boundary's bytes there and back: tests/test_qwen3_vl_pipeline.py's PP=4
    # cuts 5, 11, 13 at 2 rows of fp32, the cut at 11 the busiest: 11776 x 2 x 4 = 94208 bytes, / 450 GB/s, x 2
    device = KNOWN_DEVICES["h100-80gb"]
    layout = plan_layout(rows, Shape(4, 1, 2, 2), Training("fp32", 0, device, partition="5,11,13"))
    assert layout.parts == [0, 5, 11, 13, len(rows)]
    assert layout.step["p2p_s"] == pytest.approx((L * 64 + 3 * s) * 2 * 4 * 2 / device.link, rel=1e-12)


def test_qwen3_vl_32b_boundary_bytes_at_1024x768():
    """At the issue's shape, qwen3-vl-32b (D_text 5120) with one 1024 x 768 image a row (a 48 x 64 grid of 16 px
    patches = 3072, 768 merged tokens), bf16: a boundary before decoder layer 0's add sends the row (768 + 2 + text
    positions) plus 3 x 768 x 5120 x 2 bytes = 22.5 MiB of DeepStack sets; after decoder layer 0's add 2 sets,
    after layer 1's 1, after layer 2's none."""
    cfg, rows = _table("qwen3-vl-32b", p=3072, images=1, text=512, sizes=[(1024, 768)])
    kinds = [s.typename for s in layer_specs(cfg)]
    per_set = 768 * 5120 * BYTES["bf16"]
    assert per_set == 7_864_320  # 7.5 MiB
    row = (2 + 768 + 512) * 5120 * BYTES["bf16"]
    adds = [kinds.index(a) for a in q3.DEEPSTACK_ADDS[:3]]
    assert [rows[a - 1].boundary_elems * BYTES["bf16"] for a in adds] == [row + 3 * per_set, row + 2 * per_set,
                                                                          row + per_set]
    assert [rows[a].boundary_elems * BYTES["bf16"] for a in adds] == [row + 2 * per_set, row + per_set, row]


def test_mergers_cost_their_weights_and_a_frozen_tower_stays_a_prefix():
    """Each DeepStack merger is costed with its own weights (norm on the merged 4 x 32, fc1 128 -> 128, fc2 128 ->
    64: 256 + 16512 + 8256 = 25024 for qwen3-vl-tiny), 2 FLOPs per weight per merged token (32 a row). Under
    --freeze vision the mergers still train, but they branch off the tower's stream, so the tower's blocks after
    them stay a frozen prefix: no backward, nothing kept (the runtime runs none there either)."""
    cfg, rows = _table("qwen3-vl-tiny")
    kinds = [s.typename for s in layer_specs(cfg)]
    mergers = [kinds.index(m) for m in q3.DEEPSTACK_MERGERS[:3]]
    assert all(rows[i].params == 25024 and rows[i].fwd_flops == 2 * 25024 * 32 for i in mergers)
    _, frozen = _table("qwen3-vl-tiny", ("vision",))
    tower = [i for i, k in enumerate(kinds) if k in (q3.Qwen3PatchEmbed, q3.Qwen3VisionBlock)]
    assert all(frozen[i].bwd_flops == 0 and frozen[i].act_bytes("fp32") == 0 for i in tower)
    assert all(frozen[i].trainable and frozen[i].bwd_flops == frozen[i].fwd_flops for i in mergers)  # weights only
    assert all(rows[i].bwd_flops == 2 * rows[i].fwd_flops for i in mergers + tower[1:])  # trained: both gradients


def test_balanced_cuts_inside_the_tower_and_between_the_first_decoder_layers():
    """`--partition balanced` may cut anywhere a trainable layer starts: on qwen3-vl-tiny at PP=4 (tower trained)
    its split puts a cut inside the tower before the last DeepStack merger and one between decoder layers 0 and 2,
    where the Qwen maintainers' rule would keep the tower and the first 3 decoder layers on stage 0."""
    cfg, rows = _table("qwen3-vl-tiny")
    kinds = [s.typename for s in layer_specs(cfg)]
    parts = compute_parts(rows, 4, "balanced")
    blocks = [i for i, k in enumerate(kinds) if k is q3.Qwen3Block]
    assert any(0 < b < kinds.index(q3.DEEPSTACK_MERGERS[2]) for b in parts), parts
    assert any(blocks[0] < b <= blocks[2] for b in parts), parts


def test_plan_prints_the_fixed_first_stage_beside_its_own_split(capsys):
    """`mmpipe plan` on Qwen3-VL prints, beside its best layout, the same layout with stage 0 fixed where other
    trainers must cut (the tower and decoder layers 0..2 with DeepStack's last add: layers 0..38 of qwen3-vl-32b),
    the other stages balanced: the step and stage 0 the same model predicts for that split; no such line for a
    family without the rule (Qwen2.5-VL)."""
    from mmpipe.cli import main
    from mmpipe.registry import family_of
    cfg = load_preset("qwen3-vl-32b")
    kinds = [s.typename for s in layer_specs(cfg)]
    first = family_of(cfg).fixed_first_stage(layer_specs(cfg))
    assert kinds[first - 1] is q3.DEEPSTACK_ADDS[2] and kinds[:first].count(q3.Qwen3Block) == 3  # 3 sets
    argv = ["plan", "--device", "h100-80gb", "--gpus-per-node", "8", "--nodes", "2", "--image-size", "1024x768",
            "--max-patches", "3072", "--text-len", "1024"]
    assert main([*argv, "--preset", "qwen3-vl-32b"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("stage 0 fixed"))
    assert line.startswith(f"stage 0 fixed at layers 0..{first - 1} ") and "the other 7 balanced: step " in line
    assert main([*argv, "--preset", "qwen2.5-vl-32b"]) == 0
    assert "stage 0 fixed" not in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["qwen3-vl-2b", "qwen3-vl-32b"])
def test_checks_shrunk_model_keeps_a_deepstack_set(preset):
    """`mmpipe check`'s shrunk model (2 blocks a group) keeps a DeepStack tap inside its shrunk tower, so a set
    still goes from a merger to a decoder add (it refused to validate: the taps at 5, 11, 17 of a 2-block tower)."""
    from mmpipe.check.equivalence import shrunk
    small = shrunk(load_preset(preset), 2)
    assert small.vision.n_layers == small.text.n_layers == 2 and small.vision.deepstack_indexes == (1,)
    kinds = [s.typename for s in layer_specs(small)]
    assert q3.DEEPSTACK_MERGERS[0] in kinds and q3.DEEPSTACK_ADDS[0] in kinds
