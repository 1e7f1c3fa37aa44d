"""--sp splits the vision tower over a stage's SP ranks by whole images (issue 58 deliver 3; mmpipe.model.sp_tower,
docs/sequence_parallel.md "The vision tower").

In process, 2 forked gloo ranks: the tower, its merger / projector (Qwen3-VL's DeepStack mergers inside) and the
decoder embedding (Qwen3-VL's DeepStack adds after it), each rank under the family's SP plan against the same layers
run whole, on 2 rows of 3 images of different sizes and a clip of 2 temporal patches (Qwen families; LLaVA: 3 images
in 4 slots), one image cut by the SP slice: every image token's features (hidden and DeepStack's sets) gathered on
each rank equal the whole tower's, each rank's slice of the embedded row equals the whole one's, and every parameter's
gradient (tower, mergers, embedding) summed over SP equals the single-device one (fp32, 1e-6); each rank ran the
tower on its share of the patches only (counted: the greedy's 64 | 48 of the 112 real patches, where the whole tower
runs 2 x 96 with the rows' padding)."""
from __future__ import annotations

import copy
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmpipe.config import load_preset
from mmpipe.model import ReferenceModel
from mmpipe.model.llava import LlavaEmbed
from mmpipe.model.qwen2_vl import used_grids
from mmpipe.model.qwen3_vl import DeepstackAdd
from mmpipe.model.sequence_parallel import local, parallelize_sequence, sum_gradients
from mmpipe.model.sp_tower import TOWER, split_tower
from mmpipe.model.stage import StageTuple, unpack_out
from mmpipe.model.tensor_parallel import Shard
from mmpipe.registry import family_of

TOL = 1e-6
L = 48  # rank 0 holds positions 0..23, rank 1 24..47
# row 0: an image of 4 x 4 patches (4 tokens) and a clip of 2 x 4 x 8 (2 temporal patches, 16 tokens), a sample each;
# row 1: an image of 8 x 4 (8 tokens at 18..25: cut by the SP slice at 24) and an unused slot; 96 patches a row
GRIDS = [[(1, 4, 4), (2, 4, 8)], [(1, 8, 4), (0, 0, 0)]]
P = 96
# the rows' real patches, 16 + 64 + 32 = 112, in units of 16, 32, 32 (the clip's two) and 32: the greedy (largest
# first to the least loaded, ties to the lowest rank) gives rank 0 the clip's first and row 1's image, rank 1 the
# clip's second and the 4 x 4 image
PATCHES = {"qwen": [64, 48], "llava": [32, 16]}  # llava-tiny: 3 images of 4 x 4 patches, rank 0 two of them


def _layout(image_tokens: list[list[int]]):
    """(input_ids, segments) [2, L]: row 0 two samples (2 text, image, text to 22; 1 text, clip, text), row 1 one
    (18 text, image, text) and padding; placeholders -1 here (the caller's token)."""
    ids, seg = torch.full((2, L), 5), torch.zeros(2, L, dtype=torch.long)
    a, b = image_tokens[0]
    ids[0, 2:2 + a] = -1
    seg[0, :22] = 1
    ids[0, 23:23 + b] = -1
    seg[0, 22:26 + b] = 2
    (c,) = image_tokens[1]
    ids[1, 18:18 + c] = -1
    seg[1, :24 + c] = 1
    return ids, seg


def _row(cfg, family: str, g: torch.Generator) -> StageTuple:
    if family == "llava":
        n = cfg.vision.n_features
        ids, seg = _layout([[n, n], [n]])
        v = cfg.vision
        pixels = torch.randn(2, 2, v.channels, v.image_size, v.image_size, generator=g)
        tiling = None
    else:
        ids, seg = _layout([[t * h * w // 4 for t, h, w in GRIDS[0]], [8]])
        pixels = torch.randn(2, P, cfg.vision.patch_dim, generator=g)
        # a 4th column as a clip's time step rides (qwen2_vl.time_steps: 0.5's float32 bits), kept through the split
        step = torch.tensor([0.5]).view(torch.int32).long()
        tiling = torch.cat([torch.tensor(GRIDS), step.expand(2, 2, 1)], -1)
    ids[ids == -1] = cfg.image_token_id
    has_image = torch.tensor([[1, 2], [1, 0]])
    return StageTuple(pixels, ids, has_image, seg, **({} if tiling is None else {"tiling": tiling}))


def _stage(model) -> list:
    """The model's tower, merger / projector, decoder embedding and DeepStack adds (no decoder block changes the
    tuple's fields, so the adds run on the embedding's output)."""
    return [m for m in model if getattr(m, "group", None) in ("vision", "projector")
            or isinstance(m, (LlavaEmbed, DeepstackAdd))]


def _run(layers, t: StageTuple, exit_cls):
    x, feats = t.pack(), None
    for layer in layers:
        x = layer(x)
        if isinstance(layer, exit_cls):
            feats = unpack_out(layer, x)
    return unpack_out(layers[-1], x).hidden, feats


def _real_tokens(t: StageTuple, family: str, feats: StageTuple) -> torch.Tensor:
    """bool over the tower's output tokens [B, T] (LLaVA [B x M, N]) that a placeholder reads."""
    if family == "llava":
        return (t.has_image.flatten() > 0)[:, None].expand(feats.hidden.shape[:2])
    n = (t.tiling[..., :3].prod(-1) * (t.has_image > 0)).sum(-1) // 4
    return torch.arange(feats.hidden.shape[1])[None] < n[:, None]


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _pairs(t: StageTuple) -> tuple[StageTuple, StageTuple]:
    """dpo's rows (--objective dpo): each row twice (a pair's chosen and rejected sides, the same images in the same
    slots). (every side its images: the per-side path, pixels [4, ..]; the pairs' images once: pixels [2, ..])."""
    side = t._replace(**{k: getattr(t, k).repeat_interleave(2, 0) for k in t.names})
    return side, side._replace(hidden=t.hidden)


def _evens(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [rows (x M), ..] -> the even rows' part (a pair's chosen side), [rows / 2 (x M), ..]."""
    return x.reshape(rows, -1, *x.shape[1:])[::2].flatten(0, 1)


def _check(preset: str, shard: Shard, pairs: bool = False) -> dict:
    """pairs: the whole tower on every side's images (the per-side path) against the split one on each pair's images
    once (sp_tower deals out the pairs' B / 2 image rows)."""
    cfg = load_preset(preset)
    family = "llava" if cfg.family == "llava" else "qwen"
    plan = family_of(cfg).sp_plan
    tower = plan[TOWER]
    g = torch.Generator().manual_seed(0)
    whole = _stage(ReferenceModel(cfg, seed=0))
    split = copy.deepcopy(whole)
    t, t_split = _row(cfg, family, g), None
    if pairs:
        t, t_split = _pairs(t)
    B = t.input_ids.shape[0]
    cot = torch.randn(B, L, cfg.text.dim, generator=g)
    out, feats = _run(whole, t, tower.exit)
    (out * cot).sum().backward()

    assert not split_tower(split[:2], shard, tower), "a stage without the tower's last layer keeps it whole"
    parallelize_sequence(split, shard, plan)
    ran = []
    entry = next(m for m in split if isinstance(m, tower.entry))
    entry.register_forward_hook(lambda m, i, o: ran.append(o[0].shape[0] * o[0].shape[1]))
    out_l, feats_l = _run(split, t if t_split is None else t_split, tower.exit)
    (out_l * local(cot, shard, 1)).sum().backward()
    sum_gradients([p for m in split for p in m.parameters()], shard)

    real = _real_tokens(t, family, feats)
    floats = [k for k in feats.names if getattr(feats, k).is_floating_point()]
    if pairs:  # the per-side features of a pair's chosen row (its rejected row's are the same: its own copy's)
        real = _evens(real, B)
        feats = feats._replace(**{k: _evens(getattr(feats, k), B) for k in floats})
    d = {f"feats.{k}": _gap(getattr(feats_l, k)[real], getattr(feats, k)[real]) for k in floats}
    d["shapes"] = float(any(getattr(feats_l, k).shape != getattr(feats, k).shape for k in feats.names))
    d["ints"] = float(any(not torch.equal(getattr(feats_l, k), getattr(feats, k)) for k in feats.names
                          if not getattr(feats, k).is_floating_point()))  # tiling, has_image decoded exactly
    d["out"] = (out_l - local(out, shard, 1)).abs().max().item()
    named = [(f"{i}.{k}", p) for i, m in enumerate(whole) for k, p in m.named_parameters()]
    got = dict((f"{i}.{k}", p) for i, m in enumerate(split) for k, p in m.named_parameters())
    # relative to the largest gradient element of its layer (the sums over 112 patches run in another order: ~1e-7 x
    # that); not of the parameter alone: a key projection's bias has a gradient of 0 in exact arithmetic (softmax
    # ignores a shift shared by a query's keys), fp32 leaves ~1e-9 of rounding there, and that over itself is noise
    top = {}
    for k, p in named:
        if p.grad is not None:
            top[k.split(".")[0]] = max(top.get(k.split(".")[0], 0.0), p.grad.abs().max().item())
    d |= {f"grad.{k}": ((got[k].grad - p.grad).abs().max() / top[k.split(".")[0]]).item() for k, p in named
          if p.grad is not None and p.grad.abs().max() > 0}
    side = (tower.assign(used_grids(t), P, 1, 2)[0] if family == "qwen" else tower.assign(t.has_image, 16, 2)).rows
    return {"diffs": d, "ran": ran, "family": family, "whole_ran": B * (P if family == "qwen" else 2 * 16),
            "side_ran": [len(r) * (1 if family == "qwen" else 16) for r in side],  # the per-side split's patches
            "grads": sum(1 for _, p in named if p.grad is not None and p.grad.abs().max() > 0)}


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    shard = Shard(dist.group.WORLD, rank, 2)
    got = {p: _check(p, shard) for p in ("qwen-tiny", "qwen3-vl-tiny", "qwen3.5-tiny", "llava-tiny")}
    got |= {f"{p} pairs": _check(p, shard, pairs=True) for p in ("qwen-tiny", "qwen3-vl-tiny", "llava-tiny")}
    with open(f"{tmp}/tower{rank}.json", "w") as f:
        json.dump(got, f)
    dist.barrier()
    os._exit(0)  # no destructors at exit (gloo's occasional abort there)


def test_tower_split_by_images_equals_the_whole_tower(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path),), nprocs=2, start_method="fork")
    ranks = [json.loads((tmp_path / f"tower{r}.json").read_text()) for r in (0, 1)]
    for preset in ranks[0]:
        family = ranks[0][preset]["family"]
        ran = [ranks[r][preset]["ran"] for r in (0, 1)]
        assert ran == [[n] for n in PATCHES[family]], (preset, ran)  # one forward a rank, its share only
        assert sum(PATCHES[family]) < ranks[0][preset]["whole_ran"]
        if preset.endswith("pairs"):  # each pair's images dealt once: half the per-side split's patches
            assert 2 * sum(PATCHES[family]) == sum(ranks[0][preset]["side_ran"]), (preset, ranks[0][preset])
        for r in (0, 1):
            d = ranks[r][preset]["diffs"]
            assert d.pop("shapes") == 0.0, (preset, "the gathered features keep the whole tower's shapes")
            assert d.pop("ints") == 0.0, (preset, "the row's integer tensors come back as they were")
            assert ranks[r][preset]["grads"] > 10, (preset, "the whole run's gradients reach the tower")
            assert len(d) > 10 and max(d.values()) < TOL, (preset, r, {k: v for k, v in d.items() if v >= TOL})
