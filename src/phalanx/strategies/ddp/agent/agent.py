"""The mechanism of the ddp control plane on one machine: worker processes, their pipes,
the TCPStore and stack dumps. It knows nothing of policy: it starts, watches, kills and
writes what it is told to, and reports what it sees (a message, an exit). The coordinator
(:mod:`.coordinator`) decides; :mod:`.supervisor` connects the two.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from phalanx.interrupt import WARNING_SIGNAL
from phalanx.strategies.ddp.process import exited, pidfd_of
from phalanx.strategies.ddp.timing import DEFAULT, Timing
from phalanx.strategies.ddp.wire.control import Signer, new_run_id, run_token
from phalanx.strategies.ddp.wire.messages import Seen
from phalanx.strategies.ddp.wire.protocol import (
    ABORT_KEY,
    CONTROL_KEY,
    GEN_LATEST,
    GEN_PREFIX,
    STACK_SIGNAL,
    STOP_KEY,
    URGENT,
    Announcement,
    Heartbeat,
    Outbox,
    Progress,
    received,
)
from phalanx.torchprivate import LAZY_IMPORTED

# What multiprocessing says of a fork server's child when the fork server is gone.
FORK_SERVER_LOST = 255
# The signals of a crash in native code, on which a worker's faulthandler writes its stacks
CRASH_SIGNALS = frozenset(
    int(s) for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT)
)
MAX_STACKS = 20_000  # characters of a crash's stacks kept in its report (the end of them)
# How worker processes start: forked by multiprocessing's fork server, which imported torch
# and the worker's code once, so a worker (a replacement, every slot of a restart) starts in
# milliseconds instead of the seconds an import of torch takes; the fork server itself never
# touches a device (CUDA is initialised in each worker, after the fork).
START_METHOD = "forkserver"
# (LAZY_IMPORTED: a module a torch optimizer imports when it is first built, 1.1 s here)
PRELOAD = ["torch", LAZY_IMPORTED, "phalanx.strategies.ddp.worker.worker"]


@dataclass
class SlotState:
    """The process that holds one worker slot (device) now, and its pipe's read end."""

    process: Any
    conn: Connection
    exit_seen: bool = False
    heartbeat: Heartbeat | None = None  # shared with the process: its phase entries
    # The read end of its bell (see Outbox): what the agent sleeps on. None: on ``conn``.
    bell: Connection | None = None
    # The kernel's count of out-of-memory kills when it started (None: not readable here)
    oom_at_start: int | None = None
    # The process itself, through a pidfd (Linux): how the agent still sees it once the fork
    # server that started it is gone (multiprocessing then says every child of it exited
    # with code 255, though they run on).
    pidfd: int | None = None
    orphan: bool = False  # its fork server is gone: watched through the pidfd

    def sentinel(self) -> Any:
        return self.pidfd if self.orphan and self.pidfd is not None else self.process.sentinel

    def exitcode(self) -> int | None:
        """The process's exit code once it exited, else None. When the fork server is gone,
        the exit code is lost with it: 255 once the process itself has exited."""
        code = self.process.exitcode
        if code is None or code != FORK_SERVER_LOST or self.pidfd is None:
            return code
        if exited(self.pidfd):
            return code
        self.orphan = True  # (it runs on: watch the process itself)
        return None

    def alive(self) -> bool:
        return self.exitcode() is None

    def kill(self) -> None:
        """SIGKILL the process. Once its fork server is gone multiprocessing no longer
        signals it (it takes it for dead): the pidfd, or the pid, still reaches it."""
        if not self.orphan:
            self.process.kill()
            return
        with contextlib.suppress(ProcessLookupError, OSError):
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            elif self.process.pid is not None:
                os.kill(self.process.pid, signal.SIGKILL)

    def waker(self) -> Connection | None:
        """What wakes the agent when this process writes: its bell, else its pipe."""
        if self.bell is not None:
            return None if self.bell.closed else self.bell
        return None if self.conn.closed else self.conn

    def close(self) -> None:
        self.conn.close()
        if self.bell is not None:
            self.bell.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


@dataclass
class Agent:
    """Worker processes of one machine, and the store they read their orders from."""

    ctx: Any = field(default_factory=lambda: worker_context())
    tmp: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="phalanx-"))
    slots: dict[int, SlotState] = field(default_factory=dict)
    retired: list[Any] = field(default_factory=list)  # replaced processes, joined at close
    queue: list[Seen] = field(default_factory=list)  # seen, not handed out yet
    # This run's key (from PHALANX_TOKEN, or a random token, and a fresh run id): signs every
    # control value it writes; the workers get it in their spawn arguments, never through
    # the store.
    signer: Signer = field(default_factory=lambda: Signer.for_run(run_token(), new_run_id()))
    seq: int = 0  # of the last control value written (a reader refuses an older one)
    # Where the store listens: 127.0.0.1 on one machine; the head's address across machines.
    # None: a node's agent, whose workers use the head's store (``store_at``).
    bind: tuple[str, int] | None = ("127.0.0.1", 0)
    store_at: tuple[str, int] | None = None  # (host, port) of the store the workers use
    # Every key this run reads and writes is under it: empty in a store of the run's own;
    # ``phalanx/<run id>/`` in a launcher's store (torchrun's agent store), which outlives
    # the run and holds the launcher's own keys.
    prefix: str = ""
    # The head's agent writing to a store it does not host (``store_at``, torchrun's).
    client: bool = False
    # This machine's snapshot folder in shared memory (see phalanx.snapshot): made by the
    # first worker that needs it, removed with the agent. It outlives every worker.
    snapshots: str | None = None
    snapshot_error: str | None = None  # why that folder could not be made
    snapshot_owner: int | None = None  # the folder's owner lock, held while the agent lives
    # The run's durations (see Timing.of): its own waits, and its workers' (WorkerArgs).
    timing: Timing = DEFAULT

    def __post_init__(self) -> None:
        self.store: dist.Store | None = None
        if self.bind is not None:
            server = serve_store(*self.bind)
            self.store, self.store_at = server, (self.bind[0], server.port)
        elif self.client:
            assert self.store_at is not None
            host, port = self.store_at
            limit = self.timing.launcher_store
            self.store = dist.TCPStore(host, port, is_master=False, timeout=limit)
        if self.store is not None and self.prefix:
            self.store = dist.PrefixStore(self.prefix, self.store)
        if self.store is not None:
            self._bump()  # (a verified counter from the start: see Watcher._run)

    def snapshot_folder(self) -> str | None:
        """This machine's snapshot folder (made on first use; stale ones of agents that
        were killed are swept then); None when it cannot be made (``snapshot_error`` says
        why): the workers then take no snapshots."""
        if self.snapshots is None and self.snapshot_error is None:
            from phalanx.snapshot import folder_for

            try:
                self.snapshots, self.snapshot_owner = folder_for(new_run_id()[:12])
            except OSError as exc:
                self.snapshot_error = f"{type(exc).__name__}: {exc}"
        return self.snapshots

    # -- processes -------------------------------------------------------------------------
    def spawn(
        self, slot: int, name: str, target: Callable[[Any], None], make_args: Callable[..., Any]
    ) -> int | None:
        """Start ``target(make_args(outbox, stack_file, heartbeat))`` as the process of
        ``slot``; the one it replaces is read to the end and retired (killed if it still
        runs: a slot has one process). Returns the new pid."""
        reader, writer = self.ctx.Pipe(duplex=False)
        bell, ring = self.ctx.Pipe(duplex=False)
        if slot in self.slots:
            old = self.slots[slot]
            if old.alive():
                old.kill()
                old.process.join(timeout=self.timing.exit_wait.total_seconds())
            self._read(slot, old, stale=True)  # its last words, then let the pipe go
            old.close()
            self.retired.append(old.process)
        heartbeat = Heartbeat.create(self.ctx)
        outbox = Outbox(writer, ring, self.timing.ring_after)
        args = make_args(outbox, self.stack_file(slot), heartbeat)
        # Not daemonic: a daemonic process cannot start children (DataLoader workers when
        # num_workers > 0). close() kills every worker, and a worker whose parent is gone
        # exits by itself (its watch thread), so none outlives the run.
        proc = self.ctx.Process(target=target, args=(args,), name=name, daemon=False)
        proc.start()
        outbox.close()  # the worker holds the only write ends: EOF means it is gone
        self.slots[slot] = SlotState(
            proc,
            reader,
            heartbeat=heartbeat,
            bell=bell,
            oom_at_start=oom_kill_count(),
            pidfd=pidfd_of(proc.pid),
        )
        return proc.pid

    def poll(self, timeout: timedelta) -> list[Seen]:
        """What arrives within ``timeout``: wakes on a bell (see :class:`Outbox`) or a
        process exit, not on a heartbeat nor on every step's event, then reads every pipe;
        an exit is reported once, after everything its process wrote. Each slot's latest
        heartbeat, read after its pipe, comes first: a beat written before a message is
        never handled after it (one written after it is the newer state)."""
        wakers = [w for w in (s.waker() for s in self.slots.values()) if w is not None]
        sentinels = [s.sentinel() for s in self.slots.values() if not s.exit_seen]
        ready = wait([*wakers, *sentinels], timeout=timeout.total_seconds())
        urgent = {
            slot
            for slot, state in self.slots.items()
            if state.bell is not None and state.bell in ready and _hush(state.bell)
        }
        # The pipes that hold step events only are read first: such an event may precede,
        # unread, another worker's message that follows it (a failure in the next step).
        for slot, state in sorted(self.slots.items(), key=lambda item: item[0] in urgent):
            if not state.conn.closed:
                self._read(slot, state)
        for slot, state in list(self.slots.items()):
            code = state.exitcode()
            if code is not None and not state.exit_seen:
                state.exit_seen = True
                if not state.conn.closed:
                    self._read(slot, state)
                kills = _since(state.oom_at_start, oom_kill_count())
                pid = state.process.pid
                stacks = self.crash_stacks(slot, code)
                ended = Seen(slot, code=code, exited=True, oom_kills=kills, pid=pid, stacks=stacks)
                self.queue.append(ended)
        beats = [Seen(slot, beat, pid=self.slots[slot].process.pid) for slot, beat in self._beats()]
        seen, self.queue = [*beats, *self.queue], []
        return seen

    def _beats(self) -> list[tuple[int, Progress]]:
        now = time.time()
        beats = []
        for slot, state in self.slots.items():
            if state.heartbeat is not None:
                beat = state.heartbeat.read(slot, now)
                if beat is not None:
                    beats.append((slot, beat))
        return beats

    def _read(self, slot: int, state: SlotState, stale: bool = False) -> None:
        conn, pid = state.conn, state.process.pid
        try:
            while conn.poll():
                self.queue.append(Seen(slot, received(conn.recv()), stale=stale, pid=pid))
        except (EOFError, OSError):
            conn.close()

    def all_exited(self) -> bool:
        return all(not s.alive() for s in self.slots.values())

    def kill(self, slot: int) -> None:
        state = self.slots.get(slot)
        if state is not None and state.alive():
            state.kill()

    def kill_all(self) -> None:
        wait = self.timing.exit_wait.total_seconds()
        for slot in self.slots:
            self.kill(slot)
        for state in self.slots.values():
            if state.orphan and state.pidfd is not None:  # (not its fork server's to report)
                select.select([state.pidfd], [], [], wait)
            else:
                state.process.join(timeout=wait)

    def close(self) -> None:
        self.kill_all()
        for state in self.slots.values():
            state.close()
        for proc in self.retired:  # replaced by a respawn: its end was accounted for then
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=self.timing.exit_wait.total_seconds())
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.snapshots is not None:
            shutil.rmtree(self.snapshots, ignore_errors=True)
        if self.snapshot_owner is not None:
            os.close(self.snapshot_owner)
            self.snapshot_owner = None

    # -- stacks ----------------------------------------------------------------------------
    def stack_file(self, slot: int) -> str:
        return os.path.join(self.tmp, f"stacks-{slot}.txt")

    def crash_stacks(self, slot: int, code: int) -> str | None:
        """Where the worker of ``slot`` died of a crash in native code (exit ``code``: minus
        the signal), the stacks its faulthandler wrote then (see
        :func:`~phalanx.strategies.ddp.worker.worker.listen_for_stack_dumps`); else None."""
        if -code not in CRASH_SIGNALS:
            return None
        try:
            with open(self.stack_file(slot), errors="replace") as fh:
                text = fh.read()
        except OSError:
            return None
        start = text.rfind("Fatal Python error")
        return text[start:][-MAX_STACKS:] if start >= 0 else None

    def dump_stacks(self, slot: int) -> str:
        """The Python stacks of every thread of the worker (faulthandler, on STACK_SIGNAL). The
        file is emptied first: the worker holds it open in append mode, so this dump starts
        at its beginning and an earlier dump is never read as this one."""
        path = self.stack_file(slot)
        with open(path, "w"):
            pass
        try:
            os.kill(self.slots[slot].process.pid, STACK_SIGNAL)
        except ProcessLookupError:
            return "(the process was gone before its stacks could be taken)"
        deadline = time.monotonic() + self.timing.stack_wait.total_seconds()
        tick = self.timing.stack_poll.total_seconds()
        text = ""
        while time.monotonic() < deadline:
            time.sleep(tick)
            with open(path) as fh:
                text = fh.read()
            if "File" in text:
                time.sleep(tick)
                with open(path) as fh:
                    return fh.read()
        return text or "(no stacks: the worker did not answer the request for them)"

    # -- the store -------------------------------------------------------------------------
    def _signed(self, key: str, payload: str) -> None:
        assert self.store is not None, "only the head's agent writes control values"
        self.seq += 1
        self.store.set(key, self.signer.seal(key, payload, self.seq))

    def announce(self, doc: Announcement) -> None:
        """Written before the counters move, so a reader sees it whole."""
        self._signed(f"{GEN_PREFIX}{doc.number}", doc.to_json())
        assert self.store is not None
        self.store.set(GEN_LATEST, str(doc.number))  # (a hint: see control.latest_generation)
        self._bump()

    def set_stop(self, reason: str) -> None:
        self._signed(STOP_KEY, reason)
        self._bump()

    def set_abort(self, reason: str) -> None:
        self._signed(ABORT_KEY, reason)
        self._bump()

    def _bump(self) -> None:
        """Move ``control/version``: signed, its payload the number of this write (every
        watch thread reads it each tick). Written with ``set``, never the store's ``add``:
        the head never reads or parses a value a rogue may have left there."""
        self._signed(CONTROL_KEY, str(self.seq + 1))


def oom_kill_count(vmstat: str = "/proc/vmstat", cgroups: str = "/sys/fs/cgroup") -> int | None:
    """How many processes the kernel's out-of-memory killer has killed where this process
    (and the workers it starts) runs: in its memory cgroup when the kernel says
    (``oom_kill`` in cgroup v2's ``memory.events`` or v1's ``memory.oom_control``; a
    container's limit is one), else on the whole machine since boot (``oom_kill`` in
    /proc/vmstat, Linux 4.13 and later); None where neither can be read."""
    for path in _memory_cgroup_files(cgroups):
        count = _counter(path, "oom_kill")
        if count is not None:
            return count
    return _counter(vmstat, "oom_kill")


def _memory_cgroup_files(root: str) -> list[str]:
    """This process's memory cgroup's files that count OOM kills, its own folder first, then
    the hierarchy's root (inside a container, the container's own cgroup)."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if controllers == "":  # cgroup v2: one unified hierarchy
            found += [f"{root}{path.rstrip('/')}/memory.events", f"{root}/memory.events"]
        elif "memory" in controllers.split(","):
            base = f"{root}/memory"
            found += [f"{base}{path.rstrip('/')}/memory.oom_control", f"{base}/memory.oom_control"]
    return found


def _counter(path: str, key: str) -> int | None:
    try:
        with open(path) as fh:
            for line in fh:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def _since(before: int | None, now: int | None) -> int | None:
    return None if before is None or now is None else max(0, now - before)


def start_fork_server() -> None:
    """Start this process's fork server now, if it is not running, and wait until it has
    imported what workers need, so that no later start of a worker waits for it (a node's
    agent must keep talking to the head meanwhile). SIGTERM, SIGHUP and SIGUSR1 are blocked
    while it starts: the fork server then never acts on them (a batch system's SIGTERM or
    time-limit warning to the job's process group reaches it too, and the agent decides what
    the workers do; were the fork server killed, multiprocessing would take every worker it
    forked for dead)."""
    ctx = worker_context()
    if START_METHOD != "forkserver":
        return
    from multiprocessing import forkserver

    held = {signal.SIGTERM, signal.SIGHUP, WARNING_SIGNAL}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        with _quiet_torch_logs():
            forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    proc = ctx.Process(target=_started, name="phalanx-fork-server-check", daemon=False)
    proc.start()  # (answered once the fork server has imported torch and phalanx's worker)
    proc.join()


# torch's C++ log level in the workers (read once, when torch loads: in the fork server):
# their stores and groups fail on purpose when a peer or the head falls, and phalanx names
# that failure itself in one report; torch would log each failed call with its C++ stack.
# A TORCH_CPP_LOG_LEVEL the user set is kept.
WORKER_CPP_LOG_LEVEL = "FATAL"


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """The fork server (started inside) loads torch with :data:`WORKER_CPP_LOG_LEVEL`; this
    process's environment is given back as it was."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = WORKER_CPP_LOG_LEVEL
    try:
        yield
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def _started() -> None:
    """A process that does nothing: that it ran says the fork server is ready."""


def worker_context() -> Any:
    """The multiprocessing context workers start in (see :data:`START_METHOD`): the fork
    server is this process's (the standard library keeps one per process), started with
    the first worker and kept until the process exits."""
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _hush(bell: Connection) -> bool:
    """Read the rings a bell holds (one read: what is left rings again): whether one was
    for a message to act on (see Outbox). Closed at EOF, when its process has closed it
    (exited)."""
    try:
        rings = os.read(bell.fileno(), 4096)
    except OSError:
        rings = b""
    if not rings:
        bell.close()
        return True
    return URGENT in rings


def serve_store(host: str, port: int) -> dist.TCPStore:
    """A TCPStore server listening on ``host`` only. torch's own listens on every interface
    whatever host it is given, so the socket is bound here and handed to it (the store owns
    its descriptor from then on, and closes it)."""
    sock = socket.create_server((host, port))
    bound = sock.getsockname()[1]
    return dist.TCPStore(
        host, bound, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach()
    )
