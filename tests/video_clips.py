"""Test clips written here with PyAV (nothing is downloaded): a bright square moving left to right over a dark
background, one frame a step, in two containers and codecs PyAV's wheel encodes: MP4 / H.264 (the container stores
its frame count) and Matroska / Motion JPEG (it stores none: mmpipe.data.video.probe reads duration x rate)."""
from __future__ import annotations

import numpy as np

FORMATS = {"mp4": ("libx264", "yuv420p"), "mkv": ("mjpeg", "yuvj420p")}


def moving_square(frames: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """uint8 [frames, height, width, 3]: a 12-px square crossing the frame, on a background that varies by seed."""
    rng = np.random.default_rng(seed)
    out = np.empty((frames, height, width, 3), np.uint8)
    out[:] = rng.integers(0, 80, 3, dtype=np.uint8)
    side, y = 12, (height - 12) // 2
    for i in range(frames):
        x = (i * (width - side)) // max(1, frames - 1)
        out[i, y:y + side, x:x + side] = (250, 200, 30)
    return out


def write_clip(path, frames: np.ndarray, fps: int, fmt: str | None = None) -> None:
    """frames [n, H, W, 3] to path (its suffix picks the format) at fps."""
    import av
    codec, pix = FORMATS[fmt or str(path).rsplit(".", 1)[-1]]
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], pix
        for f in frames:
            c.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        c.mux(s.encode())


def write_empty(path) -> None:
    """An MP4 of a video stream and no frame: the header written, nothing encoded (FFmpeg then records no stream)."""
    import av
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=4)
        s.width, s.height, s.pix_fmt = 56, 56, "yuv420p"
        c.start_encoding()
