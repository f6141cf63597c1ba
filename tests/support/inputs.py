"""Inputs as tests write them: webdataset shards, encoded images (good, broken, a bomb's header),
and job files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def write_tar(path: Path, members: list) -> Path:
    """A webdataset shard from (file name, bytes) pairs, in order; a tarfile.TarInfo is written
    as it is (a directory, a link, a device)."""
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
                continue
            name, data = member
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path



def encode_image(im, fmt: str, **kw) -> bytes:
    import io

    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()



def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height pixels but holds none (a decompression bomb's header)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")



def write_job(path: Path, shards: str, out: str = "out", **sections) -> Path:
    import yaml

    job = {"name": "test-job", "input": {"shards": shards}, "model": {"name": "demo"},
           "tasks": [{"caption": {}}, {"detect": {"objects": ["circle"]}}],
           "engine": {"max_new_tokens": 12, "max_objects": 3}, "loader": {"workers": 0},
           "output": {"dir": out}}
    for k, v in sections.items():
        job[k] = v if not isinstance(v, dict) else {**job.get(k, {}), **v}
    path.write_text(yaml.safe_dump(job))
    return path


def good_png(w=200, h=150, colour=(220, 40, 40)) -> bytes:
    im = Image.new("RGB", (w, h), (240, 240, 240))
    im.paste(colour, (40, 40, 100, 100))
    return encode_image(im, "PNG")


def broken_shard(path: Path) -> dict[str, tuple[str, int | None, int | None, str | None]]:
    """Writes a shard of good and broken images; returns key -> (status, width, height, error fragment)."""
    jpeg = encode_image(Image.new("RGB", (300, 200), (10, 120, 200)), "JPEG", quality=90)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: stored 300x200, shown 200x300
    rotated = encode_image(Image.new("RGB", (300, 200), (200, 120, 10)), "JPEG", exif=exif.tobytes())
    palette = Image.new("P", (64, 48), 0)
    palette.putpalette([255, 0, 0] + [0, 255, 0] * 255)
    pal_bytes = encode_image(palette, "PNG", transparency=0)
    sixteen = Image.fromarray(np.arange(60 * 80, dtype=np.uint16).reshape(60, 80) * 13)
    members = [
        ("a_good.png", good_png()),
        ("b_truncated.jpg", jpeg[: len(jpeg) // 2]),
        ("c_empty.jpg", b""),
        ("d_text.jpg", b"this is not an image at all"),
        ("e_huge.png", png_header_only(60000, 50000)),
        ("f_cmyk.jpg", encode_image(Image.new("CMYK", (120, 90), (0, 50, 100, 0)), "JPEG")),
        ("g_sixteen.png", encode_image(sixteen, "PNG")),
        ("h_palette.png", pal_bytes),
        ("i_rotated.jpg", rotated),
        ("j_noimage.txt", b"caption only"),
        ("k_good.jpg", jpeg),
    ]
    write_tar(path, members)
    return {
        "a_good": ("ok", 200, 150, None), "b_truncated": ("error", None, None, "decode"),
        "c_empty": ("error", None, None, "empty"), "d_text": ("error", None, None, "not an image"),
        "e_huge": ("error", 60000, 50000, "too large"), "f_cmyk": ("ok", 120, 90, None),
        "g_sixteen": ("ok", 80, 60, None), "h_palette": ("ok", 64, 48, None), "i_rotated": ("ok", 200, 300, None),
        "j_noimage": ("error", None, None, "no image in sample"), "k_good": ("ok", 300, 200, None),
    }
