"""Image bytes -> an RGB PIL image at orientation-corrected size, or an error string.

Handled: EXIF orientation (width / height are reported after it), CMYK / palette / grey /
16-bit and float modes, transparency (composited onto white), decompression bombs (checked
from the header, before any pixel is decoded), truncated files, non-images (named where their
first bytes tell: formats Pillow cannot read, and the files datasets hold in an image's place).
Animated GIF / WebP / PNG and multi-page TIFF: the first frame. JPEGs may be decoded at reduced
size (draft mode) when the model needs fewer pixels.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

Image.MAX_IMAGE_PIXELS = None  # the limit is ours (max_pixels), checked before decoding

_TRANSPOSED = {5, 6, 7, 8}  # EXIF orientations that swap width and height


@dataclass
class Decoded:
    image: Image.Image | None
    width: int  # after EXIF orientation, at full resolution
    height: int
    error: str | None = None
    format: str | None = None  # PIL's name of the encoding (JPEG, PNG, ...)


_ROWS = 256  # rows scaled at a time: the float temporaries of a wide image stay small


def _to_grey8(im: Image.Image) -> Image.Image:
    """16-bit / 32-bit / float pixels -> 8-bit grey, in the input's own dtype plus a band of
    rows at a time: a 100-megapixel 16-bit PNG must not become 800 MB of float64."""
    a = np.asarray(im)  # uint16 / int32 / float32
    sixteen = im.mode.startswith("I;16")
    scale = 1.0 / 257.0 if sixteen else 255.0 / max(1.0, float(a.max()))
    out = np.empty(a.shape, dtype=np.uint8)
    for r in range(0, a.shape[0], _ROWS):
        band = np.multiply(a[r : r + _ROWS], scale, dtype=np.float32)
        np.clip(band, 0, 255, out=band)
        out[r : r + _ROWS] = band
    return Image.fromarray(out, "L")


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        im = _to_grey8(im)
    if im.mode in ("P", "L", "RGB") and "transparency" in im.info:  # palette or PNG tRNS colour key
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        im = im.convert("RGBA")
        background = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, im).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


_HEIF_BRANDS = {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"}


def _not_decodable(data: bytes) -> str:
    """Why bytes PIL does not recognise are no image we can label, naming what they are where
    the first bytes say so."""
    head = data[:512].lstrip()
    if data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS | {b"avif", b"avis"}:
        what = "AVIF" if data[8:12] in (b"avif", b"avis") else "HEIC"
        return f"decode: {what} image, which this Pillow cannot read (convert it to JPEG or PNG)"
    if data.startswith((b"\xff\x0a", b"\x00\x00\x00\x0cJXL ")):
        return "decode: JPEG XL image, which Pillow cannot read (convert it to JPEG or PNG)"
    if b"<svg" in head[:512] and head.startswith((b"<svg", b"<?xml", b"<!DOCTYPE svg")):
        return "decode: SVG (vector) image, which is not rendered (convert it to PNG)"
    if head.startswith(b"%PDF"):
        return "decode: not an image (a PDF document)"
    if head.startswith(b"version https://git-lfs"):
        return "decode: not an image (a Git LFS pointer: fetch the file with `git lfs pull`)"
    if head[:15].lower().startswith((b"<!doctype html", b"<html")):
        return "decode: not an image (an HTML page, e.g. an error page saved in its place)"
    return "decode: not an image"


def decode(data: bytes, max_pixels: int, draft_size: Callable[[int, int], tuple[int, int]] | None = None) -> Decoded:
    """`draft_size(width, height)`: the smallest (w, h) the model needs at this full size."""
    if not data:
        return Decoded(None, 0, 0, "decode: empty file")
    try:
        im = Image.open(io.BytesIO(data))
        fmt = im.format
        w, h = im.size
        if w * h > max_pixels:
            return Decoded(None, w, h, f"too large: {w}x{h} pixels (loader.max_image_pixels: {max_pixels})")
        orientation = im.getexif().get(0x0112, 1) if hasattr(im, "getexif") else 1
        if orientation in _TRANSPOSED:
            w, h = h, w
        if draft_size is not None and im.format == "JPEG":
            need_w, need_h = draft_size(w, h)
            if orientation in _TRANSPOSED:
                need_w, need_h = need_h, need_w
            im.draft("RGB", (need_w, need_h))
        im.load()
        im = ImageOps.exif_transpose(im)
        if fmt != "JPEG":  # full resolution here; and TIFF reports an already-oriented size
            w, h = im.size
        return Decoded(_to_rgb(im), w, h, format=fmt)
    except UnidentifiedImageError:
        return Decoded(None, 0, 0, _not_decodable(data))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        return Decoded(None, 0, 0, f"decode: {e}")
