"""Export labels to the formats training code reads: COCO, YOLO, and captions.jsonl.

Coordinates are in the image as displayed, after EXIF orientation (the `width` / `height` of
the rows). With `with_images`, the oriented pixels are written next to the labels, so readers
that ignore EXIF still line up. Only `ok` rows are exported; points have no COCO / YOLO form
and are left out (they stay in the Parquet output).

    COCO  DEST/annotations.json   images, categories (detect object names, ids from 1),
                                  annotations with absolute-pixel [x, y, w, h]
    YOLO  DEST/labels/<shard>/<key>.txt   "class cx cy w h" (normalized, classes from 0)
          DEST/data.yaml
    both  DEST/captions.jsonl     the caption / query columns of every exported image
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from .output.reader import Output


def _file_name(stem: str, key: str, fmt: str) -> str:
    return f"{stem}/{key}.{'png' if fmt == 'PNG' else 'jpg'}"


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
    formats: dict[tuple[str, str], str] = {}
    by_shard: dict[str, set[str]] = defaultdict(set)
    for shard, row in rows:
        by_shard[shard.stem].add(row["key"])
    for shard in output.shards():
        if shard.stem in by_shard:
            for key, image, image_fmt in output.images(shard, by_shard[shard.stem]):
                formats[(shard.stem, key)] = image_fmt
                if with_images:
                    path = dest / "images" / _file_name(shard.stem, key, image_fmt)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    image.save(path, format="PNG" if image_fmt == "PNG" else "JPEG", quality=95)

    images, annotations, captions = [], [], []
    for image_id, (shard, row) in enumerate(rows, start=1):
        w, h = row["width"], row["height"]
        file_name = _file_name(shard.stem, row["key"], formats.get((shard.stem, row["key"]), "JPEG"))
        images.append({"id": image_id, "file_name": file_name, "width": w, "height": h})
        boxes = _boxes(row, detect_cols)
        for b in boxes:
            x, y = b["x_min"] * w, b["y_min"] * h
            bw, bh = (b["x_max"] - b["x_min"]) * w, (b["y_max"] - b["y_min"]) * h
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": category[b["label"]] + 1, "bbox": [x, y, bw, bh],
                                "area": bw * bh, "iscrowd": 0})
        if fmt == "yolo":
            label_path = dest / "labels" / Path(file_name).with_suffix(".txt")
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
        (dest / "data.yaml").write_text(yaml.safe_dump(
            {"path": str(dest.resolve()), "train": "images", "val": "images",
             "names": {i: n for i, n in enumerate(names)}}, sort_keys=False))
    with open(dest / "captions.jsonl", "w") as f:
        for c in captions:
            f.write(json.dumps(c) + "\n")
    return {"images": len(images), "annotations": len(annotations), "categories": len(names)}
