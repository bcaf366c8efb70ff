"""TensorBoard event files of a run, written with tensorboardX (no TensorFlow).

`EventWriter.write(record)` takes the records the loop writes to metrics.jsonl and turns
them into scalars, so the dashboard and the JSON lines never disagree:

  step records   train/loss, train/grad_norm, train/lr, perf/tokens_per_s, perf/step_time_s,
                 perf/mfu (when the chip's peak is known), and any other number a step
                 record carries, as train/<key> (a list of numbers, e.g. an MoE's
                 tokens_per_expert, as train/<key>/<i>)
  every step     faults/skipped_steps and faults/rollbacks: running counts of this invocation
  skipped steps  faults/consecutive_bad
  rollbacks      faults/rollbacks (at the step rolled back from), faults/steps_lost
  evaluations    eval/loss, eval/perplexity
  samples        samples (the text tab): the prompt's continuations (`train.sample_every`)

Open with `tensorboard --logdir <run_dir>` (or the parent of several runs).
"""

from __future__ import annotations

from typing import Any

# Step-record keys with their own tag; other numeric keys go to train/<key>.
TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
        "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s",
        "mfu": "perf/mfu", "consecutive_bad": "faults/consecutive_bad"}
NOT_SCALARS = {"step", "batch", "skipped", "reason", "event"}


class EventWriter:
    """Scalars of the metrics records in `logdir`'s event file."""

    def __init__(self, logdir: str):
        from tensorboardX import SummaryWriter

        self._w = SummaryWriter(logdir=logdir, flush_secs=10)
        self.skipped = 0
        self.rollbacks = 0

    def write(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        step = int(record.get("step", 0))
        if event == "eval":
            self._scalar("eval/loss", record["eval_loss"], step)
            self._scalar("eval/perplexity", record["eval_perplexity"], step)
        elif event == "sample":
            self._w.add_text("samples", sample_markdown(record), global_step=step)
        elif event == "rollback":
            self.rollbacks += 1
            self._scalar("faults/rollbacks", self.rollbacks, int(record["from_step"]))
            self._scalar("faults/steps_lost", record["steps_lost"], int(record["from_step"]))
        elif event is None:
            self.skipped += bool(record.get("skipped"))
            # Running counts on every step, so the charts exist (at 0) before any fault.
            self._scalar("faults/skipped_steps", self.skipped, step)
            self._scalar("faults/rollbacks", self.rollbacks, step)
            for key, value in record.items():
                if key not in NOT_SCALARS and isinstance(value, (int, float)) and not (
                        isinstance(value, bool)):
                    self._scalar(TAGS.get(key, f"train/{key}"), value, step)
                elif key not in NOT_SCALARS and isinstance(value, list):
                    for i, v in enumerate(value):
                        self._scalar(f"train/{key}/{i}", v, step)

    def _scalar(self, tag: str, value: float, step: int) -> None:
        self._w.add_scalar(tag, float(value), global_step=step)

    def close(self) -> None:
        self._w.close()


def sample_markdown(record: dict[str, Any]) -> str:
    """A `sample` record as the text tab shows it: each sample in a code block (whitespace
    kept), the prompt named above them."""
    fence = "```"
    blocks = [f"{fence}\n{text}\n{fence}" for text in record["samples"]]
    return f"prompt: `{record['prompt']!r}`\n\n" + "\n\n".join(blocks)
