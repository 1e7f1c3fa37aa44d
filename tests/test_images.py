"""Image opening and preprocessing: colours users see, refusals they can act on, tensors the model reads.

Every fixture is generated here with PIL in tmp_path; nothing is downloaded.
"""
from __future__ import annotations

import io
import random
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from mmpipe.config import ConfigError, VisionConfig
from mmpipe.data.images import DEFAULT_MAX_PIXELS, ImageTransform, check_image, open_image
from mmpipe.data.records import BadRecord


@pytest.fixture(autouse=True)
def warnings_are_errors():
    # PIL's decompression-bomb warning (or any other) must never reach the user
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def save(img: Image.Image, path: Path, **kw) -> Path:
    img.save(path, **kw)
    return path


def encoded(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height but holds almost no pixel data: what a bomb looks like
    before decoding (a real one is a few KB of zlib that expands to gigabytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16))


def pixel(img: Image.Image, xy=(0, 0)) -> tuple[int, int, int]:
    assert img.mode == "RGB"
    return img.getpixel(xy)


def close(a, b, tol=2) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b))


# ---------------------------------------------------------------- colour modes

def grey16(value: int, mode: str) -> Image.Image:
    a = np.full((4, 4), value, np.uint16)
    return Image.frombytes(mode, (4, 4), a.astype(">u2" if mode == "I;16B" else "<u2").tobytes())


@pytest.mark.parametrize("img, expected", [
    (Image.new("RGB", (4, 4), (10, 200, 30)), (10, 200, 30)),
    (Image.new("L", (4, 4), 77), (77, 77, 77)),
    (Image.new("1", (4, 4), 1), (255, 255, 255)),
    (Image.new("1", (4, 4), 0), (0, 0, 0)),
    (Image.new("LA", (4, 4), (77, 255)), (77, 77, 77)),
    (Image.new("RGBA", (4, 4), (10, 200, 30, 255)), (10, 200, 30)),
    (Image.new("CMYK", (4, 4), (255, 0, 0, 0)), (0, 255, 255)),  # pure cyan
    (Image.new("YCbCr", (4, 4), (76, 85, 255)), (255, 0, 0)),    # pure red, JPEG's YCbCr
    # 16-bit grey is scaled, not clipped: PIL's own convert("L") would make 32768 white
    (grey16(32768, "I;16"), (128, 128, 128)),
    (grey16(32768, "I;16B"), (128, 128, 128)),
    (grey16(65535, "I;16"), (255, 255, 255)),
    (Image.fromarray(np.full((4, 4), 32768, np.int32)), (128, 128, 128)),   # "I": read as 0..65535
    (Image.fromarray(np.full((4, 4), 100_000, np.int32)), (255, 255, 255)),  # beyond 16 bits: clipped
    (Image.fromarray(np.full((4, 4), -5, np.int32)), (0, 0, 0)),
    (Image.fromarray(np.full((4, 4), 0.5, np.float32)), (128, 128, 128)),    # "F" with max <= 1: 0..1
    (Image.fromarray(np.full((4, 4), 200.0, np.float32)), (200, 200, 200)),  # otherwise 0..255
    (Image.fromarray(np.full((4, 4), 300.0, np.float32)), (255, 255, 255)),  # clipped
], ids=lambda v: v.mode if isinstance(v, Image.Image) else None)
def test_every_mode_becomes_rgb_with_the_colour_a_viewer_shows(img, expected):
    out = open_image(img)
    assert out.mode == "RGB" and out.size == img.size
    assert close(pixel(out), expected), (img.mode, pixel(out), expected)


def test_transparent_pixels_become_white_not_the_hidden_colour():
    # PIL's convert("RGB") would give red here: the colour stored under alpha 0
    assert pixel(open_image(Image.new("RGBA", (4, 4), (255, 0, 0, 0)))) == (255, 255, 255)
    assert pixel(open_image(Image.new("LA", (4, 4), (0, 0)))) == (255, 255, 255)
    # half transparent red over white is pink
    assert close(pixel(open_image(Image.new("RGBA", (4, 4), (255, 0, 0, 128)))), (255, 127, 127))


def test_palette_image_with_and_without_transparency(tmp_path):
    p = Image.new("P", (4, 4), 1)
    p.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    p.putpixel((0, 0), 0)
    # without transparency, palette colours
    out = open_image(save(p, tmp_path / "opaque.png"))
    assert pixel(out, (0, 0)) == (0, 0, 0) and pixel(out, (1, 1)) == (200, 10, 10)
    # index 0 transparent (PNG tRNS and GIF), the rest opaque
    for name in ("t.png", "t.gif"):
        out = open_image(save(p, tmp_path / name, transparency=0))
        assert pixel(out, (0, 0)) == (255, 255, 255), name
        assert pixel(out, (1, 1)) == (200, 10, 10), name


def test_modes_survive_a_round_trip_through_real_files(tmp_path):
    # what PIL hands back after decoding real files, not only in-memory modes
    rgba = save(Image.new("RGBA", (4, 4), (255, 0, 0, 0)), tmp_path / "rgba.png")
    assert pixel(open_image(rgba)) == (255, 255, 255)
    g16 = save(grey16(32768, "I;16"), tmp_path / "g16.png")
    with Image.open(g16) as raw:
        assert raw.mode in ("I;16", "I")  # "I" on older Pillow
    assert close(pixel(open_image(g16)), (128, 128, 128))
    cmyk = save(Image.new("CMYK", (8, 8), (255, 0, 0, 0)), tmp_path / "cmyk.jpg")
    with Image.open(cmyk) as raw:
        assert raw.mode == "CMYK"
    assert close(pixel(open_image(cmyk)), (0, 255, 255), tol=6)
    la = save(Image.new("LA", (4, 4), (0, 0)), tmp_path / "la.png")
    assert pixel(open_image(la)) == (255, 255, 255)


def test_caller_image_is_not_modified():
    img = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    out = open_image(img)
    assert out is not img and img.mode == "RGBA" and img.getpixel((0, 0)) == (255, 0, 0, 0)
    rgb = Image.new("RGB", (4, 4))
    assert open_image(rgb) is not rgb


# ---------------------------------------------------------------- orientation and references

def test_exif_orientation_is_applied(tmp_path):
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (20, 0, 40, 20))  # left half red, right half blue
    exif = img.getexif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display"
    path = save(img, tmp_path / "rotated.jpg", exif=exif.tobytes(), quality=95)
    out = open_image(path)
    assert out.size == (20, 40) and check_image(path) == (20, 40)
    # rotated clockwise, the left half (red) is now on top
    assert close(pixel(out, (10, 5)), (255, 0, 0), tol=10)
    assert close(pixel(out, (10, 35)), (0, 0, 255), tol=10)


def test_every_kind_of_reference_opens(tmp_path):
    img = Image.new("RGB", (6, 3), (1, 2, 3))
    path = save(img, tmp_path / "a.png")
    data = path.read_bytes()
    for ref, root in [(str(path), None), (path, None), ("a.png", str(tmp_path)), (Path("a.png"), tmp_path),
                      (data, None), ({"bytes": data, "path": "not/there.png"}, None),  # bytes win
                      ({"bytes": None, "path": "a.png"}, str(tmp_path)), (img, None)]:
        out = open_image(ref, root=root)
        assert out.size == (6, 3) and pixel(out) == (1, 2, 3), ref if not isinstance(ref, bytes) else "bytes"


# ---------------------------------------------------------------- refusals

def refusal(ref, **kw) -> BadRecord:
    with pytest.raises(BadRecord) as e:
        open_image(ref, **kw)
    assert "\n" not in e.value.reason
    with pytest.raises(BadRecord) as e2:  # check_image refuses exactly what open_image refuses
        check_image(ref, **kw)
    assert e2.value.kind == e.value.kind
    return e.value


def test_missing_image(tmp_path):
    e = refusal("nope.png", root=str(tmp_path))
    assert e.kind == "missing_image" and str(tmp_path / "nope.png") in e.reason
    assert refusal({"bytes": None, "path": None}).kind == "missing_image"
    assert refusal(tmp_path).kind == "missing_image"  # a directory
    assert refusal(12345).kind == "missing_field"


def test_empty_image(tmp_path):
    (tmp_path / "empty.jpg").write_bytes(b"")
    e = refusal(tmp_path / "empty.jpg")
    assert e.kind == "empty_image" and "empty.jpg" in e.reason
    assert refusal(b"").kind == "empty_image"
    assert refusal({"bytes": b"", "path": None}).kind == "empty_image"
    assert refusal(Image.new("RGB", (0, 5))).kind == "empty_image"


def test_corrupt_image(tmp_path):
    noise = random.Random(0).randbytes(2000)
    jpeg = encoded(Image.effect_noise((64, 64), 50).convert("RGB"), "JPEG")
    png = encoded(Image.effect_noise((64, 64), 50), "PNG")
    cases = {"noise.jpg": noise, "text.png": b"this is not an image",
             "cut.jpg": jpeg[: len(jpeg) // 2], "cut.png": png[: len(png) // 2]}
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        e = refusal(path)
        assert e.kind == "corrupt_image" and name in e.reason, (name, e.kind, e.reason)
        assert refusal(data).kind == "corrupt_image", name
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_truncated_files_are_refused_even_if_other_code_allows_them(tmp_path, monkeypatch):
    # a common line in training code; PIL would then pad the missing half with grey
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    png = encoded(Image.effect_noise((64, 64), 50), "PNG")
    assert refusal(png[: len(png) // 2]).kind == "corrupt_image"
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # their setting is restored


def test_huge_image_is_refused_from_the_header_without_decoding(tmp_path, monkeypatch):
    path = save(Image.new("RGB", (300, 300)), tmp_path / "big.png")

    def no_decoding(self):
        raise AssertionError("decoded a huge image")
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    e = refusal(path, max_pixels=10_000)
    assert e.kind == "huge_image" and "big.png" in e.reason
    assert "300x300 = 90000 pixels exceeds the limit of 10000" in e.reason


def test_huge_image_beyond_pil_limit_is_our_refusal_not_pil_crash_or_warning():
    # 400M pixels: PIL alone raises DecompressionBombError at open (> 2 x its limit)
    e = refusal(png_header_only(20000, 20000))
    assert e.kind == "huge_image"
    assert e.reason == ("image bytes: image 20000x20000 = 400000000 pixels exceeds the limit of "
                        f"{DEFAULT_MAX_PIXELS} (--max-image-pixels)")


def test_our_limit_replaces_pil_limit_both_ways(tmp_path, monkeypatch):
    # 100M pixels with a raised --max-image-pixels: PIL alone would warn; we go on to decode
    # (this fake has no pixel data, so it is then refused as corrupt, silently)
    assert refusal(png_header_only(10000, 10000), max_pixels=200_000_000).kind == "corrupt_image"
    # PIL's limit set low by someone else does not refuse what our limit allows
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    path = save(Image.new("RGB", (300, 300), (9, 9, 9)), tmp_path / "ok.png")
    assert check_image(path) == (300, 300)
    assert Image.MAX_IMAGE_PIXELS == 1000  # and is restored


# ---------------------------------------------------------------- ImageTransform

VISION = VisionConfig(image_size=28, patch_size=14, dim=32, n_layers=1, n_heads=2, ff_dim=64,
                      mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711))
MEAN_RGB = tuple(round(255 * m) for m in VISION.mean)


def checkerboard(w: int, h: int) -> Image.Image:
    a = (np.indices((h, w)).sum(0) % 2 * 255).astype(np.uint8)
    return Image.fromarray(np.stack([a, 255 - a, a // 2], -1))


@pytest.mark.parametrize("resize", ["pad", "squash"])
@pytest.mark.parametrize("augment", [False, True])
def test_transform_output_shape_and_type(resize, augment):
    out = ImageTransform(VISION, resize, augment)(checkerboard(50, 30))
    assert out.shape == (3, 28, 28) and out.dtype == torch.float32 and type(out) is torch.Tensor


@pytest.mark.parametrize("resize", ["pad", "squash"])
def test_transform_normalises_with_the_config_mean_and_std(resize):
    out = ImageTransform(VISION, resize)(Image.new("RGB", (50, 30), MEAN_RGB))
    assert out.abs().max() < 0.02  # the mean colour is ~0
    white = ImageTransform(VISION, resize)(Image.new("RGB", (50, 30), (255, 255, 255)))
    expected = torch.tensor([(1 - m) / s for m, s in zip(VISION.mean, VISION.std)])
    assert torch.allclose(white[:, 14, 14], expected, atol=1e-4)


def test_pad_keeps_aspect_ratio_with_mean_colour_bars():
    # 56x28 (2:1) -> 56x56 with 14-row bars above and below -> 28x28: rows 0-6 and 21-27 are padding
    out = ImageTransform(VISION, "pad")(Image.new("RGB", (56, 28), (255, 255, 255)))
    assert out[:, :6].abs().max() < 0.02 and out[:, -6:].abs().max() < 0.02
    assert (out[:, 8:20] > 1.5).all()  # the white image itself, whole width
    squashed = ImageTransform(VISION, "squash")(Image.new("RGB", (56, 28), (255, 255, 255)))
    assert (squashed > 1.5).all()  # squash fills the square


def test_transform_converts_non_rgb_input():
    out = ImageTransform(VISION)(Image.new("RGBA", (20, 20), (0, 0, 0, 0)))
    assert out.shape == (3, 28, 28) and (out > 1.5).all()  # transparent -> white


def test_no_augmentation_is_deterministic_and_augmentation_follows_the_torch_seed():
    img = checkerboard(50, 40)
    plain = ImageTransform(VISION, augment=False)
    torch.manual_seed(1)
    a = plain(img)
    torch.manual_seed(2)
    assert torch.equal(a, plain(img))

    aug = ImageTransform(VISION, augment=True)
    torch.manual_seed(7)
    x = aug(img)
    torch.manual_seed(7)
    assert torch.equal(x, aug(img))
    outs = []
    for seed in range(4):
        torch.manual_seed(seed)
        outs.append(aug(img))
    assert any(not torch.equal(outs[0], o) for o in outs[1:])
    assert not any(torch.equal(a, o) for o in outs)


def test_augmentation_never_mirrors_left_and_right():
    img = Image.new("RGB", (40, 40), (255, 0, 0))
    img.paste((0, 0, 255), (20, 0, 40, 40))  # red left, blue right
    aug = ImageTransform(VISION, augment=True)
    for seed in range(20):
        torch.manual_seed(seed)
        out = aug(img)
        assert out[0, 14, 2] > out[2, 14, 2] and out[2, 14, -3] > out[0, 14, -3], seed


def test_unknown_resize_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="pad, squash"):
        ImageTransform(VISION, resize="crop")
