"""Q1b: FSDP2's MixedPrecisionPolicy on CPU over gloo: param_dtype bf16 (fp16) with
reduce_dtype fp32 or the low dtype; does it train, which dtype do the collectives carry?"""

import collections

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import data, generation_group, mlp, shard, spawn, sum_reduction
from torch.distributed.fsdp import MixedPrecisionPolicy

SEEN = collections.Counter()


def run(rank, ws, port, param, reduce):
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
    mesh = generation_group(rank, ws, store, 0)
    for name in ("all_gather_single", "reduce_scatter_single"):
        orig = getattr(dist, name)

        def wrapped(*a, _o=orig, _n=name, **k):
            inp = k.get("input", a[1] if len(a) > 1 else None)
            SEEN[f"{_n}:{inp.dtype}".replace("torch.", "")] += 1
            return _o(*a, **k)

        setattr(dist, name, wrapped)
    mp = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    model = shard(mlp(), mesh, mp_policy=mp)
    sum_reduction(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(12)
    losses = []
    try:
        for _ in range(3):
            loss = F.cross_entropy(
                model(x[rank * 6 : rank * 6 + 6]).float(), y[rank * 6 : rank * 6 + 6]
            )
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(round(loss.item(), 4))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"}
    return {
        "losses": losses,
        "seen": dict(SEEN),
        "param_dtype": str(next(model.parameters()).dtype),
    }


if __name__ == "__main__":
    for param, reduce in [
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, None),
        (torch.float16, torch.float32),
        (torch.float16, None),
    ]:
        r = spawn(run, 2, param, reduce)[0]
        print(
            f"param_dtype={param} reduce_dtype={reduce}: "
            + (
                r["error"]
                if "error" in r
                else f"losses {r['losses']}, sharded params stay {r['param_dtype']}, collectives {r['seen']}"
            )
        )
