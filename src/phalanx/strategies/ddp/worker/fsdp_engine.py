"""The engine of one fsdp rank in one generation: the model sharded with FSDP2
(``fully_shard``) over the generation's mesh, each member holding its dim-0 shard of every
parameter, gradient and optimizer state.

What differs from the ddp engine (:mod:`.engine`), and why:

- **The model is built again in each generation** (the factory, the same seed), its units and
  then the root sharded on that generation's mesh, then the optimizer. The first generation
  shards the model preflight built; a later one takes the shards this member kept when it
  left the generation before (same members, same ranks: a rebuild), so nothing travels.
- **Reductions are plain sums.** Every FSDP unit reduce-scatters with SUM (no division; gloo
  refuses the PREMUL_SUM that FSDP2 otherwise uses), and each member scales its loss by its
  rows over the global batch, as the threads strategy does: the math of one device.
- **The vote rides a reduce-scatter of the backward** (:class:`.ballot.FsdpBallot`): the
  root's, or, where the root would hold nothing but the box, a unit's (:func:`box_carrier`).
- **An ``mp_policy``** (FSDP2's ``MixedPrecisionPolicy``) goes to every unit; the model's
  own parameters, where it has any, are a unit of their own in the policy too, which then
  carries the box; in bfloat16 the box's pieces are 8-bit (exact in bfloat16).
- **Every member runs the same passes** (forward gathers shards): a member with fewer rows than
  micro-batches pads with zero passes of a template sample, validation pads the same way, and
  a failure after the first gather cannot be lined up again: the member leaves the group
  (:attr:`Replica.sharded`), which the others see at once (:class:`.fsdp_group.FsdpGroup`),
  and the same members rebuild the generation.
- **Clipping** needs the norm over every shard: one float64 all-reduce of the squared sums
  before the commit point (a peer lost there changes nothing), then each member scales its
  own shards in the commit, which has no collective (no element-wise torch optimizer's step
  has one: docs/studies/fsdp, §10).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset, default_collate

from phalanx.data import validation_batches
from phalanx.failures import FailedHere
from phalanx.loop import TrainLoop
from phalanx.plan import Plan
from phalanx.ranks import acting_as
from phalanx.replica import ZERO_PASS, Cast, LocalResult, StepModule, to_device
from phalanx.report import is_secondary
from phalanx.sharding import innermost_first, units
from phalanx.snapshot import Snapshotter
from phalanx.snapshot.shards import ROWS, rows
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.ddp.worker.ballot import BF16_BITS, FsdpBallot
from phalanx.strategies.ddp.worker.engine import DdpEngine, EngineHooks, Member
from phalanx.strategies.ddp.worker.fsdp_group import FsdpGroup
from phalanx.strategies.ddp.worker.group import GroupBroken
from phalanx.trainable import Trainable

# The commits of a generation after which its members agree on their snapshot cadence: the
# first snapshot comes after the 2nd commit (a step's time is known), then one a step; the
# third (into a buffer written before: a new buffer's page faults are not the cost) after
# the 4th, measured by the time the next vote is cast.
CADENCE_COMMITS = 4
TEMPLATE_ROWS = 2  # (batch_size >= the workers >= 2)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This member's shard of a sharded tensor (a plain tensor as it is)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ShardedTrainable(Trainable):
    """A :class:`Trainable` whose model is sharded: its state dict is this member's shards
    (plain tensors, views; :meth:`kept` copies them), clipping scales the shards by a norm
    agreed before the commit (:attr:`norm`), and :meth:`full_model_state` gathers the whole
    model (collective)."""

    norm: float | None = None  # the global gradient norm of the step about to be committed

    def _parameters(self) -> Iterator[nn.Parameter]:
        return (p for p in self.model.parameters() if p.grad is not None)

    def squared_norm(self) -> torch.Tensor:
        """The sum of squares of this member's gradient shards (float64, one element)."""
        total = torch.zeros(1, dtype=torch.float64)
        for p in self._parameters():
            assert p.grad is not None
            total += local(p.grad).detach().double().pow(2).sum().cpu()
        return total

    def clip_gradients(self, clip: float) -> None:
        """Each shard scaled by the agreed norm's coefficient, as ``clip_grad_norm_``
        computes it: no collective, so once the commit runs no peer's loss can fail it."""
        assert self.norm is not None, "commit() before the norm was agreed"
        coefficient = min(1.0, clip / (self.norm + 1e-6))
        with torch.no_grad():
            for p in self._parameters():
                assert p.grad is not None
                local(p.grad).mul_(coefficient)

    def commit(self, skip: bool = False) -> None:
        super().commit(skip)
        self.norm = None

    def state_dict(self) -> dict[str, Any]:
        """This member's shards of the model and optimizer state (plain tensors: views of
        the live ones, as a snapshot copies them; :meth:`kept` copies), the scheduler's
        state: what a member of the same rank in a generation of the same size takes
        (:meth:`load_state_dict`), or one of a set to re-shard (:func:`assemble`)."""
        live = self.model.state_dict()
        model = {k: local(v).detach() for k, v in live.items()}
        optimizer = self.optimizer.state_dict()
        states = {
            i: {k: local(v).detach() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in optimizer["state"].items()
        }
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        sharded_state = {
            str(i): [k for k, v in s.items() if _param_shaped(v, params[int(i)])]
            for i, s in optimizer["state"].items()
        }
        return {
            "model": model,
            "optimizer": {"state": states, "param_groups": optimizer["param_groups"]},
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            # which entries are dim-0 shards (phalanx.snapshot.shards.whole joins them)
            "shards": {
                "model": [k for k, v in live.items() if isinstance(v, DTensor)],
                "optimizer": {i: keys for i, keys in sharded_state.items() if keys},
            },
        }

    def kept(self) -> dict[str, Any]:
        """:meth:`state_dict` with every tensor copied (it outlives this generation)."""
        state = self.state_dict()
        model = {k: v.clone() for k, v in state["model"].items()}
        optimizer = state["optimizer"]
        states = {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in values.items()}
            for i, values in optimizer["state"].items()
        }
        copied = {"state": states, "param_groups": optimizer["param_groups"]}
        return {**state, "model": model, "optimizer": copied}

    def stable(self) -> set[int]:
        """The data pointers of the shards only a commit or a restore changes (parameters,
        optimizer state): a snapshot copies them in the background."""
        found = {local(p).data_ptr() for p in self.model.parameters() if local(p).numel()}
        for values in self.optimizer.state.values():
            for v in values.values():
                if isinstance(v, torch.Tensor) and local(v).numel():
                    found.add(local(v).data_ptr())
        return found

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This member's shards (as :meth:`state_dict` gives them), a whole state (a
        checkpoint of any strategy): then this member's rows are cut out of it, or a
        checkpoint already cut to this member's rows (:func:`~phalanx.snapshot.shards.part`,
        whose record of the whole tensors' rows is checked against this model's). A tensor
        of another shape raises ValueError, alike on every member where the whole sizes
        differ (a checkpoint of another model)."""
        cut = state.get(ROWS) or {"model": {}, "optimizer": {}}
        # A whole state (a checkpoint of one file, or joined): its tensors the model's size
        # (a member's shards, kept or assembled, carry their "shards" record)
        whole = ROWS not in state and "shards" not in state
        with torch.no_grad():
            for key, value in self.model.state_dict().items():
                saved = state["model"][key]
                if key in cut["model"]:
                    _same_rows(key, cut["model"][key], value)
                else:
                    if whole:
                        _same_shape(key, saved, value)
                    saved = _mine(saved, value)
                _same_shape(key, saved, local(value))
                local(value).copy_(saved)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        saved_opt = state["optimizer"]
        states = {}
        for i, values in saved_opt["state"].items():
            param, rows_of = params[int(i)], cut["optimizer"].get(str(i), {})
            here = {}
            for k, v in values.items():
                if k in rows_of:
                    _same_rows(f"optimizer state {i}.{k}", rows_of[k], param)
                else:
                    v = _mine(v, param)
                if _param_shaped(v, param):
                    _same_shape(f"optimizer state {i}.{k}", v, local(param))
                here[k] = _like(v, param)
            states[i] = here
        saved = saved_opt
        self.optimizer.load_state_dict({"state": states, "param_groups": saved["param_groups"]})
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict, with the user's keys, on the CPU of rank 0 (the
        others get ``{}``). Collective: every member calls it."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.model, options=options)
        return {k: v.detach().clone() for k, v in full.items() if isinstance(v, torch.Tensor)}


def _same_rows(key: str, whole: int, live: torch.Tensor) -> None:
    if whole != live.shape[0]:
        raise ValueError(f"{key}: {whole} rows in the checkpoint, {live.shape[0]} in the model")


def _same_shape(key: str, value: Any, mine: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(mine.shape):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{key}: {shape} in the checkpoint, {tuple(mine.shape)} here")


def _param_shaped(value: Any, param: torch.Tensor) -> bool:
    """Whether an optimizer state value is sharded as its parameter is (Adam's moments: yes;
    its step counter: no)."""
    return (
        isinstance(param, DTensor)
        and isinstance(value, torch.Tensor)
        and value.dim() == param.dim()
        and value.dim() > 0
        and tuple(value.shape[1:]) == tuple(param.shape[1:])
    )


def _mine(value: Any, live: torch.Tensor) -> Any:
    """``value`` as this member holds it: a whole tensor of a sharded one is cut to this
    member's rows; a shard (or anything else) as it is."""
    if not (isinstance(live, DTensor) and _param_shaped(value, live)):
        return value
    d0 = live.shape[0]
    start, stop = rows(d0, live.device_mesh.size(), live.device_mesh.get_local_rank())
    if value.shape[0] == d0 and stop - start != d0:
        return value[start:stop]
    return value


def _like(value: Any, param: torch.Tensor) -> Any:
    """An optimizer state value as its parameter holds it: a shard of the parameter's shape
    becomes a sharded tensor like the parameter (copied; a step counter stays as it is)."""
    if not torch.is_tensor(value):
        return value
    if isinstance(param, DTensor) and value.dim() > 0 and value.shape == param.to_local().shape:
        return DTensor.from_local(
            value.clone(),
            param.device_mesh,
            param.placements,
            shape=param.shape,
            stride=param.stride(),
            run_check=False,
        )
    return value.clone()


class FsdpEngine(DdpEngine):
    """Rank ``group.rank`` of ``group.size`` in one generation, its model sharded over the
    generation's mesh (see the module's docstring)."""

    saves_shards = True

    def __init__(
        self,
        *,
        member: Member,
        group: FsdpGroup,
        config: FitConfig,
        plan: Plan,
        data: tuple[Dataset[Any], Dataset[Any] | None, int],
        hooks: EngineHooks,
        spec: TrainSpec,
    ) -> None:
        self.spec, self.mesh = spec, group.mesh
        self._template: Any = None
        self.took_kept = False  # set by _wrap: the shards kept from the last generation fit
        self.fence: Callable[[], None] = lambda: None  # (the snapshot taker's, when it has one)
        # The snapshot taker, while it measures its cadence (see _agree_cadence)
        self.cadence: Snapshotter | None = None
        self.commits = 0  # in this generation
        super().__init__(
            member=member,
            group=group,
            config=config,
            plan=plan,
            data=data,
            hooks=hooks,
            init_sync=False,
        )
        replica = member.replica
        replica.world = 1  # (sums, not averages: each member's loss is its rows' share)
        replica.sharded = True

    def _wrap(self, size: int, init_sync: bool) -> nn.Module:
        """The member's model sharded on this generation's mesh, with the vote's box in the
        root; its state: the model preflight built (the first generation) or the shards this
        member kept when it left the last one."""
        member, built = self.m, {}

        policy = self.config.mp_policy
        cast = {} if policy is None else {"mp_policy": policy}

        def shard(step: StepModule) -> None:
            found = innermost_first(units(step.model, self.config.shard))
            carrier = box_carrier(step.model, found)
            if carrier is None and policy is not None and not isinstance(step.model, FSDPModule):
                carrier = step.model  # (its own parameters in the policy, the box with them)
            ballot = FsdpBallot(
                step, self.rank, self.world, size, self.device, self.template, carrier,
                bits=BF16_BITS if _in_bf16(policy) else 16,
            )  # fmt: skip
            for unit in found:
                grouped = [unit, ballot.holder] if unit is carrier else unit
                fully_shard(grouped, mesh=self.mesh, **cast)
            if carrier is step.model:  # (kept gathered from forward to backward, as a root)
                grouped = [step.model, ballot.holder]
                fully_shard(grouped, mesh=self.mesh, reshard_after_forward=False, **cast)
            fully_shard(ballot, mesh=self.mesh)
            if carrier is not None:
                ballot.attach(carrier)
                ballot.all_reduce = lambda tensor: self.group.all_reduce(tensor)
            for module in ballot.modules():
                if isinstance(module, FSDPModule):  # (neither setter reaches inner units)
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
            built["ballot"] = ballot

        model = None if isinstance(member.trainable, ShardedTrainable) else member.trainable.model
        with acting_as(member.slot, len(self.config.devices)):  # (px.rank() in the factory)
            empty = self.spec.build_empty() if model is None else None
            trainable = ShardedTrainable(
                self.spec, self.device, self.config.seed, model or empty, shard, empty is not None
            )
        kept, member.kept = member.kept, None
        # (a rebuild's: only shards of this very world and rank fit; else the set's)
        self.took_kept = kept is not None and kept.get("as") == [self.world, self.rank]
        if kept is not None and self.took_kept:
            trainable.load_state_dict(kept)
        member.trainable = trainable
        member.replica.module = trainable.module
        ballot: FsdpBallot = built["ballot"]
        self.ballot = self.fsdp_ballot = ballot
        return ballot

    def template(self) -> Any:
        """Two training samples on the device (the first of the run's first batch: a batch
        of one breaks BatchNorm, and a batch statistic of one row can be NaN), for the zero
        passes; read once per generation, when first needed."""
        if self._template is None:
            collate = self.config.collate_fn or default_collate
            first = self.plan.global_batch(0, 0)[:TEMPLATE_ROWS]
            self._template = to_device(collate([self.train[i] for i in first]), self.device)
        return self._template

    @property
    def sharded(self) -> ShardedTrainable:
        trainable = self.m.trainable
        assert isinstance(trainable, ShardedTrainable)
        return trainable

    def commit(self, skip: bool = False) -> None:
        super().commit(skip)
        self.commits += 1

    def _overflowed(self) -> bool:
        """As under ddp, though each member unscales only its own gradient shards: torch's
        unscale of sharded gradients all-reduces their overflow flags over the mesh
        (DTensor's rule for the unscale op), so every member finds the same answer. That
        is a collective: every member runs it (the vote found no failure), and a peer lost
        in it is the group's end (GroupBroken), before anything changed (this member's own
        out-of-memory error stays its own)."""
        try:
            return self.trainable.overflowed()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            raise GroupBroken(f"the loss scaler's unscale: {exc}") from exc

    def _before_commit(self) -> None:
        """The global gradient norm, when the step clips: one all-reduce of every member's
        squared sum (a failure here is GroupBroken, before anything changed); once per
        generation, the snapshot cadence (:meth:`_agree_cadence`)."""
        if self.cadence is not None and self.commits == CADENCE_COMMITS:
            self._agree_cadence(self.cadence)
        if self.sharded.clip is None:
            return
        total = self.sharded.squared_norm().to(self.device)
        self.group.all_reduce(total)
        self.sharded.norm = math.sqrt(float(total.item()))

    def _agree_cadence(self, taker: Snapshotter) -> None:
        """Every member snapshots the same steps (a set is one step of every member's): the
        measured cadence each proposes after its first snapshots (the snapshot's cost over
        the budget of the step time: :func:`~phalanx.snapshot.every_for`) is agreed as the
        largest one, in one all-reduce after the generation's ``CADENCE_COMMITS``-th commit
        (the same attempt on every member). Each snapshot is then ``every`` steps apart."""
        proposals = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        proposals[self.rank] = float(taker.proposed or 0)
        self.group.all_reduce(proposals)  # (each slot one member's)
        every = int(proposals.max().item())
        taker.every = max(1, every)
        self.cadence = None

    def evaluate(self) -> torch.Tensor:
        """As under ddp; but each validation forward gathers shards, so a peer lost during
        validation breaks this member's forward: that is the group's end (GroupBroken), not
        a failure of this member's validation."""
        try:
            return super().evaluate()
        except FailedHere as exc:
            if is_secondary(dataclasses.replace(exc.failure, phase="forward")):
                raise GroupBroken(f"validation: {exc.failure.message}") from None
            raise

    def _after_validation(self) -> None:
        """Zero passes until this member has run as many forwards as the member with the
        most validation batches (each forward gathers shards); then every unit resharded on
        every member (FSDP2 keeps the root, and a unit made with reshard_after_forward=False,
        gathered after a forward without backward, and only some members would reshard it
        at their next state_dict: their next forwards would then gather differently)."""
        replica = self.m.replica
        if self.valid is not None:
            counts = [self._batches(r) for r in range(self.world)]
            replica.module.eval()
            try:
                with torch.no_grad():
                    for _ in range(max(counts) - counts[self.rank]):
                        replica.forward(ZERO_PASS)
            finally:
                replica.module.train()
        for module in self.fsdp_ballot.modules():  # (the root, and an mp_policy's model
            if isinstance(module, FSDPModule):  # unit, both kept gathered after forward)
                module.reshard()

    def _batches(self, rank: int) -> int:
        parts = validation_batches(self.valid_size, self.config.batch_size, rank, self.world)
        return sum(1 for part in parts if part)

    def discard(self) -> None:
        super().discard()
        self.fsdp_ballot.clear()  # (a failed attempt's ballots)

    def keep(self) -> None:
        """Leaving the generation: keep this member's shards of the committed state for the
        next one (a failed step's gradients are not state)."""
        self.m.kept = {**self.sharded.kept(), "as": [self.world, self.rank]}

    def launch(self, result: LocalResult) -> Cast:
        """As under ddp, once this member's snapshot of the last committed step is whole
        (:attr:`fence`): a member's vote on a step then says its shards of the step before
        are in shared memory, so no peer commits a step past a set that is not complete."""
        self.fence()
        return super().launch(result)

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """See :meth:`ShardedTrainable.full_model_state` (collective)."""
        return self.sharded.full_model_state()


def _in_bf16(policy: Any) -> bool:
    """Whether an mp_policy gathers or reduces in bfloat16 (the box's pieces are then 8-bit:
    a bfloat16 holds integers up to 256 exactly)."""
    return policy is not None and torch.bfloat16 in (policy.param_dtype, policy.reduce_dtype)


def box_carrier(model: nn.Module, found: list[nn.Module]) -> nn.Module | None:
    """The unit that carries the vote's box (:class:`.ballot.FsdpBallot`): where every
    parameter of ``model`` is in one of its units ``found``, the root would hold the box
    alone, so the last unit among the model's modules (its output head, or last block:
    used by every forward) carries it; else None (the root's collectives carry it)."""
    if not found:
        return None
    inside = {id(p) for unit in found for p in unit.parameters()}
    if any(id(p) not in inside for p in model.parameters()):
        return None
    chosen = {id(unit) for unit in found}
    return [m for m in model.modules() if id(m) in chosen][-1]


def one_position(loop: TrainLoop, group: FsdpGroup, mine: bool) -> bool:
    """Whether every member holds state of its own (``mine``: a rebuild's member took the
    shards it kept, of this very world and rank) and all stand at one committed step and
    epoch (a member that committed a step its peers did not, when a failure came after the
    vote, stands apart). Every member calls it (one all-reduce) and gets the same answer."""
    rows = torch.zeros(group.size, 3, dtype=torch.float64, device=group.device)
    st = loop.state
    rows[group.rank] = torch.tensor([st.global_step, st.epoch, float(mine)], dtype=torch.float64)
    group.all_reduce(rows)  # (each row one member's)
    seen = rows.tolist()
    return all(r[2] == 1.0 for r in seen) and len({(r[0], r[1]) for r in seen}) == 1
