"""``bench/chart.png``: each figure as a bar of measured / target, drawn with PIL.ImageDraw.

No matplotlib: it requires stock Pillow, whose install would silently replace Pillow-SIMD in the venv.
A bar reaching the dashed line at 1.0 meets its target; the label carries the measured value.
"""

from __future__ import annotations

from typing import Any

from PIL import Image, ImageDraw, ImageFont

__all__ = ["draw_chart"]

WIDTH, ROW, TOP, LEFT, RIGHT = 1100, 34, 70, 430, 150
GREEN, RED, GREY, INK = (46, 139, 87), (200, 60, 50), (150, 150, 150), (30, 30, 30)


def _font(size: int) -> ImageFont.ImageFont:
    for name in ("DejaVuSans.ttf", "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"):
        try:
            return ImageFont.truetype(name, size)
        except OSError:
            continue
    return ImageFont.load_default()


def draw_chart(figures: list[dict[str, Any]], title: str, path: str) -> None:
    """One row per figure with a numeric target: bar length = measured / target (capped at 3x)."""
    rows = [f for f in figures if f.get("target") and f.get("value") is not None]
    height = TOP + ROW * len(rows) + 50
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    font, small = _font(15), _font(12)
    draw.text((16, 14), title, fill=INK, font=_font(18))
    draw.text(
        (16, 40), "measured / target (1.0 = target met; the value is in the label)", fill=GREY, font=small
    )
    cap = 3.0
    scale = (WIDTH - LEFT - RIGHT) / cap
    for tick in (1.0, 2.0, 3.0):
        x = LEFT + tick * scale
        for y in range(TOP - 4, TOP + ROW * len(rows), 8):
            draw.line([x, y, x, y + 4], fill=INK if tick == 1.0 else GREY, width=2 if tick == 1.0 else 1)
        draw.text((x - 10, TOP + ROW * len(rows) + 6), f"{tick:g}x", fill=GREY, font=small)
    for i, figure in enumerate(rows):
        y = TOP + i * ROW
        score = (
            figure["value"] / figure["target"]
            if figure.get("op", ">=") == ">="
            else figure["target"] / max(figure["value"], 1e-9)
        )
        colour = GREEN if score >= 1.0 else RED
        draw.text((16, y + 7), figure["name"], fill=INK, font=font)
        draw.rectangle([LEFT, y + 6, LEFT + min(score, cap) * scale, y + ROW - 6], fill=colour)
        label = (
            f"{figure['value']:.3g}{figure.get('unit', '')} ({figure.get('op', '>=')} {figure['target']:g})"
        )
        x = LEFT + min(score, cap) * scale + 8
        draw.rectangle(draw.textbbox((x, y + 9), label, font=small), fill="white")  # over the tick lines
        draw.text((x, y + 9), label, fill=INK, font=small)
    image.save(path, optimize=True)
