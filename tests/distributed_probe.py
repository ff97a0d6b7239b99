"""One process of a two-process run that joins through meshtron.distributed and then idles, or
fails: ``python distributed_probe.py ADDRESS RANK BEHAVIOUR``. Used by tests/test_multiprocess.py.

BEHAVIOUR: ``wait`` sleeps in Python (no collective to notice a dead peer: only the watchdog can),
``fail`` raises after joining and ends through :func:`meshtron.distributed.fail`.
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

from meshtron import distributed
from meshtron.config import DistributedConfig


def main() -> None:
    address, rank, behaviour = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    cfg = DistributedConfig(coordinator_address=address, num_processes=2, process_id=rank, heartbeat_timeout=10)
    distributed.initialize(cfg, distributed.resolve_group(cfg))
    print("joined", flush=True)
    if behaviour == "fail":
        time.sleep(3)
        distributed.fail("ValueError: this process gave up", 3)
    time.sleep(300)


if __name__ == "__main__":
    main()
