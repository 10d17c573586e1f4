"""Reads a run dir's TensorBoard event files with TensorBoard's own reader and prints every
scalar as JSON lines: {"tag", "step", "value", "wall_time"}. Used by tests/tensorboard_cli.rs.

Needs the `tensorboard` package (scripts/setup-python.sh installs it into .venv).
Usage: python tests/tensorboard_read.py RUN_DIR
"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
for tag in acc.Tags()["scalars"]:
    for e in acc.Scalars(tag):
        print(json.dumps({"tag": tag, "step": e.step, "value": e.value, "wall_time": e.wall_time}))
