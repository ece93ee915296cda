"""Prints what the installed TensorBoard reads from an event directory, as one JSON object:
{"scalars": [[tag, step, value], ...], "images": [[tag, step, width, height], ...],
 "texts": [[tag, step, text], ...], "files": N}.

Usage: python tb_read.py RUN/tensorboard

TensorBoard's own reader (EventAccumulator, which checks every record's CRC) is the independent check of
Dew's event writer (tests/training/test_tensorboard_run.cpp). A missing tensorboard package is an error.
"""

import json
import os
import sys

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util


def main():
    logdir = sys.argv[1]
    acc = event_accumulator.EventAccumulator(
        logdir,
        size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.IMAGES: 0,
            event_accumulator.TENSORS: 0,
        },
    )
    acc.Reload()
    tags = acc.Tags()
    out = {"scalars": [], "images": [], "texts": [], "tags": tags}
    for tag in tags["scalars"]:
        for e in acc.Scalars(tag):
            out["scalars"].append([tag, e.step, e.value])
    for tag in tags["images"]:
        for e in acc.Images(tag):
            out["images"].append([tag, e.step, e.width, e.height, len(e.encoded_image_string)])
    for tag in tags["tensors"]:
        meta = acc.SummaryMetadata(tag)
        if meta.plugin_data.plugin_name != "text":
            continue
        for e in acc.Tensors(tag):
            value = tensor_util.make_ndarray(e.tensor_proto)
            text = value.item() if value.shape == () else value.flatten()[0]
            out["texts"].append([tag, e.step, text.decode("utf-8")])
    out["files"] = len([f for f in os.listdir(logdir) if "tfevents" in f])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
