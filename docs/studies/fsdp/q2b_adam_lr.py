"""Q2b: the same comparison with Adam at lr 1e-2 (Adam turns rounding in near-zero
gradients into lr-sized steps): is FSDP any further from one process than DDP is?"""

import os

os.environ["SPIKE_ADAM_LR"] = "1e-2"  # read by make_opt, in this process and (spawn) children
from common import spawn
from q2_exact import SHARES, compare, reference, worker

if __name__ == "__main__":
    ref, _ = reference("adam")
    for mode in ("sum", "ddp"):
        for ws in (2, 3):
            res = spawn(worker, ws, "adam", mode)
            d, k = compare(res[0]["state"], ref)
            print(
                f"adam lr=1e-2 {'fsdp sum' if mode == 'sum' else 'ddp'} ws={ws} shares={SHARES[ws]}: "
                f"max rel diff vs 1 process {d:.2e} ({k})",
                flush=True,
            )
