"""--sp: Ulysses sequence parallelism inside each pipeline stage (issue 58, first slice; docs/sequence_parallel.md).

- In process, 2 gloo ranks (one spawn): a decoder block (llava-tiny's LlamaBlock; qwen-tiny's QwenBlock, M-RoPE of a
  row with images, GQA 4 / 2, qkv biases; qwen3-vl-tiny's Qwen3Block; qwen3.5-tiny's DeltaNetBlock and
  GatedAttentionBlock) and the LossNorm-weighted loss under SP=2 - each rank its half of the row's positions,
  DeepSpeed's all-to-all around the attention (or the delta rule), the labels' slice, gradients summed over SP - equal
  the whole computation on packed rows of 3 samples and 2 samples, a sample cut by the SP slice in each: the loss,
  each rank's outputs and input gradients against its slice of the whole, every parameter's gradient (1e-6); and
  Qwen3-VL's DeepstackAdd0 on a slice. Also MoE blocks (Qwen3MoeBlock, DeltaNetMoeBlock: router statistics summed
  over SP, the aux loss once), rows of odd length (padded to a multiple of SP), LoRA adapters on frozen blocks, and
  experts.clip_norm's norm over SP (a shard counted once).
- In process: the tiled loss (TiledLogits) equals lm_loss on the whole logits.
- One launch (tests/rank_series.py: three runs, PP=2 x SP=2, 4 CPU ranks), packed rows of mixed image grids with 3+
  samples and one cut by the SP slice, 3 steps at a constant lr: qwen-tiny (M-RoPE), qwen3-vl-tiny shrunk (DeepStack
  sets crossing the stage cut) and qwen3.5-tiny shrunk (Gated DeltaNet, its heads split over SP, restarting at each
  sample): each step's loss and the final weights equal the single-device reference (1e-5), every trained tensor
  moved > 10 x that; qwen-tiny's gradients summed over SP once a step (at ReduceGrads).
- qwen-tiny's step-2 checkpoint resumed at SP=2 (bit for bit: one launch) and at SP=1 (weights and AdamW moments
  carried), in one launch with the ZeRO-1 run's below resumed at SP=1 (each DP rank's partition carried).
- One launch: qwen-tiny PP=1 x DP=2 x SP=2 at ZeRO-1 with the clip engaged and activation checkpointing equals the
  single-device reference (1e-5).
- The refusals, one line each (no launch)."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import assert_weights_moved, cut_at, refused, write_ds_config
from mmpipe.config import config_from_dict, load_preset
from mmpipe.model import ReferenceModel
from mmpipe.model.builder import IGNORE_INDEX, bound, lm_loss
from mmpipe.model.llava import LlamaBlock
from mmpipe.model.lora import Lora, add_adapters
from mmpipe.model.moe import MoeBlock, Qwen3MoeBlock, aux_loss
from mmpipe.model.qwen2_vl import QwenBlock
from mmpipe.model.qwen3_5 import DeltaNetBlock, DeltaNetMoeBlock, GatedAttentionBlock
from mmpipe.model.qwen3_vl import DEEPSTACK_ADDS, Qwen3Block
from mmpipe.model.sequence_parallel import local, padded, parallelize_sequence, sp_loss, sum_gradients
from mmpipe.model.stage import StageTuple
from mmpipe.model.tensor_parallel import Shard
from mmpipe.registry import family_of
from mmpipe.runtime.checkpoint import load_reference
from rank_series import launch_series
from test_qwen3_vl_pipeline import SIZES as QWEN3_SIZES
from test_qwen_pipeline import SIZES, PackedSet, _weights_equal_within, loaders_agree
from test_tensor_parallel_families import ADAM
from test_tp_combos import OPTIMIZER as CLIPPED_ADAM

TOL = 1e-5
STEPS, SEED = 3, 5
L = 16  # the in-process row: rank 0 positions 0..7, rank 1 8..15
# row 0: samples of 5, 6, 3 positions and 2 of padding (the second, 5..10, cut at 8); row 1: 9 and 7 (cut at 8)
SEGMENTS = torch.tensor([[1] * 5 + [2] * 6 + [3] * 3 + [0] * 2, [1] * 9 + [2] * 7])


def _row(cfg, hidden: torch.Tensor, length: int = L) -> StageTuple:
    """The stage tuple of the two rows (their first `length` positions): row 0's second sample holds a 4 x 4-patch
    image (4 merged tokens at positions 6..9, across the cut) for QwenBlock's M-RoPE; LlamaBlock reads the segments
    alone."""
    ids = torch.full((2, length), 5)
    ids[0, 6:10] = cfg.image_token_id
    tiling = torch.zeros(2, 1, 3, dtype=torch.long)
    tiling[0, 0] = torch.tensor([1, 4, 4])
    has_image = torch.tensor([[2], [0]])  # row 0's slot belongs to its sample 2
    return StageTuple(hidden, ids, has_image, SEGMENTS[:, :length].clone(), tiling=tiling)


def _moe_config(preset: str):
    """The preset made MoE (8 experts, top 2; test_moe_pipeline's), its aux coefficient 1 so the load-balancing term
    weighs as much as the cross-entropy in the gradients compared."""
    model = load_preset(preset).to_dict()
    model["text"].update(tie_embeddings=False, moe={"experts": 8, "top_k": 2, "ff_dim": 32, "aux_coef": 1.0})
    return config_from_dict(model, f"{preset}-moe")


def _run(block, t: StageTuple):
    """(hidden, the MoE block's router statistics or None)."""
    return block.run_moe(t, 0) if isinstance(block, MoeBlock) else (block.run(t, 0), None)


def _loss(logits, stats, labels, weights, real: int):
    """The head's loss: LossNorm-weighted cross-entropy, plus an MoE block's load-balancing loss (MoeHead's)."""
    return lm_loss(logits if stats is None else (logits, aux_loss(stats, torch.tensor(real), 1)), (labels, weights))


def _block_check(block_cls, preset: str, shard: Shard, length: int = L, lora: bool = False) -> dict:
    """block -> head -> the weighted loss (and an MoE block's aux loss), whole on each rank and under SP: max
    differences. A row of odd `length` is padded to a multiple of SP: rank 1's slice ends in a padding position.
    lora: the block's base frozen, rank-4 adapters on its linears (B drawn nonzero, so A's gradient is too)."""
    cfg = _moe_config(preset) if issubclass(block_cls, MoeBlock) else load_preset(preset)
    torch.manual_seed(0)
    whole = block_cls(cfg)
    if lora:
        add_adapters(whole, 0, Lora(rank=4, alpha=8.0), seed=0)
        with torch.no_grad():  # peft starts B at zero: A's gradient would be 0 = 0
            for name, p in whole.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    head = torch.nn.Linear(cfg.text.dim, 24, bias=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, length, cfg.text.dim, generator=g, requires_grad=True)
    labels = torch.randint(0, 24, (2, length), generator=g)
    segments = SEGMENTS[:, :length]
    labels[segments == 0] = IGNORE_INDEX
    labels[0, :3] = IGNORE_INDEX  # a prompt
    weights = torch.rand(2, length, generator=g) * (labels != IGNORE_INDEX)
    real = int((segments > 0).sum())
    out, stats = _run(whole, _row(cfg, x, length))
    loss = _loss(head(out), stats, labels, weights, real)
    loss.backward()

    block, sp_head = copy.deepcopy(whole), copy.deepcopy(head)
    for m in (block, sp_head):
        m.zero_grad()
    parallelize_sequence([block], shard, family_of(cfg).sp_plan)
    n = padded(length, shard) // 2
    mine = slice(shard.rank * n, min((shard.rank + 1) * n, length))  # this rank's real positions
    # the hidden's slice of the padded row (what the embedding hands the block: sequence_parallel.padded_row)
    x_local = local(x.detach(), shard, 1).clone().requires_grad_()
    out_local, stats_local = _run(block, _row(cfg, x_local, length))  # the row's integer tensors whole (unpadded)
    logits = sp_head(out_local)  # what the head returns: logits, and an MoE head's aux loss beside them
    head_out = logits if stats is None else (logits, aux_loss(stats_local, torch.tensor(real), 1))
    loss_local = sp_loss(lm_loss, shard)(head_out, (labels, weights))
    loss_local.backward()
    sum_gradients([*block.parameters(), *sp_head.parameters()], shard)  # what ReduceGrads runs first under --sp
    kept = mine.stop - mine.start
    # the loss relative to its size: a sum of ~20 weighted cross-entropies (qwen3-vl-tiny's ~60), added in another order
    diffs = {"loss": abs(loss_local.item() - loss.item()) / abs(loss.item()),
             "out": (out_local[:, :kept] - out[:, mine]).abs().max().item(),
             "x.grad": (x_local.grad[:, :kept] - x.grad[:, mine]).abs().max().item()}
    if stats is not None:  # every SP rank carries the whole row's router statistics
        diffs["stats"] = (stats_local - stats).abs().max().item()
    grads = dict(whole.named_parameters()) | {f"head.{k}": v for k, v in head.named_parameters()}
    got = dict(block.named_parameters()) | {f"head.{k}": v for k, v in sp_head.named_parameters()}
    diffs |= {k: (got[k].grad - p.grad).abs().max().item() for k, p in grads.items() if p.requires_grad}
    return diffs


def _deepstack_check(shard: Shard) -> dict:
    """Qwen3-VL's DeepstackAdd0 (qwen3-vl-tiny's layer 11) on each rank's slice: its slice of the whole row's output,
    its hidden's gradient the slice of the whole one, the set's gradient summed over SP the whole one."""
    cfg = load_preset("qwen3-vl-tiny")
    g = torch.Generator().manual_seed(2)
    fields = bound(DEEPSTACK_ADDS[0](cfg), cfg, 11).__dict__["stage_in"]
    row = _row(cfg, torch.randn(2, L, cfg.text.dim, generator=g))
    sets = {f.name: torch.randn(2, 4, cfg.text.dim, generator=g) for f in fields if f.name.startswith("deepstack")}
    mine = slice(shard.rank * L // 2, (shard.rank + 1) * L // 2)
    cotangent = torch.randn(2, L, cfg.text.dim, generator=g)  # the gradient reaching the add's output
    results = []
    for split in (False, True):
        add = bound(DEEPSTACK_ADDS[0](cfg), cfg, 11)
        if split:
            parallelize_sequence([add], shard, family_of(cfg).sp_plan)
        hidden = (row.hidden[:, mine] if split else row.hidden).clone().requires_grad_()
        ds = {k: v.clone().requires_grad_() for k, v in sets.items()}
        t = row._replace(hidden=hidden, **ds)
        out = add(tuple(getattr(t, f.name) for f in fields))[0]
        out.backward(cotangent[:, mine] if split else cotangent)
        grad = ds["deepstack_0"].grad.clone()
        if split:
            dist.all_reduce(grad)
        results.append((out, hidden.grad, grad))
    (out, h_grad, d_grad), (out_l, h_grad_l, d_grad_l) = results
    return {"deepstack.out": (out_l - out[:, mine]).abs().max().item(),
            "deepstack.hidden.grad": (h_grad_l - h_grad[:, mine]).abs().max().item(),
            "deepstack.set.grad": (d_grad_l - d_grad).abs().max().item(),
            "moved": (out_l - row.hidden[:, mine]).abs().max().item()}  # this rank's slice holds image positions


class _Grid:  # the pipeline grid's two questions clip_norm asks, for PP = 1: the SP group is the model-parallel one
    def __init__(self, shard: Shard):
        self.shard = shard

    def get_model_parallel_rank(self):
        return self.shard.rank

    def get_model_parallel_group(self):
        return self.shard.group


def _clip_check(shard: Shard) -> dict:
    """experts.clip_norm (--ep's fp32 clip) under SP: a replicated weight and an expert shard, each held by both SP
    ranks with the same (SP-summed) gradient, marked as the pipeline marks them (mark_norm_counting: SP rank 0 only),
    EP 1 (each rank its own EP group): the norm and the clipped gradients are one copy's, as torch clips it (the shard
    counted on both SP ranks, the norm would be sqrt(|w|^2 + 2 |s|^2): 10.5 against 7.75 here)."""
    from mmpipe.model.tensor_parallel import mark_norm_counting
    from mmpipe.runtime.experts import clip_norm
    g = torch.Generator().manual_seed(3)
    w, s = torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(4, 3))
    w.grad, s.grad = torch.randn(5, 3, generator=g), torch.randn(4, 3, generator=g) * 3
    whole = [copy.deepcopy(w), copy.deepcopy(s)]
    for p, q in zip(whole, (w, s)):
        p.grad = q.grad.clone()
    mark_norm_counting([w, s], shard.rank)
    alone = [dist.new_group([r]) for r in range(shard.size)][shard.rank]
    norm = clip_norm([w, s], [s], 1.0, _Grid(shard), alone)
    want = torch.nn.utils.clip_grad_norm_(whole, 1.0)
    return {"clip.norm": abs(norm.item() - want.item()), "clip.w": (w.grad - whole[0].grad).abs().max().item(),
            "clip.s": (s.grad - whole[1].grad).abs().max().item(), "clip.moved": want.item()}


def _worker(rank: int, tmp: str) -> None:
    from deepspeed.comm import comm as ds_comm
    from deepspeed.comm.torch import TorchBackend
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    ds_comm.cdb = TorchBackend("gloo", ds_comm.default_pg_timeout, None)  # DistributedAttention's all-to-all
    shard = Shard(dist.group.WORLD, rank, 2)
    diffs = {name: _block_check(cls, preset, shard)
             for name, cls, preset in (("llava", LlamaBlock, "llava-tiny"), ("qwen", QwenBlock, "qwen-tiny"),
                                       ("qwen3", Qwen3Block, "qwen3-vl-tiny"),
                                       ("deltanet", DeltaNetBlock, "qwen3.5-tiny"),
                                       ("gated", GatedAttentionBlock, "qwen3.5-tiny"),
                                       ("qwen3_moe", Qwen3MoeBlock, "qwen3-vl-tiny"),
                                       ("deltanet_moe", DeltaNetMoeBlock, "qwen3.5-tiny"))}
    # a row of 15 positions, padded to 16 (rank 1 holds 7 and a padding position)
    diffs |= {f"{name}_odd": _block_check(cls, preset, shard, L - 1)
              for name, cls, preset in (("qwen", QwenBlock, "qwen-tiny"), ("deltanet", DeltaNetBlock, "qwen3.5-tiny"),
                                        ("qwen3_moe", Qwen3MoeBlock, "qwen3-vl-tiny"))}
    # LoRA on the frozen blocks (adapters injected after the SP wrapping in the pipeline, before it here: the same)
    diffs |= {f"{name}_lora": _block_check(cls, preset, shard, lora=True)
              for name, cls, preset in (("qwen", QwenBlock, "qwen-tiny"), ("deltanet", DeltaNetBlock, "qwen3.5-tiny"))}
    diffs["deepstack"] = _deepstack_check(shard)
    diffs["clip"] = _clip_check(shard)
    with open(f"{tmp}/diffs{rank}.json", "w") as f:
        json.dump(diffs, f)
    dist.barrier()
    os._exit(0)  # as test_tensor_parallel's workers: no destructors at exit (gloo's occasional abort there)


def test_block_and_loss_under_sp2_equal_the_whole_row(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in (0, 1):
        diffs = json.loads((tmp_path / f"diffs{rank}.json").read_text())
        moved = diffs["deepstack"].pop("moved")
        assert moved > 0.1, moved  # the set was added on this rank's image positions (6, 7 | 8, 9)
        assert diffs["clip"].pop("clip.moved") > 2, diffs["clip"]  # the norm (7.75) clipped at 1.0
        for block, d in diffs.items():
            assert len(d) > (2 if block in ("deepstack", "clip") else 10), (block, d)  # every parameter's gradient
            assert max(d.values()) < 1e-6, (rank, block, d)


def test_tiled_loss_equals_the_whole_logits_loss(monkeypatch):
    """TiledLogits' loss (what sp_loss computes from a head under --sp) equals lm_loss on the whole logits: the
    LossNorm-weighted cross-entropy and the gradients of the hidden and the head's weight (1e-6), over 38 positions in
    tiles of 5 (8 tiles forward, 8 recomputed backward); autograd keeps no logits, and no tile's logits exceed 5 x V."""
    from mmpipe.model import sequence_parallel
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 19, 16, generator=g, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(50, 16, generator=g))
    labels = torch.randint(0, 50, (2, 19), generator=g)
    labels[0, :4] = labels[1, 15:] = IGNORE_INDEX
    weights = torch.rand(2, 19, generator=g) * (labels != IGNORE_INDEX)
    loss = lm_loss(torch.nn.functional.linear(hidden, weight), (labels, weights))
    loss.backward()
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    tiles, saved = [], []
    real = sequence_parallel._tile_loss
    monkeypatch.setattr(sequence_parallel, "_tile_loss", lambda x, *a: tiles.append(len(x)) or real(x, *a))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        tiled = sequence_parallel.TiledLogits(h, w, tile=5).loss(labels, weights)
    tiled.backward()
    assert tiles == [5] * 7 + [3] + [5] * 7 + [3]
    assert sorted(saved) == [38, 38, 608, 800]  # its inputs only (labels, weights, hidden, weight): no logits
    assert abs(tiled.item() - loss.item()) <= 1e-6 * abs(loss.item())
    assert (h.grad - hidden.grad).abs().max() < 1e-6 and (w.grad - weight.grad).abs().max() < 1e-6


pytestmark = pytest.mark.usefixtures("small_tiles")  # conftest's: the launches' loss in tiles of 16 positions

# The PP=2 x SP=2 launch's families: (preset, image sizes, its shrinking or None, PP=2's cut or None: the planner's).
# qwen3-vl-tiny and qwen3.5-tiny shrunk (SMALL) to keep the launch short (~75k parameters each): a 16-wide 2-block
# tower, a 32-wide decoder of 2 heads / 2 kv (SP 2 divides both). qwen3-vl: DeepStack after both tower blocks, 3
# decoder layers (a set added after the last one would reach only the image positions, whose labels are ignored: its
# merger would take no gradient), cut 8 before DeepstackAdd0 (layers: patch embed, block, merger 0, block, merger 1,
# merger, embed, Qwen3Block 7, DeepstackAdd0 8, ...): both sets cross the cut beside each SP rank's slice of the
# hidden. qwen3.5: layer 0 Gated DeltaNet (the preset's 2 key / 4 value heads: one key head per SP rank), layer 1
# gated full attention, cut 6 between them.
SMALL = {"vision": {"dim": 16, "ff_dim": 32, "n_layers": 2},
         "text": {"dim": 32, "ff_dim": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2}}
SP_FAMILIES = {"qwen-tiny": ("qwen-tiny", SIZES, None, None),
               "qwen3-vl": ("qwen3-vl-tiny", QWEN3_SIZES, {"vision": {"deepstack_indexes": [0, 1]},
                                                           "text": {"n_layers": 3}}, 8),
               "qwen3.5": ("qwen3.5-tiny", QWEN3_SIZES, {"text": {"full_attention_indexes": [1]}}, 6)}
# The shrunk ones' AdamW at eps 1e-3 (ADAM's 5e-3 chose TP's rounding, test_tensor_parallel_families): at 5e-3 their
# 3 steps left a tensor of each under 10 x TOL (qwen3.5's tower norms, pos_embed, dt_bias, A_log 3.4e-5 .. 8.0e-5),
# at 1e-3 every tensor of both moved > 1e-4 (measured on the reference)
SMALL_ADAM = {**ADAM, "params": {**ADAM["params"], "eps": 1e-3}}


def _small_preset(preset: str, changes: dict, root) -> str:
    """The preset with SMALL's and `changes`' fields, written to root / preset.json; its path (--preset takes one)."""
    model = load_preset(preset).to_dict()
    for part in ("vision", "text"):
        model[part].update(SMALL[part], **changes.get(part, {}))
    model["proj_inner_dim"] = 2 * SMALL["text"]["dim"]
    (root / f"{preset}.json").write_text(json.dumps(model))
    return str(root / f"{preset}.json")


@pytest.fixture(scope="module")
def sp_families(tmp_path_factory):
    """Each family's set (test_tensor_parallel_families' set-up: 2 rows x 2 micro-batches a step, AdamW at a constant
    lr), its single-device reference and its PP=2 x SP=2 run: one launch, the runs one after another
    (tests/rank_series.py); qwen-tiny's checkpoints at step 2 too (the resume tests')."""
    sets, runs = {}, []
    for name, (preset, sizes, changes, cut) in SP_FAMILIES.items():
        root = tmp_path_factory.mktemp(name)
        data = PackedSet(root, preset if changes is None else _small_preset(preset, changes, root), sizes, 36, STEPS,
                         SEED, {2: [cut]} if cut else None)
        write_ds_config(data.root / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                        scheduler=None, optimizer=ADAM if changes is None else SMALL_ADAM)
        cuts = ["--partition", str(cut)] if cut else []
        save = ["--save-every", "2"] if name == "qwen-tiny" else []
        runs.append((root / "sp", [*data.args, "--stages", "2", "--steps", str(STEPS), *cuts, "--sp", "2", *save], {}))
        sets[name] = data
    launched = launch_series(runs)
    return {name: (data, data.reference(), run) for (name, data), run in zip(sets.items(), launched)}


@pytest.fixture(scope="module")
def qwen_sp(sp_families):
    """qwen-tiny's (set, reference, PP=2 x SP=2 run)."""
    data, reference, run = sp_families["qwen-tiny"]
    return data, reference, run.check()


@pytest.mark.parametrize("name", list(SP_FAMILIES))
def test_rows_have_a_sample_cut_by_the_sp_slice(sp_families, name):
    """What each family's launch trains on: every micro-batch holds a row of 3 or more samples, and a sample is cut by
    the SP slice (it has positions on both sides of the row's middle)."""
    data = sp_families[name][0]
    run = data.resolved()
    cut = 0
    for _, _, _, segments, _ in loaders_agree(run, data.root, SEED, STEPS):
        half = segments.shape[1] // 2
        assert segments.shape[1] % 2 == 0 and int(segments.max()) >= 3
        cut += int(((segments[:, half - 1] == segments[:, half]) & (segments[:, half] > 0)).sum())
    assert cut >= 1


@pytest.mark.parametrize("name", list(SP_FAMILIES))
def test_pp2_sp2_equals_single_device(sp_families, name):
    """qwen-tiny (M-RoPE, windowed tower), qwen3-vl (DeepStack sets crossing the cut, each SP rank adding its slice)
    and qwen3.5 (Gated DeltaNet restarting at each sample of the whole row, its heads split over SP) at PP=2 x SP=2:
    each step's loss and the final weights equal the single-device reference (1e-5), every trained tensor moved."""
    data, (ref_model, ref_losses), run = sp_families[name]
    run.check()
    assert run.summary["stages"] == 2 and sorted(run.losses) == list(range(1, STEPS + 1))
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-3
    assert list(run.losses.values()) == pytest.approx(ref_losses, abs=TOL), (run.losses, ref_losses)
    ckpt = run.out / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    assert not list((ckpt / tag).glob("layer_*-model_0*")), "SP's layer files are whole layers, named as without SP"
    model = torch.nn.Sequential(*load_reference(ckpt, ref_model.cfg))
    ref = ref_model.state_dict()
    print(f"{name} PP=2 x SP=2 against the single device: losses "
          f"{max(abs(run.losses[s] - x) for s, x in enumerate(ref_losses, 1)):.1e}, weights "
          f"{max((v - ref[k]).abs().max().item() for k, v in model.state_dict().items()):.1e}")
    _weights_equal_within(model, ref_model, TOL)
    init = ReferenceModel(ref_model.cfg, seed=SEED).state_dict()
    assert_weights_moved(model.state_dict(), init, TOL)  # every trained tensor > 10 x TOL


def test_resume_at_sp2_is_bit_exact(qwen_sp):
    """The PP=2 x SP=2 run cut after step 2 (its step-2 checkpoint: every SP rank's own optimizer file
    mp_rank_<stage x 2 + SP rank>) and resumed at SP=2: step 3's loss and every layer file bit for bit."""
    data, (ref_model, _), run = qwen_sp
    assert sorted(p.name for p in (run.out / "checkpoints" / "step2").glob("mp_rank_*")) == [
        f"mp_rank_0{r}_model_states.pt" for r in range(4)]
    resumed = data.launch(cut_at(run, data.root / "cut_sp2", 2).name, 2, "--sp", "2", "--resume")
    assert resumed.summary["start_step"] == 2
    assert [int(r["step"]) for r in resumed.rows] == list(range(1, STEPS + 1))
    assert resumed.losses == run.losses
    got, want, cut = (torch.nn.Sequential(*load_reference(r.out / "checkpoints", ref_model.cfg, tag)).state_dict()
                      for r, tag in ((resumed, None), (run, None), (resumed, "step2")))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # step 3 ran: every tensor changed from the cut's (one constant-lr step moves some by < 1e-4, so no 10 x TOL here;
    # test_pp2_sp2_equals_single_device checks the run moved)
    assert not [k for k in cut if torch.equal(cut[k], got[k])]


def _optimizers(tag_dir, ranks) -> list[dict]:
    return [torch.load(tag_dir / f"mp_rank_{r:02d}_model_states.pt", map_location="cpu", weights_only=False)
            ["optimizer"] for r in ranks]


def _max_gap(a: dict, b: dict) -> float:
    """The largest difference between two AdamW states' tensors (same parameters, same keys)."""
    a, b = a["state"], b["state"]
    assert a.keys() == b.keys() and all(a[i].keys() == b[i].keys() for i in a)
    return max(float((a[i][k].float() - b[i][k].float()).abs().max()) for i in a for k in a[i])


def _bitwise_equal(a, b) -> bool:
    """Two saved optimizer states (nested dicts / lists of tensors, numbers and objects such as ZeRO's loss scaler,
    compared by their attributes) hold the same values, bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_bitwise_equal, a, b))
    if hasattr(a, "__dict__"):  # no __eq__: == would compare identities
        return type(a) is type(b) and _bitwise_equal(vars(a), vars(b))
    return a == b


@pytest.fixture(scope="module")
def sp1_resumes(qwen_sp, qwen_sp_zero1):
    """The step-2 checkpoints of the PP=2 x SP=2 run and of the ZeRO-1 PP=1 x DP=2 x SP=2 run, each cut there
    (conftest.cut_at) and resumed at SP=1 (2 ranks each): one launch (tests/rank_series.py)."""
    data, _, run = qwen_sp
    _, z1_run, z1_data, z1 = qwen_sp_zero1
    runs = [(cut_at(run, data.root / "cut_sp1", 2), [*data.args, "--stages", "2", "--steps", str(STEPS), "--resume"],
             {}),
            (cut_at(z1_run, z1_data.root / "cut_z1_sp1", 2),
             [*z1_data.args, "--stages", "1", "--steps", str(STEPS), "--ds-config", str(z1), "--dp", "2", "--resume"],
             {})]
    return dict(zip(("pp2", "zero1"), launch_series(runs)))


def _assert_carried_across_sp(resumed, run, cfg) -> float:
    """`resumed` (run's step-2 checkpoint resumed at SP=1) said so in its two notes, no restart warning, and its step
    3 is run's: the loss within TOL, every tensor changed from the cut's; returns the weights' largest difference."""
    assert resumed.summary["start_step"] == 2
    log = resumed.proc.stdout + resumed.proc.stderr
    assert "note: step2 was written at --sp 2, this run is --sp 1" in log, log[-3000:]
    assert "the optimizer state (AdamW moments) carried too" in log and "starts again from zero" not in log
    assert resumed.losses[3] == pytest.approx(run.losses[3], abs=TOL), (resumed.losses, run.losses)
    got, want, cut = (torch.nn.Sequential(*load_reference(r.out / "checkpoints", cfg, tag)).state_dict()
                      for r, tag in ((resumed, None), (run, None), (resumed, "step2")))
    assert not [k for k in cut if torch.equal(cut[k], got[k])]  # step 3 ran at SP=1 (moved as in the SP=2 test)
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def test_sp2_checkpoint_resumes_at_sp1(qwen_sp, sp1_resumes):
    """The same step-2 checkpoint resumed at SP=1 (PP=2, 2 ranks): the weights carry over (the layer files are whole
    layers at any SP) and so do the AdamW moments (SP splits positions, not parameters: every SP rank's optimizer is
    the same, so stage s reads SP rank 0's, mp_rank_<2 s>), with a note naming both SPs and no restart warning; step 3's
    loss, its weights and its moments are the uninterrupted SP=2 run's."""
    data, (ref_model, _), run = qwen_sp
    step2 = run.out / "checkpoints" / "step2"
    for stage in range(2):  # each stage's two SP ranks saved the same optimizer, bit for bit
        sp0, sp1 = _optimizers(step2, (2 * stage, 2 * stage + 1))
        assert sp0["state"] and _bitwise_equal(sp0, sp1)
    resumed = sp1_resumes["pp2"].check()
    weights = _assert_carried_across_sp(resumed, run, ref_model.cfg)
    # the step-3 moments: stage s at SP 1 (mp_rank_0s) against the SP=2 run's SP rank 0 (mp_rank_0<2 s>); restarted
    # moments (the old policy) measured 1.2e-3 on the weights and 2.0 here: AdamW's step counter at 1, not 3
    tag = (resumed.out / "checkpoints" / "latest").read_text().strip()
    mine, theirs = resumed.out / "checkpoints" / tag, run.out / "checkpoints" / tag
    moments = max(_max_gap(*_optimizers(mine, (s,)), *_optimizers(theirs, (2 * s,))) for s in range(2))
    print(f"SP 2 -> 1 resume, step 3 against the SP=2 run: loss {abs(resumed.losses[3] - run.losses[3]):.2e}, "
          f"weights {weights:.2e}, moments {moments:.2e}")
    assert weights <= TOL and moments <= TOL, (weights, moments)


CLIP = 0.05  # below the gradient norm from step 1
# test_tp_combos' AdamW (lr 3e-3, eps 1e-4): at ADAM's eps 5e-3 the clipped gradients move 23 of 56 tensors < 1e-4
# in 3 steps; at eps 1e-4 the clip's scale still reaches the update (a clip at sqrt(2) x CLIP ends elsewhere)


@pytest.fixture(scope="module")
def qwen_sp_zero1(tmp_path_factory):
    """qwen-tiny PP=1 x DP=2 x SP=2 (4 ranks) at ZeRO-1, clipped at CLIP, activation checkpointing on (each decoder
    block's forward, all-to-alls included, recomputed in backward on both SP ranks), and its references: the
    single-device loop on
    the same 4 rows a step (micro 2 x GAS 2; the launch micro 2 x GAS 1 x DP 2), clipped at CLIP and sqrt(2) x CLIP."""
    data = PackedSet(tmp_path_factory.mktemp("sp_z1"), "qwen-tiny", SIZES, 36, STEPS, SEED)
    common = {"train_micro_batch_size_per_gpu": 2, "scheduler": None, "optimizer": CLIPPED_ADAM}
    z1 = write_ds_config(data.root / "z1.json", gradient_accumulation_steps=1, gradient_clipping=CLIP,
                         zero_optimization={"stage": 1}, **common,  # and every checkpointable layer checkpointed
                         pipeline={"stages": "auto", "partition": "best", "activation_checkpoint_interval": 1})
    refs = []
    for clip in (CLIP, CLIP * 2 ** 0.5):
        write_ds_config(data.root / "ds.json", gradient_accumulation_steps=2, gradient_clipping=clip, **common)
        refs.append(data.reference())
    return refs, data.launch("z1", 1, "--ds-config", str(z1), "--dp", "2", "--sp", "2", "--save-every", "2"), data, z1


def test_zero1_dp2_sp2_clipped_equals_single_device(qwen_sp_zero1):
    """ZeRO-1 partitions each SP rank's optimizer over its data axis (DP 2): 4 files, zero_pp_rank_D_mp_rank_0S; its
    norm counts each replicated weight once over SP (mark_norm_counting; counted twice, the clip would act as at
    CLIP / sqrt(2), and a clip at sqrt(2) x CLIP ends > 10 x TOL away)."""
    ((ref_model, ref_losses), (_, other_losses)), run, _, _ = qwen_sp_zero1
    assert abs(other_losses[-1] - ref_losses[-1]) > 10 * TOL  # the clip engaged (measured 7.1e-3)
    assert list(run.losses.values()) == pytest.approx(ref_losses, abs=TOL), (run.losses, ref_losses)
    ckpt = run.out / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    assert sorted(p.name for p in (ckpt / tag).glob("zero_pp_rank_*")) == [
        f"zero_pp_rank_{d}_mp_rank_0{s}_optim_states.pt" for d in range(2) for s in range(2)]
    for d in range(2):  # the two SP ranks' DP part d is the same partition, bit for bit (what an SP change would keep)
        sp0, sp1 = (torch.load(ckpt / tag / f"zero_pp_rank_{d}_mp_rank_0{s}_optim_states.pt", weights_only=False)
                    ["optimizer_state_dict"] for s in range(2))
        assert _bitwise_equal(sp0, sp1)
    model = torch.nn.Sequential(*load_reference(ckpt, ref_model.cfg))
    _weights_equal_within(model, ref_model, TOL)
    assert_weights_moved(model.state_dict(), ReferenceModel(ref_model.cfg, seed=SEED).state_dict(), TOL)


def test_sp_refusals_one_line_each(capsys):
    err = refused(["--preset", "qwen-tiny", "--sp", "3", "--steps", "1"], capsys)
    for what in ("4 attention heads", "2 KV heads"):
        assert any(f"--sp: 3 does not divide qwen-tiny's {what}" in line for line in err), err
    for preset, why in (("gemma3-tiny", "gemma3"), ("tiny", "moondream")):
        err = refused(["--preset", preset, "--sp", "2", "--steps", "1"], capsys)
        assert any(f"--sp: 2 on {preset}" in line and why in line for line in err), err
    for flags, what in ((["--schedule", "dualpipev"], "schedule dualpipev"),  # (--tp with --sp: test_tp_sp)
                        (["--lora", "4", "--lora-dropout", "0.1", "--lora-groups", "text,vision"],
                         "--lora-dropout 0.1 on --lora-groups text,vision")):  # on the text: test_lora_dropout_split
        err = refused(["--preset", "llava-tiny", "--sp", "2", "--steps", "1", *flags], capsys)
        assert any(f"--sp: 2 with {what}" in line and "not supported yet" in line for line in err), err
    err = refused(["--preset", "llava-tiny", "--sp", "0", "--steps", "1"], capsys)
    assert any("--sp: 0 must be >= 1" in line for line in err), err
    from mmpipe.cli import main
    assert main(["check", "--preset", "llava-tiny", "--sp", "2", "--steps", "1", "--dry-run"]) == 0  # check --sp runs
    assert "x sp 2 = " in capsys.readouterr().out


def _zero1_parts(tag_dir, sp_rank: int) -> list[dict]:
    """Each DP part's ZeRO-1 optimizer state (its AdamW state over the flat partition) SP rank `sp_rank` saved."""
    return [torch.load(tag_dir / f"zero_pp_rank_{d}_mp_rank_0{sp_rank}_optim_states.pt", weights_only=False)
            ["optimizer_state_dict"]["base_optimizer_state"] for d in range(2)]


def test_zero1_sp2_checkpoint_resumes_at_sp1(qwen_sp_zero1, sp1_resumes):
    """ZeRO-1's partitions carried across SP: the PP=1 x DP=2 x SP=2 run's step-2 checkpoint resumed at DP=2 x SP=1
    (2 ranks), DP rank D loading the part D SP rank 0 saved (zero_pp_rank_D_mp_rank_00: the SP ranks' parts are the
    same, test_zero1_dp2_sp2_clipped_equals_single_device), with the notes and no restart warning: step 3's loss,
    weights and each DP part's AdamW moments are the uninterrupted SP=2 run's (restarted moments hold AdamW's step 1,
    not 3)."""
    ((ref_model, _), _), run, _, _ = qwen_sp_zero1
    resumed = sp1_resumes["zero1"].check()
    weights = _assert_carried_across_sp(resumed, run, ref_model.cfg)
    tag = (resumed.out / "checkpoints" / "latest").read_text().strip()
    mine, theirs = (_zero1_parts(r.out / "checkpoints" / tag, 0) for r in (resumed, run))
    moments = max(_max_gap(a, b) for a, b in zip(mine, theirs))
    print(f"ZeRO-1 SP 2 -> 1 resume, step 3 against the SP=2 run: loss {abs(resumed.losses[3] - run.losses[3]):.2e}, "
          f"weights {weights:.2e}, moments {moments:.2e}")
    assert weights <= TOL and moments <= TOL, (weights, moments)
