"""Opening training images safely, and turning them into the vision tower's input tensor.

open_image() accepts every form a Record's image can take (a path, bytes, an HF datasets
`Image(decode=False)` dict, a PIL image) and returns a fully decoded RGB image with its EXIF
orientation applied, or raises BadRecord with one line saying what is wrong with which file.
ImageTransform makes the [3, S, S] normalised float tensor the model reads.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import threading

import numpy as np
import torch
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from ..config import ConfigError, VisionConfig
from .records import BadRecord

# PIL's own default decompression-bomb limit (1 GiB of 24-bit pixels / 4), kept as ours so the
# default behaviour matches PIL's while the limit is ours to set (--max-image-pixels).
DEFAULT_MAX_PIXELS = 89_478_485

RESIZE_MODES = ("pad", "squash")


# ---------------------------------------------------------------- opening

def open_image(ref, root: str | None = None, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """A decoded RGB image from a path (relative ones joined to root), bytes, a {"bytes", "path"}
    dict, or a PIL image; raises BadRecord (missing_image, empty_image, huge_image,
    corrupt_image) otherwise. A PIL image passed in is not modified."""
    with _our_pil_settings():
        if isinstance(ref, Image.Image):
            return _decode(ref, "in-memory image", max_pixels)
        source, name = _resolve(ref, root)
        try:
            im = Image.open(source)  # lazy: reads the header only
        except UnidentifiedImageError:  # its message names a BytesIO object: say it ourselves
            raise BadRecord("corrupt_image", f"{name}: not a recognised image format") from None
        except Exception as e:
            raise _corrupt(name, e) from None
        # the context closes the file: the returned image is a converted copy, detached from it
        with im:
            return _decode(im, name, max_pixels)


def check_image(ref, root: str | None = None, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """(width, height) after EXIF orientation, having made every check open_image makes,
    including a full decode (a truncated file is only found by decoding it)."""
    return open_image(ref, root, max_pixels).size


def _resolve(ref, root: str | None):
    """(something Image.open reads, a name for messages) for a path, bytes or HF-style dict."""
    if isinstance(ref, dict):  # HF datasets Image(decode=False): embedded bytes win over the path
        data, path = ref.get("bytes"), ref.get("path")
        if data is not None:
            return _resolve(data, root)[0], f"{path} (embedded bytes)" if path else "image bytes"
        if path is None:
            raise BadRecord("missing_image", "image dict has neither 'bytes' nor 'path'")
        ref = path
    if isinstance(ref, (bytes, bytearray, memoryview)):
        if len(ref) == 0:
            raise BadRecord("empty_image", "image bytes are empty")
        return io.BytesIO(ref), "image bytes"
    if isinstance(ref, (str, os.PathLike)):
        path = os.fspath(ref)
        if root is not None and not os.path.isabs(path):
            path = os.path.join(root, path)
        if not os.path.exists(path):
            raise BadRecord("missing_image", f"{path}: image file does not exist")
        if not os.path.isfile(path):
            raise BadRecord("missing_image", f"{path}: is not a file")
        if os.path.getsize(path) == 0:
            raise BadRecord("empty_image", f"{path}: image file is empty (0 bytes)")
        return path, path
    raise BadRecord("missing_field", f"image reference of type {type(ref).__name__} "
                                     "(expected a path, bytes, a {'bytes', 'path'} dict or a PIL image)")


def _decode(im: Image.Image, name: str, max_pixels: int) -> Image.Image:
    """Size checks from the header, then the full decode, orientation and RGB conversion."""
    w, h = im.size
    if w == 0 or h == 0:
        raise BadRecord("empty_image", f"{name}: image is {w}x{h}")
    if w * h > max_pixels:  # before load(): a decompression bomb is refused without decoding it
        raise BadRecord("huge_image", f"{name}: image {w}x{h} = {w * h} pixels exceeds the limit "
                                      f"of {max_pixels} (--max-image-pixels)")
    try:
        im.load()  # lazy until now: corrupt or truncated pixel data only shows up here
        return to_rgb(ImageOps.exif_transpose(im))
    except MemoryError:
        raise
    except Image.DecompressionBombError as e:  # a frame / tile beyond PIL's limit (we lift it, but)
        raise BadRecord("huge_image", f"{name}: {e}") from None
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, EOFError, struct.error...
        raise _corrupt(name, e) from None


def _corrupt(name: str, e: Exception) -> BadRecord:
    detail = " ".join(str(e).split()) or type(e).__name__  # one line, whatever PIL said
    return BadRecord("corrupt_image", f"{name}: cannot decode image ({detail})")


# PIL reads two module globals at call time, and both would undo our checks:
# - Image.MAX_IMAGE_PIXELS: PIL warns above it and raises above twice it, at open and at some
#   loads. Our own limit (max_pixels, from the header) replaces it, so it is lifted while we open:
#   otherwise PIL would refuse images the user allowed, or print warnings for them.
# - ImageFile.LOAD_TRUNCATED_IMAGES: other code often sets it True, which makes PIL pad truncated
#   files with grey instead of failing; we force False so truncated files are refused.
# Both are set while any open_image call is running in this process and restored when the last
# one ends (a count, so overlapping calls from threads never "restore" our own values). Other
# code opening images in another thread during that window sees no PIL bomb limit.
_pil_lock = threading.Lock()
_pil_users = 0
_pil_saved: tuple = ()


@contextlib.contextmanager
def _our_pil_settings():
    global _pil_users, _pil_saved
    with _pil_lock:
        if _pil_users == 0:
            _pil_saved = (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES)
            Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = None, False
        _pil_users += 1
    try:
        yield
    finally:
        with _pil_lock:
            _pil_users -= 1
            if _pil_users == 0:
                Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = _pil_saved


# ---------------------------------------------------------------- colour

WHITE = (255, 255, 255)


def to_rgb(im: Image.Image) -> Image.Image:
    """A new RGB image with the colours a viewer would show.

    - Transparency (RGBA, LA, PA, P or L/RGB with a transparent colour) is composited onto white:
      PIL's plain convert("RGB") drops alpha and keeps whatever colour is stored under it, often
      black or garbage, so a logo on a transparent background would become a logo on black.
    - 16-bit greyscale (I;16, I;16B, ...) is scaled by 1/257 onto 0..255: PIL's convert clips, so
      a mid-grey 32768 would come out white. Mode "I" (32-bit int) is read the same way, as
      0..65535 (clipped), because that is what such images almost always hold: 16-bit PNG/TIFF
      data in the container older Pillow versions load it into.
    - "F" (float) is taken as 0..1 when its maximum is <= 1 (the usual float image convention),
      otherwise as 0..255, clipped; NaN becomes 0.
    - everything else (L, 1, P, CMYK, YCbCr, ...) uses PIL's conversion.
    """
    if im.mode == "I" or im.mode.startswith("I;16"):
        grey = np.clip(np.asarray(im, dtype=np.float64), 0, 65535) / 257
        return _grey_to_rgb(grey)
    if im.mode == "F":
        grey = np.nan_to_num(np.asarray(im, dtype=np.float64))
        return _grey_to_rgb(grey * 255 if grey.max() <= 1 else grey)
    if im.has_transparency_data:
        background = Image.new("RGBA", im.size, WHITE + (255,))
        return Image.alpha_composite(background, im.convert("RGBA")).convert("RGB")
    return im.convert("RGB")  # a copy even when already RGB, so the caller's image is never shared


def _grey_to_rgb(grey: np.ndarray) -> Image.Image:
    return Image.fromarray(np.rint(np.clip(grey, 0, 255)).astype(np.uint8)).convert("RGB")


# ---------------------------------------------------------------- to tensor

class ImageTransform:
    """PIL image -> [3, S, S] float32 tensor, normalised with the vision config's mean / std.

    resize="pad" pads to a square with the model's mean colour (LLaVA's expand2square), centred,
    then resizes: the aspect ratio is kept and the padding is ~0 after normalisation. "squash"
    resizes straight to S x S, distorting non-square images but keeping every pixel at full scale.

    augment=True adds light, label-preserving augmentation: a random crop of 85-100% of the
    (square) image with aspect 0.9-1.1, resized back to S, and mild brightness / contrast jitter.
    There is deliberately no horizontal flip: it would make answers to "what is on the left?"
    wrong. The randomness comes from torch's global RNG, so a caller that wants reproducible
    samples seeds it per sample (e.g. torch.manual_seed(hash of seed, epoch, index)) first.
    """

    def __init__(self, vision: VisionConfig, resize: str = "pad", augment: bool = False):
        if resize not in RESIZE_MODES:
            raise ConfigError(f"--resize: '{resize}' is not a resize mode (valid: {', '.join(RESIZE_MODES)})")
        self.size, self.resize, self.augment, self.vision = vision.image_size, resize, augment, vision

    @functools.cached_property
    def pipelines(self):
        """(transform, exact): torchvision's v2 pipelines, built at the first image. torchvision is imported
        here, not at the top or in __init__: it costs ~3 s of CPU per process (it imports its models and
        torch._dynamo), which every rank would pay for building its samples while only the ranks that
        decode images (the first stage, the loader's workers) use it."""
        from torchvision.transforms import v2
        vision, resize, augment = self.vision, self.resize, self.augment
        size = (vision.image_size, vision.image_size)
        steps: list = [v2.ToImage()]  # uint8 [3, H, W]
        if resize == "pad":
            steps.append(_PadToSquare(tuple(round(255 * m) for m in vision.mean)))
        elif augment:
            # squash first, so the crop's 0.9-1.1 aspect is relative to the square the model sees
            steps.append(v2.Resize(size, antialias=True))
        if augment:
            steps += [v2.RandomResizedCrop(size, scale=(0.85, 1.0), ratio=(0.9, 1.1), antialias=True),
                      v2.ColorJitter(brightness=0.1, contrast=0.1)]
        else:
            steps.append(v2.Resize(size, antialias=True))
        mean, std = list(vision.mean), list(vision.std)
        to_float = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
        return v2.Compose(steps + to_float), functools.partial(_to_float, mean=mean, std=std)

    def __call__(self, img: Image.Image) -> torch.Tensor:
        if img.mode != "RGB":  # open_image already gives RGB; this keeps other callers correct
            img = to_rgb(img)
        transform, exact = self.pipelines
        if not self.augment and img.size == (self.size, self.size):
            return exact(img)
        return transform(img).as_subclass(torch.Tensor)


def _to_float(img: Image.Image, mean: list[float], std: list[float]) -> torch.Tensor:
    """An image already S x S (no pad, no resize): to_dtype and normalize as torchvision's functions, not
    through Compose's module calls and tv_tensor wrapping: ~0.2 ms an image at 64 px instead of ~0.55."""
    from torchvision.transforms.v2 import functional as F  # see ImageTransform
    return F.normalize(F.to_dtype(F.pil_to_tensor(img), torch.float32, scale=True), mean, std)


class _PadToSquare:
    """Pad a [C, H, W] image to its longer side, centred, with a fill colour (expand2square)."""

    def __init__(self, fill: tuple[int, ...]):
        self.fill = list(fill)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        h, w = img.shape[-2:]
        side = max(h, w)
        left, top = (side - w) // 2, (side - h) // 2
        from torchvision.transforms.v2 import functional as F  # see ImageTransform
        return F.pad(img, [left, top, side - w - left, side - h - top], fill=self.fill)
