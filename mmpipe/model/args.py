"""The model-side flags that `mmpipe train` and `mmpipe plan` share (what is frozen, LoRA, the crop
budget), declared once as fields, with the one check of each: both commands inherit or add these
fields (mmpipe.run_args.TrainArgs, mmpipe.planning.plan), so a flag and its rule cannot drift apart."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError, ModelConfig, crop_budget
from ..flags import flag
from .builder import FREEZE_GROUPS
from .lora import Lora

LORA = "LoRA adapters"


@dataclass(frozen=True)
class ModelArgs:
    freeze: str = flag("", f"comma-separated groups to freeze: {', '.join(FREEZE_GROUPS)}")
    lora: int = flag(0, "LoRA rank: train low-rank adapters (peft's LoRA layers) on the --lora-groups' linear layers, "
                     "their base weights frozen (0: off; docs/lora.md)", metavar="RANK", group=LORA)
    lora_alpha: float | None = flag(None, "LoRA scale numerator: delta W = (alpha / rank) B A (default: 2 x rank)",
                                    group=LORA)
    lora_dropout: float = flag(0.0, "dropout on the adapters' input (default: 0)", group=LORA)
    lora_groups: str = flag("text", f"comma-separated groups that get adapters and whose base is frozen: "
                            f"{', '.join(FREEZE_GROUPS)} (default: text)", group=LORA)
    lora_targets: str = flag("", "regular expression on a linear's name within its layer, e.g. 'q_proj|v_proj' or "
                             "'attn' (default: every linear of those groups but the LM head)", group=LORA)
    max_crops: int | None = flag(None, "moondream multi-crop: local crops per image at most (default: the model's "
                                 "vision.max_crops, 12 for moondream2; lower it for memory: the tower encodes 1 + N "
                                 "crops per image; 0: the global crop only)", metavar="N")

    def frozen_groups(self) -> tuple[str, ...]:
        """--freeze, checked: the groups it names."""
        groups = tuple(g for g in self.freeze.split(",") if g)
        bad = [g for g in groups if g not in FREEZE_GROUPS]
        if bad:
            raise ConfigError(f"--freeze: unknown group(s) {bad} (valid: {', '.join(FREEZE_GROUPS)})")
        return groups

    def adapters(self) -> Lora | None:
        """--lora and its options, checked; None when off."""
        if not self.lora:
            return None
        return Lora.parse(self.lora, self.lora_alpha, self.lora_dropout, self.lora_groups, self.lora_targets,
                          FREEZE_GROUPS)

    def with_crops(self, model: ModelConfig) -> ModelConfig:
        """The model under --max-crops (checked against its own budget)."""
        return model if self.max_crops is None else crop_budget(model, self.max_crops)
