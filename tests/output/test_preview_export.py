"""Preview in a real headless Chromium, COCO through pycocotools, YOLO, EXIF-rotated images."""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from support.cli import cli_app
from support.inputs import encode_image, write_job, write_tar
from PIL import Image

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
RED = np.array([220, 40, 40])


def scene(w: int, h: int, box: tuple[int, int, int, int]) -> Image.Image:
    im = Image.new("RGB", (w, h), (235, 235, 240))
    im.paste((220, 40, 40), box)
    return im


def red_bbox(a: np.ndarray) -> tuple[int, int, int, int]:
    ys, xs = np.nonzero((np.abs(a[..., :3].astype(int) - RED) < 40).all(-1))
    return xs.min(), ys.min(), xs.max() + 1, ys.max() + 1


def iou(a, b) -> float:
    ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    root = tmp_path_factory.mktemp("vis")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 280x200, displayed 200x280 (rotated 90 degrees clockwise)
    stored = scene(280, 200, (40, 120, 110, 190))
    members = [("a.png", encode_image(scene(300, 220, (180, 40, 250, 110)), "PNG")),
               ("b.jpg", encode_image(stored, "JPEG", quality=95, exif=exif.tobytes())),
               ("c.jpg", b"broken")]
    write_tar(root / "vis-000.tar", members)
    job = write_job(root / "job.yaml", "vis-000.tar", tasks=[{"caption": {}}, {"detect": {"objects": ["square"]}},
                                                            {"point": {"objects": ["square"]}}])
    cli_app(root, "run", job, check=True)
    rows = {row["key"]: row for row in pq.read_table(root / "out" / "vis-000.parquet").to_pylist()}
    assert (rows["b"]["width"], rows["b"]["height"]) == (200, 280)
    return root, rows


def cli(*args):
    return cli_app(Path.cwd(), *args, check=True)


def test_coco_round_trips_through_pycocotools(labelled, tmp_path):
    from pycocotools.coco import COCO

    root, rows = labelled
    cli("export", "coco", root / "out", tmp_path / "coco", "--with-images")
    coco = COCO(str(tmp_path / "coco" / "annotations.json"))
    assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == ["square"]
    assert len(coco.getImgIds()) == 2  # the broken image is not exported
    for img in coco.loadImgs(coco.getImgIds()):
        key = Path(img["file_name"]).stem
        row = rows[key]
        assert (img["width"], img["height"]) == (row["width"], row["height"])
        anns = coco.loadAnns(coco.getAnnIds(imgIds=img["id"]))
        assert len(anns) == len(row["detect"]) >= 1
        for ann, b in zip(anns, row["detect"]):
            want = [b["x_min"] * row["width"], b["y_min"] * row["height"],
                    (b["x_max"] - b["x_min"]) * row["width"], (b["y_max"] - b["y_min"]) * row["height"]]
            assert np.allclose(ann["bbox"], want, atol=1.0)
        # The written image is the displayed orientation, and the box sits on the square.
        pixels = np.asarray(Image.open(tmp_path / "coco" / "images" / img["file_name"]))
        x, y, w, h = anns[0]["bbox"]
        assert pixels.shape[:2] == (img["height"], img["width"])
        assert iou((x, y, x + w, y + h), red_bbox(pixels)) > 0.5
    captions = [json.loads(line) for line in (tmp_path / "coco" / "captions.jsonl").read_text().splitlines()]
    assert {c["key"] for c in captions} == {"a", "b"} and all(c["caption"] for c in captions)


def test_yolo_labels_match_the_rows(labelled, tmp_path):
    root, rows = labelled
    cli("export", "yolo", root / "out", tmp_path / "yolo")
    data = yaml.safe_load((tmp_path / "yolo" / "data.yaml").read_text())
    assert data["names"] == {0: "square"}
    for key in ("a", "b"):
        lines = (tmp_path / "yolo" / "labels" / f"{key}.txt").read_text().split("\n")[:-1]
        got = np.array([[float(v) for v in line.split()] for line in lines])
        want = np.array([[0, (b["x_min"] + b["x_max"]) / 2, (b["y_min"] + b["y_max"]) / 2, b["x_max"] - b["x_min"],
                          b["y_max"] - b["y_min"]] for b in rows[key]["detect"]])
        assert np.allclose(got, want, atol=1e-5)


def edges(mask: np.ndarray) -> tuple[int, int, int, int]:
    """Outline of a drawn rectangle from its long runs (ignores the label text above it)."""
    cols, rows = mask.sum(0), mask.sum(1)
    xs, ys = np.nonzero(cols >= 0.6 * cols.max())[0], np.nonzero(rows >= 0.6 * rows.max())[0]
    return xs.min(), ys.min(), xs.max() + 1, ys.max() + 1


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (installed by .ci/run)")
def test_preview_in_headless_chromium(labelled, tmp_path):
    root, rows = labelled
    page = tmp_path / "preview.html"
    cli("preview", root / "out", "--n", "1", "-o", page)  # the first row: image "a"
    assert "data:image/jpeg;base64," in page.read_text() and "http" not in page.read_text().replace("http-equiv", "")
    shot = tmp_path / "shot.png"
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp_path / 'profile'}", "--window-size=800,600", "--enable-logging=stderr",
                        "--v=0", f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=120)
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    magenta = (np.abs(pixels - [255, 0, 255]) < 40).all(-1)
    cyan = (np.abs(pixels - [0, 229, 255]) < 40).all(-1)
    square = red_bbox(pixels)
    assert magenta.sum() > 100 and iou(edges(magenta), square) > 0.5
    ys, xs = np.nonzero(cyan)
    cx, cy = xs.mean(), ys.mean()
    assert square[0] <= cx <= square[2] and square[1] <= cy <= square[3]
