#!/usr/bin/env python3
"""Writes a synthetic image question-answering set for training a tiny vision-language model.

Each example is a 64x64 RGB PNG: a light-grey, slightly noisy background holding one filled shape
(circle, square, triangle or cross) in one colour (red, green, blue or yellow), of random size
(40-52 px box) and position (its centre within 6 px of the image's). The conversation asks one
question, either "What colour is the shape?" or "What shape is this?", answered with one word.
Question type, shape and colour are balanced (every combination equally often, shuffled), so a
model that cannot see the image can do no better than 25% (chance); text_only.jsonl holds the same
conversations without the image, as that baseline.

Output in OUT_DIR: images/NNNNN.png, train.jsonl, text_only.jsonl, README.txt.
Standard library only; the PNG writer is below.

Usage: python3 scripts/vlm-data.py OUT_DIR [--train N] [--seed S]   (defaults N=12000, S=0)
"""
import argparse
import itertools
import json
import os
import random
import struct
import zlib

SIZE = 64
BACKGROUND = 210
NOISE = 12  # per-channel noise, +-NOISE
JITTER = 20  # per-example colour jitter, +-JITTER
MIN_SIDE, MAX_SIDE = 40, 52  # the shape's bounding box, in pixels
SHIFT = 6  # the box's centre moves at most this far from the image's, in each direction
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is this?"}


def write_png(path, width, height, rgb):
    """Writes 8-bit RGB pixels (bytes, row-major, 3 per pixel) as a PNG (colour type 2, filter 0)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride:(y + 1) * stride] for y in range(height))
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(raw, 6)))
        f.write(chunk(b"IEND", b""))


# Inside tests take (u, v) in [0, 1): the pixel centre's position within the shape's bounding box.
def in_circle(u, v):
    return (u - 0.5) ** 2 + (v - 0.5) ** 2 <= 0.25


def in_square(u, v):
    return True


def in_triangle(u, v):  # apex at top centre, base along the bottom
    return abs(u - 0.5) <= v / 2


def in_cross(u, v):  # plus sign, arms a third of the box wide
    return abs(u - 0.5) <= 1 / 6 or abs(v - 0.5) <= 1 / 6


SHAPES = {"circle": in_circle, "square": in_square, "triangle": in_triangle, "cross": in_cross}


def noise_table(level):
    """Maps a random byte to level +- NOISE, clamped to 0..255 (for bytes.translate)."""
    return bytes(min(255, max(0, level + b % (2 * NOISE + 1) - NOISE)) for b in range(256))


BG_TABLE = noise_table(BACKGROUND)


def render(rng, shape, colour):
    """Returns the image's RGB bytes: noisy background with one noisy, jittered shape."""
    n = SIZE * SIZE
    img = bytearray(rng.randbytes(3 * n).translate(BG_TABLE))
    fg = bytearray(3 * n)
    for c, level in enumerate(COLOURS[colour]):
        jittered = min(255, max(0, level + rng.randint(-JITTER, JITTER)))
        fg[c::3] = rng.randbytes(n).translate(noise_table(jittered))
    side = rng.randint(MIN_SIDE, MAX_SIDE)
    # Near the centre, so each shape covers the middle patches whatever its position.
    x0, y0 = ((SIZE - side) // 2 + rng.randint(-SHIFT, SHIFT) for _ in range(2))
    inside = SHAPES[shape]
    for y in range(side):
        v = (y + 0.5) / side
        row = ((y0 + y) * SIZE + x0) * 3
        for x in range(side):
            if inside((x + 0.5) / side, v):
                i = row + 3 * x
                img[i:i + 3] = fg[i:i + 3]
    return bytes(img)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=12000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(os.path.join(args.out_dir, "images"), exist_ok=True)

    combos = list(itertools.product(QUESTIONS, SHAPES, COLOURS))  # 32 equally frequent cases
    plan = combos * (args.train // len(combos)) + rng.sample(combos, args.train % len(combos))
    rng.shuffle(plan)

    with open(os.path.join(args.out_dir, "train.jsonl"), "w") as train, \
            open(os.path.join(args.out_dir, "text_only.jsonl"), "w") as text_only:
        for k, (qtype, shape, colour) in enumerate(plan):
            rel = f"images/{k:05d}.png"
            write_png(os.path.join(args.out_dir, rel), SIZE, SIZE, render(rng, shape, colour))
            question, answer = QUESTIONS[qtype], colour if qtype == "colour" else shape
            image_part = {"type": "image", "path": rel}
            user = {"role": "user", "content": [image_part, {"type": "text", "text": question}]}
            reply = {"role": "assistant", "content": answer}
            train.write(json.dumps({"messages": [user, reply]}) + "\n")
            text_only.write(json.dumps({"messages": [{"role": "user", "content": question}, reply]}) + "\n")

    with open(os.path.join(args.out_dir, "README.txt"), "w") as f:
        f.write("Synthetic shape/colour image QA set for a tiny vision-language model (chance = 25%).\n")
        f.write(f"Made by: python3 scripts/vlm-data.py {args.out_dir} --train {args.train} --seed {args.seed}\n")
    print(f"wrote {args.train} examples to {args.out_dir}")


if __name__ == "__main__":
    main()
