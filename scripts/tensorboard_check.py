#!/usr/bin/env python3
"""Reads a run's TensorBoard event file back with the `tensorboard` package
and checks it against the run's metrics.jsonl: every numeric field of every
row is a scalar at its step (`train/<field>`, `val/<field>` for `val_*`,
`memory/<field>` for `*_bytes`), equal to the row's value rounded to f32.

Usage: python3 scripts/tensorboard_check.py METRICS_JSONL
Exits non-zero, naming what differs, if the event file does not match.
"""

import json
import math
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def tag_of(key):
    if key.startswith("val_"):
        return "val/" + key[4:]
    if key.endswith("_bytes"):
        return "memory/" + key[: -len("_bytes")]
    return "train/" + key


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    metrics = sys.argv[1]
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    want = {}
    for row in rows:
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            want[(tag_of(key), row["step"])] = f32(float(value))
    acc = EventAccumulator(metrics + ".tfevents", size_guidance={"scalars": 0})
    acc.Reload()
    got = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            got[(tag, event.step)] = event.value
    problems = []
    for key, value in sorted(want.items()):
        if key not in got:
            problems.append(f"missing {key[0]} at step {key[1]}")
        elif not (got[key] == value or (math.isnan(got[key]) and math.isnan(value))):
            problems.append(f"{key[0]} at step {key[1]}: event {got[key]!r}, metrics {value!r}")
    extra = sorted(set(got) - set(want))
    problems += [f"unexpected {k[0]} at step {k[1]}" for k in extra]
    tags = sorted({k[0] for k in want})
    print(f"{len(rows)} metrics rows, {len(want)} scalars over {len(tags)} tags: {', '.join(tags)}")
    for p in problems:
        print("FAIL", p)
    print("PASS" if not problems else f"{len(problems)} problem(s)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
