"""`export --with-images` names files after tar members and Parquet keys that whoever made the
dataset chose: every file it writes stays inside DEST, whatever the key (issue 40, item 1)."""

import json
import os
from pathlib import Path

from support.cli import cli_app
from support.inputs import encode_image, write_job, write_tar
from PIL import Image


def files_under(root: Path) -> set[Path]:
    return {Path(d) / f for d, _, fs in os.walk(root) for f in fs}


def test_hostile_member_names_stay_inside_dest(tmp_path):
    png = encode_image(Image.new("RGB", (32, 32), (200, 30, 30)), "PNG")
    outside = tmp_path / "victim"
    members = [("../../../escape.png", png), (f"{outside}/abs.png", png), ("a.png", png), ("sub/../a.png", png),
               ("./b.png", png)]
    write_tar(tmp_path / "x-000.tar", members)
    job = write_job(tmp_path / "job.yaml", "x-000.tar", tasks=[{"detect": {"objects": ["square"]}}])
    cli_app(tmp_path, "run", job, check=True)
    for fmt in ("coco", "yolo"):
        dest = tmp_path / "exports" / fmt
        before = files_under(tmp_path)
        r = cli_app(tmp_path, "export", fmt, tmp_path / "out", dest, "--with-images")
        assert r.returncode == 0, r.stdout
        new = files_under(tmp_path) - before - files_under(dest)
        assert not new, f"{fmt} wrote outside DEST: {sorted(new)}"
        assert not outside.exists()
        images = sorted(p.relative_to(dest / "images") for p in (dest / "images").rglob("*") if p.is_file())
        assert len(images) == len(members) and len({p.as_posix().lower() for p in images}) == len(members)
        manifest = json.loads((dest / "export.json").read_text())
        assert sorted(m["key"] for m in manifest["images"]) == sorted(
            ["../../../escape", f"{outside}/abs", "a", "sub/../a", "./b"])
        for m in manifest["images"]:
            assert (dest / "images" / m["file_name"]).is_file()
            assert ".." not in Path(m["file_name"]).parts and not Path(m["file_name"]).is_absolute()
        if fmt == "yolo":
            labels = sorted(p for p in (dest / "labels").rglob("*.txt"))
            assert len(labels) == len(members)
