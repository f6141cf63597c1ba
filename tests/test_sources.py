"""Shard listing and image decoding details."""


import numpy as np
from helpers import encode_image, write_tar
from PIL import Image

from batchvlm.data.decode import decode
from batchvlm.data.sources import Encoded, ShardRef, list_shards, read_shard
from batchvlm.job import InputSpec
from batchvlm.models.moondream.config import VisionConfig
from batchvlm.models.moondream.preprocess import Preprocessor


def test_brace_globs_and_urls_list_sorted_unique_shards(tmp_path):
    for name in ["b-001.tar", "b-000.tar", "a-000.tar"]:
        write_tar(tmp_path / name, [("k.png", b"x")])
    inp = InputSpec(shards=[str(tmp_path / "b-{000..001}.tar"), str(tmp_path / "*.tar"), f"file://{tmp_path}/a-000.tar"])
    shards = list_shards(inp.model_copy(update={"shards": inp.shards[:2]}))
    assert [s.stem for s in shards] == ["a-000", "b-000", "b-001"]
    url = list_shards(InputSpec(shards=f"file://{tmp_path}/a-*.tar"))
    assert url == [ShardRef("a-000", f"file://{tmp_path}/a-000.tar", "tar")]
    assert [e.key for e in read_shard(url[0], InputSpec(shards="x"))] == ["k"]


def test_image_keys_priority_and_upper_case_extensions(tmp_path):
    png = encode_image(Image.new("RGB", (8, 8)), "PNG")
    path = write_tar(tmp_path / "s.tar", [("a.JPG", b"jpeg?"), ("a.png", png), ("b.webp", png)])
    got = list(read_shard(ShardRef("s", str(path), "tar"), InputSpec(shards="x", image_keys=["png", "jpg", "webp"])))
    assert [(e.key, e.data) for e in got if isinstance(e, Encoded)] == [("a", png), ("b", png)]


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
    assert np.abs(a.crops.astype(int) - b.crops.astype(int)).mean() < 2
