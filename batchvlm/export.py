"""Export labels to the formats training code reads: COCO, YOLO, and captions.jsonl.

Coordinates are in the image as displayed, after EXIF orientation (the `width` / `height` of
the rows). Images keep their input's file name and format (COCO: `DEST/images/<shard>/<file>`;
YOLO: `DEST/images/<file>`, flat, the layout supervision's `from_yolo` and ultralytics read,
a `/` inside a name turned into `_`); with
`with_images` they are written there as the input's bytes, re-encoded (same format) only where
EXIF turns them, so readers that ignore EXIF still line up. Without it no image is decoded.
Only `ok` rows are exported; points have no COCO / YOLO form and are left out (they stay in
the Parquet output).

    COCO  DEST/annotations.json   images, categories (detect object names, ids from 1),
                                  annotations with absolute-pixel [x, y, w, h]
    YOLO  DEST/labels/<file stem>.txt   "class cx cy w h" (normalized, classes from 0)
          DEST/data.yaml          train / val only where the images were written
    both  DEST/captions.jsonl     the caption / query columns of every exported image
          DEST/export.json        every exported image's key, source and file_name (under images/)

A name comes from the dataset (tar member, Parquet key), so it is made safe first (`safe_name`):
an absolute path, `..` or `.` parts are dropped and the hash of the original name is added
(`../x.png` -> `x~1a2b3c4d.png`); every file an export writes stays inside DEST. YOLO pairs an
image with its labels by file stem: where two images share one (`a.png`, `a.jpg`; in YOLO across
shards too, its folders being flat), the later one is exported as `a+2.jpg` (labels `a+2.txt`),
in every file; in COCO only names of one shard equal without case (`A.png`, `a.png`) are parted
that way.
DEST must be empty (an export never merges into another: class maps would disagree) unless
`overwrite`, which replaces what an export writes there; it may not lie inside the output
folder or an input folder.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml
from PIL import Image

from .data.decode import decode
from .data.sources import FOLDER_EXTS, Encoded
from .job import is_url
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


EXPORT_FILES = ("annotations.json", "data.yaml", "captions.jsonl", "export.json", "labels", "images")


def _check_dest(dest: Path, output: Output, overwrite: bool) -> None:
    """DEST apart from the output folder and the inputs, and empty (or cleared: `overwrite`)."""
    real = Path(os.path.realpath(dest))
    inputs = ([("the output folder", output.dir)] if not output.layout.in_store else []) + (
        [("input.folder", Path(output.job.input.folder))] if output.job.input.folder
        and not is_url(output.job.input.folder) else [])  # a folder in a store holds no local DEST
    for what, folder in inputs:
        inside = Path(os.path.realpath(folder))
        if real == inside or inside in real.parents:
            raise OutputError(f"DEST: {dest} is inside {what} {folder}; files written there would mix with it "
                              "(or become inputs of the next run). Choose a folder outside it")
    if not dest.is_dir() or next(dest.iterdir(), None) is None:
        return
    if not overwrite:
        raise OutputError(f"DEST: {dest} is not empty; an export never merges into another (their class maps "
                          "would disagree). Use --overwrite to replace an export there, or another folder")
    for name in EXPORT_FILES:
        p = dest / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


MAX_PART_BYTES = 200  # a path component's limit is 255 bytes on most filesystems; room for a suffix


def safe_name(name: str) -> str:
    """`name` (a tar member, a folder file, a Parquet key: chosen by whoever made the dataset) as
    a relative path that stays inside the folder it is joined to: no absolute path, no `..` or
    `.` part, no part longer than a file system takes. A name that had to change gets `~` and a
    hash of the original before its suffix, so two keys that clean to one name stay apart."""
    parts = [p for p in name.split("/") if p not in ("", ".", "..")]
    fitted = [p.encode()[:MAX_PART_BYTES].decode(errors="ignore") for p in parts]
    safe = "/".join(fitted)
    if safe == name:
        return name
    stem, suffix = os.path.splitext(safe or "image")
    return f"{stem}~{hashlib.sha256(name.encode()).hexdigest()[:8]}{suffix}"


class _Names:
    """Collision-free file names within one shard's folder, compared without case (as on macOS
    and Windows). YOLO pairs images and labels by stem, so there a shared stem (`a.png`,
    `a.jpg`) is a collision too: the later becomes `a+2.jpg`. A name is never also a folder
    (`a.png` and `a.png/b.png`)."""

    def __init__(self, by_stem: bool) -> None:
        self.by_stem = by_stem
        self.ids: set[str] = set()
        self.files: set[str] = set()
        self.dirs: set[str] = set()

    def _id(self, name: str) -> str:
        return (os.path.splitext(name)[0] if self.by_stem else name).lower()

    def _taken(self, name: str) -> bool:
        low = name.lower()
        prefixes = ["/".join(low.split("/")[:i]) for i in range(1, low.count("/") + 1)]
        return self._id(name) in self.ids or low in self.dirs or any(p in self.files for p in prefixes)

    def claim(self, key_name: str) -> str:
        name = safe_name(key_name)
        stem, suffix = os.path.splitext(name)
        candidate, n = name, 1
        while self._taken(candidate):
            n += 1
            candidate = f"{stem}+{n}{suffix}"
        low = candidate.lower()
        self.ids.add(self._id(candidate))
        self.files.add(low)
        self.dirs.update("/".join(low.split("/")[:i]) for i in range(1, low.count("/") + 1))
        return candidate


def _boxes(row: dict[str, Any], columns: list[str]) -> list[dict[str, Any]]:
    return [b for c in columns for b in (row.get(c) or [])]


def _file_names(output: Output, rows: list, fmt: str, dest: Path | None) -> dict[tuple[str, str], str]:
    """(shard stem, key) -> the image's file name under images/ (safe and collision-free: COCO
    `<shard>/<name>`, YOLO `<name>` with no folder), each image written to `dest`/images/ where
    `dest` is given (--with-images)."""
    file_names: dict[tuple[str, str], str] = {}
    by_shard: dict[str, list[str]] = defaultdict(list)  # keys in row order
    for shard, row in rows:
        by_shard[shard.stem].append(row["key"])
    flat = _Names(by_stem=True) if fmt == "yolo" else None  # one folder for every shard's images
    for shard in output.shards():
        if shard.stem not in by_shard:
            continue
        folder, taken = safe_name(shard.stem), flat or _Names(by_stem=False)

        def place(name: str) -> str:
            return taken.claim(safe_name(name).replace("/", "_")) if flat else f"{folder}/{taken.claim(name)}"

        if not (shard.kind == "folder" and dest is None):  # a folder's key is its file name: no need to read
            try:
                for enc in output.encoded(shard, set(by_shard[shard.stem])):
                    name = file_names[(shard.stem, enc.key)] = place(_name(enc))
                    if dest is not None:
                        _write_image(enc, dest / "images" / name, output.job.loader.max_image_pixels)
            except OutputError:
                if dest is not None:
                    raise
                # without images a gone input only costs the extension: names stay the keys
        for key in by_shard[shard.stem]:
            if (shard.stem, key) not in file_names:
                file_names[(shard.stem, key)] = place(key)
    return file_names


def export(out_dir: str | Path, dest: Path, fmt: str, with_images: bool = False, overwrite: bool = False) -> dict[str, int]:
    output = Output.open(out_dir)
    _check_dest(dest, output, overwrite)
    detect_cols = output.columns("detect")
    text_cols = output.columns("caption") + output.columns("query")
    names = output.labels(("detect",))
    category = {n: i for i, n in enumerate(names)}
    dest.mkdir(parents=True, exist_ok=True)

    rows = [(shard, row) for shard, row in output.rows() if row["status"] == "ok"]
    file_names = _file_names(output, rows, fmt, dest if with_images else None)

    images, annotations, captions = [], [], []
    for image_id, (shard, row) in enumerate(rows, start=1):
        w, h = row["width"], row["height"]
        file_name = file_names[(shard.stem, row["key"])]
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
                                       "folder that holds them,\n# laid out as labels/ is (flat: <file>)\n")
        (dest / "data.yaml").write_text(note + yaml.safe_dump(data | {"names": dict(enumerate(names))},
                                                               sort_keys=False))
    manifest = {"format": fmt, "output": str(output.dir.resolve()), "images_written": with_images,
                "images": [{"key": row["key"], "source": row["source"], "file_name": img["file_name"]}
                           for (_, row), img in zip(rows, images)]}
    (dest / "export.json").write_text(json.dumps(manifest))
    with open(dest / "captions.jsonl", "w") as f:
        for c in captions:
            f.write(json.dumps(c) + "\n")
    return {"images": len(images), "annotations": len(annotations), "categories": len(names)}
