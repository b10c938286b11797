"""A ddp worker process: one device, one slot, a rank in each generation it joins.

Order of work: ignore SIGINT and SIGTERM (the supervisor decides), register faulthandler on
SIGUSR1 (the supervisor asks for stacks of a hung worker), watch the parent and the control
keys, unpickle the user's parts, preflight (one isolated forward/backward: no collective can
hang on a shape bug), then for each generation: form its process group under the store
prefix ``g<n>/``, wrap the model in DDP, take the agreed state (generations after the
first), and train until the run ends or the group breaks. When a collective fails because
a peer fell, the worker waits for the next generation the supervisor announces and goes on
in it.

Exit codes: 0 done or stopped by the step policy (an :class:`Aborted` was sent), 1 failed
(a fatal :class:`Failed` was sent), 3 told to exit by the supervisor.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.utils.data import Dataset, default_collate

from phalanx.devices import torch_device
from phalanx.events import Event
from phalanx.failures import FailedHere, WorkerFailure, from_exception
from phalanx.faults import FaultInjector
from phalanx.loop import Regroup, StepAborted, TrainLoop
from phalanx.plan import Plan
from phalanx.replica import Identity, Replica
from phalanx.report import is_secondary
from phalanx.runner import build_loop, make_checkpointer, start_run
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.ddp.engine import DdpEngine, Member, hand_over
from phalanx.strategies.ddp.identity import announce
from phalanx.strategies.ddp.protocol import (
    ABORT_KEY,
    CONTROL_KEY,
    EXIT_TOLD,
    GEN_LATEST,
    GEN_PREFIX,
    STOP_KEY,
    Aborted,
    Announcement,
    Broke,
    Done,
    Failed,
    Generation,
    Joined,
    Progress,
    Ready,
    Relay,
)
from phalanx.trainable import Trainable

T = TypeVar("T")
WATCH_INTERVAL = 0.1
ANNOUNCE_WAIT = 10.0  # after a broken collective: how long to wait for the next generation
STARTUP_WAIT = 120.0  # for the first generation to be announced
REPLACEMENT_WAIT = 3600.0  # a replacement waits to be let in (or dismissed when the run ends)


class Superseded(Exception):
    """A newer generation was announced while this one was forming."""


def pack_user(spec: TrainSpec) -> bytes:
    """The user's parts of the run (model and optimizer factories, step function, metrics,
    scheduler) as bytes, for :class:`WorkerArgs`."""
    return pickle.dumps(spec)


@dataclass
class WorkerArgs:
    """What a worker is started with. The user's parts travel pickled (``user``, see
    :func:`pack_user`) and are unpickled by :meth:`Worker.run`, so a module of theirs that
    cannot be imported in the worker (a package its environment lacks) is that worker's
    preflight failure with its traceback, not a bare exit of spawn's bootstrap. The datasets
    travel as they are (tensors go through torch's shared memory)."""

    slot: int
    store_port: int
    user: bytes  # the TrainSpec, pickled: see spec
    config: FitConfig
    plan: Plan
    train: Dataset[Any]
    valid: Dataset[Any] | None
    valid_size: int
    conn: Any  # write end of this worker's pipe to the supervisor
    parent_pid: int
    stack_file: str
    weights_path: str
    threads: int
    replacement: bool = False  # started to replace a fallen worker: joins a later generation
    # A replacement fires only the faults meant for steps after the one its predecessor
    # fell at: those up to it were the predecessor's.
    faults_after: int = -1
    # (issue 9) The first generation this worker may take part in comes after this one: a
    # worker restarted from the checkpoint once every member fell ignores the generations
    # its fallen predecessors formed.
    after_generation: int = -1

    def __post_init__(self) -> None:
        self._spec: TrainSpec | None = None

    def unpack(self) -> None:
        """Unpickle the user's parts (imports their modules): in the worker, under a try."""
        self._spec = pickle.loads(self.user)

    @property
    def spec(self) -> TrainSpec:
        if self._spec is None:
            raise RuntimeError("WorkerArgs.unpack() was not called")
        return self._spec


class Worker:
    def __init__(self, args: WorkerArgs) -> None:
        self.a = args
        self.label = args.config.devices[args.slot]
        self.device = torch_device(self.label)
        self.stop_reason: str | None = None
        self.generation = -1
        self.latest = -1  # newest generation announced, as the watch thread last saw it
        self.members: list[int] = []  # of the generation this worker is in
        self.aborted_for = -1  # the generation for which this group was aborted (NCCL)
        self.rank = args.slot
        self.step = 0
        self.phase = "start"
        self.loop: TrainLoop | None = None  # kept across generations
        self.interrupted: str | None = None
        self.lock = threading.Lock()  # the checkpointer thread sends events too
        # (issue 9) This worker's failures that no vote carried (sent as Broke): evidence for
        # the loop's repeat rule in the next generation, whenever the supervisor reads them.
        self.unvoted: list[WorkerFailure] = []

    # -- messages ----------------------------------------------------------------------
    def send(self, message: object) -> None:
        """Written to the pipe before returning: survives this process's sudden death."""
        with self.lock:
            self.a.conn.send(message)

    def on_phase(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase
        attempt = self.loop.attempt if self.loop is not None else 0
        self.send(Progress(self.a.slot, step, phase, time.time(), attempt))

    def emit(self, event: Event) -> None:
        self.send(Relay(event))

    def failure(self, exc: BaseException, phase: str) -> WorkerFailure:
        return from_exception(
            exc,
            worker=self.a.slot,
            rank=self.rank,
            device=self.label,
            phase=phase,
            step=self.step,
            epoch=None,
            pid=os.getpid(),
        )

    # -- the watch thread: parent gone, abort, stop or a new generation ---------------------
    def watch(self, store: dist.TCPStore) -> None:
        """One store read a tick (the control counter); the keys only when it moved, or while
        a CUDA worker is behind the newest generation (its abort may have to wait for the
        group to exist)."""
        seen = 0
        while True:
            time.sleep(WATCH_INTERVAL)
            if os.getppid() != self.a.parent_pid:
                os._exit(1)  # the supervisor died: no orphans
            try:
                version = int(store.add(CONTROL_KEY, 0))
                pending = self.device.type == "cuda" and self.latest > self.generation
                if version == seen and not pending:  # (NCCL: try the abort again each tick)
                    continue
                seen = version
                present = [k for k in (ABORT_KEY, STOP_KEY) if store.check([k])]
                self.latest = int(store.add(GEN_LATEST, 0))
                if STOP_KEY in present and self.stop_reason is None:
                    self.stop_reason = store.get(STOP_KEY).decode()
                if self.device.type == "cuda" and self.latest > self.generation:
                    self.abort_if_peer_fell(store)
            except Exception:
                os._exit(1)  # the store (the supervisor) is unreachable
            if ABORT_KEY in present:
                os._exit(EXIT_TOLD)

    def abort_if_peer_fell(self, store: dist.TCPStore) -> None:
        """NCCL: a collective with a dead peer never returns (gloo errors at once, when the
        peer's socket closes). When the newest generation leaves out a member of this one,
        abort this group's communicators so the main thread gets an error and moves on;
        likewise when it rebuilds the group with the same members (a member broke it). A
        generation that only adds members is joined at a step boundary: no abort."""
        if self.aborted_for >= self.latest or not dist.is_initialized():
            return
        doc = Announcement.from_json(self.latest, store.get(f"{GEN_PREFIX}{self.latest}"))
        if doc.rebuild or set(self.members) - set(doc.members):
            self.aborted_for = self.latest
            with contextlib.suppress(Exception):  # the main thread may be leaving already
                distributed_c10d._abort_process_group()

    def regroup_requested(self) -> bool:
        return self.latest > self.generation

    def connect(self) -> dist.TCPStore:
        return dist.TCPStore(
            "127.0.0.1", self.a.store_port, is_master=False, timeout=timedelta(seconds=30)
        )

    def wait_generation(self, store: dist.TCPStore, after: int, timeout: float) -> Generation:
        """The newest generation after ``after`` that counts this worker in (or one that
        leaves it out: then it exits). Raises TimeoutError when none comes in time."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            latest = int(store.add(GEN_LATEST, 0))
            if latest > after:
                text = store.get(f"{GEN_PREFIX}{latest}")
                gen = Announcement.from_json(latest, text).generation()
                if self.a.slot in gen.members or not self.a.replacement:
                    return gen
                after = latest  # a replacement waits for the generation that lets it in
            time.sleep(0.02)
        raise TimeoutError(f"no new generation after {after} within {timeout:.0f}s")

    # -- the run -------------------------------------------------------------------------
    def build_member(self) -> Member:
        cfg = self.a.config
        trainable = Trainable(self.a.spec, self.device, cfg.seed)
        later = [f for f in cfg.faults if f.step > self.a.faults_after]
        faults = FaultInjector(later, self.a.slot)
        identity = Identity(worker=self.a.slot, rank=self.a.slot, device=self.label)
        replica = Replica(
            trainable.module,
            self.device,
            identity,
            self.a.spec.summed_metrics(),
            faults,
            on_phase=self.on_phase,
        )
        return Member(self.a.slot, trainable, replica, faults, self.device)

    def before_training(self, build: Callable[[], T]) -> T:
        """``build()``; an exception there (the model factory raised, the model does not
        fit on the device) is this worker's failure, with its traceback. At the start of the
        run it is in phase ``preflight``: nothing has trained yet and any worker would fail
        the same way, so the run stops. A replacement's is in phase ``joining``: the device
        that just lost a worker may still be in a bad state, and the recovery policy decides
        (another replacement, or going on without it)."""
        try:
            return build()
        except FailedHere:
            raise
        except Exception as exc:
            phase = "joining" if self.a.replacement else "preflight"
            raise FailedHere(self.failure(exc, phase)) from None

    def preflight(self) -> None:
        """One forward and backward on this worker's first slice, alone, gradients dropped."""
        self.on_phase(0, "preflight")
        self.before_training(self._preflight)

    def _preflight(self) -> None:
        cfg, plan, slot = self.a.config, self.a.plan, self.a.slot
        trainable = Trainable(self.a.spec, self.device, cfg.seed)
        # Only preflight faults fire here: the others belong to the real steps.
        faults = FaultInjector([f for f in cfg.faults if f.phase == "preflight"], slot)
        replica = Replica(
            trainable.module,
            self.device,
            Identity(slot, slot, self.label),
            self.a.spec.summed_metrics(),
            faults,
        )
        first = plan.local_batch(0, 0, slot, len(cfg.devices))
        faults.check(0, "preflight")
        result = replica.run(
            lambda: (cfg.collate_fn or default_collate)([self.a.train[i] for i in first]),
            first,
            len(plan.global_batch(0, 0)),
            0,
            0,
            trainable.micro_batches,
        )
        if result.failure is not None:
            result.failure.phase = "preflight"
            raise FailedHere(result.failure)

    def run(self) -> int:
        a, cfg = self.a, self.a.config
        store = self.connect()
        # Its own client: a TCPStore client must not be shared between threads.
        threading.Thread(target=self.watch, args=(self.connect(),), daemon=True).start()
        if self.device.type == "cpu":
            torch.set_num_threads(a.threads)
        else:
            torch.cuda.set_device(self.device)
        # Until it joins a generation (preflight): its slot and the full world.
        announce(a.slot, len(cfg.devices), self.label, a.slot, -1, a.store_port)
        try:
            self.before_training(a.unpack)
            if cfg.preflight and not a.replacement:
                self.preflight()
            member = self.before_training(self.build_member)
            # (issue 9) Every worker says when it is ready (preflight passed, model built):
            # the supervisor announces the first generation once all are.
            self.send(Ready(a.slot))
            # A replacement waits until it is let in or dismissed (the supervisor decides).
            first_wait = REPLACEMENT_WAIT if a.replacement else STARTUP_WAIT
            gen = self.wait_generation(store, a.after_generation, first_wait)
        except FailedHere as exc:
            self.send(Failed(exc.failure, fatal=True))
            return 1
        except TimeoutError as exc:
            self.send(Failed(self.failure(exc, self.phase), fatal=True))
            return 1
        return self.generations(store, member, gen)

    def generations(self, store: dist.TCPStore, member: Member, gen: Generation) -> int:
        """Train in one generation after another until the run ends for this worker."""
        while True:
            if self.a.slot not in gen.members:
                return EXIT_TOLD
            wait, broken = ANNOUNCE_WAIT, None
            try:
                self.train_in(store, member, gen)
                return self.finish()
            except (Regroup, Superseded):
                wait = _forming_timeout(self.a.config).total_seconds()
            except StepAborted as exc:
                self.send(Aborted(self.a.slot, exc.step, exc.poison))
                return 0
            except FailedHere as exc:
                self.send(Failed(exc.failure, fatal=True))
                return 1
            except Exception as exc:  # the group broke: a peer fell, or this worker did
                # A record, not the exception: its traceback would keep the old group alive.
                broken = self.failure(exc, self.phase)
                self.report_unvoted(member)
            finally:
                self.leave_group(member)
            try:
                gen = self.wait_generation(store, gen.number, wait)
            except TimeoutError as exc:  # nobody else fell: the failure is this worker's
                self.send(Failed(broken or self.failure(exc, self.phase), fatal=True))
                return 1

    def report_unvoted(self, member: Member) -> None:
        """This worker's own failure in a step whose collectives broke before the vote could
        carry it: a peer fell in the same step, or this failure broke the group itself (in
        the middle of backward). The supervisor decides (see :class:`Broke`). Not when the
        failure is that broken collective (a backward that met a fallen peer's closed
        socket): that is the peer's failure."""
        lost, member.replica.unvoted = member.replica.unvoted, None
        if lost is not None and self.loop is not None:
            lost.attempt = self.loop.attempt
        if lost is not None and not is_secondary(lost):
            self.send(Broke(lost, self.generation, member.replica.unvoted_splittable))
            if not member.replica.unvoted_splittable:
                self.unvoted.append(lost)

    def leave_group(self, member: Member) -> None:
        """Drop every reference to this generation's DDP module and process group, then
        destroy the group, so its sockets close and peers still blocked on them error out."""
        if self.loop is not None and isinstance(self.loop.engine, DdpEngine):
            self.loop.engine.ddp = None
        member.replica.forward = member.trainable.module
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a broken group may refuse a clean shutdown
                dist.destroy_process_group()
        # torch names the default group by a counter that destroy_process_group resets only
        # when it completes; after a failed shutdown the next group would get another name
        # than its peers' and its rendezvous would wait for keys nobody writes.
        distributed_c10d._world.group_count = 0
        gc.collect()  # drops the old DDP reducer and its autograd hooks

    def arrive(self, store: dist.TCPStore, gen: Generation, rank: int) -> None:
        """Wait until every member of ``gen`` has arrived, before any of them starts torch's
        rendezvous (which cannot be interrupted). If a newer generation is announced
        meanwhile (a member fell before arriving), this one is dropped: Superseded."""
        keys = [f"arrived/g{gen.number}/{r}" for r in range(len(gen.members))]
        store.set(keys[rank], "1")
        deadline = time.time() + _forming_timeout(self.a.config).total_seconds()
        while not store.check(keys):
            if self.latest > gen.number and not store.check(keys):
                # (checked again: a peer that saw every key is already in the rendezvous)
                raise Superseded(gen.number)
            if time.time() > deadline:
                raise TimeoutError(f"generation {gen.number} did not form in time")
            time.sleep(0.02)

    def train_in(self, store: dist.TCPStore, member: Member, gen: Generation) -> None:
        """Form ``gen``'s group, take the agreed state, train until the run ends."""
        a, cfg = self.a, self.a.config
        self.generation, self.members = gen.number, list(gen.members)
        rank, world = gen.rank_of(a.slot), len(gen.members)
        self.rank = rank
        announce(rank, world, self.label, a.slot, gen.number, a.store_port)  # env, ps title
        self.on_phase(self.step, "regroup")
        member.trainable.discard()  # gradients of a step the old group never committed
        self.arrive(store, gen, rank)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        rendezvous = dist.TCPStore(
            "127.0.0.1", a.store_port, is_master=False, timeout=_forming_timeout(cfg)
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"g{gen.number}/", rendezvous),
            rank=rank,
            world_size=world,
            timeout=cfg.hang_timeout * 2 + timedelta(seconds=30),
        )
        data = (a.train, a.valid, a.valid_size)
        engine = DdpEngine(
            member,
            cfg,
            a.plan,
            data,
            rank,
            world,
            self.on_phase,
            self.regroup_requested,
            init_sync=gen.number == 0,
        )
        first = self.loop is None
        if self.loop is None:
            self.loop = build_loop(
                engine,
                a.spec,
                cfg,
                a.plan,
                self.emit,
                lambda: self.stop_reason,
                a.valid_size if a.valid is not None else None,
                None,
                on_failure=lambda f: self.send(Failed(f, fatal=False)),
            )
        loop = self.loop
        loop.engine = engine
        loop.failed_before = dict(gen.failed)
        loop.known_failures = [*gen.known, *self.unvoted]
        if first and not a.replacement:
            start_run(loop, a.plan, cfg, loop.emit, a.plan.samples, a.valid_size)
        if gen.number > 0:
            hand_over(loop, rank, self.device, _forming_timeout(cfg))
        if engine.is_main and loop.checkpointer is None and cfg.run_dir:
            loop.checkpointer = make_checkpointer(cfg, self.emit)
        self.send(Joined(a.slot, gen.number, loop.state.global_step))
        self.interrupted = loop.run().interrupted

    def finish(self) -> int:
        loop = self.loop
        assert loop is not None
        loop.close_checkpointer()
        done = Done(self.a.slot)
        if loop.engine.is_main:
            torch.save(loop.engine.state_dict()["model"], self.a.weights_path)
            st = loop.state
            done = Done(
                self.a.slot,
                self.a.weights_path,
                st.history,
                st.global_step,
                st.epoch,
                self.interrupted,
                st.ledger,
            )
        self.send(done)
        return 0


def _forming_timeout(config: FitConfig) -> timedelta:
    return max(timedelta(seconds=10), config.hang_timeout)


def listen_for_stack_dumps(path: str) -> None:
    """On SIGUSR1, write every thread's Python stack to ``path``. Opened in append mode: the
    supervisor empties the file before it asks, and each dump then starts at its beginning
    (with "w", the next dump would land at the old offset, after a run of NUL bytes)."""
    stacks = open(path, "a")  # noqa: SIM115 - kept open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)


def main(args: WorkerArgs) -> None:
    """Entry point of a spawned worker. Ctrl-C and a SIGTERM sent to the whole process group
    (Slurm, ``kill -TERM -<pgid>``) are the supervisor's to act on: it relays the stop
    through the store, so the workers finish the step and checkpoint. (They cannot be
    orphaned: the watch thread exits a worker whose parent is gone.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    listen_for_stack_dumps(args.stack_file)
    code = Worker(args).run()
    args.conn.close()
    sys.stdout.flush()
    os._exit(code)
