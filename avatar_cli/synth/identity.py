"""A synthetic person: every look parameter of one stylized portrait, drawn from an int seed.

Identities are sampled with their own numpy Generator (never the global RNG) salted with a
constant, so identity seed N and audio seed N are independent streams.
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass

import numpy as np

Color = tuple[float, float, float]

HAIR_STYLES = ("bald", "short", "long", "bob", "bun", "curly")
NOSE_STYLES = ("button", "line", "round")
HAT_STYLES = ("none", "beanie", "cap")
BACKGROUND_STYLES = ("solid", "vertical", "diagonal")

_SALT = 0x1DE7

# Real skin tones from very light to very dark; identities interpolate between neighbours.
_SKIN = np.array(
    [
        (0.99, 0.87, 0.78), (0.95, 0.79, 0.66), (0.89, 0.69, 0.53), (0.80, 0.58, 0.42),
        (0.66, 0.45, 0.30), (0.50, 0.33, 0.21), (0.36, 0.23, 0.15), (0.27, 0.17, 0.11),
    ]
)
# (colour, weight): natural colours dominate, a few stylized ones add diversity.
_HAIR = [
    ((0.07, 0.06, 0.06), 4.0), ((0.22, 0.13, 0.07), 4.0), ((0.42, 0.26, 0.13), 3.0),
    ((0.58, 0.22, 0.10), 1.5), ((0.85, 0.45, 0.18), 1.0), ((0.92, 0.78, 0.48), 2.0),
    ((0.93, 0.91, 0.84), 0.7), ((0.58, 0.58, 0.60), 1.0), ((0.22, 0.36, 0.80), 0.4),
    ((0.90, 0.44, 0.66), 0.4), ((0.45, 0.25, 0.70), 0.3), ((0.20, 0.62, 0.45), 0.3),
]
_EYES = [
    (0.36, 0.21, 0.10), (0.16, 0.10, 0.07), (0.24, 0.50, 0.82), (0.28, 0.56, 0.32),
    (0.48, 0.54, 0.60), (0.56, 0.44, 0.18),
]
_LIPSTICK = [(0.78, 0.10, 0.18), (0.88, 0.38, 0.52), (0.50, 0.12, 0.30), (0.72, 0.30, 0.22)]


@dataclass(frozen=True)
class Identity:
    """Look of one synthetic person. Lengths are in canonical units (the frame spans 2.0)."""

    seed: int
    # Face outline: ellipse half sizes, jaw narrowing towards the chin, chin exponent
    # (< 2 pointed, > 2 square).
    face_width: float
    face_height: float
    jaw_taper: float
    chin_power: float
    skin: Color
    blush: float
    hair_style: str
    hair_color: Color
    hairline: float  # how high the hairline sits, as a fraction of face height
    eye_color: Color
    eye_width: float
    eye_height: float
    eye_spacing: float  # eye centre |u| as a fraction of face width
    brow_thickness: float
    brow_tilt: float  # > 0 lowers the outer ends (soft look), < 0 raises them (stern look)
    brow_arch: float
    nose_style: str
    nose_size: float
    mouth_width: float
    lip_color: Color
    lip_thickness: float
    background_style: str
    background_top: Color
    background_bottom: Color
    shirt_color: Color
    glasses: bool
    glasses_round: bool
    glasses_color: Color
    earrings: bool
    earring_color: Color
    hat: str
    hat_color: Color

    @classmethod
    def from_seed(cls, seed: int) -> "Identity":
        rng = np.random.default_rng([int(seed), _SALT])
        return _sample(int(seed), rng)

    @property
    def brow_color(self) -> Color:
        # Bald heads and very light hair still get visible brows.
        base = np.array(self.hair_color)
        if self.hair_style == "bald" or _luma(self.hair_color) > 0.6:
            base = np.array(self.skin) * 0.45
        return _tuple(base * 0.85)


def _sample(seed: int, rng: np.random.Generator) -> Identity:
    skin = _skin(rng)
    hair_style = HAIR_STYLES[int(rng.integers(len(HAIR_STYLES)))]
    hair_color = _weighted(rng, _HAIR)
    if hair_style == "bald":
        hair_color = _tuple(np.array(skin) * 0.8)
    bg_top, bg_bottom, bg_style = _background(rng, skin)
    hat = "none"
    if hair_style != "bun" and rng.random() < 0.2:
        hat = HAT_STYLES[1 + int(rng.integers(2))]
    return Identity(
        seed=seed,
        face_width=float(rng.uniform(0.40, 0.48)),
        face_height=float(rng.uniform(0.52, 0.60)),
        jaw_taper=float(rng.uniform(0.0, 0.3)),
        chin_power=float(rng.uniform(1.6, 3.2)),
        skin=skin,
        blush=float(rng.uniform(0.0, 0.35)),
        hair_style=hair_style,
        hair_color=hair_color,
        hairline=float(rng.uniform(0.42, 0.62)),
        eye_color=_EYES[int(rng.integers(len(_EYES)))],
        eye_width=float(rng.uniform(0.062, 0.092)),
        eye_height=float(rng.uniform(0.036, 0.058)),
        eye_spacing=float(rng.uniform(0.38, 0.48)),
        brow_thickness=float(rng.uniform(0.016, 0.032)),
        brow_tilt=float(rng.uniform(-0.15, 0.2)),
        brow_arch=float(rng.uniform(0.0, 0.025)),
        nose_style=NOSE_STYLES[int(rng.integers(len(NOSE_STYLES)))],
        nose_size=float(rng.uniform(0.8, 1.3)),
        mouth_width=float(rng.uniform(0.12, 0.17)),
        lip_color=_lips(rng, skin),
        lip_thickness=float(rng.uniform(0.02, 0.034)),
        background_style=bg_style,
        background_top=bg_top,
        background_bottom=bg_bottom,
        shirt_color=_hsv(rng.random(), rng.uniform(0.2, 0.8), rng.uniform(0.25, 0.9)),
        glasses=bool(rng.random() < 0.25),
        glasses_round=bool(rng.random() < 0.5),
        glasses_color=_hsv(rng.random(), rng.uniform(0.0, 0.7), rng.uniform(0.05, 0.6)),
        earrings=bool(rng.random() < 0.25),
        earring_color=((0.95, 0.78, 0.25) if rng.random() < 0.6 else (0.85, 0.87, 0.92)),
        hat=hat,
        hat_color=_hsv(rng.random(), rng.uniform(0.3, 0.9), rng.uniform(0.3, 0.9)),
    )


def _skin(rng: np.random.Generator) -> Color:
    pos = rng.uniform(0, len(_SKIN) - 1)
    i = min(int(pos), len(_SKIN) - 2)
    t = pos - i
    base = _SKIN[i] * (1 - t) + _SKIN[i + 1] * t
    return _tuple(np.clip(base + rng.normal(0, 0.015, 3), 0, 1))


def _lips(rng: np.random.Generator, skin: Color) -> Color:
    if rng.random() < 0.2:
        return _LIPSTICK[int(rng.integers(len(_LIPSTICK)))]
    # Natural lips: the skin tone pulled towards a muted red; keeps dark skin's lips clearly
    # lighter than the inner mouth, which the mouth meter relies on.
    s = np.array(skin)
    return _tuple(np.clip(s * np.array([0.92, 0.62, 0.64]) + np.array([0.06, 0.0, 0.0]), 0, 1))


def _background(rng: np.random.Generator, skin: Color) -> tuple[Color, Color, str]:
    style = BACKGROUND_STYLES[int(rng.integers(len(BACKGROUND_STYLES)))]
    for _ in range(20):  # resample until the face stands out from the backdrop
        top = _hsv(rng.random(), rng.uniform(0.1, 0.7), rng.uniform(0.2, 0.95))
        if abs(_luma(top) - _luma(skin)) > 0.18:
            break
    bottom = top
    if style != "solid":
        bottom = _hsv(rng.random(), rng.uniform(0.1, 0.7), rng.uniform(0.2, 0.95))
        if abs(_luma(bottom) - _luma(skin)) < 0.12:
            bottom = _tuple(np.array(top) * 0.6)
    return top, bottom, style


def _weighted(rng: np.random.Generator, table: list[tuple[Color, float]]) -> Color:
    weights = np.array([w for _, w in table])
    return table[int(rng.choice(len(table), p=weights / weights.sum()))][0]


def _hsv(h: float, s: float, v: float) -> Color:
    return _tuple(np.array(colorsys.hsv_to_rgb(float(h), float(s), float(v))))


def _luma(c: Color) -> float:
    return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]


def _tuple(a: np.ndarray) -> Color:
    return (round(float(a[0]), 4), round(float(a[1]), 4), round(float(a[2]), 4))
