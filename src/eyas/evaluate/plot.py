"""A PNG bar chart of per-position acceptance, drawn with pillow (no plotting library needed)."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from eyas.evaluate.report import Summary
from eyas.paths import atomic_write_bytes

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def plot_acceptance(summaries: dict[str, Summary], path: str | Path, title: str) -> None:
    """Grouped bars: for each draft position j, the share of steps that accepted >= j tokens."""
    series = [s for s in summaries.values() if s.acceptance]
    positions = max((len(s.acceptance) for s in series), default=1)
    W, H, left, right, top, bottom = 900, 520, 70, 200, 50, 60
    img = Image.new("RGB", (W, H), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    plot_w, plot_h = W - left - right, H - top - bottom
    draw.text((left, 15), title, fill="black", font=font)
    draw.text((10, top - 22), "share of steps", fill="black", font=font)
    for tick in range(6):  # y axis: 0 .. 1
        y = top + plot_h - tick * plot_h / 5
        draw.line([(left - 5, y), (left + plot_w, y)], fill=(220, 220, 220))
        draw.text((left - 40, y - 6), f"{tick / 5:.1f}", fill="black", font=font)
    draw.line([(left, top), (left, top + plot_h), (left + plot_w, top + plot_h)], fill="black")
    group = plot_w / positions
    bar = group * 0.8 / max(len(series), 1)
    for j in range(positions):
        x0 = left + j * group + group * 0.1
        draw.text((x0 + group * 0.35, top + plot_h + 8), str(j + 1), fill="black", font=font)
        for i, s in enumerate(series):
            if j < len(s.acceptance):
                y = top + plot_h - s.acceptance[j] * plot_h
                draw.rectangle([x0 + i * bar, y, x0 + (i + 1) * bar - 1, top + plot_h], fill=COLORS[i % len(COLORS)])
    draw.text((left + plot_w / 2 - 120, H - 25), "draft position j (accepted >= j tokens)", fill="black", font=font)
    for i, s in enumerate(series):  # legend
        y = top + 10 + i * 22
        draw.rectangle([W - right + 15, y, W - right + 30, y + 12], fill=COLORS[i % len(COLORS)])
        draw.text((W - right + 36, y), f"{s.method} (tau {s.tau:.2f})", fill="black", font=font)
    png = io.BytesIO()
    img.save(png, format="PNG")
    atomic_write_bytes(Path(path), png.getvalue())
