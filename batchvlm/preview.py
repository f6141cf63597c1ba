"""A self-contained HTML page to look at labels before trusting a million rows.

Thumbnails are embedded (data: URIs, after EXIF orientation) with boxes and points drawn over
them in SVG, text answers beside them, error rows with their error, and filters by status and
object label. No network, no external files.
"""

from __future__ import annotations

import base64
import html
import io
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from .data.decode import decode
from .output.layout import is_store_url
from .output.reader import Output, OutputError

THUMB = 320  # longest thumbnail side, pixels
BOX_COLOUR, POINT_COLOUR = "#ff00ff", "#00e5ff"

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>batchvlm preview: {title}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 16px; background: #f4f4f6; color: #222; }}
header {{ margin-bottom: 12px; }} .meta {{ color: #666; }}
.filters {{ display: flex; gap: 16px; flex-wrap: wrap; align-items: center; margin: 8px 0 16px; }}
.grid {{ display: flex; flex-wrap: wrap; gap: 12px; }}
.card {{ background: #fff; border-radius: 6px; padding: 8px; width: {thumb}px; box-shadow: 0 1px 3px #0002; }}
.card.error {{ border: 2px solid #d33; }}
.frame {{ position: relative; line-height: 0; }} .frame img {{ display: block; }}
.frame svg {{ position: absolute; left: 0; top: 0; }}
.key {{ font-weight: 600; word-break: break-all; }} .err {{ color: #d33; }}
dl {{ margin: 6px 0 0; }} dt {{ color: #666; font-size: 12px; }} dd {{ margin: 0 0 4px; overflow-wrap: anywhere; }}
</style></head><body>
<header><h2>{title}</h2><div class="meta">{meta}</div></header>
<div class="filters">
  <label>status <select id="status"><option value="">all</option><option>ok</option><option>error</option></select></label>
  <span>labels: {label_boxes}</span>
  <label>text <input id="text" placeholder="filter captions / answers"></label>
  <span id="count"></span>
</div>
<div class="grid">{cards}</div>
<script>
(function () {{
  const status = document.getElementById("status");
  const text = document.getElementById("text");
  const boxes = Array.from(document.querySelectorAll("input.label"));
  function apply() {{
    const want = new Set(boxes.filter(b => b.checked).map(b => b.value));
    let shown = 0;
    document.querySelectorAll(".card").forEach(card => {{
      const labels = card.dataset.labels ? card.dataset.labels.split("|") : [];
      const okStatus = !status.value || card.dataset.status === status.value;
      const okLabel = labels.length === 0 || labels.some(l => want.has(l)) || boxes.length === 0;
      const okText = !text.value || card.textContent.toLowerCase().includes(text.value.toLowerCase());
      const show = okStatus && okLabel && okText;
      card.style.display = show ? "" : "none";
      shown += show ? 1 : 0;
      card.querySelectorAll("[data-label]").forEach(el => {{
        el.style.display = want.has(el.dataset.label) ? "" : "none";
      }});
    }});
    document.getElementById("count").textContent = shown + " shown";
  }}
  [status, text, ...boxes].forEach(el => el.addEventListener("input", apply));
  apply();
}})();
</script></body></html>
"""


def _thumb(image) -> tuple[str, int, int]:
    image = image.copy()
    image.thumbnail((THUMB, THUMB))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode(), image.width, image.height


def _overlay(row: dict[str, Any], detect: list[str], point: list[str], w: int, h: int) -> str:
    e = html.escape
    parts = []
    for col in detect:
        for b in row.get(col) or []:
            x, y = b["x_min"] * w, b["y_min"] * h
            bw, bh = (b["x_max"] - b["x_min"]) * w, (b["y_max"] - b["y_min"]) * h
            parts.append(f'<g data-label="{e(b["label"])}"><rect x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" '
                         f'height="{bh:.1f}" fill="none" stroke="{BOX_COLOUR}" stroke-width="2"/>'
                         f'<text x="{x + 2:.1f}" y="{max(10, y - 3):.1f}" font-size="11" fill="{BOX_COLOUR}" '
                         f'stroke="#000" stroke-width="0.3">{e(b["label"])}</text></g>')
    for col in point:
        for p in row.get(col) or []:
            parts.append(f'<circle data-label="{e(p["label"])}" cx="{p["x"] * w:.1f}" cy="{p["y"] * h:.1f}" r="4" '
                         f'fill="{POINT_COLOUR}" stroke="#000" stroke-width="1"/>')
    return f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}">{"".join(parts)}</svg>'


def render(out_dir: str | Path, n: int) -> str:
    output = Output.open(out_dir)
    detect, point = output.columns("detect"), output.columns("point")
    texts = output.columns("caption") + output.columns("query")
    rows = list(output.rows(limit=n, partial=True))  # a --limit quick look is worth a look
    wanted: dict[str, set[str]] = defaultdict(set)
    for shard, row in rows:
        if row["status"] == "ok":
            wanted[shard.stem].add(row["key"])
    thumbs, gone = {}, []
    for shard in output.shards(partial=True):
        if shard.stem in wanted:
            try:
                for enc in output.encoded(shard, wanted[shard.stem]):
                    d = decode(enc.data, output.job.loader.max_image_pixels)
                    if d.image is not None:
                        thumbs[(shard.stem, enc.key)] = _thumb(d.image)
            except OutputError:  # the labels are still worth a look without their images
                gone.append(shard.url)
    e = html.escape
    cards = []
    for shard, row in rows:
        labels = sorted({x["label"] for c in detect + point for x in (row.get(c) or [])})
        body = [f'<div class="key">{e(row["key"])}</div>',
                f'<div class="meta">{e(shard.stem)} · {row["width"] or "?"}×{row["height"] or "?"}</div>']
        thumb = thumbs.get((shard.stem, row["key"]))
        if thumb:
            src, w, h = thumb
            body.insert(0, f'<div class="frame"><img src="{src}" width="{w}" height="{h}" alt="{e(row["key"])}">'
                           f'{_overlay(row, detect, point, w, h)}</div>')
        if row["error"]:
            body.append(f'<div class="err">{e(row["error"])}</div>')
        answers = "".join(f"<dt>{e(c)}</dt><dd>{e(str(row.get(c)))}</dd>" for c in texts if row.get(c) is not None)
        if answers:
            body.append(f"<dl>{answers}</dl>")
        cls = "card error" if row["status"] == "error" else "card"
        cards.append(f'<div class="{cls}" data-status="{row["status"]}" data-labels="{e("|".join(labels))}">'
                     + "".join(body) + "</div>")
    model = output.record.get("model") or {}
    meta = f"{len(rows)} rows · model {e(str(model.get('name')))} · {e(str(out_dir))}"
    if gone:
        meta += f" · no images: input {e(gone[0])} not found" + (f" (and {len(gone) - 1} more)" if len(gone) > 1 else "")
    label_boxes = " ".join(f'<label><input type="checkbox" class="label" value="{e(lab)}" checked> {e(lab)}</label>'
                           for lab in output.labels())
    return PAGE.format(title=e(output.job.name), meta=meta, cards="\n".join(cards), label_boxes=label_boxes,
                       thumb=THUMB)


def write(out_dir: str | Path, n: int, dest: Path) -> int:
    # a file in the output folder is read as labels by every reader of it (pandas, DuckDB, datasets)
    folder, where = Path(os.path.realpath(out_dir)), Path(os.path.realpath(dest))
    if not is_store_url(str(out_dir)) and folder in where.parents:
        raise OutputError(f"-o: {dest} is inside the output folder {out_dir}, where every reader would take it for "
                          "labels (and fail on it); write the preview elsewhere")
    page = render(out_dir, n)
    dest.write_text(page)
    return page.count('class="card')
