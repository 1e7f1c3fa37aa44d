"""Every RNG a rank uses, as JSON-safe data: Python's, NumPy's global, torch's CPU (and the
accelerator's when there is one). Saved per rank with each checkpoint and restored on --resume,
so anything random (dropout, augmentation, sampling) continues as if never stopped. JSON, not
pickle: a checkpoint file must not be able to run code when read."""
from __future__ import annotations

import random

import numpy as np
import torch


def get_state() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    state = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
