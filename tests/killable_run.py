"""A training run that SIGKILLs itself at a chosen event: ``python killable_run.py EVENT STEP METRICS [k=v ...]``.

EVENT is one of the trainer's events (``dispatched``: the step is queued on the devices, not yet
done; ``saving``: a checkpoint's arrays are on the host and its files are being written in the
background; ``done``) or ``never``. Used by tests/test_faults.py.
"""

import os
import signal
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from meshtron.config import load_config
from meshtron.train.loop import Trainer


def main() -> None:
    event, step, metrics, *overrides = sys.argv[1:]

    def hook(at_event: str, at_step: int) -> None:
        if at_event == event and at_step == int(step):
            os.kill(os.getpid(), signal.SIGKILL)

    trainer = Trainer.from_config(load_config(None, overrides))
    with open(metrics, "a+") as f:
        trainer.run(metrics_file=f, on_event=hook)


if __name__ == "__main__":
    main()
