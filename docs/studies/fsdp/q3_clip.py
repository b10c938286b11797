"""Q3: clip_grad_norm_ on FSDP2's DTensor gradients: the global norm across shards, the
same on every rank and as one process? Also with gradient accumulation (2 micro-batches,
set_requires_gradient_sync(False) on the first). Same model, splits and metric as q2."""

from common import spawn
from q2_exact import SHARES, compare, reference, worker

if __name__ == "__main__":
    worst = 0.0
    for opt_kind, accum in [("sgd", 1), ("adam", 1), ("sgd", 2), ("adam", 2)]:
        ref, ref_norms = reference(opt_kind, clip=0.5, accum=accum)
        for ws in (2, 3):
            res = spawn(worker, ws, opt_kind, "sum", 0.5, accum)
            if any("error" in r for r in res):
                print(opt_kind, accum, ws, [r.get("error") for r in res])
                continue
            d, k = compare(res[0]["state"], ref)
            worst = max(worst, d)
            nd = max(abs(a - b) / b for a, b in zip(res[0]["norms"], ref_norms, strict=False))
            same = all(r["norms"] == res[0]["norms"] for r in res)
            print(
                f"{opt_kind:4s} clip=0.5 accum={accum} ws={ws} shares={SHARES[ws]}: params rel "
                f"diff {d:.2e} ({k}); total norms rel diff {nd:.1e}, identical on all ranks: "
                f"{same}; step-0 norm {res[0]['norms'][0]:.6f} vs 1 process {ref_norms[0]:.6f}",
                flush=True,
            )
    print(f"WORST {worst:.2e} (goal <= 1e-5)")
