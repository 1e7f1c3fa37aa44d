"""What a user asks of a training run, as code can build it: `TrainArgs` (every flag of
`mmpipe train` and `python -m mmpipe.train`, declared once; the data and model flags it shares with
`mmpipe plan` in their own dataclasses, DataArgs and ModelArgs), `LaunchArgs` (the front door's
own: where the ranks run) and `CheckArgs` (`mmpipe check`'s own). `mmpipe.run_config.resolve` turns
TrainArgs into a checked RunConfig."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from .data.args import DataArgs
from .flags import add_flags, flag, from_namespace, to_argv
from .model.args import ModelArgs
from .model.dpo import DPO_LOSSES
from .model.objectives import OBJECTIVE_NAMES, TOKENS
from .planning.schedule_registry import BASELINE, SCHEDULE_NAMES


@dataclass(frozen=True)
class TrainArgs(DataArgs, ModelArgs):
    preset: str | None = flag(None, "model preset name or path to a model JSON (default: small; with --init-from: "
                              "the run's model.json)")
    init_from: str | None = flag(None, "start from the weights of an mmpipe run (e.g. `mmpipe import --out RUN`): "
                                 "its model.json, latest checkpoint and tokenizer/ (else the built-in tokenizer); "
                                 "fresh optimizer and schedule", metavar="RUN")
    ds_config: str | None = flag(None, "DeepSpeed JSON config (default: ds_configs/cpu_fp32.json). A relative "
                                 "ds_configs/NAME that is not there from the working directory is the shipped NAME, "
                                 "so the shipped configs work from any directory")
    stages: int | None = flag(None, "pipeline stages (default: the config's pipeline.stages, else 2)")
    partition: str | None = flag(None, "balanced | uniform | parameters | explicit first-layer indices of stages "
                                 "1..P-1 (default: the config's pipeline.partition, 'best' = balanced)")
    schedule: str | None = flag(None, f"pipeline schedule: {' | '.join(SCHEDULE_NAMES)} (default: the config's "
                                f"pipeline.schedule, else {BASELINE.name}; docs/schedules.md)")
    ep: int = flag(1, "expert-parallel ranks: an MoE model's experts split over groups of EP data-parallel ranks "
                   "of each stage, tokens exchanged by all-to-all; EP divides DP (default: 1; docs/moe.md)")
    tp: int = flag(1, "tensor-parallel ranks: each stage's layers split over TP ranks as the family's plan says "
                   "(Megatron-style column / row / vocabulary splits); world = stages x dp x tp (default: 1; "
                   "docs/tensor_parallel.md)")
    sp: int = flag(1, "sequence-parallel ranks (Ulysses): each stage's rows split by position over SP ranks, "
                   "attention's all-to-all trading positions for heads; world = stages x dp x sp; not with --tp "
                   "(default: 1; docs/sequence_parallel.md)")
    sequence_parallel: bool = flag(False, "with --tp: Megatron's sequence parallelism, the decoder's norms and "
                                   "residuals on 1/TP of each row's positions (all-gather / reduce-scatter at each "
                                   "TP region; docs/tensor_parallel.md)")
    objective: str = flag(TOKENS.name, "what the last stage trains on: sft, the cross-entropy of the answer tokens "
                          "(default; docs/architecture.md, Objective), or dpo, preference pairs' DPO loss against the "
                          "starting weights (docs/dpo.md)", choices=OBJECTIVE_NAMES)
    beta: float = flag(0.1, "--objective dpo: the KL weight beta (default: 0.1; > 0)")
    dpo_loss: str = flag("sigmoid", "--objective dpo: TRL's loss_type, sigmoid (DPO, default), ipo or hinge",
                         choices=DPO_LOSSES)
    rpo_alpha: float = flag(0.0, "--objective dpo: weight of an SFT term on the chosen answers (RPO; default 0: off)")
    reference: str | None = flag(None, "--objective dpo: the reference model, an mmpipe run directory's latest "
                                 "checkpoint (`mmpipe import --out RUN` makes one of a transformers directory; "
                                 "default: the run's starting weights)", metavar="RUN")
    reference_logps: str | None = flag(None, "--objective dpo: the reference's log-probs precomputed by `mmpipe "
                                       "score-reference` (no reference runs at train time; refused when scored with "
                                       "another model or data index; docs/dpo.md)", metavar="FILE")
    steps: int = flag(3000, "optimizer steps (default: 3000)")
    output_dir: str = flag("runs/default", "log, checkpoints and summary.json go here")
    resume: bool = flag(False, "continue from the latest checkpoint in --output-dir")
    seed: int = flag(0, "seed for weights and data (default: 0)")
    save_every: int = flag(0, "checkpoint every N steps (0: only at the end)")
    nonfinite: str = flag("stop", "a NaN/inf loss: stop the run, keeping the last good checkpoint (default), or skip "
                          "that batch's update and count it (fp32 with ZeRO-0)", choices=("stop", "skip"))
    keep_checkpoints: int = flag(3, "keep the newest K checkpoints (default: 3; 0: all); the one `latest` names is "
                                 "never deleted")
    eval_samples: int = flag(1000, "held-out shapes samples scored after training, split evenly over the question "
                             "types (0: skip; user data is not scored); with --eval-data shapes also the size of "
                             "the validation set")
    eval_data: str | None = flag(None, "validation data, any format --data takes (checked by the same bad-record "
                                 "policy), or 'shapes' (the built-in held-out split): its loss through the pipeline "
                                 "goes to eval_log.csv every --eval-every steps and at the end (docs/evaluation.md)")
    eval_split: float = flag(0.0, "hold out this fraction of --data's good records for validation instead of "
                             "--eval-data (the same records for every seed and layout; training never sees them)")
    eval_every: int = flag(0, "validate every N optimizer steps (0: only at the end; needs --eval-data)")

    @classmethod
    def from_argv(cls, argv: list[str], prog: str = "mmpipe train") -> "TrainArgs":
        p = argparse.ArgumentParser(prog=prog)
        add_flags(p, cls)
        return from_namespace(cls, p.parse_args(argv))

    def to_argv(self) -> list[str]:
        return to_argv(self)


@dataclass(frozen=True)
class LaunchArgs:
    dp: int | None = flag(None, "data-parallel replicas of the pipeline (default: the --ds-config's train_batch_size / "
                          "(micro x GAS) when it gives all three, as `mmpipe plan --write-config` does, else 1; with "
                          "--hostfile: slots / stages)")
    master_port: int | None = flag(None, "rendezvous port (default: a free one; with --hostfile 29500)")
    hostfile: str | None = flag(None, "DeepSpeed hostfile ('HOST slots=N' lines): run on those hosts over ssh "
                                "(pdsh); docs/multinode.md")
    include: str = flag("", "with --hostfile: only these hosts/slots, e.g. node1:0,1@node2")
    exclude: str = flag("", "with --hostfile: leave out these hosts/slots, e.g. node3")
    master_addr: str | None = flag(None, "with --hostfile: rendezvous host (default: the first active host)")


@dataclass(frozen=True)
class CheckArgs:
    """`mmpipe check`'s own flags, beside train's (and `mmpipe slurm --command check`'s)."""
    full_step: bool = flag(False, "also one real step of the FULL model on every stage: each rank's measured peak "
                                  "memory against the planner's for its stage (docs/check.md)", group="check")
