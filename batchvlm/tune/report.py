"""`tune`'s output: a table for the terminal, the JSON record, and a PNG of agreement against
images/s (one line per task, each setting a point)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .measure import Measured


def record(job_name: str, family: str, device: str, seed: int, population: int, rows: list[Measured]) -> dict[str, Any]:
    return {"job": job_name, "family": family, "device": device, "seed": seed, "sample": rows[0].images if rows else 0,
            "population": population, "reference": rows[0].setting.name if rows else None,
            "settings": [r.to_dict() for r in rows]}


def table(rows: list[Measured]) -> str:
    """One line per setting: tokens, vision work, images/s, then each task's agreement."""
    columns = list(rows[0].agreement) if rows else []
    head = ["setting", "prefix/img", "vision", "img/s", *(f"{c} ({rows[0].agreement[c]['metric']})" for c in columns)]
    body = [[r.setting.name, f"{r.prefix_tokens:.0f}", f"{r.vision_cost:.2f}", f"{r.images_per_s:.2f}",
             *(f"{r.agreement[c]['value']:.3f}" for c in columns)] for r in rows]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(line, widths))) for line in [head, *body])


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plot(path: Path, rows: list[Measured], title: str) -> None:
    """Agreement (y) against images/s (x): a line per task through the settings, each point named."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    x = [r.images_per_s for r in rows]
    for column in rows[0].agreement:
        y = [r.agreement[column]["value"] for r in rows]
        ax.plot(x, y, marker="o", label=f"{column} ({rows[0].agreement[column]['metric']})")
    for r in rows:
        ax.annotate(r.setting.name, (r.images_per_s, min(a["value"] for a in r.agreement.values())),
                    textcoords="offset points", xytext=(4, -12), fontsize=7)
    ax.set_xlabel("images/s (labelling, this run)")
    ax.set_ylabel("agreement with the full budget")
    ax.set_ylim(-0.02, 1.05)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
