"""Image decoding (data/formats.py `load_image` / `to_rgb`): every Pillow mode becomes faithful 8-bit RGB."""

import io

import numpy as np
import pytest
from PIL import Image

from data.formats import TRANSPARENT_BACKGROUND, load_image, to_rgb


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def gray(image: Image.Image) -> np.ndarray:
    rgb = np.asarray(to_rgb(image), dtype=np.int64)
    assert rgb.shape[-1] == 3 and (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()
    return rgb[..., 0]


def test_16_bit_png_keeps_its_gray_levels():
    """A 16-bit grayscale PNG read through load_image maps value v to round(v / 257): a full ramp stays a full ramp
    (Pillow's own convert saturated 99.6% of such pixels at 255)."""
    ramp = (np.arange(256 * 256, dtype=np.int64).reshape(256, 256)).astype(np.uint16)
    decoded = np.asarray(load_image({"path": None, "bytes": png_bytes(Image.fromarray(ramp))}), dtype=np.int64)
    assert np.abs(decoded[..., 0] - np.rint(ramp / 257)).max() == 0
    assert (decoded == 255).mean() < 0.01


@pytest.mark.parametrize(
    ("values", "mode", "expected"),
    [
        ([[0, 65535]], "I;16", [[0, 255]]),
        ([[0, 32768]], "I;16B", [[0, 128]]),
        ([[0, 1000, 65535]], "I", [[0, 4, 255]]),  # 16-bit data in a 32-bit container
        ([[0, 128, 255]], "I", [[0, 128, 255]]),  # 8-bit data in a 32-bit container
        ([[-1000, 0, 1000]], "I", [[0, 128, 255]]),  # no nominal range: its own min..max
        ([[0.0, 0.5, 1.0]], "F", [[0, 128, 255]]),  # unit floats
        ([[-2.0, 0.0, 2.0]], "F", [[0, 128, 255]]),
        ([[float("nan"), 1.0, 0.0]], "F", [[0, 255, 0]]),
    ],
)
def test_high_depth_gray_is_scaled_by_its_real_range(values, mode, expected):
    """I;16 (either byte order) spans 0..65535; I and F use the range their values occupy (8-bit, 16-bit, unit,
    else min..max), never clipping at 255 as Pillow's convert does; NaN is black."""
    if mode.startswith("I;16"):
        image = Image.new(mode, (len(values[0]), 1))
        for x, v in enumerate(values[0]):
            image.putpixel((x, 0), v)
    else:
        image = Image.fromarray(np.asarray(values, dtype=np.int32 if mode == "I" else np.float32), mode=mode)
    assert gray(image).tolist() == expected


def test_transparency_is_composited_on_the_stated_background():
    """RGBA, RGBa, LA, La, PA and P/L/RGB with a transparent colour composite on TRANSPARENT_BACKGROUND: fully
    transparent pixels take the background, opaque ones keep their colour, half-transparent ones blend."""
    white = list(TRANSPARENT_BACKGROUND)
    rgba = Image.new("RGBA", (3, 1))
    for x, pixel in enumerate([(255, 0, 0, 0), (255, 0, 0, 255), (0, 0, 0, 128)]):
        rgba.putpixel((x, 0), pixel)
    assert np.asarray(to_rgb(rgba)).tolist() == [[white, [255, 0, 0], [127, 127, 127]]]
    assert np.asarray(to_rgb(rgba.convert("RGBa")))[0, 1].tolist() == [255, 0, 0]
    la = Image.new("LA", (2, 1))
    la.putpixel((0, 0), (0, 0))
    la.putpixel((1, 0), (0, 255))
    assert np.asarray(to_rgb(la)).tolist() == [[white, [0, 0, 0]]]
    assert np.asarray(to_rgb(la.convert("La"))).tolist() == [[white, [0, 0, 0]]]
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 255, 0, 255, 0])
    palette.putpixel((1, 0), 1)
    palette.info["transparency"] = 0
    reloaded = Image.open(io.BytesIO(png_bytes(palette)))
    assert reloaded.mode == "P" and np.asarray(to_rgb(reloaded)).tolist() == [[white, [0, 255, 0]]]
    assert np.asarray(to_rgb(palette.convert("PA"))).tolist() == [[white, [0, 255, 0]]]
    keyed = Image.new("L", (1, 1), 7)
    keyed.info["transparency"] = 7
    assert np.asarray(to_rgb(keyed)).tolist() == [[white]]


def test_other_modes_convert_to_their_colours():
    """CMYK, 1-bit, palette, YCbCr and HSV images become the RGB colours they denote."""
    cmyk = Image.new("CMYK", (2, 1))
    cmyk.putpixel((0, 0), (0, 0, 0, 0))
    cmyk.putpixel((1, 0), (0, 255, 255, 0))
    assert np.asarray(to_rgb(cmyk)).tolist() == [[[255, 255, 255], [255, 0, 0]]]
    assert np.asarray(to_rgb(Image.new("1", (1, 1), 1))).tolist() == [[[255, 255, 255]]]
    red = Image.new("RGB", (1, 1), (200, 30, 40))
    for mode in ("YCbCr", "HSV"):
        assert np.abs(np.asarray(to_rgb(red.convert(mode)), dtype=int) - [200, 30, 40]).max() <= 3, mode
