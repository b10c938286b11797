"""A ddp worker process: one device, one slot, a rank in each generation it joins.

Order of work: ignore SIGINT, SIGTERM and SIGUSR1 (the supervisor decides), register
faulthandler on ``STACK_SIGNAL`` (the supervisor asks for stacks of a hung worker), watch
the parent and the control keys (:class:`Watcher`), unpickle the user's parts, build the
replica (the model factory runs once in this process), preflight it (one isolated
forward/backward: no collective can hang on a shape bug), then for each generation: form its
own process group under the store prefix ``g<n>/``, wrap the model in DDP over it, take the
agreed state (generations after the first), and train until the generation ends. How it
ended is an :class:`Exit`, and the worker acts on that: finish, report, or wait for the next
generation and go on in it.

Exit codes: 0 done or stopped by the step policy (an :class:`Aborted` was sent), 1 failed
(a fatal :class:`Failed` was sent), 3 told to exit by the supervisor.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import gc
import hashlib
import hmac
import json
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from phalanx.checkpoint import Checkpoints
from phalanx.checkpoint.checkpointer import ShardedCheckpointer
from phalanx.devices import torch_device
from phalanx.events import Event, Notice
from phalanx.failures import FailedHere, WorkerFailure, from_exception
from phalanx.interrupt import WARNING_SIGNAL
from phalanx.loop import Regroup, StepAborted, TrainLoop
from phalanx.plan import Plan
from phalanx.report import is_secondary
from phalanx.runner import build_loop, checkpoint_dir, make_checkpointer, start_run
from phalanx.snapshot import SnapshotStore, Snapshotter, Taken, stable_tensors
from phalanx.snapshot.copies import (
    Copied,
    CopyListener,
    CopySender,
    Endpoint,
    buddies,
)
from phalanx.snapshot.shards import tag as shard_tag
from phalanx.snapshot.store import Header
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.ddp.process import Lifeline
from phalanx.strategies.ddp.timing import DEFAULT, Timing
from phalanx.strategies.ddp.wire.control import SignedStore, Signer, latest_generation
from phalanx.strategies.ddp.wire.link import address_towards
from phalanx.strategies.ddp.wire.protocol import (
    ABORT_KEY,
    ARRIVED_PREFIX,
    CONTROL_KEY,
    EXIT_HEAD_LOST,
    EXIT_TOLD,
    GEN_PREFIX,
    ORDER_SAVE,
    STACK_SIGNAL,
    STOP_KEY,
    Aborted,
    Announcement,
    Broke,
    Done,
    Failed,
    Generation,
    Heartbeat,
    Joined,
    Progress,
    Ready,
    Rejected,
    Relay,
    Snapshotted,
)
from phalanx.strategies.ddp.worker.emergency import await_verdict, keep_committed
from phalanx.strategies.ddp.worker.engine import DdpEngine, EngineHooks, Member
from phalanx.strategies.ddp.worker.fsdp_engine import FsdpEngine, ShardedTrainable, one_position
from phalanx.strategies.ddp.worker.fsdp_group import FsdpGroup
from phalanx.strategies.ddp.worker.fsdp_handover import NoShardSet, restore_from_set, slot_folder
from phalanx.strategies.ddp.worker.group import GenerationGroup, GroupBroken
from phalanx.strategies.ddp.worker.handover import LocalState, hand_over
from phalanx.strategies.ddp.worker.identity import announce
from phalanx.strategies.ddp.worker.preflight import preflight

T = TypeVar("T")


class Exit(Enum):
    """How a worker left a generation."""

    FINISHED = "finished"  # the run ended: trained through, stopped early or interrupted
    REGROUP = "regroup"  # after a committed step, for a newer generation that waits
    SUPERSEDED = "superseded"  # a newer generation was announced while this one formed
    ABORTED = "aborted"  # the step policy stopped the run (a poison batch, a broken step)
    FAILED = "failed"  # this worker failed where no vote can carry it: it is out
    BROKEN = "broken"  # a collective failed: a peer fell, or this worker broke the group


@dataclass(frozen=True)
class Left:
    """A generation's end for this worker: how, and what the worker knows about why."""

    exit: Exit
    failure: WorkerFailure | None = None  # FAILED: this worker's; BROKEN: the error it saw
    step: int = 0  # ABORTED: the step the policy stopped at
    poison: bool = False  # ABORTED: a poison batch


class Superseded(Exception):
    """A newer generation was announced while this one was forming."""


class HeadGone(Exception):
    """Across machines: this node's agent said the head is lost (no generation can come)."""


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
    token: bytes  # the run's: control values in the store are signed with it (see control)
    user: bytes  # the TrainSpec, pickled: see spec
    config: FitConfig
    plan: Plan
    train: Dataset[Any]
    valid: Dataset[Any] | None
    valid_size: int
    conn: Any  # its Outbox: the pipe to the supervisor, and the bell that wakes it
    parent_pid: int
    stack_file: str
    weights_path: str
    threads: int
    timing: Timing  # the run's (Timing.of its configuration, on the machine that spawned it)
    replacement: bool = False  # started to replace a fallen worker: joins a later generation
    # A replacement fires only the faults meant for steps after the one its predecessor
    # fell at: those up to it were the predecessor's.
    faults_after: int = -1
    # The first generation this worker may take part in comes after this one: a worker
    # restarted once every member fell ignores the generations its fallen predecessors
    # formed.
    after_generation: int = -1
    # Restarted once every member fell: it restores the newest state it finds, its machine's
    # snapshot or the newest checkpoint in run_dir (see runner.restore_newest).
    restart: bool = False
    # This machine's snapshot folder in shared memory (the agent's), or None: no snapshots.
    snapshot_dir: str | None = None
    # The agent's environment when it started this worker: a worker forked by the fork
    # server (started once, earlier) takes it, as a spawned process would have.
    environ: dict[str, str] | None = None
    # The heartbeat in memory shared with the supervisor (None: beats go through the pipe)
    heartbeat: Heartbeat | None = None
    # The host of the store: the head's address across machines
    store_host: str = "127.0.0.1"
    store_prefix: str = ""  # of every key the run uses (in a launcher's store, see Agent)
    # The slots this machine runs (its node's; every slot when empty): LOCAL_RANK counts them
    local_slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self._spec: TrainSpec | None = None

    def unpack(self) -> None:
        """Unpickle the user's parts (imports their modules): in the worker, under a try."""
        self._spec = pickle.loads(self.user)

    @property
    def sharded(self) -> bool:
        """fsdp: each member holds a shard of the state (its engine, group, snapshots and
        checkpoints are fsdp's)."""
        return self.config.strategy == "fsdp"

    @property
    def spans_nodes(self) -> bool:
        """Whether the run has slots on other machines than this one."""
        return len(self.here) < len(self.config.devices)

    @property
    def here(self) -> tuple[int, ...]:
        """The slots on this machine."""
        return self.local_slots or tuple(range(len(self.config.devices)))

    @property
    def spec(self) -> TrainSpec:
        if self._spec is None:
            raise RuntimeError("WorkerArgs.unpack() was not called")
        return self._spec

    def connect(self, timeout: timedelta | None = None) -> dist.Store:
        """A new client of the run's store (one per thread: clients are not shared); each
        request bounded by ``timeout`` (None: the timing's ``store``)."""
        timeout = self.timing.store if timeout is None else timeout
        store = dist.TCPStore(self.store_host, self.store_port, is_master=False, timeout=timeout)
        return dist.PrefixStore(self.store_prefix, store) if self.store_prefix else store

    def reconnect(self, timeout: timedelta | None = None) -> dist.Store:
        """:meth:`connect` again after a client failed (the head may be gone): first a plain
        TCP connection to the store's port, which fails at once where nobody listens (a lost
        head's port), instead of torch's client, which retries until its timeout and logs
        each attempt."""
        timeout = self.timing.store if timeout is None else timeout
        with socket.create_connection((self.store_host, self.store_port), timeout.total_seconds()):
            pass
        return self.connect(timeout)

    def signed(self, store: dist.Store, send: Callable[[object], None]) -> SignedStore:
        """``store``'s control keys, read only when signed with this run's token; a rejected
        value is told to the supervisor once (``send`` a :class:`Rejected`)."""

        def report(key: str, reason: str, digest: str) -> None:
            send(Rejected(self.slot, key, reason, digest))

        return SignedStore(store, Signer(self.token), report)


COPY_KEY = b"px-copies/1"  # the copies' key: HMAC(the run's key, this)


class Watcher:
    """The watch thread: exits the process when the parent is gone, the store unreachable
    or the run aborted; keeps the stop reason and the newest generation announced; aborts the
    group of a generation that a newer one leaves a member out of."""

    def __init__(
        self, args: WorkerArgs, device: torch.device, send: Callable[[object], None]
    ) -> None:
        self.a, self.device, self.send = args, device, send
        self.stop_reason: str | None = None
        self.latest = -1  # the newest generation announced
        self.generation = -1  # the one this worker is in
        self.members: list[int] = []  # of that generation
        self.group: GenerationGroup | None = None  # its group, while this worker is in it
        self.aborted_for = -1  # the generation for which this group was aborted
        self.head_lost = False  # across machines: this node's agent said the head is lost
        self.agent = Lifeline(args.parent_pid)  # the process that started this one

    def start(self) -> None:
        store = self.a.signed(self.a.connect(), self.send)
        threading.Thread(target=self._run, args=(store,), daemon=True).start()
        if self.a.spans_nodes and self.a.heartbeat is not None:
            threading.Thread(target=self._wait_for_order, daemon=True).start()

    def _wait_for_order(self) -> None:
        """Across machines: until the node's agent orders a save (the head is lost, see
        :mod:`.emergency`); then abort the group, so a collective blocked on the head's
        workers ends now, and the main thread saves."""
        beat = self.a.heartbeat
        assert beat is not None
        while beat.told() != ORDER_SAVE:
            time.sleep(self.a.timing.watch_tick.total_seconds())
        self.head_lost = True
        group = self.group
        if group is not None:
            group.abort()

    def _run(self, store: SignedStore) -> None:
        """One store read a tick (the control counter, signed); the keys only when it moved,
        or while a CUDA worker is behind the newest generation (its abort may have to wait
        for the group to exist). A counter that does not verify (a rogue's: reported once)
        is no proof that nothing moved: the keys are read each tick while it is there."""
        seen: str | None = None
        tick = self.a.timing.watch_tick.total_seconds()
        while True:
            time.sleep(tick)
            if not self.agent.alive():
                os._exit(1)  # the supervisor died: no orphans
            try:
                version = store.get(CONTROL_KEY)
                pending = self.latest > self.generation
                if version is not None and version == seen and not pending:
                    continue  # (a pending generation: try the abort again each tick)
                seen = version
                abort = self._read(store)
            except Exception:
                if not self.a.spans_nodes:
                    os._exit(1)  # the store (the supervisor) is unreachable
                # Across machines the node's agent decides (the head may be lost): try a new
                # client now and then (a failed one stays broken).
                store = self._reconnect(store)
                continue
            if abort:
                os._exit(EXIT_TOLD)

    def _reconnect(self, store: SignedStore) -> SignedStore:
        time.sleep(self.a.timing.reconnect_every.total_seconds())
        try:
            return self.a.signed(self.a.reconnect(), self.send)
        except Exception:
            return store

    def _read(self, store: SignedStore) -> bool:
        """The control keys (signed ones only); whether the run was aborted."""
        aborted = store.get(ABORT_KEY) is not None
        stop = store.get(STOP_KEY)
        self.latest = latest_generation(store, self.latest)
        if stop is not None and self.stop_reason is None:
            self.stop_reason = stop
        if self.latest > self.generation:
            self._abort_if_peer_fell(store)
        return aborted

    def _abort_if_peer_fell(self, store: SignedStore) -> None:
        """A collective with a peer that is gone but whose sockets stay open (a frozen or
        cut-off node; any dead peer under NCCL) does not return before the group's timeout.
        When the newest generation leaves out a member of this one, abort this group so the
        main thread gets an error and moves on; likewise when it rebuilds the group with the
        same members (a member broke it). A generation that only adds members is joined at a
        step boundary: no abort."""
        # The group first, then the generation it is of: the main thread sets the generation
        # (and members) before it forms that generation's group, so a group read here that
        # is already the newest generation's is never aborted for that generation's rebuild.
        group, members = self.group, list(self.members)
        if self.aborted_for >= self.latest or group is None or self.generation >= self.latest:
            return
        doc = announcement(store, self.latest)
        if doc is None:
            return
        dropped = set(members) - set(doc.members)
        if doc.rebuild or dropped:
            self.aborted_for = self.latest
            group.abort(lost=dropped)

    def regroup_requested(self) -> bool:
        return self.latest > self.generation


class Worker:
    def __init__(self, args: WorkerArgs) -> None:
        self.a = args
        self.label = args.config.devices[args.slot]
        self.device = torch_device(self.label)
        self.watcher = Watcher(args, self.device, self.send)
        self.rank = args.slot
        self.step = 0
        self.phase = "start"
        self.loop: TrainLoop | None = None  # kept across generations
        self.interrupted: str | None = None
        self.lock = threading.Lock()  # the checkpointer thread sends events too
        # This worker's failures that no vote carried (sent as Broke): evidence for the
        # loop's repeat rule in the next generation, whenever the supervisor reads them.
        self.unvoted: list[WorkerFailure] = []
        self.abandoned: list[GenerationGroup] = []  # groups left with work still in flight
        # This worker's snapshot taker, made when it first writes its machine's snapshots.
        self.snapshotter: Snapshotter | None = None
        self.took_local = False  # its last hand-over's state came from shared memory
        self.final_model: dict[str, torch.Tensor] | None = None  # fsdp: the gathered weights
        # fsdp across machines: where this process receives copies of its buddies' shard
        # snapshots (made with its first generation; see phalanx.snapshot.copies)
        self.copies: CopyListener | None = None
        self.no_copies = False  # (its listener could not be made: told once)
        self.restored: list[int] | None = None  # fsdp: the set this generation started from

    # -- messages ----------------------------------------------------------------------
    def send(self, message: object) -> None:
        """Written to the pipe before returning: survives this process's sudden death."""
        with self.lock:
            self.a.conn.send(message)

    def on_phase(self, step: int, phase: str) -> None:
        """The heartbeat: a store into shared memory (no pickling, no pipe write, no wake-up
        of the supervisor), read by the supervisor within its poll interval."""
        self.step, self.phase = step, phase
        attempt = self.loop.attempt if self.loop is not None else 0
        if self.a.heartbeat is not None:
            self.a.heartbeat.beat(step, phase, attempt)
        else:
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

    # -- before the first generation ---------------------------------------------------
    def run(self) -> int:
        a = self.a
        store = a.signed(a.connect(), self.send)
        self.watcher.start()
        if self.device.type == "cpu":
            torch.set_num_threads(a.threads)
        else:
            torch.cuda.set_device(self.device)
        # Until it joins a generation (preflight): its slot and the full world.
        everyone = range(len(a.config.devices))
        announce(everyone, a.here, self.label, a.slot, -1, (a.store_host, a.store_port))
        try:
            member = self.prepare()
            # A replacement waits until it is let in or dismissed (the supervisor decides).
            first_wait = a.timing.replacement_wait if a.replacement else a.timing.first_generation
            gen = wait_generation(store, a, self.watcher, a.after_generation, first_wait)
        except FailedHere as exc:
            self.send(Failed(exc.failure, fatal=True))
            return 1
        except TimeoutError as exc:
            self.send(Failed(self.failure(exc, self.phase), fatal=True))
            return 1
        except HeadGone:
            return self.save_for_resume()
        return self.generations(store, member, gen)

    def prepare(self) -> Member:
        """Unpickle the user's parts, build the replica (the model factory's one call in this
        process), preflight it, and say it is ready: the supervisor announces the first
        generation once every worker is (a replacement waits to be let in)."""
        a = self.a
        self.before_training(a.unpack)
        checked = a.config.preflight and not a.replacement
        if checked:  # (building the replica is part of it: a death there stops the run)
            self.on_phase(0, "preflight")
        member = self.before_training(
            lambda: Member.build(a.spec, a.config, a.slot, a.faults_after, self.on_phase)
        )
        if checked:
            self.before_training(lambda: preflight(member, a.config, a.plan, a.train))
        self.send(Ready(a.slot))
        return member

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

    # -- generations ---------------------------------------------------------------------
    def generations(self, store: SignedStore, member: Member, gen: Generation) -> int:
        """Train in one generation after another until the run ends for this worker."""
        while self.a.slot in gen.members:
            left = self.run_generation(store, member, gen)
            if left.exit is not Exit.FINISHED and self.head_gone():
                return self.save_for_resume()
            match left.exit:
                case Exit.FINISHED:
                    return self.finish()
                case Exit.ABORTED:
                    self.send(Aborted(self.a.slot, left.step, left.poison))
                    return 0
                case Exit.FAILED:
                    assert left.failure is not None
                    self.send(Failed(left.failure, fatal=True))
                    return 1
                case Exit.REGROUP | Exit.SUPERSEDED:
                    wait = self.a.timing.forming
                case Exit.BROKEN:
                    wait = self.a.timing.announce_wait
            try:
                gen = wait_generation(store, self.a, self.watcher, gen.number, wait)
            except HeadGone:
                return self.save_for_resume()
            except TimeoutError as exc:  # nobody else fell: the failure is this worker's
                self.send(Failed(left.failure or self.failure(exc, self.phase), fatal=True))
                return 1
        return EXIT_TOLD

    def head_gone(self) -> bool:
        """Across machines, after a generation ended for this worker: whether the head is
        lost (see :func:`.emergency.await_verdict`); on one machine, never."""
        if not self.a.spans_nodes:
            return False
        timing = self.a.timing

        def probe() -> None:  # (a read that parses nothing: see control)
            self.a.reconnect(timing.probe).check([CONTROL_KEY])

        return await_verdict(
            lambda: self.watcher.head_lost, probe, timing.verdict, timing.probe_every
        )

    def save_for_resume(self) -> int:
        """The head is lost: keep the state this worker committed last in an emergency
        checkpoint (see :mod:`.emergency`), tell the agent, and exit."""
        folder = self.a.snapshot_dir if self.a.config.snapshots is not None else None
        self.send(keep_committed(self.loop, self.a.config, self.a.slot, folder))
        return EXIT_HEAD_LOST

    def run_generation(self, store: SignedStore, member: Member, gen: Generation) -> Left:
        """Train in ``gen`` until it ends for this worker; exceptions become an :class:`Exit`
        here, and only here."""
        try:
            self.train_in(store, member, gen)
            return Left(Exit.FINISHED)
        except Exception as exc:
            return self.left_by(exc, member)
        finally:
            self.leave_group(member)

    def left_by(self, exc: Exception, member: Member) -> Left:
        """How an exception out of a generation ends it. The group broke when a collective
        failed (:class:`GroupBroken`) or when this worker's own step failed before the vote
        could carry it (the reducer it left behind fails next). Anything else is a bug in
        phalanx's own code: reported at once, with its traceback, never waited on."""
        match exc:
            case Regroup():
                return Left(Exit.REGROUP)
            case Superseded():
                return Left(Exit.SUPERSEDED)
            case StepAborted(step=step, poison=poison):
                return Left(Exit.ABORTED, step=step, poison=poison)
            case FailedHere(failure=failure):
                return Left(Exit.FAILED, failure)
        # A record, not the exception: its traceback would keep the old group alive.
        failure = self.failure(exc, self.phase)
        if not isinstance(exc, GroupBroken) and member.replica.unvoted is None:
            if self.loop is not None:  # (the last heartbeat may be the previous step's)
                failure.step = self.loop.state.global_step
            return Left(Exit.FAILED, failure)
        self.report_unvoted(member)
        return Left(Exit.BROKEN, failure)

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
            self.send(Broke(lost, self.watcher.generation, member.replica.unvoted_splittable))
            if not member.replica.unvoted_splittable:
                self.unvoted.append(lost)

    def leave_group(self, member: Member) -> None:
        """Drop every reference to this generation's DDP module and group: its sockets close
        (peers still blocked on them error out) and DDP's autograd hooks go."""
        if self.loop is not None and isinstance(self.loop.engine, FsdpEngine):
            if self.snapshotter is not None:
                self.snapshotter.end_copies()  # (its snapshot whole, and its copy)
            self.loop.engine.keep()  # (its shards, for the next generation: before the group)
        if self.loop is not None and isinstance(self.loop.engine, DdpEngine):
            self.loop.engine.ddp = None
        member.replica.forward = member.trainable.module
        group, self.watcher.group = self.watcher.group, None
        if group is not None and group.leave():  # (kept: its abandoned work still runs)
            self.abandoned.append(group)
        gc.collect()  # drops the old DDP reducer and its autograd hooks
        # Groups kept earlier whose work has ended since: dropped here, on the main thread.
        self.abandoned = [kept for kept in self.abandoned if not kept.release()]

    def train_in(self, store: SignedStore, member: Member, gen: Generation) -> None:
        """Form ``gen``'s group, take the agreed state, train until the run ends."""
        cfg, timing = self.a.config, self.a.timing
        rank = gen.rank_of(self.a.slot)
        self.rank, self.watcher.members = rank, list(gen.members)
        self.watcher.generation = gen.number
        store_at = (self.a.store_host, self.a.store_port)
        announce(gen.members, self.a.here, self.label, self.a.slot, gen.number, store_at)
        self.on_phase(self.step, "regroup")
        member.trainable.discard()  # gradients of a step the old group never committed
        listener = self.copy_listener()
        said = json.dumps(dataclasses.asdict(listener.endpoint)) if listener else "1"
        arrived = arrive(store, gen, rank, self.watcher, timing.forming, timing.store_poll, said)
        if listener is not None:  # (an earlier generation's copies stop before any set is read)
            listener.begin(gen.number)
        rendezvous = self.a.connect(timing.forming)
        group = self.form(rendezvous, gen, rank)
        self.watcher.group = group
        if self.watcher.head_lost:  # (the order came before there was a group to abort)
            raise GroupBroken("the head was lost")
        loop = self.loop_in(member, group, gen)
        if isinstance(group, FsdpGroup):
            self.sharded_state(loop, group, gen)
        elif gen.number > 0:
            subgroup = lambda ranks: self.subgroup(rendezvous, gen, ranks)  # noqa: E731
            restarted = gen.number == gen.timeline  # (a restart's: see hand_over)
            hand_over(loop, group, subgroup, self.local_state(loop, gen), everyone=restarted)
        if isinstance(loop.engine, FsdpEngine) and cfg.run_dir:
            loop.checkpointer = self.shard_checkpointer(loop, gen, rank)
        elif loop.engine.is_main and loop.checkpointer is None and cfg.run_dir:
            loop.checkpointer = make_checkpointer(cfg, self.emit)
        loop.snapshots = self.snapshot_writer(member, gen)
        if isinstance(loop.engine, FsdpEngine) and self.snapshotter is not None:
            self.copy_sender(self.snapshotter, group, gen, arrived, loop)
            loop.engine.fence = self.snapshotter.before_vote
            if self.snapshotter.propose_only:
                loop.engine.cadence = self.snapshotter
        local, self.took_local = self.took_local, False
        restored, self.restored = self.restored, None
        self.send(Joined(self.a.slot, gen.number, loop.state.global_step, local, restored))
        self.interrupted = loop.run().interrupted
        if isinstance(loop.engine, FsdpEngine):
            if self.a.config.gather:  # (gathered by every member, kept by rank 0)
                self.final_model = loop.engine.full_model_state()
            else:  # (left in a sharded checkpoint: each member writes its own shards)
                loop.save_final()

    def shard_checkpointer(
        self, loop: TrainLoop, gen: Generation, rank: int
    ) -> ShardedCheckpointer:
        """fsdp: every member writes its shards of each checkpoint, as its rank in ``gen``."""
        checkpointer = loop.checkpointer
        if not isinstance(checkpointer, ShardedCheckpointer):
            cfg = self.a.config
            assert cfg.run_dir
            settings = cfg.checkpoint if cfg.checkpoint is not None else Checkpoints()
            timing = self.a.timing
            wait, poll = timing.forming.total_seconds(), timing.store_poll.total_seconds()
            folder = checkpoint_dir(cfg.run_dir)
            checkpointer = ShardedCheckpointer(folder, settings, self.emit, wait, poll)
        checkpointer.rank, checkpointer.world = rank, len(gen.members)
        return checkpointer

    def sharded_state(self, loop: TrainLoop, group: FsdpGroup, gen: Generation) -> None:
        """fsdp: a rebuild's members hold their own shards (kept when they left, taken by
        the engine): they only check they stand at one step. Any other later generation
        starts from the newest complete set of shard snapshots (re-sharded, the steps since
        computed again)."""
        self.restored = None
        if gen.number == 0:
            return
        engine = loop.engine
        assert isinstance(engine, FsdpEngine)
        if gen.rebuild and one_position(loop, group, engine.took_kept):
            return  # (else a member's kept shards are of another world, or a member
            # committed a step the others did not: the newest set is the common ground)
        # A restart's members (every member fell) resumed from the newest checkpoint, if
        # any: a set of shard snapshots replaces it only when it is further.
        restart = gen.number == gen.timeline
        folder = self.a.snapshot_dir
        if folder is not None and self.a.config.snapshots is not None:
            # (a restart without a run_dir resumed nothing: it needs a set, as any regroup)
            past = loop.state.global_step if restart and self.a.config.run_dir else None
            chosen = restore_from_set(loop, group, folder, self.a.slot, past)
            if chosen is not None:
                self.restored = [chosen.generation, chosen.step]
        elif not restart:
            raise NoShardSet(
                "snapshots are off (fit(snapshots=False)): no copy of the shards to start "
                "the new generation from"
            )
        if not one_position(loop, group, True):
            raise NoShardSet("the members of the new generation stand at different steps")

    def form(self, store: dist.Store, gen: Generation, rank: int) -> GenerationGroup:
        """``gen``'s group: its own (ddp), or torch's default group and a mesh (fsdp)."""
        timing, size = self.a.timing, len(gen.members)
        prefix = f"g{gen.number}/"
        if self.a.sharded:
            return FsdpGroup.form_default(
                store, prefix, rank, size, self.device, timing.collective, self.a.store_port
            )
        return GenerationGroup.form(
            store, prefix, rank, size, self.device, timing.collective, self.a.spans_nodes
        )

    def local_state(self, loop: TrainLoop, gen: Generation) -> LocalState | None:
        """How a member behind takes the agreed state from its machine's shared memory
        instead of from a peer (see :func:`.handover.hand_over`): a snapshot of exactly that
        position, written since the latest restart (one from before it may hold a step
        computed another way); None without snapshots."""
        folder = self.a.snapshot_dir
        if folder is None or self.a.config.snapshots is None:
            return None

        def take(top: tuple[float, float]) -> bool:
            def wanted(h: Header) -> bool:
                return (h.step, h.epoch) == (round(top[0]), round(top[1])) and (
                    h.tag >= gen.timeline
                )

            snap = SnapshotStore(folder).read(wanted)
            if snap is None:
                return False
            loop.restore(snap.state)
            self.took_local = True
            return True

        return take

    def snapshot_writer(self, member: Member, gen: Generation) -> Snapshotter | None:
        """This worker's snapshot taker when it writes its machine's snapshots in ``gen``:
        the first member in rank order on this machine (survivors keep their order and
        newcomers go last, so a writer stays one while it lives)."""
        settings, folder = self.a.config.snapshots, self.a.snapshot_dir
        if self.a.sharded:
            return self.shard_snapshot_writer(member, gen)
        local = [slot for slot in gen.members if slot in self.a.here]
        if settings is None or folder is None or not local or local[0] != self.a.slot:
            return None
        if self.snapshotter is None:
            trainable = member.trainable
            self.snapshotter = Snapshotter(
                SnapshotStore(folder),
                settings,
                lambda: stable_tensors(trainable.model, trainable.optimizer),
                self.snapshot_taken,
                self.snapshot_failed,
            )
        self.snapshotter.tag = gen.number
        # (after a regroup the source is rank 0: all members stand at the same step)
        self.snapshotter.for_joins = gen.members[0] not in self.a.here
        return self.snapshotter

    def shard_snapshot_writer(self, member: Member, gen: Generation) -> Snapshotter | None:
        """fsdp: every member writes its own shards into its slot's folder, after the same
        steps as the others (``every_steps``, or the cadence the members agree on: see
        ``FsdpEngine._agree_cadence``) and whole at each regroup; its
        tag names the generation, its world and rank (:func:`phalanx.snapshot.shards.tag`)."""
        settings, folder = self.a.config.snapshots, self.a.snapshot_dir
        if settings is None or folder is None:
            return None
        if self.snapshotter is None:
            mine = slot_folder(folder, self.a.slot)
            os.makedirs(mine, exist_ok=True)

            def stable() -> set[int]:
                trainable = member.trainable
                return trainable.stable() if isinstance(trainable, ShardedTrainable) else set()

            self.snapshotter = Snapshotter(
                SnapshotStore(mine), settings, stable, self.snapshot_taken, self.snapshot_failed
            )
        taker = self.snapshotter
        taker.tag = shard_tag(gen.number, len(gen.members), gen.rank_of(self.a.slot))
        taker.for_joins = True  # (whole at a regroup: the next set is that step)
        taker.propose_only = settings.every_steps is None
        taker.own_folder = True
        taker.restart_cadence()  # (every member of the generation counts from here)
        return taker

    def copy_listener(self) -> CopyListener | None:
        """fsdp with snapshots, across machines: this process's end for copies of other
        machines' members' snapshots (made once, kept to the process's end)."""
        a = self.a
        if not (a.sharded and a.spans_nodes and a.snapshot_dir and a.config.snapshots):
            return None
        if self.copies is None and not self.no_copies:
            host = "?"
            handshake = a.timing.handshake.total_seconds()
            try:  # (on the interface that reaches the head's store: the nodes share it)
                host = address_towards(a.store_host, a.store_port)
                self.copies = CopyListener(
                    a.snapshot_dir, self.token_key, host, self.copy_timeout, handshake
                )
            except OSError as exc:  # (the run goes on: this machine keeps no copies)
                self.no_copies = True
                self.emit(
                    Notice(
                        f"worker {a.slot}: cannot receive copies of shard snapshots on {host} "
                        f"({type(exc).__name__}: {exc}); a node's loss restarts from the "
                        "newest checkpoint where no other machine keeps the copies",
                        level="warning",
                    )
                )
        return self.copies

    @property
    def token_key(self) -> bytes:
        return hmac.new(self.a.token, COPY_KEY, hashlib.sha256).digest()

    @property
    def copy_timeout(self) -> float:
        return self.a.timing.collective.total_seconds()

    def copy_sender(
        self,
        taker: Snapshotter,
        group: GenerationGroup,
        gen: Generation,
        said: list[str],
        loop: TrainLoop,
    ) -> None:
        """fsdp across machines: this member's copies go to its buddy in ``gen`` (the next
        member on another machine, from what each said at its arrival: ``said``), the first
        of a snapshot of the step the generation starts from (see
        :meth:`~phalanx.snapshot.taker.Snapshotter.start_copies`). None where every member
        is on one machine."""
        start = loop.state.global_step
        if self.copies is None or not isinstance(group, FsdpGroup):
            return
        ends = [_endpoint(text) for text in said]
        if any(end is None for end in ends):
            return
        places = [end.place for end in ends if end is not None]
        rank = gen.rank_of(self.a.slot)
        buddy = buddies(places)[rank]
        to = ends[buddy] if buddy is not None else None
        if to is None or buddy is None:
            return
        timing = self.a.timing
        handshake = timing.handshake.total_seconds()
        sender = CopySender(
            to, self.token_key, gen.number, self.a.slot, start, self.copy_timeout, handshake
        )
        taker.settle_within = timing.settle_copy.total_seconds()  # (then the next one forms)
        holder = gen.members[buddy]
        generation = gen.number

        def copied(done: Copied) -> None:
            self.send(
                Snapshotted(
                    self.a.slot, done.step, done.nbytes, done.seconds, generation, held_by=holder
                )
            )

        def failed(exc: BaseException) -> None:
            self.send(
                Snapshotted(self.a.slot, -1, generation=generation, failed=True, held_by=holder)
            )
            self.emit(
                Notice(
                    f"worker {self.a.slot}: the copies of its shard snapshots to worker "
                    f"{holder}'s machine failed ({type(exc).__name__}: {exc}) and stop in "
                    "this generation; the loss of this worker's machine now restarts from "
                    "the newest checkpoint",
                    level="warning",
                )
            )

        taker.on_copied, taker.on_copy_error = copied, failed

        sender.holder = holder
        group.also_abort.append(sender.abort_for)
        taker.start_copies(sender, loop.snapshot, start)

    def snapshot_taken(self, taken: Taken) -> None:
        generation = self.watcher.generation
        self.send(Snapshotted(self.a.slot, taken.step, taken.nbytes, taken.seconds, generation))

    def snapshot_failed(self, exc: BaseException) -> None:
        if self.a.sharded:  # (no complete set of shards after this one)
            self.send(Snapshotted(self.a.slot, -1, generation=self.watcher.generation, failed=True))
            self.emit(
                Notice(
                    f"worker {self.a.slot}: its shard snapshots in shared memory failed "
                    f"({type(exc).__name__}: {exc}) and stop; a worker's loss now ends the run "
                    "unless a checkpoint in run_dir holds the state",
                    level="warning",
                )
            )
            return
        self.emit(
            Notice(
                f"worker {self.a.slot}: a snapshot in shared memory failed ({type(exc).__name__}:"
                f" {exc}); this worker takes no more, the run goes on (snapshots of other "
                "machines, and checkpoints, still hold the state)",
                level="warning",
            )
        )

    def subgroup(self, store: dist.Store, gen: Generation, ranks: list[int]) -> GenerationGroup:
        """The hand-over's group of the source and the members behind it."""
        rank = ranks.index(gen.rank_of(self.a.slot))
        timeout = self.a.timing.forming
        prefix = f"g{gen.number}/handover/"
        return GenerationGroup.form(
            store, prefix, rank, len(ranks), self.device, timeout, self.a.spans_nodes
        )

    def loop_in(self, member: Member, group: GenerationGroup, gen: Generation) -> TrainLoop:
        """The training loop (built with the first generation, kept across generations) over
        a new engine for ``gen``."""
        a = self.a
        data = (a.train, a.valid, a.valid_size)
        hooks = EngineHooks(self.on_phase, self.watcher.regroup_requested)
        engine: DdpEngine
        if isinstance(group, FsdpGroup):
            if not gen.rebuild:  # (its kept shards are of another world: the set's instead)
                member.kept = None
            engine = FsdpEngine(
                member=member, group=group, config=a.config, plan=a.plan, data=data,
                hooks=hooks, spec=a.spec,
            )  # fmt: skip
        else:
            engine = DdpEngine(
                member=member, group=group, config=a.config, plan=a.plan, data=data,
                hooks=hooks, init_sync=gen.number == 0,
            )  # fmt: skip
        first = self.loop is None
        if self.loop is None:
            self.loop = build_loop(
                engine,
                a.spec,
                a.config,
                a.plan,
                self.emit,
                lambda: self.watcher.stop_reason,
                a.valid_size if a.valid is not None else None,
                None,
                on_failure=lambda f: self.send(Failed(f, fatal=False)),
            )
        self.loop.engine = engine
        self.loop.failed_before = dict(gen.failed)
        self.loop.known_failures = [*gen.known, *self.unvoted]
        if first and not a.replacement:
            store = SnapshotStore(a.snapshot_dir) if a.restart and a.snapshot_dir else None
            start_run(
                self.loop,
                a.plan,
                a.config,
                self.loop.emit,
                a.plan.samples,
                a.valid_size,
                restart=a.restart,
                snapshots=store,
            )
        return self.loop

    def finish(self) -> int:
        assert self.loop is not None
        self.loop.close_checkpointer()
        kept = None  # fsdp's gather=False: the final sharded checkpoint, found by rank 0
        if not self.a.config.gather and self.loop.engine.is_main:
            kept = self.loop.final_checkpoint()
        done = done_of(
            self.loop, self.a.slot, self.a.weights_path, self.interrupted, self.final_model, kept
        )
        self.send(done)
        return 0


def done_of(
    loop: TrainLoop,
    slot: int,
    weights_path: str,
    interrupted: str | None,
    model: dict[str, torch.Tensor] | None = None,
    kept: str | None = None,
) -> Done:
    """A finished worker's word; the main member's with the final weights (``model``, the
    whole model gathered under fsdp, else its own replica's; saved to ``weights_path``; or,
    under fsdp's ``gather=False``, ``kept``: the final sharded checkpoint, nothing gathered)
    and the results."""
    if not loop.engine.is_main:
        return Done(slot)
    if kept is None:
        torch.save(loop.engine.state_dict()["model"] if model is None else model, weights_path)
    st = loop.state
    quarantine = [[i, g] for i, g in sorted(st.quarantine.items())]
    return Done(
        slot,
        None if kept is not None else weights_path,
        st.history,
        st.global_step,
        st.epoch,
        interrupted,
        st.ledger,
        quarantine,
        model_path=kept,
    )


def announcement(store: SignedStore, number: int) -> Announcement | None:
    """The verified ``gen/<number>``, or None (absent, or rejected and reported)."""
    return store.read(f"{GEN_PREFIX}{number}", functools.partial(Announcement.from_json, number))


def wait_generation(
    store: SignedStore, args: WorkerArgs, watcher: Watcher, after: int, timeout: timedelta
) -> Generation:
    """The newest generation after ``after`` that counts this worker in (or one that leaves
    it out: then it exits). Raises TimeoutError when none comes in time, HeadGone when the
    node's agent says the head is lost."""
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        if watcher.head_lost:
            raise HeadGone()
        try:
            latest = latest_generation(store, after)  # (verified announcements only)
            doc = announcement(store, latest) if latest > after else None
        except Exception:
            if not args.spans_nodes:
                raise
            doc = None  # across machines: the head may be lost (the agent decides)
        if doc is not None:
            gen = doc.generation()
            if args.slot in gen.members or not args.replacement:
                return gen
            after = latest  # a replacement waits for the generation that lets it in
        time.sleep(args.timing.store_poll.total_seconds())
    raise TimeoutError(f"no new generation after {after} within {timeout}")


def arrive(
    store: SignedStore,
    gen: Generation,
    rank: int,
    watcher: Watcher,
    timeout: timedelta,
    poll: timedelta = DEFAULT.store_poll,
    said: str = "1",
) -> list[str]:
    """Wait until every member of ``gen`` has arrived (reading the keys every ``poll``),
    before any of them starts the group's rendezvous (which cannot be interrupted). If a
    newer generation is announced meanwhile (a member fell before arriving), this one is
    dropped: Superseded. Each member says ``said`` as it arrives (where it receives copies
    of snapshots, fsdp across machines); returns what each said, in rank order."""
    keys = [f"{ARRIVED_PREFIX}g{gen.number}/{r}" for r in range(len(gen.members))]
    store.set(keys[rank], said, seq=gen.number)  # (signed: a forged arrival is not one)
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.all_present(keys):
        if watcher.latest > gen.number and not store.all_present(keys):
            # (checked again: a peer that saw every key is already in the rendezvous)
            raise Superseded(gen.number)
        if time.monotonic() > deadline:
            raise GroupBroken(f"generation {gen.number} did not form in time")
        time.sleep(poll.total_seconds())
    return [store.get(key) or "" for key in keys]


def _endpoint(said: str) -> Endpoint | None:
    """Where a member receives copies, from what it said at its arrival (None: nowhere)."""
    try:
        doc = json.loads(said)
        return Endpoint(str(doc["host"]), int(doc["port"]), str(doc["place"]))
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError):
        return None


def listen_for_stack_dumps(path: str) -> None:
    """On ``STACK_SIGNAL``, write every thread's Python stack to ``path``. Opened in append
    mode: the supervisor empties the file before it asks, and each dump then starts at its beginning
    (with "w", the next dump would land at the old offset, after a run of NUL bytes)."""
    stacks = open(path, "a")  # noqa: SIM115 - kept open for faulthandler
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    # A crash in native code (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT): every thread's
    # stack into the same file before the process dies of it (the agent reads it then)
    faulthandler.enable(file=stacks, all_threads=True)


def fork_children() -> None:
    """Processes this worker starts (DataLoader workers, the user's own) are forked, as in a
    plain DDP script. A process the fork server started inherits "forkserver" as its start
    method; a DataLoader's workers started that way are children of a second fork server,
    each holding that server's alive pipe, and watch only that server as their parent: when
    this worker exits, neither ever ends (the server waits for its children to close the
    pipe, the children for their parent to die). Forked, their parent is this worker, whose
    end they notice (torch's worker watchdog)."""
    if "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)


def main(args: WorkerArgs) -> None:
    """Entry point of a spawned worker. Ctrl-C, a SIGTERM and a SIGUSR1 (a time-limit
    warning) sent to the whole process group (Slurm, ``kill -TERM -<pgid>``) are the
    supervisor's to act on: it relays the stop
    through the store, so the workers finish the step and checkpoint. (They cannot be
    orphaned: the watch thread exits a worker whose parent is gone.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(WARNING_SIGNAL, signal.SIG_IGN)  # (a batch system's time-limit warning)
    # (the fork server runs with these blocked, see agent.start_fork_server: not its workers)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGHUP, WARNING_SIGNAL})
    if args.environ is not None:
        os.environ.clear()
        os.environ.update(args.environ)
    listen_for_stack_dumps(args.stack_file)
    fork_children()
    code = Worker(args).run()
    args.conn.close()
    sys.stdout.flush()
    os._exit(code)
