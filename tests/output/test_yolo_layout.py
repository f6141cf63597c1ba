"""A YOLO export is the layout YOLO tools read: images/ and labels/ flat, an image's labels at
labels/<its stem>.txt. supervision's `DetectionDataset.from_yolo(images_directory_path,
annotations_directory_path, data_yaml_path)` lists images/ without recursing and reads
labels/<stem>.txt beside each; ultralytics finds an image's labels by turning /images/ into
/labels/ in its path. Names that two shards share are parted (`a+2.png`) as names one shard
shares were; COCO keeps a folder per shard."""

import json
from pathlib import Path

import yaml
from PIL import Image
from support.cli import cli_app
from support.inputs import encode_image, write_job, write_tar


def supervision_pairs(images: Path, labels: Path) -> dict[str, Path]:
    """What supervision's from_yolo pairs: each jpg / jpeg / png directly in `images`, with
    labels/<stem>.txt (it reads an image without one as an image with no boxes)."""
    return {p.name: labels / f"{p.stem}.txt" for p in sorted(images.iterdir())
            if p.suffix.lower() in (".jpg", ".jpeg", ".png")}


def test_yolo_export_is_flat_and_every_image_has_its_labels(tmp_path):
    png = encode_image(Image.new("RGB", (32, 32), (200, 30, 30)), "PNG")
    for shard in ("x-000", "x-001"):
        write_tar(tmp_path / f"{shard}.tar", [("a.png", png), ("b.png", png), ("d/c.png", png)])
    job = write_job(tmp_path / "job.yaml", "x-{000..001}.tar", tasks=[{"detect": {"objects": ["square"]}}])
    cli_app(tmp_path, "run", job, check=True)
    dest = tmp_path / "yolo"
    r = cli_app(tmp_path, "export", "yolo", tmp_path / "out", dest, "--with-images")
    assert r.returncode == 0, r.stdout

    assert all(p.is_file() for p in (dest / "images").iterdir()) and all(p.is_file() for p in (dest / "labels").iterdir())
    pairs = supervision_pairs(dest / "images", dest / "labels")
    assert sorted(pairs) == ["a+2.png", "a.png", "b+2.png", "b.png", "d_c+2.png", "d_c.png"]
    assert all(label.is_file() for label in pairs.values())
    manifest = json.loads((dest / "export.json").read_text())
    for m in manifest["images"]:  # ultralytics: .../images/<f> -> .../labels/<stem>.txt
        image = dest / "images" / m["file_name"]
        assert Path(str(image).replace("/images/", "/labels/")).with_suffix(".txt").is_file()
    data = yaml.safe_load((dest / "data.yaml").read_text())
    assert data["train"] == data["val"] == "images" and data["names"] == {0: "square"}

    coco = tmp_path / "coco"
    assert cli_app(tmp_path, "export", "coco", tmp_path / "out", coco, "--with-images").returncode == 0
    assert sorted(p.name for p in (coco / "images").iterdir()) == ["x-000", "x-001"]
