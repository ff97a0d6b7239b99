"""Multi-process start-up on JAX's distributed runtime, and what happens when a process dies.

Who this process is comes from, in order: the ``distributed`` config section; the
``MESHTRON_COORDINATOR_ADDRESS`` / ``MESHTRON_NUM_PROCESSES`` / ``MESHTRON_PROCESS_ID`` variables
(``meshtron launch`` sets them); JAX's own cluster detection when a SLURM or Open MPI job with more
than one task is visible. Otherwise the run is single-process and nothing here runs.

Why a watchdog: when a peer dies, JAX 0.10's survivors block inside the collective until the
coordination service's heartbeat timeout (100 s by default) and then abort in C++ with a stack
trace -- no Python exception, no message naming the dead process. Each process therefore runs a
daemon thread that writes a heartbeat into the coordination service's key-value store every
couple of seconds and reads everyone's; a peer silent for ``distributed.heartbeat_timeout``
seconds, or one that reported a failure, ends this process at once with a message naming it
(``os._exit``: the main thread is stuck in the collective, and JAX's exit-time shutdown barrier
would wait for the dead peer). JAX's own heartbeat timeout is set 10 s longer, as a backstop for
the case where the watchdog thread cannot run (the main thread holding the GIL inside a C++ call):
JAX then aborts the process itself, naming the task that stopped sending heartbeats.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from meshtron.config import DistributedConfig
from meshtron.errors import ConfigError

ENV_ADDRESS = "MESHTRON_COORDINATOR_ADDRESS"
ENV_PROCESSES = "MESHTRON_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHTRON_PROCESS_ID"
EXIT_PEER_LOST = 70  # EX_SOFTWARE: this process was fine, a peer was not
_KV_PREFIX = "meshtron/watchdog/"


@dataclass(frozen=True)
class ProcessGroup:
    """This process's place in a multi-process run (``auto``: JAX detects the cluster itself)."""

    num_processes: int
    process_id: int | None
    coordinator_address: str | None
    auto: bool = False


def _env_int(environ, name: str) -> int | None:
    value = environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected an integer") from None


def _cluster_size(environ) -> int | None:
    """Tasks in a SLURM or Open MPI job (JAX detects those itself); None outside one."""
    if "SLURM_JOB_ID" in environ:
        return _env_int(environ, "SLURM_NTASKS")
    if "OMPI_MCA_orte_hnp_uri" in environ:
        return _env_int(environ, "OMPI_COMM_WORLD_SIZE")
    return None


def resolve_group(cfg: DistributedConfig, environ=None) -> ProcessGroup | None:
    """The process group this run belongs to, or ``None`` for a single-process run."""
    environ = os.environ if environ is None else environ
    address = cfg.coordinator_address or environ.get(ENV_ADDRESS)
    processes = cfg.num_processes if cfg.num_processes is not None else _env_int(environ, ENV_PROCESSES)
    process_id = cfg.process_id if cfg.process_id is not None else _env_int(environ, ENV_PROCESS_ID)
    if address is None and processes is None and process_id is None:
        size = _cluster_size(environ)
        return ProcessGroup(size, None, None, auto=True) if size and size > 1 else None
    if processes == 1 and process_id in (None, 0):
        return None
    missing = [name for name, value in (("coordinator_address", address), ("num_processes", processes),
                                        ("process_id", process_id)) if value is None]
    if missing:
        raise ConfigError(
            f"distributed.{missing[0]}: a multi-process run needs coordinator_address, num_processes and process_id "
            f"(config or {ENV_ADDRESS} / {ENV_PROCESSES} / {ENV_PROCESS_ID}); use `meshtron launch` to start "
            "local processes"
        )
    if not 0 <= process_id < processes:
        raise ConfigError(f"distributed.process_id: {process_id} is not in 0..{processes - 1} "
                          f"(distributed.num_processes={processes})")
    return ProcessGroup(processes, process_id, address)


def initialize(cfg: DistributedConfig, group: ProcessGroup) -> None:
    """Join the run (``jax.distributed.initialize``; gloo collectives on CPU) and start the watchdog."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service would take SIGTERM (a C handler that only records it): the trainer
    # handles SIGTERM itself during a run and agrees on the stopping step with its peers; outside a
    # run SIGTERM keeps its default meaning.
    jax.config.update("jax_enable_preemption_service", False)
    timeouts = {
        "initialization_timeout": cfg.initialization_timeout,
        # JAX's own detector is the backstop: it aborts without naming the peer, so ours goes first.
        "heartbeat_timeout_seconds": cfg.heartbeat_timeout + 10,
        "shutdown_timeout_seconds": max(60, 2 * cfg.heartbeat_timeout),
    }
    try:
        if group.auto:
            jax.distributed.initialize(**timeouts)
        else:
            jax.distributed.initialize(group.coordinator_address, group.num_processes, group.process_id, **timeouts)
    except Exception as err:  # noqa: BLE001 -- JAX raises plain RuntimeError/ValueError/XlaRuntimeError here
        where = "cluster auto-detection" if group.auto else f"coordinator {group.coordinator_address}"
        raise ConfigError(
            f"distributed: could not join the run ({where}, {group.num_processes} processes) within "
            f"distributed.initialization_timeout={cfg.initialization_timeout}s: {str(err).splitlines()[0]}"
        ) from None
    Watchdog(timeout_s=cfg.heartbeat_timeout).start()


class Watchdog:
    """Ends this process with a clear message when a peer dies or fails (see the module docstring)."""

    _active: Watchdog | None = None

    def __init__(self, timeout_s: float, interval_s: float = 2.0):
        from jax._src import distributed as jax_distributed

        state = jax_distributed.global_state
        self.client, self.process_id, self.processes = state.client, state.process_id, state.num_processes
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self._stopping = threading.Event()
        self._last_round = time.monotonic()

    def start(self) -> None:
        if self.client is None or self.processes <= 1:
            return
        Watchdog._active = self
        atexit.register(self.stop)  # registered after JAX's own shutdown hook, so it runs before it
        threading.Thread(target=self._beat, name="meshtron-watchdog", daemon=True).start()
        threading.Thread(target=self._supervise, name="meshtron-watchdog-supervisor", daemon=True).start()

    def stop(self) -> None:
        """A clean finish: peers stop expecting heartbeats from this process."""
        if self._stopping.is_set():
            return
        try:
            self.client.key_value_set(f"{_KV_PREFIX}done/{self.process_id}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001,S110 -- the service may already be gone at exit
            pass
        self._stopping.set()

    def report_failure(self, message: str) -> None:
        """Tell peers this process failed (they exit within a heartbeat instead of a timeout)."""
        try:
            self.client.key_value_set(f"{_KV_PREFIX}failed/{self.process_id}", message[:2000], allow_overwrite=True)
        except Exception:  # noqa: BLE001,S110 -- best effort: the timeout still catches it
            pass
        if self.process_id == 0:  # the coordinator's exit tears the service down: let peers read the record first
            time.sleep(1.5 * self.interval_s)

    def _beat(self) -> None:
        beat, seen = 0, {}  # peer -> (its last heartbeat value, when it last changed)
        while not self._stopping.is_set():
            beat += 1
            try:
                self.client.key_value_set(f"{_KV_PREFIX}hb/{self.process_id}", str(beat), allow_overwrite=True)
                entries = self.client.key_value_dir_get(_KV_PREFIX)
            except Exception as err:  # noqa: BLE001 -- the coordinator (process 0) is gone
                if not self._stopping.is_set():
                    _die(self.process_id, f"lost the JAX coordination service (process 0 is gone?): "
                                          f"{str(err).splitlines()[0][:300]}")
                return
            now = self._last_round = time.monotonic()
            beats, done = {}, set()
            for key, value in entries:
                kind, _, who = key.removeprefix(_KV_PREFIX).partition("/")
                if kind == "failed" and who != str(self.process_id):
                    _die(self.process_id, f"process {who} failed: {value}")
                elif kind == "hb":
                    beats[int(who)] = value
                elif kind == "done":
                    done.add(int(who))
            for peer in range(self.processes):
                if peer == self.process_id or peer in done:
                    continue
                value = beats.get(peer)
                if peer not in seen or seen[peer][0] != value:
                    seen[peer] = (value, now)
                elif now - seen[peer][1] > self.timeout_s:
                    _die(self.process_id, f"process {peer} of {self.processes} sent no heartbeat for "
                                          f"{now - seen[peer][1]:.0f} s (distributed.heartbeat_timeout="
                                          f"{self.timeout_s:.0f}); it has probably died: see its log")
            self._stopping.wait(self.interval_s)

    def _supervise(self) -> None:
        """The heartbeat call itself may hang when the service is unreachable."""
        while not self._stopping.wait(self.interval_s):
            if time.monotonic() - self._last_round > self.timeout_s + 2 * self.interval_s:
                _die(self.process_id, "the heartbeat to the JAX coordination service is stuck")


def _die(process_id: int, message: str) -> None:
    try:
        main = sys._current_frames().get(threading.main_thread().ident)
        where = "".join(traceback.format_stack(main)[-2:]) if main is not None else ""
    except Exception:  # noqa: BLE001
        where = ""
    sys.stderr.write(f"\nmeshtron: error (process {process_id}): {message}; stopping this process "
                     f"(exit status {EXIT_PEER_LOST})\n" + (f"meshtron: it was at\n{where}" if where else ""))
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)


def explain(err: BaseException) -> str | None:
    """A one-line message for errors that mean a peer process is gone (gloo sees the closed
    connection inside the step before the watchdog sees missing heartbeats); None for others."""
    text = str(err)
    if "Connection closed by peer" in text or "Connection reset by peer" in text:
        import jax

        detail = text.splitlines()[0][:200]
        return (f"meshtron: error (process {jax.process_index()}): lost a peer process in a collective ({detail}); "
                "it has probably died: see its log")
    return None


def fail(message: str, status: int) -> None:
    """End a multi-process run's process after an error: peers are told (and exit at once), and the
    exit skips JAX's shutdown barrier, which would otherwise wait for peers stuck in a collective."""
    if Watchdog._active is not None:
        Watchdog._active.report_failure(message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def finish() -> None:
    """A clean end of a multi-process run: stop the watchdog, then leave the distributed runtime."""
    if Watchdog._active is None:
        return
    import jax

    Watchdog._active.stop()
    jax.distributed.shutdown()
