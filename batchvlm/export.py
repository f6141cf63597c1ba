"""Export labels to the formats training code reads: COCO, YOLO, and captions.jsonl.

Coordinates are in the image as displayed, after EXIF orientation (the `width` / `height` of
the rows). Images keep their input's file name and format (`DEST/images/<shard>/<file>`); with
`with_images` they are written there as the input's bytes, re-encoded (same format) only where
EXIF turns them, so readers that ignore EXIF still line up. Without it no image is decoded.
Only `ok` rows are exported; points have no COCO / YOLO form and are left out (they stay in
the Parquet output).

    COCO  DEST/annotations.json   images, categories (detect object names, ids from 1),
                                  annotations with absolute-pixel [x, y, w, h]
    YOLO  DEST/labels/<shard>/<file stem>.txt   "class cx cy w h" (normalized, classes from 0)
          DEST/data.yaml          train / val only where the images were written
    both  DEST/captions.jsonl     the caption / query columns of every exported image
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml
from PIL import Image

from .data.decode import decode
from .data.sources import FOLDER_EXTS, Encoded
from .output.reader import Output, OutputError

EXTENSION = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tif", "MPO": "jpg"}


def _name(enc: Encoded) -> str:
    """The image's file name as in the input (tar member, file); bytes in a Parquet column
    are named by their key and their format, read from the header alone."""
    if enc.name:
        return enc.name
    if Path(enc.key).suffix.lower() in FOLDER_EXTS:
        return enc.key
    try:
        fmt = Image.open(io.BytesIO(enc.data)).format
    except (OSError, ValueError):
        fmt = None
    return f"{enc.key}.{EXTENSION.get(fmt or '', 'bin')}"


def _write_image(enc: Encoded, path: Path, max_pixels: int) -> None:
    """The input's own bytes where they are displayed as stored; re-encoded in the input's
    format only where EXIF turns them (readers that ignore EXIF must see the same pixels)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        orientation = Image.open(io.BytesIO(enc.data)).getexif().get(0x0112, 1)
    except (OSError, ValueError):
        orientation = 1
    if orientation == 1:
        path.write_bytes(enc.data)
        return
    d = decode(enc.data, max_pixels)
    if d.image is not None:
        fmt = d.format if d.format in EXTENSION and d.format != "MPO" else "JPEG"
        d.image.save(path, format=fmt, **({"quality": 95} if fmt in ("JPEG", "WEBP") else {}))


def _boxes(row: dict[str, Any], columns: list[str]) -> list[dict[str, Any]]:
    return [b for c in columns for b in (row.get(c) or [])]


def export(out_dir: Path, dest: Path, fmt: str, with_images: bool = False) -> dict[str, int]:
    output = Output.open(out_dir)
    detect_cols = output.columns("detect")
    text_cols = output.columns("caption") + output.columns("query")
    names = output.labels(("detect",))
    category = {n: i for i, n in enumerate(names)}
    dest.mkdir(parents=True, exist_ok=True)

    rows = [(shard, row) for shard, row in output.rows() if row["status"] == "ok"]
    file_names: dict[tuple[str, str], str] = {}
    by_shard: dict[str, set[str]] = defaultdict(set)
    for shard, row in rows:
        by_shard[shard.stem].add(row["key"])
    for shard in output.shards():
        if shard.stem not in by_shard:
            continue
        if shard.kind == "folder" and not with_images:  # the key is the file name: no need to read
            file_names |= {(shard.stem, k): k for k in by_shard[shard.stem]}
            continue
        try:
            for enc in output.encoded(shard, by_shard[shard.stem]):
                name = file_names[(shard.stem, enc.key)] = _name(enc)
                if with_images:
                    _write_image(enc, dest / "images" / shard.stem / name, output.job.loader.max_image_pixels)
        except OutputError:
            if with_images:
                raise
            # without images a gone input only costs the extension: names stay the keys

    images, annotations, captions = [], [], []
    for image_id, (shard, row) in enumerate(rows, start=1):
        w, h = row["width"], row["height"]
        file_name = f"{shard.stem}/{file_names.get((shard.stem, row['key']), row['key'])}"
        images.append({"id": image_id, "file_name": file_name, "width": w, "height": h})
        boxes = _boxes(row, detect_cols)
        for b in boxes:
            x, y = b["x_min"] * w, b["y_min"] * h
            bw, bh = (b["x_max"] - b["x_min"]) * w, (b["y_max"] - b["y_min"]) * h
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": category[b["label"]] + 1, "bbox": [x, y, bw, bh],
                                "area": bw * bh, "iscrowd": 0})
        if fmt == "yolo":
            label_path = dest / "labels" / Path(file_name).with_suffix(".txt")  # YOLO pairs them by stem
            label_path.parent.mkdir(parents=True, exist_ok=True)
            label_path.write_text("".join(
                f"{category[b['label']]} {(b['x_min'] + b['x_max']) / 2:.6f} {(b['y_min'] + b['y_max']) / 2:.6f} "
                f"{b['x_max'] - b['x_min']:.6f} {b['y_max'] - b['y_min']:.6f}\n" for b in boxes))
        if text_cols:
            captions.append({"file_name": file_name, "key": row["key"], "source": row["source"]}
                            | {c: row.get(c) for c in text_cols})

    if fmt == "coco":
        coco = {"info": {"description": f"batchvlm job {output.job.name}", "model": output.record.get("model")},
                "images": images, "annotations": annotations,
                "categories": [{"id": i + 1, "name": n, "supercategory": "object"} for i, n in enumerate(names)]}
        (dest / "annotations.json").write_text(json.dumps(coco))
    else:
        data = {"path": str(dest.resolve())} | ({"train": "images", "val": "images"} if with_images else {})
        note = "" if with_images else ("# images were not exported (--with-images): add train / val with the "
                                       "folder that holds them,\n# laid out as labels/ is (<shard>/<file>)\n")
        (dest / "data.yaml").write_text(note + yaml.safe_dump(data | {"names": dict(enumerate(names))},
                                                               sort_keys=False))
    with open(dest / "captions.jsonl", "w") as f:
        for c in captions:
            f.write(json.dumps(c) + "\n")
    return {"images": len(images), "annotations": len(annotations), "categories": len(names)}
