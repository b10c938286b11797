"""The ddp supervisor: the process that called ``fit()``.

It hosts the TCPStore (127.0.0.1, a free port), spawns one worker per device, relays the
main worker's events to the sinks, and watches. A worker falls when it exits without saying
why (the process sentinel tells within one poll), when it reports a failure no vote can
absorb, or when its progress has stalled for ``hang_timeout`` while its peers wait (its
stacks are dumped, then it is killed). For a fallen worker the recovery policy
(:func:`phalanx.policy.recover`) decides:

- shrink / respawn: a new *generation* is announced in the store (``gen/<n>``: the members
  in rank order) and the survivors, whose collectives failed at once, form it under a fresh
  store prefix, agree on the highest committed step and go on. For respawn a replacement is
  started on the fallen worker's device; when it is ready, the next generation lets it in
  and the members move to it at a step boundary (the vote carries the request).
- abort, or a poison batch: workers are told to exit, stragglers are killed, and one
  :class:`~phalanx.errors.TrainingFailed` names the root cause.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import Dataset

from phalanx import report
from phalanx.events import (
    Beat,
    GenerationStarted,
    Notice,
    StepEnded,
    WorkerFailed,
    WorkerState,
    WorkersTick,
)
from phalanx.failures import WorkerFailure
from phalanx.interrupt import Interrupter
from phalanx.plan import Plan
from phalanx.policy import STEP_PHASES, failed_attempts, is_poison, recover
from phalanx.run import RunEnd, RunInputs, stopped
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.ddp import worker as worker_mod
from phalanx.strategies.ddp.protocol import (
    ABORT_KEY,
    CONTROL_KEY,
    GEN_LATEST,
    GEN_PREFIX,
    STOP_KEY,
    Aborted,
    Broke,
    Done,
    Failed,
    Joined,
    Progress,
    Ready,
    Relay,
)

POLL = 0.1
GRACE = 2.0  # seconds workers get to exit by themselves once the run is decided
BROKE_SETTLE = 0.2  # a Broke report waits this long for a peer's death to be seen first
STACK_WAIT = 0.5
STARTUP_TIMEOUT = 120.0  # spawning and importing torch is not a hang
PREFLIGHT_TIMEOUT = 30.0
IDLE_PHASES = ("start", "regroup", "joining")  # bounded by their own timeouts, not hangs
TICK = 0.5  # seconds between two WorkersTick events (the live worker panel)
PANEL_STATES = {"start": "starting", "preflight": "preflight", "regroup": "joining"}
ACTIONS = {"respawn": "respawned", "shrink": "shrunk", "abort": "aborted"}


@dataclass
class SlotState:
    """The process that holds one worker slot (device) now."""

    process: Any
    conn: Connection
    step: int = 0
    phase: str = "start"
    changed: float = field(default_factory=time.time)
    finished: bool = False  # sent Done or Aborted, or its end is already accounted for
    generation: int = -1  # the newest generation it has joined
    attempt: int = 0  # of its step, from its last heartbeat


@dataclass
class Outcome:
    failures: list[WorkerFailure] = field(default_factory=list)
    fatal: bool = False  # the run is aborted
    poison: bool = False
    done: Done | None = None
    aborted: set[int] = field(default_factory=set)


class Supervisor:
    def __init__(
        self,
        spec: TrainSpec,
        config: FitConfig,
        plan: Plan,
        data: tuple[Dataset[Any], Dataset[Any] | None, int],
        emit: Any,
        interrupter: Interrupter,
    ) -> None:
        self.spec, self.config, self.plan = spec, config, plan
        self.user = worker_mod.pack_user(spec)  # unpickled by each worker (see WorkerArgs)
        self.train, self.valid, self.valid_size = data
        self.emit, self.interrupter = emit, interrupter
        self.world = len(config.devices)
        self.ctx = mp.get_context("spawn")
        self.tmp = tempfile.mkdtemp(prefix="phalanx-")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.slots: dict[int, SlotState] = {}
        self.retired: list[Any] = []  # processes replaced by a respawn, joined at close
        self.outcome = Outcome()
        self.stop_sent = False
        self.generation = -1
        self.members: list[int] = []
        self.waiting: list[int] = []  # replacements ready to be let in
        self.recovering: list[WorkerFailure] = []  # failures waiting for a committed step
        self.broke: list[tuple[float, Broke]] = []  # received, not yet settled
        self.gen_members: dict[int, list[int]] = {}
        self.rebuilds: set[int] = set()  # generations that rebuild the same members' group
        cpu_workers = sum(1 for d in config.devices if d.startswith("cpu"))
        self.threads = max(1, (os.cpu_count() or 1) // max(1, cpu_workers))
        self.shown: dict[int, str] = {}  # the worker panel: each slot's last state shown
        self.ticked = 0.0

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.emit(
            Notice(
                f"starting {self.world} worker process(es) on {', '.join(self.config.devices)} "
                "(each imports torch first: a few seconds)"
            )
        )
        for slot in range(self.world):
            self._spawn(slot)
        self._announce(list(range(self.world)), "start")

    def _spawn(self, slot: int, replaces: WorkerFailure | None = None) -> None:
        """Start the worker of ``slot``; a replacement when it ``replaces`` a fallen one."""
        replacement = replaces is not None
        reader, writer = self.ctx.Pipe(duplex=False)
        args = worker_mod.WorkerArgs(
            slot=slot,
            store_port=self.store.port,
            user=self.user,
            config=self.config,
            plan=self.plan,
            train=self.train,
            valid=self.valid,
            valid_size=self.valid_size,
            conn=writer,
            parent_pid=os.getpid(),
            stack_file=self._stack_file(slot),
            weights_path=os.path.join(self.tmp, "final.pt"),
            threads=self.threads,
            replacement=replacement,
            faults_after=-1 if replaces is None or replaces.step is None else replaces.step,
        )
        name = f"phalanx-worker-{slot}" + ("-replacement" if replacement else "")
        if slot in self.slots:
            old = self.slots[slot]
            if not old.conn.closed:
                self._read(old.conn)  # its last words, then let the pipe go
                old.conn.close()
            self.retired.append(old.process)
        proc = self.ctx.Process(target=worker_mod.main, args=(args,), name=name, daemon=True)
        proc.start()
        writer.close()  # the worker holds the only write end: EOF means it is gone
        if slot in self.slots:
            self._show(slot, "replaced", f"by pid {proc.pid}")
        self.slots[slot] = SlotState(proc, reader, phase="joining" if replacement else "start")
        self._show(slot, "joining" if replacement else "starting")

    def _announce(
        self, members: list[int], cause: str, rebuild: bool = False, replacing: int | None = None
    ) -> None:
        """Generation n+1: written before the counter moves, so a reader sees it whole.
        ``replacing``: the slot whose replacement process was started (it joins later)."""
        self.generation += 1
        self.members = list(members)
        self.gen_members[self.generation] = self.members
        if rebuild:
            self.rebuilds.add(self.generation)
        now = time.time()
        for slot in self.members:  # a fresh hang window to form the new group in
            self.slots[slot].changed = now
        history = [(f, report.is_secondary(f)) for f in self.outcome.failures]
        # Held Broke reports (not decided yet) failed their attempts too.
        history += [
            (m.failure, report.is_secondary(m.failure)) for _, m in self.broke if not m.splittable
        ]
        failed = failed_attempts(history)
        doc = json.dumps(
            {
                "members": self.members,
                "cause": cause,
                "rebuild": rebuild,
                "replacing": replacing,
                "failed": {str(k): v for k, v in failed.items()},
            }
        )
        self.store.set(f"{GEN_PREFIX}{self.generation}", doc)
        self.store.add(GEN_LATEST, 1 if self.generation > 0 else 0)
        self.store.add(CONTROL_KEY, 1)
        devices = [self.config.devices[m] for m in self.members]
        self.emit(GenerationStarted(self.generation, self.members, devices, cause))
        if self.generation > 0:
            self.emit(Notice(f"generation {self.generation}: workers {self.members} ({cause})"))

    def watch(self) -> Outcome:
        """Until every worker has ended or the run is decided (then tear down)."""
        decided_at: float | None = None
        while True:
            self._drain()
            self._check_deaths()
            self._settle_broke()
            self._tick_panel()
            if decided_at is None:
                self._check_hang()
                self._forward_stop()
                self._admit()
            if self._decided() and decided_at is None:
                decided_at = time.time()
                self.store.set(ABORT_KEY, "run decided")
                self.store.add(CONTROL_KEY, 1)
            if all(not s.process.is_alive() for s in self.slots.values()):
                for state in self.slots.values():
                    if not state.conn.closed:
                        self._read(state.conn)
                self._settle_broke(everything=True)
                return self.outcome
            if decided_at is not None and time.time() - decided_at > GRACE:
                self.kill_all()

    def kill_all(self) -> None:
        for state in self.slots.values():
            if state.process.is_alive():
                state.finished = True  # killed by us: not a failure of its own
                state.process.kill()
        for state in self.slots.values():
            state.process.join(timeout=5)

    def close(self) -> None:
        self.kill_all()
        for state in self.slots.values():
            state.conn.close()
        for proc in self.retired:  # replaced by a respawn: its end was accounted for then
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- what workers say ----------------------------------------------------------------
    def _drain(self, timeout: float = POLL) -> None:
        """Handle what arrives within ``timeout`` (wakes on a message or a process exit)."""
        conns = [s.conn for s in self.slots.values() if not s.conn.closed]
        sentinels = [s.process.sentinel for s in self.slots.values()]
        ready = wait([*conns, *sentinels], timeout=timeout)
        for conn in conns:
            if conn in ready:
                self._read(conn)

    def _read(self, conn: Connection) -> None:
        try:
            while conn.poll():
                self._handle(conn.recv())
        except (EOFError, OSError):
            conn.close()

    def _handle(self, message: object) -> None:
        out = self.outcome
        if isinstance(message, Relay):
            if isinstance(message.event, StepEnded):
                self._recovered(message.event.time, message.event.global_step)
            self.emit(message.event)
        elif isinstance(message, Progress):
            state = self.slots[message.slot]
            state.step, state.phase, state.changed = message.step, message.phase, time.time()
            state.attempt = message.attempt
            self._show(message.slot, PANEL_STATES.get(message.phase, "training"))
        elif isinstance(message, Joined):
            state = self.slots[message.slot]
            state.generation, state.changed = message.generation, time.time()
            self._show(message.slot, "training")
        elif isinstance(message, Ready):
            self.waiting.append(message.slot)
        elif isinstance(message, Failed):
            if message.fatal:
                self.slots[message.failure.worker].finished = True
                self._fallen(message.failure)
            else:
                self._voted(message.failure)
        elif isinstance(message, Broke):
            self.broke.append((time.time(), message))
        elif isinstance(message, Aborted):
            # An older generation's held report is that step's earlier attempt: it counts
            # before the run is decided (a peer's Aborted can come before this one's Failed).
            self._settle_broke(before=self.slots[message.slot].generation)
            out.aborted.add(message.slot)
            out.poison = out.poison or message.poison
            self.slots[message.slot].finished = True
        elif isinstance(message, Done):
            self._settle_broke(before=self.slots[message.slot].generation)
            self.slots[message.slot].finished = True
            self._show(message.slot, "finished")
            if message.weights_path is not None:
                out.done = message
                self._dismiss_waiting()

    def _decided(self) -> bool:
        return self.outcome.fatal or bool(self.outcome.aborted)

    # -- what the supervisor sees for itself ----------------------------------------------
    def _check_deaths(self) -> None:
        """A worker that exited without having finished (sent Done, Aborted or a fatal
        Failed) has fallen, whatever its exit code: user code that calls ``sys.exit(0)``
        outside a step ends the process with code 0. Only two exits are expected of an
        unfinished worker: 0 or EXIT_TOLD once the run is decided (the abort key is set, or
        about to be), and EXIT_TOLD from one the current generation leaves out."""
        for slot, state in list(self.slots.items()):
            code = state.process.exitcode
            if code is None or state.finished:
                continue
            self._read(state.conn)  # its last words may still be in the pipe
            if state.finished:
                continue
            state.finished = True
            if not self._expected_exit(slot, code):
                self._fallen(self._death(slot, state, code))

    def _expected_exit(self, slot: int, code: int) -> bool:
        if code not in (0, worker_mod.EXIT_TOLD):
            return False
        return self._decided() or (code == worker_mod.EXIT_TOLD and slot not in self.members)

    def _death(self, slot: int, state: SlotState, code: int) -> WorkerFailure:
        sig = -code if code < 0 else None
        if sig is not None:
            message = f"worker process died from signal {signal.Signals(sig).name}"
            if sig == signal.SIGKILL:
                message += " (SIGKILL: possibly the kernel's out-of-memory killer; check dmesg)"
        else:
            message = f"worker process exited with code {code} without a report"
        epoch, samples = self._share(slot, state)
        return WorkerFailure(
            worker=slot,
            rank=self._rank(slot),
            device=self.config.devices[slot],
            kind="crash",
            message=message,
            phase=state.phase,
            step=state.step,
            epoch=epoch,
            pid=state.process.pid,
            exit_code=code if sig is None else None,
            signal=sig,
            sample_indices=samples,
            attempt=self._attempt(state),
        )

    def _attempt(self, state: SlotState) -> int | None:
        """The attempt of its step the worker was in (None outside a step's phases)."""
        return state.attempt if state.phase in STEP_PHASES else None

    def _share(self, slot: int, state: SlotState) -> tuple[int | None, list[int] | None]:
        """The epoch of the step the worker was in, and the samples it was computing there
        (None outside a step's phases): the plan knows them, the supervisor need not ask."""
        steps = self.plan.steps
        epoch = state.step // steps if steps else None
        members = self.gen_members.get(state.generation, [])
        if state.phase not in STEP_PHASES or slot not in members or epoch is None:
            return epoch, None
        share = self.plan.local_batch(epoch, state.step % steps, members.index(slot), len(members))
        return epoch, share

    def _check_hang(self) -> None:
        watched = {
            slot: self.slots[slot]
            for slot in self.members
            if not self.slots[slot].finished and self.slots[slot].phase not in IDLE_PHASES
        }
        starting = [s for s in self.slots.values() if s.phase == "start" and not s.finished]
        now = time.time()
        if any(now - s.changed > STARTUP_TIMEOUT for s in starting):
            watched.update({k: s for k, s in self.slots.items() if s in starting})
        elif not watched:
            return
        if any(now - s.changed < self._limit(s) for s in watched.values()):
            return
        # Everyone stalled: the hung ones are behind (the others wait in a collective).
        behind = min((s.step, _phase_rank(s.phase)) for s in watched.values())
        tied = {k: s for k, s in watched.items() if (s.step, _phase_rank(s.phase)) == behind}
        stacks = {k: self._dump_stacks(k, s) for k, s in tied.items()}
        hung = [k for k in tied if not _waits_in_collective(stacks[k])] or list(tied)
        for slot in hung:
            state = tied[slot]
            failure = self._hang(slot, state, now - state.changed, stacks[slot])
            state.finished = True
            state.process.kill()
            self._fallen(failure)

    def _limit(self, state: SlotState) -> float:
        """How long a worker may make no progress: ``hang_timeout``; at least
        PREFLIGHT_TIMEOUT for the preflight (first calls are slow: lazy initialisation)."""
        limit = self.config.hang_timeout.total_seconds()
        return max(limit, PREFLIGHT_TIMEOUT) if state.phase == "preflight" else limit

    def _hang(self, slot: int, state: SlotState, stalled: float, stacks: str) -> WorkerFailure:
        epoch, samples = self._share(slot, state)
        return WorkerFailure(
            worker=slot,
            rank=self._rank(slot),
            device=self.config.devices[slot],
            kind="hang",
            message=f"no progress for {stalled:.1f}s in phase {state.phase} of step "
            f"{state.step + 1} (hang_timeout {self.config.hang_timeout.total_seconds():g}s)",
            phase=state.phase,
            step=state.step,
            epoch=epoch,
            pid=state.process.pid,
            stacks=stacks,
            sample_indices=samples,
            attempt=self._attempt(state),
            last_progress=state.changed,
        )

    def _dump_stacks(self, slot: int, state: SlotState) -> str:
        """The Python stacks of every thread of the worker (faulthandler, on SIGUSR1). The
        file is emptied first: the worker holds it open in append mode, so this dump starts
        at its beginning and an earlier dump is never read as this one."""
        path = self._stack_file(slot)
        with open(path, "w"):
            pass
        try:
            os.kill(state.process.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return "(the process was gone before its stacks could be taken)"
        deadline = time.time() + STACK_WAIT
        text = ""
        while time.time() < deadline:
            time.sleep(0.05)
            with open(path) as fh:
                text = fh.read()
            if "File" in text:
                time.sleep(0.05)
                with open(path) as fh:
                    return fh.read()
        return text or "(no stacks: the worker did not answer SIGUSR1)"

    # -- decisions -------------------------------------------------------------------------
    def _fallen(self, failure: WorkerFailure) -> None:
        """A worker is out. Decide with the recovery policy, and act."""
        out = self.outcome
        slot = failure.worker
        generation = self.slots[slot].generation
        self._show(slot, "fallen", f"{failure.kind} in {failure.phase}")
        self._settle_broke(before=generation)
        if out.done is not None:  # the run has its result: nothing left to recover
            failure.action = "ignored"
            out.failures.append(failure)
            return
        if self._decided():
            failure.action = "aborted"
            out.failures.append(failure)
            return
        if slot in self.waiting:
            self.waiting.remove(slot)
        if is_poison(failure, report.is_secondary(failure)):
            self._poison(failure)
            return
        survivors = [m for m in self.members if m != slot and not self.slots[m].finished]
        action = recover(self.config.recovery, failure, out.failures, len(survivors))
        failure.action = ACTIONS[action]
        self._record(failure)
        if action == "abort":
            out.fatal = True
            return
        self.recovering.append(failure)
        if slot in self.members:  # the survivors first: a process start takes a while
            replacing = slot if action == "respawn" else None
            cause = f"worker {slot} {failure.kind}: {failure.action}"
            self._announce(survivors, cause, replacing=replacing)
        if action == "respawn":
            self._spawn(slot, replaces=failure)

    def _settle_broke(self, everything: bool = False, before: int | None = None) -> None:
        """Decide on :class:`Broke` reports once they are ``BROKE_SETTLE`` old: a peer that
        died in the same step (what broke the group) is seen first, so its generation, not
        a rebuild, carries the retry. ``before``: also settle at once every report from a
        generation older than that one (a failure of a later generation is decided next,
        and the older attempt's failure must count first)."""
        now = time.time()
        waiting, self.broke = self.broke, []
        for received, message in waiting:
            older = before is not None and message.generation < before
            if everything or older or now - received >= BROKE_SETTLE:
                self._broke(message)
            else:
                self.broke.append((received, message))

    def _broke(self, message: Broke) -> None:
        """A worker's own failure that no vote carried. The step is computed again by the
        next generation: a rebuild of the same members when nothing else has moved the run
        on since the worker's generation; a poison batch when the step had already failed
        in an earlier attempt (out-of-memory splits do not count)."""
        failure, generation, out = message.failure, message.generation, self.outcome
        if out.done is not None or self._decided():
            failure.action = "ignored" if out.done is not None else "aborted"
            self._record(failure)
            return
        if not message.splittable and is_poison(failure, report.is_secondary(failure)):
            self._poison(failure)
            return
        failure.action = "split" if message.splittable else "retried"
        self._record(failure)
        self.recovering.append(failure)
        if not self._group_left(generation):
            cause = f"worker {failure.worker} {failure.kind} in {failure.phase}: rebuilt"
            self._announce(self.members, cause, rebuild=True)

    def _group_left(self, generation: int) -> bool:
        """Whether a generation after ``generation`` already makes its members leave its
        group (one that drops a member, or a rebuild): then that one carries the retry.
        Generations that only add a replacement are joined at a step boundary, which a
        broken step never reaches (NCCL peers would stay blocked in it)."""
        for later in range(generation + 1, self.generation + 1):
            before, after = self.gen_members[later - 1], self.gen_members[later]
            if set(before) - set(after) or later in self.rebuilds:
                return True
        return False

    def _voted(self, failure: WorkerFailure) -> None:
        """A failure a vote carried: the loop chose its action (retried, split, aborted) with
        the step's attempts counted over the run (the generation told it how many failed
        before it formed), so the supervisor only records it."""
        generation = self.slots[failure.worker].generation
        self._settle_broke(before=generation)
        self._record(failure)
        if failure.action in ("retried", "split"):
            self.recovering.append(failure)

    def _poison(self, failure: WorkerFailure) -> None:
        """The same step failed in two attempts: a poison batch. The run stops; the report
        names the step's first failure as the root cause."""
        failure.action = "aborted"
        self._record(failure)
        self.outcome.poison = True
        self.outcome.aborted.add(failure.worker)

    def _record(self, failure: WorkerFailure) -> None:
        self.outcome.failures.append(failure)
        self.emit(WorkerFailed(failure, failure.action or ""))

    def _dismiss_waiting(self) -> None:
        """The run is over: workers that have not joined the last generation (replacements
        waiting to be let in, or let in while the others finished) are not needed."""
        for state in self.slots.values():
            if state.generation < self.generation and not state.finished:
                state.finished = True
                state.process.kill()
        self.waiting = []

    def _admit(self) -> None:
        """Let ready replacements in, once the current generation has formed (so no
        member is half-way into an older one)."""
        if not self.waiting or self.outcome.done is not None:
            return
        formed = all(self.slots[m].generation == self.generation for m in self.members)
        if formed:
            joining, self.waiting = self.waiting, []
            self._announce(self.members + joining, f"workers {joining} rejoin")

    def _recovered(self, when: float, committed: int) -> None:
        """Step ``committed - 1`` was committed at ``when``: the failures of that step or an
        earlier one are recovered (a step committed before a failure, whose event comes late,
        recovers nothing)."""
        waiting = []
        for failure in self.recovering:
            if failure.step is None or failure.step < committed:
                failure.recovery_seconds = max(0.0, when - failure.time)
            else:
                waiting.append(failure)
        self.recovering = waiting

    # -- the worker panel (events only: nothing here decides anything) -------------------
    def _show(self, slot: int, state: str, detail: str = "") -> None:
        """Tell the sinks that ``slot``'s worker is now in ``state`` (once per change)."""
        if self.shown.get(slot) == state:
            return
        if state not in ("fallen", "replaced", "finished") and self.slots[slot].finished:
            return  # a fallen worker's last words do not revive its row
        self.shown[slot] = state
        proc = self.slots[slot].process if slot in self.slots else None
        generation = self.slots[slot].generation if slot in self.slots else -1
        self.emit(
            WorkerState(
                slot,
                self.config.devices[slot],
                state,
                rank=self._rank(slot) if slot in self.members else None,
                generation=generation if generation >= 0 else None,
                pid=proc.pid if proc is not None else None,
                detail=detail,
            )
        )

    def _tick_panel(self) -> None:
        """Every live worker's heartbeat, every TICK seconds, for the live panel."""
        now = time.time()
        if now - self.ticked < TICK:
            return
        self.ticked = now
        beats = [
            Beat(
                slot,
                s.phase,
                s.step,
                s.changed,
                None if s.phase in IDLE_PHASES or slot not in self.members else self._limit(s),
            )
            for slot, s in self.slots.items()
            if not s.finished
        ]
        self.emit(WorkersTick(beats))

    def _rank(self, slot: int) -> int:
        return self.members.index(slot) if slot in self.members else slot

    def _forward_stop(self) -> None:
        if self.interrupter.should_stop() and not self.stop_sent:
            self.store.set(STOP_KEY, self.interrupter.reason or "stop requested")
            self.store.add(CONTROL_KEY, 1)
            self.stop_sent = True

    def _stack_file(self, slot: int) -> str:
        return os.path.join(self.tmp, f"stacks-{slot}.txt")

    # -- the result ------------------------------------------------------------------------
    def final_model(self, path: str) -> torch.nn.Module:
        model = self.spec.build_model()
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model


_PHASE_ORDER = (
    "start",
    "preflight",
    "regroup",
    "data",
    "forward",
    "backward",
    "metrics",
    "sync",
    "optimizer",
    "validation",
    "checkpoint",
)


def _waits_in_collective(stacks: str) -> bool:
    """Whether some thread's innermost Python frame is inside torch's distributed or
    autograd code: a rank blocked there is waiting for a peer, not hung itself."""
    lines = stacks.splitlines()
    innermost = [
        lines[i + 1]
        for i, line in enumerate(lines)
        if "most recent call first" in line and i + 1 < len(lines)
    ]
    markers = ("torch/distributed", "torch/autograd", "torch/nn/parallel")
    return any(m in frame for frame in innermost for m in markers)


def _phase_rank(phase: str) -> int:
    return _PHASE_ORDER.index(phase) if phase in _PHASE_ORDER else len(_PHASE_ORDER)


def run_ddp(run: RunInputs, emit: Any, interrupter: Interrupter) -> RunEnd:
    """Train on one worker process per device; raises TrainingFailed when the run stopped
    (the caller finishes it: :func:`phalanx.run.finish`)."""
    started = time.time()
    config = run.config
    data = (run.train, run.valid, run.valid_size)
    sup = Supervisor(run.spec, config, run.plan, data, emit, interrupter)
    try:
        sup.start()
        outcome = sup.watch()
        if outcome.fatal or outcome.aborted or outcome.done is None:
            failures = outcome.failures or [_lost(config)]
            raise stopped(failures, outcome.poison and not outcome.fatal, config)
        done = outcome.done
        assert done.weights_path is not None
        model = sup.final_model(done.weights_path)
    finally:
        sup.close()
    interrupted = done.interrupted
    if interrupted and interrupter.reason:  # the reason as the supervisor was told it
        interrupted = f"Training interrupted: {interrupter.reason}"
    return RunEnd(
        model=model,
        history=done.history,
        steps=done.steps,
        epochs=done.epochs,
        interrupted=interrupted,
        ledger=done.ledger,
        failures=outcome.failures,
        seconds=time.time() - started,
    )


def _lost(config: FitConfig) -> WorkerFailure:
    return WorkerFailure(
        worker=0,
        rank=0,
        device=config.devices[0],
        kind="crash",
        message="the run ended without a result from its main worker",
        phase="sync",
    )
