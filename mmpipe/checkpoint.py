"""Reading DeepSpeed pipeline checkpoints outside the engine.

Layout (one directory per tag): layer_XX-model_states.pt per layer (written by data-parallel
rank 0 of the stage that owns it), mp_rank_SS_model_states.pt per stage (optimizer, counters,
client state), plus a `latest` file naming the newest tag. DeepSpeed's zero_to_fp32.py does not
understand pipeline checkpoints, so consolidation reads the layer files directly; they do not
depend on the stage count that wrote them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig
from .model.builder import ReferenceModel


def latest_tag(ckpt_dir: str | Path) -> str | None:
    f = Path(ckpt_dir) / "latest"
    return f.read_text().strip() if f.is_file() else None


def load_reference(ckpt_dir: str | Path, cfg: ModelConfig, tag: str | None = None) -> ReferenceModel:
    """The single-device model with every layer's weights from a pipeline checkpoint of any stage count."""
    tag = tag or latest_tag(ckpt_dir)
    if tag is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir} (no 'latest' file)")
    model = ReferenceModel(cfg)
    for idx, layer in enumerate(model):
        path = Path(ckpt_dir) / tag / f"layer_{idx:02d}-model_states.pt"
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {tag} lacks layer {idx} ({type(layer).__name__}): {path}")
        layer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model
