"""Reading a directory's safetensors weights, one file or sharded (model.safetensors.index.json)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..config import ConfigError


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise ConfigError(f"{path}: no model.safetensors or model.safetensors.index.json "
                          f"(only safetensors weights are read)")
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not (path / shard).is_file():
            raise ConfigError(f"{path}: the index names shard {shard}, which is missing")
        out.update(load_file(str(path / shard)))
    return out
