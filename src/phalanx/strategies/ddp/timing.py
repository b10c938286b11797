"""Every duration of the ddp strategy, in one frozen :class:`Timing`.

A run builds one with :meth:`Timing.of` from its configuration (``hang_timeout`` and
``node_timeout`` and the bounds derived from them) where the configuration is known: the
head's :func:`~.supervisor.run_ddp` and a node's :func:`~.nodes.node.run_node`. From there it
is handed down: to the coordinator (:class:`~.roster.Setup`), the agent (and through it to
each worker, in :class:`~.worker.WorkerArgs`), the node hub and the links. No other module
of the strategy holds a timing literal (``tests/test_timing.py`` checks it). :data:`DEFAULT`
is ``Timing()``, the bounds of fit's default configuration: the default of a few helpers'
parameters (tests call them without a Timing) and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.spec import FitConfig
    from phalanx.strategies.ddp.coordinator.hangs import Watched


@dataclass(frozen=True)
class Timing:
    """Every bound and tick of the ddp control plane, each a :class:`timedelta` on the
    monotonic clock. The defaults are fit's default configuration's (see :meth:`of`)."""

    # -- from the configuration (see of) --------------------------------------------------
    hang: timedelta = timedelta(seconds=60)  # hang_timeout: a worker's silence, peers waiting
    node: timedelta = timedelta(seconds=10)  # node_timeout: a node's (the head's) silence: lost
    # max(10 s, hang): members wait for each other while a generation forms (their arrival,
    # the group's rendezvous, a hand-over's group), and for the next one after a regroup
    forming: timedelta = timedelta(seconds=60)
    # 2 × hang + 30 s: the process group's bound on one collective (the supervisor decides
    # long before)
    collective: timedelta = timedelta(seconds=150)
    # node + 5 s: across machines, a worker out of its generation while the head's store
    # does not answer waits this long for its agent to say whether the head is lost
    verdict: timedelta = timedelta(seconds=15)
    # node + 10 s: the head lost, its successor waits this long for the other survivors to
    # reach it (from when it listens as the new head), then goes on with those that came
    # (fsdp with snapshots: save_wait more, the time each survivor may spend writing its
    # machine's shard snapshots first)
    takeover: timedelta = timedelta(seconds=20)
    # forming / 2 (fsdp across machines): a member leaving a generation waits this long for
    # its snapshot's copy under way to another machine, then gives it up (the next
    # generation forms within ``forming``)
    settle_copy: timedelta = timedelta(seconds=30)

    # -- the coordinator ------------------------------------------------------------------
    grace: timedelta = timedelta(seconds=2)  # to exit by themselves once the run is decided
    broke_settle: timedelta = timedelta(seconds=0.2)  # a Broke waits for a peer's death
    startup: timedelta = timedelta(seconds=120)  # spawning and importing torch is not a hang
    preflight: timedelta = timedelta(seconds=30)  # first calls are slow: lazy initialisation
    # After an announcement, its members get this long to say they left their old group
    # before a silence is called a hang (no worker's own clock is reset by it); also how
    # long a hang check waits after stacks found no hung worker (one was regrouping).
    announce_grace: timedelta = timedelta(seconds=0.5)
    panel_tick: timedelta = timedelta(seconds=0.5)  # between two WorkersTick events

    # -- the supervisor and the agents (every machine's) ----------------------------------
    # one wait on the agent for its workers' words: the supervisor's loop, a node's loop,
    # a node's agent waiting for its workers to save once the head is lost
    poll: timedelta = timedelta(seconds=0.1)
    stack_wait: timedelta = timedelta(seconds=0.5)  # a worker's stacks after SIGUSR1
    stack_poll: timedelta = timedelta(seconds=0.05)  # between two reads of its stack file
    # the stacks of workers on other nodes: two of their agents' stack_wait, and a second
    # for the link both ways
    remote_stacks: timedelta = timedelta(seconds=2)
    exit_wait: timedelta = timedelta(seconds=5)  # each killed (or retired) worker, to exit
    # each request of the head's client of a launcher's store (torchrun's)
    launcher_store: timedelta = timedelta(seconds=30)
    # a committed step's event rings the supervisor's bell at most this long after the
    # last ring (see protocol.Outbox)
    ring_after: timedelta = timedelta(seconds=0.05)

    # -- a worker ---------------------------------------------------------------------------
    watch_tick: timedelta = timedelta(milliseconds=100)  # the watch (and order) thread's tick
    first_generation: timedelta = timedelta(seconds=120)  # for the first one to be announced
    replacement_wait: timedelta = timedelta(hours=1)  # a replacement: let in or dismissed
    announce_wait: timedelta = timedelta(seconds=10)  # a broken collective: the next generation
    store: timedelta = timedelta(seconds=30)  # each request of a worker's store client
    probe: timedelta = timedelta(seconds=1)  # the probe that asks whether the head's store answers
    probe_every: timedelta = timedelta(seconds=0.05)  # between two such probes
    reconnect_every: timedelta = timedelta(seconds=1)  # (across machines) after a failed client
    # a head with a fencing term reads run_dir's head.json at most this often (and before
    # each generation it announces)
    fence_every: timedelta = timedelta(seconds=1)
    # between two reads of the store while waiting for a generation, or for its members
    store_poll: timedelta = timedelta(seconds=0.02)

    # -- across machines ------------------------------------------------------------------
    # every node to register (the head waits); a node's to reach the head and to find the
    # token in run_dir
    join: timedelta = timedelta(seconds=300)
    # the head's wait for the next hello while nodes join; a node's between two looks for
    # the token file
    join_poll: timedelta = timedelta(seconds=0.2)
    connect: timedelta = timedelta(seconds=5)  # one TCP connect of a node to the head
    connect_retry: timedelta = timedelta(seconds=0.5)  # between a node's tries to reach the head
    handshake: timedelta = timedelta(seconds=10)  # a new connection, in all, to prove the token
    accept_retry: timedelta = timedelta(seconds=0.1)  # the head's accept loop after a failed accept
    beat_every: timedelta = timedelta(seconds=1)  # between a link's keep-alive frames
    # a node's wait for the head's next frame (a parked spare's loop, the last word)
    link_poll: timedelta = timedelta(seconds=0.05)
    # a node whose link failed or fell silent: for the head's end or fenced frame
    last_word: timedelta = timedelta(seconds=0.5)
    # a node's agent waits for its workers to save and exit after the head was lost (a
    # worker blocked in a store call to a frozen head answers once that call times out)
    save_wait: timedelta = timedelta(seconds=60)
    # save_wait + node + 20 s: the head lost, a node's wait for its successor's welcome (the
    # successor welcomes once its own workers saved and the others came: at most its
    # save_wait and takeover, node + 10 s), with 10 s to spare (fsdp with snapshots:
    # save_wait more, as takeover)
    follow: timedelta = timedelta(seconds=90)

    @classmethod
    def of(cls, config: FitConfig) -> Timing:
        """The run's timing: the configuration's ``hang_timeout`` and ``node_timeout`` and
        the bounds derived from them; every other field as in :class:`Timing`."""
        hang, node = config.hang_timeout, config.node_timeout
        # (fsdp with snapshots: a node that lost the head first writes the shard snapshots
        # its machine holds, up to save_wait, before it reaches the successor)
        saving = cls.save_wait if config.strategy == "fsdp" and config.snapshots else timedelta()
        return cls(
            hang=hang,
            node=node,
            forming=max(timedelta(seconds=10), hang),
            collective=hang * 2 + timedelta(seconds=30),
            verdict=node + timedelta(seconds=5),
            takeover=node + timedelta(seconds=10) + saving,
            settle_copy=max(timedelta(seconds=10), hang) / 2,
            follow=cls.save_wait + node + timedelta(seconds=20) + saving,
        )

    def limit(self, state: Watched) -> float:
        """How long a worker may make no progress: ``hang``; at least ``preflight`` there."""
        hang = self.hang.total_seconds()
        return max(hang, self.preflight.total_seconds()) if state.phase == "preflight" else hang


DEFAULT = Timing()  # fit's default configuration's: see the module's docstring
