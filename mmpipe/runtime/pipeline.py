"""The model as a DeepSpeed PipelineModule, cut at boundaries mmpipe computed (mmpipe.planning.partition).
Only floats cross its stage boundaries (mmpipe.runtime.wire, mmpipe.model.stage)."""
from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology

from ..model.builder import apply_freeze, bind_layer_fields, layer_specs
from ..model.lora import add_adapters
from ..model.moe import head_aux
from ..model.sequence_parallel import parallelize_sequence, sum_gradients_at_step
from ..model.tensor_parallel import Shard, mark_norm_counting, parallelize
from ..model.tensor_parallel import sum_gradients_at_step as sum_tp_gradients_at_step
from ..registry import family_of
from ..run_config import RunConfig
from .experts import shard_experts
from .wire import install as install_wire


def _has(fields, name: str) -> bool:
    return any(f.name == name for f in fields)


def rank_objective(engine, run):
    """The objective's form this rank's loss, validation sum and reference record take: under --sp its SP form (each
    SP rank's slice of the row; under --tp too, the head's tiles carrying the TP shard), under --tp alone its
    vocab-parallel form over the last stage's 1/TP of the logits (every TP rank gets the same sums), else the record
    itself (mmpipe.model.objectives.Objective.split_sequence / split_vocab)."""
    if getattr(run, "sp", 1) > 1:  # (a test's stand-in run may not say)
        return run.objective.split_sequence(engine.module._sp_shard())
    if run.tp == 1:
        return run.objective
    shard = Shard(engine.grid.get_slice_parallel_group(), engine.grid.get_slice_parallel_rank(), run.tp)
    return run.objective.split_vocab(shard, run.model.text.vocab_size)


class VLMPipeline(PipelineModule):
    """PipelineModule with explicit stage bounds: DeepSpeed's 'profile' is unimplemented and its
    'parameters' ignores frozen layers, so `_partition_layers` (the hook DeepSpeed calls during
    __init__) takes the boundaries computed beforehand."""

    def __init__(self, run: RunConfig, seed: int):
        self.__dict__["_mmpipe_parts"] = list(run.parts)  # read by _partition_layers inside super().__init__
        self.__dict__["wire_ints"] = None  # the running micro-batch's integer tensors (set per ForwardPass)
        topology = grid_topology(run)
        super().__init__(
            layers=layer_specs(run.model),
            num_stages=None if topology else run.stages, topology=topology,  # (sets self._topo, self._grid)
            loss_fn=run.objective.loss,  # what the last stage trains on (mmpipe.model.objectives)
            partition_method="mmpipe",
            # layer i is built under seed + i, exactly as ReferenceModel builds it. DeepSpeed also calls
            # seed_fn before every layer of every forward (for dropout); torch.manual_seed costs
            # ~0.4 ms there on a CPU-only build (it formats tracebacks for the lazy CUDA seed), ~8% of
            # a `small` step, while the CPU generator's own manual_seed is the same seed for the
            # weights (built on the CPU) and nearly free. mmpipe's layers have no dropout.
            seed_layers=True, base_seed=seed, seed_fn=torch.default_generator.manual_seed,
            activation_checkpoint_interval=int(run.ds_config.get("pipeline", {}).get(
                "activation_checkpoint_interval", 0)),
            checkpointable_layers=[c.__name__ for c in family_of(run.model).checkpointable],  # DeepSpeed wants names
        )
        self.tp, self.sp = run.tp, run.sp
        self._seq_group = seq_group(self._topo)  # --sp: this rank's SP group (None without); collective
        if "seq" in self._topo.get_axis_names():
            # DeepSpeed's ZeRO-1 and bf16 norms count an unmarked parameter where the grid's tensor-parallel rank
            # (bwc_tensor_model_parallel_rank: the model coordinate) is 0, and every weight is replicated over seq
            # too: the grid answers the rank within seq x model, 0 on (seq 0, model 0) alone (measured: ZeRO-1 DP 2 x
            # SP 2 clipped, step 2's loss 1.1e-2 off with the model coordinate, which counts each SP rank's copy)
            at = self._topo.get_coord(self.global_rank)
            self._grid.get_tensor_model_parallel_rank = lambda: at.seq * run.tp + at.model
        if run.tp > 1:  # every layer was built whole under its seed above; keep this rank's slices
            self._split_tensors(run)
        if run.sp > 1:  # each SP rank keeps its slice of the row's positions (mmpipe.model.sequence_parallel)
            self._split_sequence(run)
        for _ in self.each_part():  # this rank's layer list(s): one, or DualPipeV's two (mmpipe.runtime.dualpipev)
            apply_freeze(self.forward_funcs, run.freeze)
        self.moe = run.experts is not None  # its head reports the aux loss
        self.metrics = run.objective.metrics  # the loss's last micro-batch values, logged (mmpipe.model.objectives)
        # --ep: this rank's share of the experts (mmpipe.runtime.experts; the engine's reduction and save follow it),
        # in every part it holds: the whole module, DualPipeV's phase-1 stage too, not the active forward_funcs
        self.expert_shards, self.expert_shards_group = (shard_experts([self], self._topo, run.ep)
                                                        if run.ep > 1 else ([], None))
        for _ in self.each_part():
            bind_layer_fields(self.forward_funcs, run.model, self._local_start)
            for offset, layer in enumerate(self.forward_funcs):  # layer i's adapters seeded as in the reference
                if isinstance(layer, torch.nn.Module):
                    add_adapters(layer, self._local_start + offset, run.lora, seed)
        for module in self.tied_modules.values():  # a tied copy (LLaVA's head) freezes with its group
            add_adapters(module, -1, run.lora, seed)  # (an embedding: no linear, so no adapter)
        # DeepSpeed 0.19.8 computes the global gradient norm (clipping, ZeRO-1, bf16) by summing
        # over its "model parallel" group - here, the stages of one pipeline - but counts a
        # parameter only on group rank 0 (stage 0) unless it is marked model_parallel. Unmarked,
        # every stage clips with stage 0's norm and PP=2 drifts from PP=1 once clipping engages.
        # Each parameter lives on exactly one stage, so marking all of them counts each once - except
        # a tied module (TiedLayerSpec), held on every stage that uses it: DeepSpeed flags the copies
        # after the first ds_pipe_replicated (its ZeRO/fp16 norms skip them; the fp32 clip does not),
        # and an unmarked copy off stage 0 is not counted, so the tied weight counts once.
        # Under --tp the same rule per TP slice, a replicated weight counted on TP rank 0 only (mark_norm_counting).
        # Under --sp every weight is replicated over the seq axis too (DeepSpeed's group is then stages x SP x TP):
        # counted on SP rank 0 only, each TP slice there once.
        mark_norm_counting(self.parameters(), self._grid.get_slice_parallel_rank())
        if self._seq_rank():
            for p in self.parameters():
                p.model_parallel = False
        # a tiling the layers drop is read from the images themselves by the layer that drops it (moondream's
        # multi-crop, read by its Projector: mmpipe.families.CROP_TILING); a later stage holding it loads images too.
        # The dynamic families keep theirs to the head, from the index: no image opened (mmpipe.runtime.wire)
        self.reads_images = self.stage_id == 0 or any(_has(f.__dict__["stage_in"], "tiling") and not _has(
            f.__dict__["stage_out"], "tiling") for _ in self.each_part() for f in self.forward_funcs)

    # The hooks a PipelineModule with several parts per rank (DualPipeV's V: mmpipe.runtime.dualpipev) overrides.
    def install_wire(self, engine) -> None:
        """What the engine needs patched for this module (trainer.build_engine calls it after deepspeed.initialize):
        only floats cross a stage boundary (mmpipe.runtime.wire); under --sp each SP rank's gradient is its positions'
        share, summed over the SP group once a step at ReduceGrads (sequence_parallel.sum_gradients_at_step)."""
        install_wire(engine)
        if self.tp > 1:  # the TP ranks' shares of a whole weight's gradient (tp_summed) summed once a step
            sum_tp_gradients_at_step(engine, self._tp_shard())
        if self.sp > 1:
            sum_gradients_at_step(engine, self._sp_shard())

    def each_part(self):
        """Make each of this rank's parts of the layer list the active one (forward_funcs, _local_start) in turn."""
        yield 0

    def first_part(self) -> bool:
        """The active part is the pipeline's first (it takes the loader's whole tuple, nothing received)."""
        return self.stage_id == 0

    def last_part(self) -> bool:
        """The active part is the pipeline's last (the head: it returns what the loss reads, not floats to send)."""
        return self.stage_id == self.num_stages - 1

    def _split_tensors(self, run: RunConfig) -> None:
        """The family's tensor-parallel plan applied to each built layer (mmpipe.model.tensor_parallel.parallelize),
        each tied module once (it is a layer where first used, and DeepSpeed's partial of the head's forward_fn on
        it where used again), and the last stage's loss over its 1/TP of the vocabulary."""
        plan, shard = family_of(run.model).tp_plan, self._tp_shard()
        # --sequence-parallel: the plan's SEQUENCE layers hold 1/TP of the row's positions (tensor_parallel)
        layers = Shard(shard.group, shard.rank, shard.size, sequence=run.sequence_parallel)
        done = set()
        for module in [*self.tied_modules.values(), *self.forward_funcs]:
            if isinstance(module, torch.nn.Module) and id(module) not in done:
                done.add(id(module))
                parallelize(module, plan, layers)
        self.forward_funcs[:] = [f if isinstance(f, torch.nn.Module) else parallelize(f, plan, layers)
                                 for f in self.forward_funcs]
        self.loss_fn = run.objective.split_vocab(shard, run.model.text.vocab_size).loss

    def _tp_shard(self) -> Shard:
        return Shard(self._grid.get_slice_parallel_group(), self._grid.get_slice_parallel_rank(), self.tp)

    def _seq_rank(self) -> int:
        """This rank's coordinate on the grid's seq axis (its SP rank; 0 without --sp)."""
        return getattr(self._topo.get_coord(self.global_rank), "seq", 0)

    def _sp_shard(self) -> Shard:
        return Shard(self._seq_group, self._seq_rank(), self.sp)

    def _index_tied_modules(self):
        """DeepSpeed's tie groups (called in PipelineModule.__init__), one per coordinate of every axis but pipe. Its
        own loops over (data, model) alone and asks stage_to_global for the rest, which keeps the caller's seq
        coordinate: seq 0 and seq 1 would pass different rank lists to the same dist.new_group. On the seq grid each
        (data, seq, model) coordinate's stages holding a tied module form its group: the copies of one SP x TP rank
        tied across stages, as DeepSpeed ties one TP rank's."""
        if "seq" not in self._topo.get_axis_names() or self._topo.get_dim("pipe") == 1:
            return super()._index_tied_modules()
        comms, specs = {}, self._layer_specs
        others = [a for a in self._topo.get_axis_names() if a != "pipe"]
        for key in sorted({s.key for s in specs if isinstance(s, TiedLayerSpec)}):  # every rank, one order
            stages = sorted({self.stage_owner(i) for i, s in enumerate(specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})
            for at in itertools.product(*(range(self._topo.get_dim(a)) for a in others)):
                ranks = [self._topo.get_rank(pipe=st, **dict(zip(others, at))) for st in stages]
                group = dist.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    comms[key] = {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                                  "module": self.tied_modules[key]}
                    if self.global_rank != ranks[0]:  # counted once (DeepSpeed's mark, read by the norms)
                        for p in self.tied_modules[key].parameters():
                            p.ds_pipe_replicated = True
        return comms

    def _split_sequence(self, run: RunConfig) -> None:
        """--sp: the embedding keeps this rank's slice of each row, the decoder blocks attend through DeepSpeed's
        all-to-all, the loss reads this rank's slice of the labels (mmpipe.model.sequence_parallel)."""
        shard = self._sp_shard()
        # (under --tp the head's weight is its vocab slice: its tiles take the vocab-parallel loss)
        layers = parallelize_sequence([*self.tied_modules.values(), *self.forward_funcs], shard,
                                      family_of(run.model).sp_plan)
        self.forward_funcs[:] = layers[len(self.tied_modules):]  # a tied head's partial comes back tiled
        self.loss_fn = run.objective.split_sequence(shard).loss  # the objective's SP form (model.objectives)

    # --sp: the layer files hold whole layers (or under --tp this TP rank's slices), the same on every SP rank, so SP
    # rank 0 writes them under the names a run without SP uses (layer_XX-model_states.pt, under --tp
    # layer_XX-model_TT-model_states.pt; DeepSpeed would add the seq coordinate: layer_XX-seq_SS-model_TT-...), and
    # every SP rank reads those: load_reference, reshard and a run at another SP read them as their own.
    def ckpt_layer_path(self, ckpt_dir, local_layer_idx):
        if self.sp == 1:
            return super().ckpt_layer_path(ckpt_dir, local_layer_idx)
        tp = f"-model_{self._grid.get_slice_parallel_rank():02d}" if self.tp > 1 else ""
        return os.path.join(ckpt_dir, f"layer_{local_layer_idx + self._local_start:02d}{tp}-model_states.pt")

    def save_state_dict(self, save_dir, checkpoint_engine, exclude_frozen_params=False):
        if self._seq_rank() == 0:
            super().save_state_dict(save_dir, checkpoint_engine, exclude_frozen_params)

    def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
        if self.sp == 1:
            return super().load_state_dir(load_dir, checkpoint_engine, strict)
        for idx, layer in enumerate(self.forward_funcs):
            if hasattr(layer, "load_state_dict"):
                layer.load_state_dict(checkpoint_engine.load(self.ckpt_layer_path(load_dir, idx),
                                                             map_location="cpu"), strict=strict)
        self._synchronize_tied_weights()

    def forward(self, forward_input):
        """A non-first stage receives floats only (hidden[, vision]) and joins the running micro-batch's
        integer tensors, from its own loader (`wire_ints`, set by mmpipe.runtime.wire for each ForwardPass),
        before its layers run: activation checkpointing then saves them with the floats and recomputes
        the right micro-batch. A non-last stage returns its floats only: they are all that is sent."""
        x = forward_input if isinstance(forward_input, tuple) else (forward_input,)
        if not self.first_part():
            if self.wire_ints is None:
                raise RuntimeError("mmpipe: a non-first stage ran without its micro-batch's integer tensors: "
                                   "install mmpipe.runtime.wire on the engine (trainer.build_engine does)")
            x = x + tuple(self.wire_ints)
        out = super().forward(x)
        if not self.last_part():  # the floats of the last layer's fields (packed first)
            out = out[:sum(f.floating for f in self.forward_funcs[-1].__dict__["stage_out"])]
            if torch.is_grad_enabled():  # a cut inside a frozen tower after a trained DeepStack merger: the
                # tower's hidden carries no graph, yet DeepSpeed's backward takes every float this stage sent
                # (with the next stage's gradient for it); a leaf of it takes that gradient and goes nowhere
                out = tuple(t if t.requires_grad else t.detach().requires_grad_() for t in out)
        return out

    def get_additional_losses(self):
        """An MoE model's load-balancing term (aux_coef x aux, mmpipe.model.moe.MoeHead) of the micro-batch just run,
        under DeepSpeed's name for such: the engine sums it over the step's micro-batches on the last stage, scales
        by 1 / GAS, averages over DP and broadcasts it with the loss (engine.agg_additional_losses), so every rank
        logs it; the other stages give a placeholder of the same keys (the broadcast's size). None: a dense model."""
        last = self.last_part()  # its last layer is the MoeHead, which keeps the micro-batch's
        out = {"aux_loss": head_aux(self.forward_funcs[-1]) if last else torch.zeros(())} if self.moe else {}
        if self.metrics is not None:  # the objective's logged values (--objective dpo: the rewards), the same way
            out.update({k: v if last else torch.zeros(()) for k, v in self.metrics().items()})
        return out or None

    def _synchronize_tied_weights(self):
        """DeepSpeed's copy of each tied weight (the LLaVA / Qwen2-VL families' embedding = head) from its first
        stage to the others holding it (in PipelineModule.__init__ and load_state_dir), under no_grad. DeepSpeed
        broadcasts the Parameter in grad mode: c10d::broadcast_ has no autograd kernel, so torch's fallback hooks
        the leaf and its first backward, on every rank holding a tied copy (the first and last stage), warns that
        backprop through broadcast_ "may lead to silently incorrect behavior". Nothing backprops through it: it
        sets the weight's value before any forward, the gradient flows from the forward's own ops, and the tied
        copies' gradients are summed by DeepSpeed's all-reduce (docs/pipeline.md). A value copy, as an init is."""
        with torch.no_grad():
            super()._synchronize_tied_weights()

    def _partition_layers(self, method="mmpipe"):
        self.parts = self._mmpipe_parts
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def grid_topology(run: RunConfig):
    """The engine's grid (DeepSpeed's PipelineParallelGrid takes any ProcessTopology), ranks pipe-major, the innermost
    axis fastest. Without TP or SP: None (num_stages alone, DeepSpeed's PipeDataParallelTopology). --tp:
    PipeModelDataParallelTopology, axes (pipe, data, model), rank = (pipe x DP + data) x TP + model. --sp (with or
    without --tp): axes (pipe, data, seq, model), rank = ((pipe x DP + data) x SP + seq) x TP + model: TP innermost
    (Megatron's order: TP ranks closest, inside a node). What DeepSpeed builds from it is per axis: the DP all-reduce
    over 'data' (one group per (pipe, seq, model)), p2p sends between stages of one (data, seq, model), its slice
    group (the TP group, get_slice_parallel_group) over 'model', and its model-parallel group (the norm's sum) over
    every rank of one data coordinate; the SP groups come from 'seq' (seq_group), the tie groups from every
    coordinate (VLMPipeline._index_tied_modules). E.g. PP 1 x SP 2 x TP 2: TP groups {0, 1}, {2, 3}, SP groups
    {0, 2}, {1, 3}."""
    if run.sp > 1:
        return ProcessTopology(axes=["pipe", "data", "seq", "model"], dims=[run.stages, run.dp, run.sp, run.tp])
    return PipeModelDataParallelTopology(num_pp=run.stages, num_mp=run.tp, num_dp=run.dp) if run.tp > 1 else None


def seq_group(topo):
    """Collective (every rank creates every group, in one order): this rank's SP group, the ranks of its (pipe, data,
    model) coordinate along 'seq'; None on a grid without that axis."""
    mine = None
    for ranks in topo.get_axis_comm_lists("seq") if "seq" in topo.get_axis_names() else ():
        group = dist.new_group(ranks=ranks)
        mine = group if dist.get_rank() in ranks else mine
    return mine


def pipeline_class(schedule) -> type:
    """The PipelineModule class a schedule's record names (`Schedule.module`, "package.module:Class"):
    VLMPipeline, or DualPipeV's VLMDualPipeV; deepspeed.initialize picks the engine from it."""
    import importlib
    path, _, name = schedule.module.partition(":")
    return getattr(importlib.import_module(path), name)
