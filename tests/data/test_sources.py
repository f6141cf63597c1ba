"""Shard listing and image decoding details."""


import subprocess
import sys

import numpy as np
import pytest
from support.inputs import encode_image, write_tar
from PIL import Image

from batchvlm.data.decode import decode
from batchvlm.output.shardlist import plan
from batchvlm.data.sources import Encoded, ShardRef, read_shard
from batchvlm.job import InputSpec
from batchvlm.models.moondream.config import VisionConfig
from batchvlm.models.moondream.preprocess import Preprocessor


def test_brace_globs_and_urls_list_sorted_unique_shards(tmp_path):
    for name in ["b-001.tar", "b-000.tar", "a-000.tar"]:
        write_tar(tmp_path / name, [("k.png", b"x")])
    inp = InputSpec(shards=[str(tmp_path / "b-{000..001}.tar"), str(tmp_path / "*.tar"), f"file://{tmp_path}/a-000.tar"])
    shards = plan(inp.model_copy(update={"shards": inp.shards[:2]}))
    assert [s.stem for s in shards] == ["a-000", "b-000", "b-001"]
    url = plan(InputSpec(shards=f"file://{tmp_path}/a-*.tar"))
    assert url == [ShardRef("a-000", f"file://{tmp_path}/a-000.tar", "tar")]
    assert [e.key for e in read_shard(url[0], InputSpec(shards="x"))] == ["k"]


def test_every_image_member_is_its_own_sample_keyed_back_to_its_name(tmp_path):
    """Two images of one key (a.JPG and a.png, a.png and a.PNG) kept only the first and dropped the
    other without a trace; names with more dots (img.v1.jpg) lost their key to webdataset's
    first-dot split and were `no image` rows. Now every member whose (last) extension is one of
    input.image_keys is a row, keyed as webdataset does where that is unique (`b`), else by its
    name up to the last extension (`img.v1`), else by its whole name (`a.JPG`); sidecars attach to
    their image (its own `img.v1.json` first, then the sample's `img.json`)."""
    png = encode_image(Image.new("RGB", (8, 8)), "PNG")
    path = write_tar(tmp_path / "s.tar", [
        ("a.JPG", b"jpeg?"), ("a.png", png), ("a.json", b"A"),
        ("b.webp", png), ("b.txt", b"B"),
        ("img.v1.jpg", b"v1"), ("img.v1.json", b"V1"), ("img.v2.jpg", b"v2"), ("img.json", b"IMG"),
        ("photo.2024.01.jpg", b"p"), ("photo.2024.01.txt", b"P"),
        ("c.png", png), ("c.PNG", b"second"), ("c.seg.png", b"mask"), ("d.txt", b"D")])
    inp = InputSpec(shards="x", keep=["json", "txt"])
    got = [(e.key, e.data, e.name, e.meta) for e in read_shard(ShardRef("s", str(path), "tar"), inp)]
    assert got == [
        ("a.JPG", b"jpeg?", "a.JPG", {"json": "A", "txt": None}), ("a.png", png, "a.png", {"json": "A", "txt": None}),
        ("b", png, "b.webp", {"json": None, "txt": "B"}),
        ("img.v1", b"v1", "img.v1.jpg", {"json": "V1", "txt": None}),
        ("img.v2", b"v2", "img.v2.jpg", {"json": "IMG", "txt": None}),
        ("photo.2024.01", b"p", "photo.2024.01.jpg", {"json": None, "txt": "P"}),
        ("c.png", png, "c.png", {"json": None, "txt": None}), ("c.PNG", b"second", "c.PNG", {"json": None, "txt": None}),
        ("c.seg", b"mask", "c.seg.png", {"json": None, "txt": None}),
        ("d", None, None, {"json": None, "txt": "D"})]
    # image_keys says which members are images: a mask left out is no row, as any other member
    only_jpg = InputSpec(shards="x", image_keys=["JPG"])
    assert [e.key for e in read_shard(ShardRef("s", str(path), "tar"), only_jpg)] == [
        "a", "b", "img.v1", "img.v2", "photo.2024.01", "c", "d"]


def test_sixteen_bit_and_transparency_keep_their_content():
    ramp = (np.linspace(0, 65535, 64 * 64).reshape(64, 64)).astype(np.uint16)
    d = decode(encode_image(Image.fromarray(ramp), "PNG"), 10**8)
    a = np.asarray(d.image)
    assert d.image.mode == "RGB" and a.min() == 0 and a.max() == 255  # scaled, not clipped to white
    rgba = Image.new("RGBA", (10, 10), (255, 0, 0, 0))
    d = decode(encode_image(rgba, "PNG"), 10**8)
    assert np.asarray(d.image)[0, 0].tolist() == [255, 255, 255]  # transparent -> white


def test_jpeg_draft_keeps_enough_pixels_and_the_tiling():
    vc = VisionConfig()
    pre = Preprocessor(vc, 12)
    im = Image.new("RGB", (4000, 3000), (30, 60, 90))
    data = encode_image(im, "JPEG", quality=90)
    full, drafted = decode(data, 10**9), decode(data, 10**9, pre.largest_size)
    assert (drafted.width, drafted.height) == (full.width, full.height) == (4000, 3000)
    need = pre.largest_size(4000, 3000)
    assert need[0] <= drafted.image.width < full.image.width and drafted.image.height >= need[1]
    a, b = pre(full.image), pre(drafted.image, drafted.width, drafted.height)
    assert a.tiling == b.tiling and a.crops.shape == b.crops.shape
    assert (a.crops.int() - b.crops.int()).abs().float().mean() < 2


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF"])
@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_size_is_reported_after_orientation_in_every_format(fmt, orientation):
    import io

    stored = Image.new("RGB", (80, 40), (200, 30, 30))
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    if fmt == "TIFF":
        stored.save(buf, fmt, tiffinfo={0x0112: orientation})
    else:
        stored.save(buf, fmt, exif=exif.tobytes())
    d = decode(buf.getvalue(), 10**8)
    shown = (40, 80) if orientation in (6, 8) else (80, 40)
    assert d.error is None and (d.width, d.height) == shown == d.image.size


def _keys(path, inp=InputSpec(shards="x")):
    return [e.key if isinstance(e, Encoded) else "DAMAGED" for e in read_shard(ShardRef("s", str(path), "tar"), inp)]


def test_every_way_a_tar_breaks_is_reported(tmp_path):
    import subprocess
    import tarfile

    members = [(f"k{i}.png", bytes(range(256)) * 3) for i in range(4)]  # 768 B: header + 2 blocks each
    whole = write_tar(tmp_path / "whole.tar", members).read_bytes()
    assert _keys(tmp_path / "whole.tar") == ["k0", "k1", "k2", "k3"]
    cuts = {"at a member boundary": whole[:1536], "inside a header": whole[:1536 + 100],
            "inside a member's data": whole[:1536 + 700]}
    for name, data in cuts.items():
        (tmp_path / "cut.tar").write_bytes(data)
        assert _keys(tmp_path / "cut.tar") == ["k0", "DAMAGED"], name
    bad = bytearray(whole)
    bad[2 * 1536 + 148] ^= 0xFF  # the third header's checksum
    (tmp_path / "bad.tar").write_bytes(bytes(bad))
    assert _keys(tmp_path / "bad.tar") == ["k0", "k1", "DAMAGED"]
    # Archives from other writers end cleanly: GNU tar, gzip-compressed.
    (tmp_path / "src").mkdir()
    for name, data in members:
        (tmp_path / "src" / name).write_bytes(data)
    subprocess.run(["tar", "-cf", str(tmp_path / "gnu.tar"), "-C", str(tmp_path / "src"), *[n for n, _ in members]],
                   check=True)
    assert _keys(tmp_path / "gnu.tar") == ["k0", "k1", "k2", "k3"]
    with tarfile.open(tmp_path / "z.tar.gz", "w:gz") as tf:
        tf.add(tmp_path / "src" / "k0.png", "k0.png")
    assert _keys(tmp_path / "z.tar.gz") == ["k0"]


def test_a_broken_link_in_a_folder_is_an_error_row(tmp_path):
    (tmp_path / "a.png").write_bytes(encode_image(Image.new("RGB", (8, 8)), "PNG"))
    (tmp_path / "b.png").symlink_to(tmp_path / "gone.png")
    inp = InputSpec(folder=str(tmp_path))
    (shard,) = plan(inp)
    assert (shard.stem, shard.files) == ("root-00000", ("a.png", "b.png"))
    got = list(read_shard(shard, inp))
    assert [(e.key, e.error is None) for e in got] == [("a.png", True), ("b.png", False)]
    assert got[1].error.startswith("read:")


@pytest.mark.parametrize("mode, key", [("RGB", (0, 0, 0)), ("L", 0), ("P", 0)])
def test_transparent_pixels_become_white(mode, key):
    im = Image.new(mode, (4, 4), 0)
    im.putpixel((0, 0), (255, 0, 0) if mode == "RGB" else 1)
    d = decode(encode_image(im, "PNG", transparency=key), 10**8)
    rgb = np.asarray(d.image)
    assert tuple(rgb[3, 3]) == (255, 255, 255) and tuple(rgb[0, 0]) != (255, 255, 255)


def test_a_large_sixteen_bit_png_decodes_in_bounded_memory():
    """A 16-bit PNG of 4000x4000 (100 KB on disk, under the pixel limit) must not take
    float64 temporaries: measured as the decode's peak RSS in a fresh process."""
    script = """
import io, resource
from PIL import Image
from batchvlm.data.decode import decode
buf = io.BytesIO(); Image.new("I;16", (4000, 4000), 40000).save(buf, "PNG", compress_level=1)
data = buf.getvalue()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
d = decode(data, 10**9)
assert d.error is None and d.image.getpixel((0, 0)) == (155, 155, 155), (d.error, d.image.getpixel((0, 0)))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024 / 4000 / 4000)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) < 10, f"{float(r.stdout):.1f} bytes per pixel"  # 8-bit RGB itself is 3
