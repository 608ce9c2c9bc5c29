"""TensorBoard's own reader on a run's event directory: every scalar tag's (step, value) list and
every text tag's (step, text) list, as JSON on stdout. Used by test_tensorboard."""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main(directory):
    acc = EventAccumulator(directory, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    out = {"scalars": {}, "text": {}}
    for tag in tags["scalars"]:
        out["scalars"][tag] = [[e.step, e.value] for e in acc.Scalars(tag)]
    for tag in tags["tensors"]:
        out["text"][tag] = [
            [e.step, e.tensor_proto.string_val[0].decode("utf-8")] for e in acc.Tensors(tag)
        ]
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
