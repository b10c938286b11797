"""The vote's one layout: a member packs its vote into one float64 vector, the members' packed
votes are summed (an all-reduce under ddp, a sum over threads), and the sum unpacks to the
step's vote. Threads and ddp both go through :func:`pack_vote` / :func:`unpack_vote`."""

from __future__ import annotations

from phalanx.failures import WorkerFailure
from phalanx.loop import VOTE_FIELDS, Vote, pack_vote, unpack_vote
from phalanx.replica import LocalResult
from phalanx.strategies.base import member_vote


def a_vote(**kw: object) -> Vote:
    base: dict[str, object] = dict(
        failed=1,
        stop=True,
        regroup=False,
        splittable=1,
        contract=0,
        ledger=(3.0, 10.0, 40.0, 7.0),
        sums=[2.5, 4.0, 1.0],
    )
    base.update(kw)
    return Vote(**base)  # type: ignore[arg-type]


def test_one_vote_round_trips() -> None:
    vote = a_vote()
    back = unpack_vote(pack_vote(vote))
    for name in VOTE_FIELDS:
        assert getattr(back, name) == getattr(vote, name), name
    assert back.ledger == vote.ledger
    assert back.sums == vote.sums
    assert all(type(x) is float for x in back.sums)


def test_a_sum_of_packed_votes_is_the_steps_vote() -> None:
    failure = WorkerFailure(worker=1, rank=1, device="cpu:1", kind="oom", message="x")
    a = a_vote(failed=0, stop=False, splittable=0, regroup=True)
    b = a_vote(failed=1, stop=False, splittable=1, contract=1, ledger=(1.0, 2.0, 4.0, 1.0))
    total = unpack_vote(pack_vote(a) + pack_vote(b), [failure])
    assert (total.failed, total.splittable, total.contract) == (1, 1, 1)
    assert total.stop is False and total.regroup is True  # flags: any member's
    assert total.ledger == (4.0, 12.0, 44.0, 8.0)
    assert total.sums == [x + y for x, y in zip(a.sums, b.sums, strict=True)]
    assert total.failures == [failure]


def test_a_members_result_is_its_vote() -> None:
    failure = WorkerFailure(
        worker=0, rank=0, device="cpu", kind="exception", message="bad",
        exception_type="NonFiniteLossError",
    )  # fmt: skip
    ok = member_vote(LocalResult([1.0, 1.0], ledger=(1.0, 1, 1, 1)), True)
    assert (ok.failed, ok.stop, ok.contract, ok.failures) == (0, True, 0, [])
    bad = member_vote(LocalResult([0.0, 0.0], failure), False, True)
    assert (bad.failed, bad.contract, bad.regroup, bad.failures) == (1, 1, True, [failure])
    assert unpack_vote(pack_vote(ok) + pack_vote(bad)).failed == 1
