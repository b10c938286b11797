"""The error catalog behind ``phalanx explain CODE``.

One :class:`Explanation` per code: every code an error class in :mod:`phalanx.errors` uses,
plus the kinds of :class:`~phalanx.errors.TrainingFailed` (PX201 crash, PX202 hang, PX203
out of memory, PX204 poison batch, PX205 preflight, PX206 a step that keeps failing, PX207
too many bad samples, PX208 a worker at fault, PX209 a worker too slow), and the warnings a
run gives by code (PX150 a rejected control message). The shape follows burn's error pages:
what it means, when it happens, common causes, what to do, an example fix.
"""

from __future__ import annotations

import difflib
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Explanation:
    """One catalog entry. ``example`` is a short before/after code snippet."""

    code: str
    title: str
    meaning: str
    when: str
    causes: list[str]
    fixes: list[str]
    example: str


_ENTRIES = [
    Explanation(
        code="PX000",
        title="phalanx error",
        meaning="The base of every phalanx error. You see this code only from an error raised "
        "directly as PhalanxError, which phalanx itself does not do.",
        when="Only when code (yours or an extension) raises PhalanxError without a subclass.",
        causes=["A custom extension raising the base class instead of a specific error."],
        fixes=[
            "Read the message: it says what went wrong.",
            "If you raise it yourself, raise a specific subclass so users get a real code.",
        ],
        example="# before\nraise PhalanxError('bad input')\n"
        "# after\nraise InvalidSettingError('patience must be >= 1, got 0')",
    ),
    Explanation(
        code="PX100",
        title="configuration error",
        meaning="Something in the configuration is wrong. Nothing has started: no worker "
        "process or thread was launched, no checkpoint was written.",
        when="In the caller's process, while fit() checks its arguments, before training.",
        causes=[
            "An argument phalanx cannot use; the message names it and the fix.",
            "Code that raises the base ConfigError rather than one of its subclasses.",
        ],
        fixes=[
            "Read the message: it names the argument and the value expected.",
            "Fix it and run again: nothing needs cleaning up, nothing had started.",
        ],
        example="# the message says what to change, e.g.\n"
        "learner.fit(train, valid, epochs=0)   # before\n"
        "learner.fit(train, valid, epochs=10)  # after",
    ),
    Explanation(
        code="PX101",
        title="empty dataset",
        meaning="The training (or validation) dataset has no samples, so there is nothing to "
        "train on or to measure.",
        when="Before training, when fit() measures len() of the datasets.",
        causes=[
            "A filter, split or path glob that matched nothing (wrong data directory).",
            "A train/valid split with a fraction that rounds to zero samples.",
            "A Dataset whose __len__ returns 0 (e.g. files not downloaded yet).",
        ],
        fixes=[
            "Print len(train_set) and len(valid_set) before fit() and check the data path.",
            "Give the split enough samples, or pass valid=None to skip validation.",
        ],
        example="# before\ntrain = ImageFolder('data/trian')   # typo: 0 images\n"
        "# after\ntrain = ImageFolder('data/train')\nassert len(train) > 0",
    ),
    Explanation(
        code="PX102",
        title="invalid batch size",
        meaning="batch_size is not a positive integer. In phalanx batch_size is the GLOBAL "
        "batch: the samples consumed by one optimizer step over all devices together.",
        when="Before training, when fit() validates batch_size.",
        causes=[
            "batch_size=0, a negative number, a float or None.",
            "A per-device batch computed by integer division that came out as 0.",
        ],
        fixes=[
            "Pass a positive integer: the total samples per optimizer step, all devices "
            "together (phalanx splits it across workers for you).",
        ],
        example="# before\nbatch_size = 64 // 128   # 0\n# after\nbatch_size = 64",
    ),
    Explanation(
        code="PX103",
        title="unknown strategy",
        meaning="The strategy name is not one phalanx knows. The strategy decides where "
        "replicas run: 'single' (in process), 'threads' (one thread per device) or 'ddp' "
        "(one process per device, DistributedDataParallel).",
        when="Before training, when fit() looks the strategy up.",
        causes=[
            "A typo ('dpp', 'DDP ', 'multi').",
            "A strategy name from another library ('fsdp', 'deepspeed', 'dp').",
        ],
        fixes=[
            "Use strategy='single', 'threads' or 'ddp'.",
            "For several GPUs or fault tolerance use 'ddp'.",
        ],
        example="# before\nlearner.fit(train, valid, strategy='dpp')\n"
        "# after\nlearner.fit(train, valid, strategy='ddp')",
    ),
    Explanation(
        code="PX104",
        title="device spec cannot be read",
        meaning="A device in the device list is not something torch can parse, or is of a "
        "type phalanx does not train on.",
        when="Before training, while the device list is parsed.",
        causes=[
            "A malformed label: 'gpu0', 'cuda0', 'cuda-1', '0'.",
            "An unsupported device type (phalanx trains on cpu and cuda).",
        ],
        fixes=[
            "Write devices as 'cpu', 'cpu:0,cpu:1', 'cuda:0,cuda:1' or 'auto'.",
            "Several CPU workers are 'cpu:0,cpu:1,...' (they share the host's cores).",
        ],
        example="# before\ndevices = 'gpu0,gpu1'\n# after\ndevices = 'cuda:0,cuda:1'",
    ),
    Explanation(
        code="PX105",
        title="epoch too short",
        meaning="An epoch would not contain one complete optimizer step: the training set is "
        "smaller than one global batch (batch_size is the global batch; grad_accumulation "
        "cuts each device's share into micro-batches and does not change it).",
        when="Before training, when phalanx plans the epoch's global batches.",
        causes=[
            "A tiny (debug) dataset with a production batch size.",
            "A filter or split that left far fewer training samples than expected.",
        ],
        fixes=[
            "Lower batch_size to at most the number of train samples.",
            "Use more training data.",
        ],
        example="# before: 100 samples\nlearner.fit(train, valid, batch_size=256)\n"
        "# after\nlearner.fit(train, valid, batch_size=32)",
    ),
    Explanation(
        code="PX106",
        title="loss is not a scalar",
        meaning="The step function's loss has more than one element. phalanx needs the mean "
        "loss over the local batch (one number) to call backward() and to weight workers.",
        when="At the first step whose step function returns a non-scalar loss.",
        causes=[
            "A loss built with reduction='none' (one value per sample).",
            "Returning the model's output, or a per-class loss vector, instead of the loss.",
        ],
        fixes=[
            "Reduce it: return loss.mean(), or use the loss with reduction='mean'.",
        ],
        example="# before\nloss = F.cross_entropy(logits, y, reduction='none')\n"
        "# after\nloss = F.cross_entropy(logits, y)  # mean",
    ),
    Explanation(
        code="PX107",
        title="loss is NaN or infinite",
        meaning="A step produced a NaN or infinite loss. Stepping the optimizer would write "
        "NaN into every weight on every worker, so phalanx refuses the step and reports it as "
        "that step's failure (with the worker, step and sample indices).",
        when="During training, right after the forward pass of the step that diverged.",
        causes=[
            "Learning rate too high: the loss grows, then overflows.",
            "log(0) or division by zero in the loss (e.g. log of a softmax that hit 0).",
            "Bad samples: NaN/inf features, or labels out of range.",
            "fp16/bf16 overflow without loss scaling.",
        ],
        fixes=[
            "Lower the learning rate, add warmup, or clip gradients.",
            "Use numerically stable ops (F.cross_entropy on logits, log_softmax, eps).",
            "Check the samples named in the report: torch.isfinite(x).all() on them.",
        ],
        example="# before\nloss = -(y * torch.log(torch.softmax(logits, 1))).sum(1).mean()\n"
        "# after\nloss = F.cross_entropy(logits, y)",
    ),
    Explanation(
        code="PX108",
        title="invalid setting",
        meaning="An option is outside the range phalanx accepts (a count below 1, a timeout "
        "of 0, an unknown fault kind, a min_workers above the number of devices...).",
        when="Before training, when settings, early stopping or fault specs are checked.",
        causes=[
            "epochs, grad_accumulation, patience or max_restarts below their minimum.",
            "hang_timeout <= 0, or min_workers larger than the device list.",
            "A fault spec that does not parse, e.g. 'kill:1' without '@STEP'.",
        ],
        fixes=[
            "Read the message: it names the setting and the accepted range.",
            "Fault specs read KIND:WORKER@STEP, e.g. kill:1@30, hang:0@5, oom:1@12.",
        ],
        example="# before\nlearner.fit(train, valid, hang_timeout=0)\n"
        "# after\nlearner.fit(train, valid, hang_timeout=60)",
    ),
    Explanation(
        code="PX109",
        title="step function returned the wrong type",
        meaning="The step function must return a scalar loss tensor or "
        "px.StepOutput(loss=..., outputs=..., targets=...); it returned something else.",
        when="At the first step, when phalanx reads the step function's return value.",
        causes=[
            "Returning loss.item() (a float: no graph to call backward on).",
            "Returning a tuple (loss, logits) or a dict.",
            "Forgetting the return statement (None).",
        ],
        fixes=[
            "Return the loss tensor itself, not loss.item().",
            "To feed metrics, return px.StepOutput(loss=loss, outputs=logits, targets=y).",
        ],
        example="# before\nreturn loss, logits\n"
        "# after\nreturn px.StepOutput(loss=loss, outputs=logits, targets=y)",
    ),
    Explanation(
        code="PX110",
        title="no devices",
        meaning="The device list is empty, so there is no worker to train on.",
        when="Before training, while the device list is parsed.",
        causes=[
            "devices='' or devices=[] (e.g. from an unset environment variable).",
            "A device list filtered down to nothing.",
        ],
        fixes=["Pass devices='cpu', 'cuda:0,cuda:1' or 'auto' (every visible GPU, else cpu)."],
        example="# before\ndevices = os.environ.get('DEVICES', '')\n"
        "# after\ndevices = os.environ.get('DEVICES', 'auto')",
    ),
    Explanation(
        code="PX111",
        title="duplicate device",
        meaning="The same device appears twice in the device list. Two workers on one device "
        "would fight for its memory and give a misleading speed-up.",
        when="Before training, while the device list is parsed.",
        causes=[
            "'cuda:0,cuda:0' or 'cuda,cuda:0' ('cuda' means cuda:0).",
            "'cpu,cpu' meaning two CPU workers.",
        ],
        fixes=[
            "List each device once.",
            "For several CPU workers write 'cpu:0,cpu:1' (distinct labels).",
        ],
        example="# before\ndevices = 'cpu,cpu'\n# after\ndevices = 'cpu:0,cpu:1'",
    ),
    Explanation(
        code="PX112",
        title="device unavailable",
        meaning="A device in the list does not exist on this machine, or CUDA is not "
        "available to this torch.",
        when="Before training, while each device is checked.",
        causes=[
            "A CPU-only torch build (torch.cuda.is_available() is False).",
            "cuda:N with N >= the number of visible GPUs; CUDA_VISIBLE_DEVICES hides some "
            "and renumbers the rest from 0.",
            "A driver that does not match the torch CUDA version.",
        ],
        fixes=[
            "Run python -c 'import torch; print(torch.cuda.device_count())' and nvidia-smi.",
            "Use devices='auto', or indices below the visible GPU count.",
            "Install a CUDA build of torch matching the driver.",
        ],
        example="# before (CUDA_VISIBLE_DEVICES=2,3)\ndevices = 'cuda:2,cuda:3'\n"
        "# after\ndevices = 'cuda:0,cuda:1'",
    ),
    Explanation(
        code="PX113",
        title="global batch smaller than the number of workers",
        meaning="batch_size is the GLOBAL batch, split across workers. With fewer samples per "
        "step than workers, some worker would get an empty slice every step.",
        when="Before training, when fit() compares batch_size with the number of devices.",
        causes=[
            "Passing a per-device batch size while using many devices (batch_size=2 on 8 GPUs).",
            "A tiny debug batch size left on a multi-device run.",
        ],
        fixes=[
            "Raise batch_size to at least the number of devices (per-device batch x devices).",
            "Or train on fewer devices.",
        ],
        example="# before: 8 devices\nlearner.fit(train, valid, batch_size=4, devices='auto')\n"
        "# after: 32 per device\nlearner.fit(train, valid, batch_size=256, devices='auto')",
    ),
    Explanation(
        code="PX114",
        title="factory cannot be pickled",
        meaning="With the ddp strategy each worker is a new process (spawn): the model and "
        "optimizer factories, datasets and metrics are pickled and sent to it. One of them "
        "cannot be pickled.",
        when="Before any worker starts: phalanx pickles everything a worker needs first.",
        causes=[
            "A lambda or a function defined inside another function.",
            "An object holding an open file, a lock, a socket or a generator.",
            "A class defined inside a function or in an interactive session.",
        ],
        fixes=[
            "Define factories as module-level functions (def make_model(): ...).",
            "Bind arguments with functools.partial(make_model, width=128), not a lambda.",
            "Open files inside the worker (in the factory or Dataset.__getitem__).",
        ],
        example="# before\nLearner(model=lambda: Net(128), ...)\n"
        "# after\nLearner(model=functools.partial(Net, 128), ...)",
    ),
    Explanation(
        code="PX115",
        title="step function is a lambda or local function",
        meaning="The step function must be importable by name in a spawned worker process. "
        "Lambdas and functions defined inside other functions are not.",
        when="Before training, when the ddp strategy checks the step function.",
        causes=[
            "step=lambda model, batch: ...",
            "def step(...) written inside main() or another function.",
        ],
        fixes=[
            "Move the step function to module level: def step(model, batch): ...",
            "Bind extra arguments with functools.partial.",
        ],
        example="# before\ndef main():\n    def step(model, batch): ...\n"
        "# after\ndef step(model, batch): ...\n\ndef main(): ...",
    ),
    Explanation(
        code="PX116",
        title="missing if __name__ == '__main__': guard",
        meaning="The ddp strategy starts workers with spawn: each worker re-imports your main "
        "script. Without the guard, every worker would run fit() again and start workers of "
        "its own.",
        when="Before any worker starts, when fit(strategy='ddp') is called at import time of "
        "the main module.",
        causes=["Calling fit() at the top level of the script you run."],
        fixes=[
            "Put the training code in a function and call it under if __name__ == '__main__':",
        ],
        example="# before\nlearner.fit(train, valid, strategy='ddp')\n"
        "# after\ndef main():\n    learner.fit(train, valid, strategy='ddp')\n\n"
        "if __name__ == '__main__':\n    main()",
    ),
    Explanation(
        code="PX117",
        title="device busy",
        meaning="A GPU has less free memory than min_free_memory: another process is using "
        "it, and a worker there would likely run out of memory.",
        when="Before training, when free memory is checked on each CUDA device.",
        causes=[
            "Another training run, a notebook kernel or a zombie process holding the GPU.",
            "A previous crashed run whose worker processes are still alive.",
        ],
        fixes=[
            "Look at nvidia-smi; stop the process holding the device.",
            "Pick other devices, or lower min_free_memory if the run needs less.",
        ],
        example="# before\ndevices = 'cuda:0,cuda:1'   # cuda:0 used by a notebook\n"
        "# after\ndevices = 'cuda:1,cuda:2'",
    ),
    Explanation(
        code="PX118",
        title="run_dir holds an earlier run's checkpoints",
        meaning="fit() was asked to start a fresh run (resume=False) in a run_dir whose "
        "checkpoints/ folder already holds checkpoints. Training there would mix two runs: "
        "retention would delete the older run's files or the new run's own, and a later "
        "resume=True could pick up either. phalanx refuses and touches nothing.",
        when="Before anything starts, in the caller's process.",
        causes=[
            "Running the same script twice with the same run_dir after a finished, "
            "interrupted or failed run.",
            "Forgetting resume=True when restarting a preempted job.",
        ],
        fixes=[
            "Continue the earlier run: pass resume=True (phalanx demo --resume).",
            "Start a new run in a new run_dir, e.g. one named after the date or experiment.",
            "Start over in the same run_dir: delete its checkpoints/ folder first.",
        ],
        example="# before\nlearner.fit(train, run_dir='runs/exp1')   # runs/exp1 has checkpoints\n"
        "# after\nlearner.fit(train, run_dir='runs/exp1', resume=True)  # or run_dir='runs/exp2'",
    ),
    Explanation(
        code="PX120",
        title="checkpoint cannot be used or saved",
        meaning="A checkpoint could not be used or written: resume=True without a run_dir, "
        "a resume whose newest valid checkpoint was written with another plan (dataset "
        "size, batch_size, seed, shuffle, drop_last, or another dataset of the same size: "
        "the plan records a fingerprint of a few samples' contents), or a checkpoint write "
        "that failed during training. Checkpoints that are truncated or fail their checksum "
        "are skipped (and named); when none is left, the run starts from scratch with a "
        "warning instead.",
        when="Before anything starts (resume=True without run_dir; a resume with another "
        "plan, checked in the calling process before any worker starts), or during training "
        "when a checkpoint is written (the run stops with this code, phase checkpoint).",
        causes=[
            "resume=True with no run_dir.",
            "Resuming with another batch_size, dataset, seed, shuffle or drop_last.",
            "An unseeded random_split (or a reshuffled file list) that gives another "
            "training set of the same size on each run.",
            "A full disk or a read-only run_dir; state that torch.load(weights_only=True) "
            "could not open (the message names the key).",
        ],
        fixes=[
            "Pass the run_dir of the run to continue; drop resume=True to start fresh.",
            "Resume with the same dataset, batch_size, seed, shuffle and drop_last, or use "
            "a new run_dir.",
            "Seed the split: random_split(data, sizes, generator=torch.Generator()"
            ".manual_seed(0)).",
            "Free disk space or fix run_dir's permissions; phalanx writes checkpoints "
            "atomically, so older ones survive.",
        ],
        example="# before\nlearner.fit(train, valid, batch_size=64, run_dir='runs/exp1', "
        "resume=True)\n# after (runs/exp1 was trained with batch_size=32)\n"
        "learner.fit(train, valid, batch_size=32, run_dir='runs/exp1', resume=True)",
    ),
    Explanation(
        code="PX121",
        title="a metric raised",
        meaning="A metric's state() (run on every batch) or compute() (run on the summed "
        "state) raised. The report names the metric, quotes its exception and gives the "
        "shapes of the step's outputs and targets to check it against; training stops, "
        "since the same metric would fail on any worker.",
        when="During training (phase metrics) or at the end of an epoch, when metric values "
        "are computed for the progress display and the history.",
        causes=[
            "A custom metric that assumes outputs or targets of another shape or type.",
            "A division by zero in compute() for an empty state (no samples this epoch).",
        ],
        fixes=[
            "Read the metric's name and method in the report; run it on one batch by hand: "
            "m.compute(m.state(output, len(batch))).",
            "Make state() accept what the step returns (px.StepOutput outputs and targets).",
            "Guard compute() against a zero count.",
        ],
        example="# before\nclass MeanTarget(px.metrics.Metric):\n"
        "    def compute(self, state):\n        return state[0].item() / state[1].item()\n"
        "# after\nclass MeanTarget(px.metrics.Metric):\n"
        "    def compute(self, state):\n        return state[0].item() / max(state[1].item(), 1)",
    ),
    Explanation(
        code="PX122",
        title="checkpoint does not fit the model or optimizer",
        meaning="fit(resume=True) found a valid checkpoint, but its model or optimizer state "
        "does not fit this run's: other layers or shapes, another optimizer, or another "
        "number of parameter groups. The error names the checkpoint file and what did not "
        "fit; nothing was trained and the checkpoint is left as it was.",
        when="At the start of fit(resume=True), before the first step.",
        causes=[
            "The model changed since the checkpoint was written (a layer added, a width "
            "changed, another architecture).",
            "Another optimizer (e.g. Adam instead of SGD) or other parameter groups.",
            "A run_dir that belongs to another experiment.",
        ],
        fixes=[
            "Resume with the same model and optimizer as the run that wrote the checkpoint.",
            "Train the changed model in a new run_dir (or without resume=True).",
        ],
        example="# before (runs/exp1 was trained with torch.optim.SGD)\n"
        "px.Learner(make_model, adam, step).fit(train, run_dir='runs/exp1', resume=True)\n"
        "# after\npx.Learner(make_model, sgd, step).fit(train, run_dir='runs/exp1', "
        "resume=True)\n# or: .fit(train, run_dir='runs/exp2')",
    ),
    Explanation(
        code="PX200",
        title="a worker raised an exception",
        meaning="Training stopped because a worker raised. The report's first line names the "
        "root cause: worker, device, host, step, phase and the original exception; every "
        "other failure (e.g. 'Connection reset by peer' on survivors) is secondary.",
        when="During training, in the phase the report names (data, forward, backward, "
        "optimizer, metrics, validation, checkpoint).",
        causes=[
            "A bug in the step function, model or dataset (shape mismatch, KeyError...).",
            "A sample that only this worker's slice contains.",
            "A device error on that worker.",
        ],
        fixes=[
            "Read the traceback in the report: it is the worker's own.",
            "Reproduce with strategy='single' on that device and the sample indices shown.",
        ],
        example="# before\nlogits = model(x.view(-1, 784))   # x is 3x32x32\n"
        "# after\nlogits = model(x.flatten(1))",
    ),
    Explanation(
        code="PX201",
        title="a worker process crashed",
        meaning="A worker process died without raising a Python exception: killed by a "
        "signal or exited on its own. The report gives the exit code or signal, and for a "
        "crash in native code (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) the Python stacks of "
        "every thread of the worker as it died.",
        when="During training; the supervisor notices the death within milliseconds.",
        causes=[
            "SIGKILL (-9): often the kernel OOM killer, host RAM exhausted (not GPU memory).",
            "SIGSEGV (-11): a crash in native code (a C extension, a driver, a CUDA kernel).",
            "os._exit() or sys.exit() called from user code or a library.",
            "An operator or scheduler killing the process (job preemption).",
        ],
        fixes=[
            "For SIGKILL, check dmesg / journalctl -k for 'Out of memory: Killed process'.",
            "Lower host memory use: a smaller batch_size, fewer DataLoader workers, no "
            "whole dataset per worker.",
            "For SIGSEGV, read the crashed worker's stacks in the report: the innermost "
            "frame of its main thread is where native code was called; reproduce with "
            "strategy='single' on that device.",
            "Let the run go on: max_restarts respawns a worker, min_workers lets it shrink.",
        ],
        example="# before: every worker loads the full array into RAM\n"
        "data = np.load('big.npy')\n"
        "# after: memory-mapped, shared by the page cache\n"
        "data = np.load('big.npy', mmap_mode='r')",
    ),
    Explanation(
        code="PX202",
        title="a worker hung",
        meaning="A worker's step counter did not move for hang_timeout seconds while its peers "
        "waited. phalanx dumped its Python stacks into the report, then killed it.",
        when="During training, hang_timeout seconds after the worker's last progress.",
        causes=[
            "A collective (all_reduce, barrier) that only some ranks call, e.g. inside an "
            "if on rank or on data.",
            "A deadlock in the data path: DataLoader workers, queues, locks.",
            "An infinite loop or a blocking read (network, input()) in user code.",
            "hang_timeout shorter than a legitimately slow step or a first-step compile.",
        ],
        fixes=[
            "Read the stacks in the report: they show the line the worker was stuck on.",
            "Make every rank call the same collectives in the same order.",
            "Raise hang_timeout if steps are legitimately long.",
        ],
        example="# before\nif rank == 0:\n    dist.all_reduce(t)   # other ranks never join\n"
        "# after\ndist.all_reduce(t)   # every rank",
    ),
    Explanation(
        code="PX203",
        title="a worker ran out of memory",
        meaning="A worker raised torch.OutOfMemoryError: its device could not allocate the "
        "tensors the step needed.",
        when="During training, usually in forward or backward of the first steps, or when a "
        "larger batch or sequence comes along.",
        causes=[
            "A per-device batch too large for the device.",
            "Another process using the same GPU.",
            "Keeping graphs alive: accumulating loss tensors instead of loss.item().",
            "One very long sample (variable-length inputs).",
        ],
        fixes=[
            "Lower batch_size, or keep it and use grad_accumulation=N (N smaller "
            "micro-batches per optimizer step, same math).",
            "Use more devices: the global batch is split across them.",
            "Free the device (nvidia-smi) or set min_free_memory to check before launch.",
        ],
        example="# before\n"
        "px.Learner(make_model, make_optimizer, step).fit(train, batch_size=512)\n"
        "# after: same global batch, each device's share in 4 micro-batches\n"
        "px.Learner(make_model, make_optimizer, step, grad_accumulation=4).fit(\n"
        "    train, batch_size=512)",
    ),
    Explanation(
        code="PX204",
        title="poison batch",
        meaning="The same step failed again and again in the same way: a failure that "
        "repeats on the same samples is evidence that the batch (or the code it triggers) is "
        "the cause, not chance, so phalanx stops rather than kill healthy workers one by "
        "one. The first failure is the root cause. The evidence: for an exception (or an "
        "out-of-memory error that splitting cannot absorb), the same type and message again "
        "in a later attempt, on samples in common; for a death or a hang, which carry no "
        "message (two one-off kills can strike overlapping shares by chance), three attempts "
        "of the step failing the same way in the same phase, with a sample common to all "
        "three shares, whichever worker each new split gives it to. Different failures in "
        "successive attempts (an exception, then a crash; a hang, then a one-off exception "
        "elsewhere) are retried (see PX206).",
        when="During training, when an attempt of a failed step fails again the same way "
        "(under ddp also when the retry runs in a new generation, after a worker fell).",
        causes=[
            "A bug in the step function that this batch triggers.",
            "A bad sample: NaN/inf values, a wrong shape, a label out of range.",
            "A deterministic error in the data pipeline for these indices.",
            "A sample that crashes the process (a segfault in a decoder or custom op) or "
            "needs more host memory than there is (the kernel's OOM killer).",
        ],
        fixes=[
            "Read the first failure in the report: its traceback is the bug.",
            "Load the sample indices listed in the report and inspect them.",
            "Fix or filter the samples, or fix the step function, then resume.",
        ],
        example="# inspect the samples the report names\n"
        "for i in [18211, 18212]:\n    x, y = train[i]\n"
        "    print(i, x.shape, torch.isfinite(x).all(), y)",
    ),
    Explanation(
        code="PX206",
        title="a step keeps failing",
        meaning="One step failed in every one of its attempts (4), each time differently: no "
        "two of its failures were the same failure on the same samples, so no batch is to "
        "blame (that would be PX204), but the run cannot get past the step either. The "
        "report lists every failure of the step, in order; the first is the root cause.",
        when="During training, at the fourth failed attempt of one step.",
        causes=[
            "An unstable machine or device: workers dying or hanging one after another.",
            "Several independent faults arriving together (a flaky filesystem, a network "
            "storage outage under the data loader).",
            "A nondeterministic bug that fails differently each time (a race in user code).",
        ],
        fixes=[
            "Read every failure the report lists: look for what they share (a host, a device, "
            "a phase, a time).",
            "Check the machine's health (dmesg, nvidia-smi, free -h) before resuming.",
            "Resume from the last checkpoint (resume=True) once the cause is fixed.",
        ],
        example="# after fixing the machine, go on from the last checkpoint\n"
        "px.Learner(make_model, make_optimizer, step).fit(\n"
        "    train, batch_size=512, strategy='ddp', run_dir='runs/a', resume=True)",
    ),
    Explanation(
        code="PX207",
        title="too many bad samples",
        meaning="With fit(on_bad_sample='skip'), more samples failed alone (an exception "
        "while reading or in the step, a loss that is not finite) than max_bad_samples "
        "allows. The data is broken wholesale (a wrong path or format, a decoder that cannot "
        "read any record), not a few samples, and leaving them out would train on what is "
        "left without saying so.",
        when="During training, when the quarantine grows past max_bad_samples.",
        causes=[
            "A dataset pointed at files of another format or version.",
            "A preprocessing bug that breaks many records (a wrong normalisation giving NaN).",
            "A learning rate that makes the loss infinite on many batches (not a data fault).",
        ],
        fixes=[
            "Read the quarantined samples and their errors in the report and in "
            "run_dir/quarantine.json; fix the data or the reader.",
            "If the loss diverges (NaN everywhere), lower the learning rate or clip "
            "gradients (grad_clip_norm=) rather than skipping samples.",
            "Raise max_bad_samples only when that many bad records are expected.",
        ],
        example="learner.fit(data, on_bad_sample='skip', max_bad_samples=100,\n"
        "            run_dir='runs/a')  # each one listed in runs/a/quarantine.json",
    ),
    Explanation(
        code="PX208",
        title="a worker at fault",
        meaning="With fit(on_bad_sample='skip'), a member's part of a step failed on it in "
        "two attempts and then passed on another member: the worker is at fault, not the "
        "data. Under ddp it is put out like a fallen worker (respawned or shrunk, as "
        "on_failure says) and the step goes on without it; in one process (threads) nothing "
        "can leave, so the run stops with this report.",
        when="During training, right after the attempt that tried the part elsewhere.",
        causes=[
            "A faulty device (a GPU with memory errors, a throttled or misconfigured one).",
            "Something on that worker only: its process state, its environment, a library "
            "loaded there.",
        ],
        fixes=[
            "Check the named device's health (nvidia-smi -q, dmesg) and take it out of the "
            "device list if it keeps failing.",
            "Under threads, train with strategy='ddp', which can put a worker out and go on.",
        ],
        example="learner.fit(data, strategy='ddp', devices='cuda:0,cuda:1,cuda:2',\n"
        "            on_bad_sample='skip', on_failure=px.Recovery('shrink'))",
    ),
    Explanation(
        code="PX209",
        title="a worker too slow",
        meaning="With fit(slow_worker=F), a member's time per sample (measured every step, "
        "smoothed) stayed above F times the median of its peers'. Balance (on by default) "
        "already gives it a smaller share; past F it is put out like a failed worker: under "
        "ddp respawned or shrunk as on_failure says, so the others stop waiting for it.",
        when="During training, at a balance decision (every 8 committed steps), once it was over "
        "F at two decisions in a row.",
        causes=[
            "A throttled or faulty GPU (thermal throttling, a slower model in the mix).",
            "A noisy neighbour on that machine, a degraded network link to it.",
        ],
        fixes=[
            "Check the device (nvidia-smi -q -d PERFORMANCE, dmesg) and take it out of the "
            "device list if it stays slow.",
            "With on_failure=px.Recovery('shrink') the run goes on without it; respawn starts "
            "a replacement on the same device, which helps only when the slowness was the "
            "process's.",
        ],
        example="learner.fit(data, strategy='ddp', devices=devices, slow_worker=3.0,\n"
        "            on_failure=px.Recovery('shrink'))",
    ),
    Explanation(
        code="PX205",
        title="a worker failed during preflight",
        meaning="A worker failed before its first step, while setting up: building the model "
        "and optimizer, moving them to its device, joining the process group or loading its "
        "first batch.",
        when="At the start of training (or of a new generation), before step 1 runs.",
        causes=[
            "The model or optimizer factory raised in the worker.",
            "The device failed to initialise (driver error, device busy).",
            "An import that works in your shell but not in a spawned process.",
        ],
        fixes=[
            "Read the traceback in the report: it is the worker's own.",
            "Call the factories once yourself, e.g. make_model().to('cuda:1').",
            "Run with strategy='single' on the same device to reproduce.",
        ],
        example="# before: factory reads a relative path\n"
        "def make_model(): return torch.load('weights.pt')\n"
        "# after\nWEIGHTS = Path(__file__).parent / 'weights.pt'\n"
        "def make_model(): return torch.load(WEIGHTS)",
    ),
    Explanation(
        code="PX119",
        title="dataset cannot be pickled",
        meaning="With the ddp strategy each worker is a new process (spawn) and gets its own "
        "copy of the training and validation datasets, pickled in the caller and unpickled in "
        "the worker. The dataset named in the message cannot be pickled, so no worker could "
        "receive it.",
        when="Before any worker starts: fit(strategy='ddp') tries to pickle both datasets "
        "first (tensors in them are not copied for this check).",
        causes=[
            "A Dataset class defined inside a function, a notebook cell or a test.",
            'A Dataset class defined under `if __name__ == "__main__":`: the workers '
            "re-import the script without running that block (named before any worker "
            "starts).",
            "A dataset holding an open file, a database connection, a lock or a generator "
            "(opened in __init__).",
            "A lambda or nested function stored on the dataset (a transform, a filter).",
        ],
        fixes=[
            "Define the Dataset class at module level, in a file the workers can import.",
            "Keep tensors, arrays or file paths in the dataset; open files and connections "
            "lazily in __getitem__ (once per worker), not in __init__.",
            "Replace lambdas by module-level functions or functools.partial.",
        ],
        example="# before\ndef main():\n    class Frames(Dataset):\n"
        "        def __init__(self): self.fh = open('frames.bin', 'rb')\n"
        "# after: at module level, the file opened in the worker\nclass Frames(Dataset):\n"
        "    def __init__(self, path): self.path, self.fh = path, None\n"
        "    def __getitem__(self, i):\n"
        "        self.fh = self.fh or open(self.path, 'rb')\n        ...",
    ),
    Explanation(
        code="PX123",
        title="ddp devices mix CUDA and CPU",
        meaning="strategy='ddp' runs one process per device and joins them in one process "
        "group, whose backend follows the device: NCCL for CUDA, gloo otherwise. A list that "
        "mixes CUDA and other devices would make the workers pick different backends, and "
        "they could never form one group.",
        when="Before any worker starts, when fit(strategy='ddp') checks the device list.",
        causes=[
            "A device list such as 'cpu:0,cuda:0', e.g. to use the CPU as an extra worker.",
            "A list built from several sources (a config file and a default).",
        ],
        fixes=[
            "Use only CUDA devices (devices='cuda:0,cuda:1'), or only CPU workers "
            "(devices='cpu:0,cpu:1').",
            "Leave the CPU out: every step waits for its slowest worker, so a CPU worker "
            "would hold the GPUs back anyway.",
        ],
        example="# before\nlearner.fit(train, strategy='ddp', devices='cpu:0,cuda:0')\n"
        "# after\nlearner.fit(train, strategy='ddp', devices='cuda:0,cuda:1')",
    ),
    Explanation(
        code="PX124",
        title="torch.distributed called from user code",
        meaning="Your code (the step, the model factory, a metric) called torch.distributed's "
        "default process group: dist.get_rank(), get_world_size(), barrier(). phalanx never "
        "creates that group: each generation of ddp workers forms a group of its own, so that "
        "a fallen worker can be replaced without torch's global state, and the single and "
        "threads strategies have no process group at all. torch then raises 'Default process "
        "group has not been initialized, please make sure to call init_process_group', which "
        "is not the fix here.",
        when="At the first call: in preflight under ddp (before any step is trained), else "
        "in the first step. The run stops at once: a retry would call it again.",
        causes=[
            "A ported DDP script that asks `if dist.get_rank() == 0:` before saving or printing.",
            "dist.get_world_size() used to scale a learning rate or a batch size.",
            "dist.barrier() left from a hand-written training loop.",
        ],
        fixes=[
            "Replace dist.get_rank() by px.rank(), dist.get_world_size() by px.world_size() "
            "and `dist.get_rank() == 0` by px.is_main() (the member that writes files).",
            "Delete dist.barrier() and dist.init_process_group(): phalanx steps every member "
            "together and forms the groups itself.",
            "Outside training (the script around fit), px.is_main() is True on the head node, "
            "and px.world_size(devices) gives the job's device count.",
        ],
        example="# before\nif dist.get_rank() == 0:\n    torch.save(model.state_dict(), "
        "'model.pt')\n# after\nif px.is_main():\n    torch.save(model.state_dict(), "
        "'model.pt')",
    ),
    Explanation(
        code="PX125",
        title="argument of the wrong type",
        meaning="An argument of Learner(...) or fit(...) is not of the type phalanx takes, "
        "e.g. grad_clip_norm='1.0' (a string) or epochs=2.5. Nothing has started.",
        when="When Learner(...) is built (its arguments) or when fit() is called (fit's), "
        "before any check of values and before any process, thread or file.",
        causes=[
            "A value read from a config file or the command line and passed as a string.",
            "A float where a whole number is meant (epochs, batch_size, max_steps).",
            "An argument given positionally in another library's order.",
        ],
        fixes=[
            "Pass the type the message names (it shows the value and, for a number in a "
            "string, the number to pass).",
            "Convert values read from text: int(cfg['epochs']), float(cfg['clip']).",
        ],
        example="# before\nLearner(model, opt, step, grad_clip_norm='1.0')\n"
        "# after\nLearner(model, opt, step, grad_clip_norm=1.0)",
    ),
    Explanation(
        code="PX126",
        title="checkpoint of an earlier format",
        meaning="The checkpoint file starts with the header of phalanx's first checkpoint "
        "format (PHALANX-CKPT-1, with the checksum inside the file), which was never released "
        "and which this version does not read. Checkpoints are now plain torch.save files "
        "that open with torch.load(path, weights_only=True); their checksums live in "
        "checkpoints.json beside them. Nothing on disk is changed.",
        when="At the start of fit(resume=True) when the newest checkpoint has the old format, "
        "or when px.load_checkpoint() opens such a file.",
        causes=[
            "A run_dir written by a development build of phalanx before the format changed.",
        ],
        fixes=[
            "Start the run again in a new run_dir (resume=False).",
            "Delete the old-format files from run_dir/checkpoints/ to resume from newer ones "
            "beside them, if any.",
        ],
        example="# before\nlearner.fit(train, run_dir='runs/old', resume=True)\n"
        "# after\nlearner.fit(train, run_dir='runs/new')",
    ),
    Explanation(
        code="PX127",
        title="a DataLoader passed as the dataset",
        meaning="fit() takes the dataset itself (a map-style torch Dataset) and the GLOBAL "
        "batch size: phalanx builds its own DataLoaders, because step s of every epoch must "
        "use the same samples whoever computes it, and it splits each global batch among the "
        "devices. A DataLoader in its place would be read as a dataset of batches.",
        when="Before anything starts, when fit() checks its datasets (train or valid).",
        causes=[
            "A script ported from a plain training loop that built "
            "DataLoader(dataset, batch_size=..., shuffle=True).",
        ],
        fixes=[
            "Pass loader.dataset as the dataset and the loader's batch size as batch_size= "
            "(the global batch). shuffle=, drop_last=, num_workers=, collate_fn= and "
            "pin_memory= are fit() arguments too.",
        ],
        example="# before\nloader = DataLoader(data, batch_size=64, shuffle=True)\n"
        "learner.fit(loader, epochs=3)\n"
        "# after\nlearner.fit(data, batch_size=64, shuffle=True, epochs=3)",
    ),
    Explanation(
        code="PX128",
        title="a dataset without len() and indexing",
        meaning="phalanx plans every epoch as a seeded permutation of sample indices, so that "
        "each sample is used exactly once per epoch whoever computes it, and a failed step "
        "is computed again with the same samples. That needs a map-style dataset: __len__ "
        "and __getitem__. A stream (an IterableDataset, a generator) has neither: it cannot "
        "have an exactly-once plan, and is refused.",
        when="Before anything starts, when fit() checks its datasets (train or valid).",
        causes=[
            "An IterableDataset (webdataset, a streaming dataset, a database cursor).",
            "A generator or a list iterator passed instead of a dataset.",
        ],
        fixes=[
            "Stream it with px.Stream(shards, read): a list of shard names (files, URLs) and "
            "a module-level read(shard) that yields the shard's samples front to back; "
            "phalanx plans it exactly once per epoch (phalanx.stream.huggingface and "
            "phalanx.stream.webdataset wrap those libraries' streams).",
            "Or use a map-style Dataset: index the records (a list of files or offsets) and "
            "read record i in __getitem__.",
        ],
        example="# before\nclass Tokens(IterableDataset):\n    def __iter__(self): ...\n"
        "# after\ndef read(shard):\n    for record in open_records(shard):\n"
        "        yield decode(record)\n\nfit(px.Stream(shard_paths, read), ...)",
    ),
    Explanation(
        code="PX160",
        title="a stream that cannot be planned",
        meaning="px.Stream(shards, read, lengths=..., lanes=..., shuffle_buffer=...) "
        "describes a dataset read front to back, shard by shard. phalanx plans every epoch "
        "from the shard list and each shard's length, so it needs a non-empty list of "
        "shard names, a read function, one sample count per shard when lengths are given, "
        "and whole numbers >= 1 for lanes and shuffle_buffer.",
        when="When px.Stream(...) is made, or when fit() plans a stream whose lengths it "
        "does not know yet.",
        causes=[
            "A glob pattern or a single path passed as shards instead of a list of them.",
            "lengths with another count of values than shards, or negative counts.",
            "read given as something that cannot be called (a file name, a list).",
        ],
        fixes=[
            "shards=sorted(glob.glob('data/*.tar')): a list, in a fixed order.",
            "Omit lengths= to have phalanx count each shard once (kept in "
            "run_dir/stream_lengths.json for a resume), or give one count per shard.",
        ],
        example="px.Stream(sorted(glob.glob('data/part-*.bin')), read, lengths=None)",
    ),
    Explanation(
        code="PX161",
        title="a shard of a stream could not be read",
        meaning="read(shard) raised while opening the shard or while reading a sample of it, "
        "and again on each retry (the shard is opened again at that sample, 3 attempts in "
        "all, waiting longer each time). The error names the shard, the sample where it "
        "failed and the error read raised. In a worker it is that step's failure: if the "
        "same samples fail again the run stops with it as the root cause.",
        when="During training, in the worker reading that shard (or in fit() when it counts "
        "the shards' samples).",
        causes=[
            "Object storage or a network file system refusing or timing out for longer than "
            "the retries wait.",
            "A record that cannot be decoded (a corrupt file, a wrong decoder).",
            "Credentials that the workers do not have (environment not passed on).",
        ],
        fixes=[
            "Read the shard named in the message alone: list(read(shard)) shows the error.",
            "Fix or drop the shard, then start a new run (another shard list is another "
            "dataset; a resume refuses it).",
        ],
        example="# reproduce what the worker saw\nfor i, sample in enumerate(read(shard)):\n"
        "    pass",
    ),
    Explanation(
        code="PX162",
        title="a shard of a stream changed under the run",
        meaning="A shard is gone, or yields more or fewer samples than when the run planned "
        "its epochs (counted at the start, given in lengths=, or kept in the checkpoint it "
        "resumed). The plan says which samples each step uses; with the shard changed, "
        "those samples no longer exist, so the run stops instead of training on others.",
        when="During training, when a worker reads past the planned end of a shard, or "
        "reaches it early, or cannot find the shard.",
        causes=[
            "A shard rewritten or appended to while the run trains or between two sessions.",
            "A file truncated by a full disk or an interrupted copy.",
            "lengths= given by hand that do not match the files.",
        ],
        fixes=[
            "Restore the shard as it was to resume the run.",
            "Or start a new run on the new data (omit lengths= to have them counted).",
        ],
        example="px.Stream(shards, read)  # lengths counted from the files as they are",
    ),
    Explanation(
        code="PX130",
        title="unknown or unusable precision",
        meaning="precision= names how the step computes: '32' (float32), 'bf16-mixed' "
        "(autocast to bfloat16) or '16-mixed' (autocast to float16 with a gradient scaler). "
        "The value given is none of these, the device cannot compute in it, or grad_scaler= "
        "was given without '16-mixed' or with an argument torch.amp.GradScaler does not take.",
        when="Before training, when fit() checks the Learner's settings.",
        causes=[
            "Another library's spelling: 'fp16', 'bf16', 16 or 'mixed'.",
            "bf16-mixed on a GPU without bfloat16 support (before Ampere).",
            "grad_scaler={'init_scale': ...} with precision='32' or 'bf16-mixed' (bf16 needs "
            "no scaler), or a misspelt key.",
        ],
        fixes=[
            "Use precision='16-mixed' or 'bf16-mixed' (Lightning's names), or '32'.",
            "On a GPU without bf16, use '16-mixed'.",
            "Pass grad_scaler only with '16-mixed', with keys among init_scale, "
            "growth_factor, backoff_factor, growth_interval.",
        ],
        example="# before\npx.Learner(model, adam, step, precision='fp16')\n"
        "# after\npx.Learner(model, adam, step, precision='16-mixed')",
    ),
    Explanation(
        code="PX131",
        title="an optimizer instead of an optimizer factory",
        meaning="The Learner got an optimizer (or scheduler) object. Every replica builds "
        "its own optimizer over its own copy of the model, so phalanx needs something it can "
        "call: a torch optimizer class, a functools.partial of one, or a function.",
        when="Before training, when fit() checks the Learner's settings.",
        causes=[
            "A script ported from plain DDP: optimizer = torch.optim.SGD(model.parameters()) "
            "built first, then handed to the Learner.",
            "A scheduler object instead of a function of the optimizer.",
        ],
        fixes=[
            "Pass the class with its settings: functools.partial(torch.optim.SGD, lr=0.1).",
            "Or a function: def make_optimizer(model): return torch.optim.AdamW(groups) "
            "(a first parameter named model gets the model, for parameter groups).",
            "For schedulers: lr_scheduler=functools.partial(StepLR, step_size=10).",
        ],
        example="# before\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "px.Learner(model, opt, step)\n"
        "# after\npx.Learner(model, functools.partial(torch.optim.SGD, lr=0.1), step)",
    ),
    Explanation(
        code="PX140",
        title="a launcher's environment cannot be read",
        meaning="fit() reads where this process stands in a job from its launcher's "
        "environment: PHALANX_NNODES, PHALANX_NODE_RANK and PHALANX_HEAD (set by phalanx run "
        "or by hand), torchrun's (GROUP_WORLD_SIZE, GROUP_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT) or Slurm's (SLURM_NNODES, SLURM_NODEID, the node list, the tasks per "
        "node). One of those variables holds a value that means nothing.",
        when="First thing in fit(), before any other check, process or file.",
        causes=[
            "A count or a rank that is not a whole number (PHALANX_NNODES=two, NODE_RANK='').",
            "A node rank not below the node count (PHALANX_NODE_RANK=2 with PHALANX_NNODES=2: "
            "nodes are numbered from 0).",
            "A head without a port (PHALANX_HEAD=node0), or a port outside 1 to 65535.",
            "PHALANX_NODE_RANK or PHALANX_HEAD exported without PHALANX_NNODES, e.g. left over "
            "in a shell from an earlier job.",
            "A Slurm node list or tasks-per-node value that was edited by hand and no longer "
            "expands (unbalanced brackets, a range that goes backwards).",
        ],
        fixes=[
            "Read the message: it names the variable, its value and what it should be.",
            "Start the script with phalanx run --nnodes N --node-rank R --head HOST:PORT, "
            "which checks its arguments and sets the PHALANX_* variables for you.",
            "Unset PHALANX_* variables that belong to another job (env | grep PHALANX).",
        ],
        example="# before\nPHALANX_NNODES=1 PHALANX_HEAD=node0 python train.py\n"
        "# after\nPHALANX_NNODES=1 python train.py        # one node needs no head\n"
        "phalanx run --nnodes 1 train.py            # the same, checked",
    ),
    Explanation(
        code="PX141",
        title="several processes per node: each would train a copy",
        meaning="The launcher started more than one process on this node (torchrun "
        "--nproc-per-node 2, srun --ntasks-per-node 2). Each of them would call fit() and "
        "train the whole job on its own, into the same run_dir: copies, not one job. phalanx "
        "starts one worker per device itself (strategy='ddp'), so it needs exactly one "
        "process per node, and devices= names that node's devices.",
        when="First thing in fit(), on every process the launcher started, before any other "
        "check, process or file: every one of them exits with this error.",
        causes=[
            "A plain DDP launch command kept when porting a script to phalanx: torchrun "
            "--nproc-per-node=NUM_GPUS train.py.",
            "A Slurm script with --ntasks-per-node equal to the number of GPUs, as plain DDP "
            "or MPI jobs use.",
        ],
        fixes=[
            "torchrun: launch one process per node, torchrun --nproc-per-node 1 train.py, or "
            "just python train.py on one machine.",
            "Slurm: srun --ntasks-per-node 1 python train.py.",
            "Name the node's devices in fit: devices='cuda:0,cuda:1' or devices='auto' "
            "(every visible GPU) with strategy='ddp'.",
        ],
        example="# before\ntorchrun --nproc-per-node 4 train.py\n"
        "# after\ntorchrun --nproc-per-node 1 train.py   # and in train.py:\n"
        "learner.fit(data, strategy='ddp', devices='auto')",
    ),
    Explanation(
        code="PX142",
        title="several nodes train with strategy='ddp' or 'fsdp' only",
        meaning="The launch names several nodes (PHALANX_NNODES, torchrun's --nnodes, or "
        "Slurm's node count for the step is above 1) but fit() was given a strategy that "
        "trains on one node only ('single' or 'threads'): each node would train its own "
        "copy. Across nodes, phalanx runs strategy='ddp' or 'fsdp': node 0 is the head (store, "
        "coordinator), every node starts and watches its own workers (docs/multinode.md).",
        when="First thing in fit(), on every node, before any other check, process or file.",
        causes=[
            "torchrun --nnodes 2 or an srun step over several nodes with strategy='single' "
            "or 'threads'.",
            "phalanx run --nnodes 2 (or PHALANX_NNODES=2) with such a strategy.",
        ],
        fixes=[
            "Pass strategy='ddp' or 'fsdp' (every node runs the same script; devices= names "
            "that node's devices).",
            "Or run on one node: torchrun --nnodes 1 --nproc-per-node 1, srun --nodes 1 "
            "--ntasks-per-node 1, or python train.py.",
        ],
        example="# before\nlearner.fit(data, strategy='threads', devices='cuda:0,cuda:1')\n"
        "# after (on every node)\nlearner.fit(data, strategy='ddp', devices='cuda:0,cuda:1')",
    ),
    Explanation(
        code="PX143",
        title="run_dir is in use by a live run",
        meaning="Another fit() holds this run_dir right now (its lock, run_dir/phalanx.lock, "
        "names its pid and host). Two runs in one folder would overwrite each other's "
        "checkpoints, run.json and logs, so the second is refused before it moves or writes "
        "anything there. The lock ends with the run that holds it, however it ends; a lock "
        "left by a killed run is taken over with a notice.",
        when="In fit(), after the argument checks, before anything in run_dir is touched.",
        causes=[
            "The same script started twice (two terminals, a job resubmitted while the first "
            "one still runs).",
            "A second fit() on the same run_dir from another thread of the same program.",
            "The first run was killed but a process it forked (a DataLoader worker) is still "
            "alive and holds the lock: the message says so when the pid has ended.",
        ],
        fixes=[
            "Wait for the other run to end, or stop it (Ctrl-C, or kill the pid the message "
            "names); then resume=True continues it.",
            "Or pass another run_dir for a separate run.",
        ],
        example="# before: a second terminal, while the first run trains\n"
        "learner.fit(data, run_dir='runs/a', resume=True)\n"
        "# after\nlearner.fit(data, run_dir='runs/b')   # or wait for runs/a to finish",
    ),
    Explanation(
        code="PX144",
        title="the nodes of a run disagree, or did not all join",
        meaning="Every node's fit() must train the same job: the head compares what each "
        "node says when it joins (torch and phalanx versions, the plan: dataset size, batch, "
        "seed, shuffling and a fingerprint of some samples, the epochs, max_steps, "
        "precision, recovery policy, hang_timeout, checkpoint settings and resume) with its "
        "own. A node that differs is refused, and the head stops too, before any worker "
        "starts: each line names the setting, the head's value and the node's. The same "
        "code is given when a node does not join (or cannot reach the head) in time.",
        when="In fit() on every node, after the local checks, before any worker starts.",
        causes=[
            "Different script versions or arguments on the nodes (epochs, batch size).",
            "A dataset built differently on one node (an unseeded random_split, another "
            "file), or different torch versions in the nodes' environments.",
            "A node that was never started, or PHALANX_HEAD naming another host or port.",
        ],
        fixes=[
            "Run the same script with the same arguments and environment on every node.",
            "Seed whatever builds the dataset (torch.Generator().manual_seed(...)).",
            "Start every node with PHALANX_HEAD=<head host>:<port> reachable from it.",
        ],
        example="# [PX144] node 1 (gpu7): nodes disagree: epochs: the head has 4, this node 5\n"
        "# run the same command on every node",
    ),
    Explanation(
        code="PX146",
        title="this node's collectives would bind to loopback",
        meaning="Across machines, gloo binds each worker's collectives to the address its "
        "host's name resolves to, unless GLOO_SOCKET_IFNAME names a network interface; "
        "where the name resolves to a loopback address (an /etc/hosts line such as "
        "'127.0.1.1 myhost' is common) or not at all, gloo falls back to loopback and "
        "gives the other nodes 127.0.0.1 for this node: their collectives with it never "
        "connect and wait until their timeout. phalanx refuses to start instead; likewise "
        "when GLOO_SOCKET_IFNAME (CPU devices) or NCCL_SOCKET_IFNAME (CUDA devices) selects "
        "only loopback interfaces (lo). A head on a loopback address means every node is "
        "on this one machine: then nothing is checked.",
        when="In fit() on every node of a multi-node run, before the head listens or the "
        "node joins: before anything trains.",
        causes=[
            "The host's name maps to 127.0.0.1 or 127.0.1.1 in /etc/hosts (many images do).",
            "The host's name does not resolve at all (no DNS entry).",
            "GLOO_SOCKET_IFNAME=lo or NCCL_SOCKET_IFNAME=lo left over from a one-machine setup.",
        ],
        fixes=[
            "export GLOO_SOCKET_IFNAME=<interface> on every node: the interface that "
            "reaches the head (`ip route get <head address>` names it, e.g. eth0, ib0).",
            "Or map the host's name to its cluster address in /etc/hosts or DNS.",
        ],
        example="# before\nPHALANX_HEAD=10.0.0.1:29410 python train.py     # PX146 on this node\n"
        "# after\nGLOO_SOCKET_IFNAME=eth0 PHALANX_HEAD=10.0.0.1:29410 python train.py",
    ),
    Explanation(
        code="PX145",
        title="this node was cut off, and the run went on without it",
        meaning="Across machines the head hears from every node at least once a second. A "
        "node it heard nothing from for node_timeout (frozen, partitioned, its host "
        "suspended) is lost: the head tells it so and the other nodes go on without its "
        "workers (their collectives with it are abandoned at once). When such a node wakes "
        "up it reads that word, stops its workers and ends fit() with this error: nothing "
        "its workers computed after the cut was committed, and the run's model is the "
        "head's. A head is fenced the same way: when the other nodes lost it and one of them "
        "took over (a newer term in run_dir's head.json), the old head, woken, stops its "
        "workers, writes no checkpoint and ends fit() with this error.",
        when="In fit() on a node other than the head, when it wakes up after the head gave "
        "it up. (A node whose link was cut for longer than node_timeout names the head lost "
        "instead: the word cannot reach it.) On a head that was replaced while it was "
        "frozen or cut off.",
        causes=[
            "The node's processes were stopped (SIGSTOP, a debugger, a suspended VM or "
            "container) for longer than node_timeout.",
            "A network partition between this node and the head.",
            "node_timeout shorter than a pause the node can legitimately have (a long "
            "garbage collection, swapping).",
        ],
        fixes=[
            "Start the same command on this node again: while the run goes on, the head "
            "takes the node back at a step boundary with the state of a live peer.",
            "Raise fit(node_timeout=...) if pauses this long are expected.",
        ],
        example="# [PX145] node 1 was cut off from the run: the head heard nothing from it "
        "for 10.4s (node_timeout 10s) and went on without it ...\n"
        "# start it again to rejoin: phalanx run --nnodes 2 --node-rank 1 --head ...",
    ),
    Explanation(
        code="PX147",
        title="the head was lost: this node saved the run's last committed step",
        meaning="Across machines node 0's process is the head: it hosts the store and "
        "decides. A node whose link to the head closed, or that heard nothing from it for "
        "node_timeout, cannot go on: no generation can form without the head. Its agent "
        "tells its workers so (through memory they share, not the network); each leaves "
        "its collective and writes an emergency checkpoint of the state it holds, which is "
        "the last step every member agreed on, into the shared run_dir (one node at a time, "
        "under a lock file; a step already saved, or an older one, is skipped). fit() then "
        "ends with HeadLost, a SystemExit with status 75 (EX_TEMPFAIL): the message says "
        "which step was kept and in which file. That is the fallback: with a run_dir every "
        "node shares and more than half of the run's nodes left, the lowest surviving node "
        "rank takes over as the head instead and the run goes on from that checkpoint "
        "without a restart (Recovery(head_failover=True), the default); this error comes "
        "when no node may take over, and the message says why. Under strategy='fsdp' a "
        "worker holds only its shards and the head's went with it: each worker writes the "
        "shard snapshots its machine holds (its own, and the copies of other machines' "
        "members) as files of sharded checkpoints, and a resume or a takeover starts from "
        "the newest step of which every member's file is there (or, snapshots off, the "
        "newest sharded checkpoint), computing the steps after it again. The head itself "
        "ends the same way when the nodes it lost may be "
        "the side of a partition that takes over (the leader of the succession they hold "
        "is among them, and they are more than half of it): it stands down first, keeping "
        "the committed step, and when a successor's term then appears in head.json it ends "
        "with PX145 instead (the run goes on there).",
        when="In fit() on a node other than the head, when the head's process, host or "
        "network is gone and no failover can be: no shared run_dir, not more than half of "
        "the nodes left (two nodes: one left), Recovery(head_failover=False) or "
        'mode="abort", or the survivors did not reach the node taking over. On the head, '
        "when the nodes it lost could take over and none did within the takeover's time.",
        causes=[
            "The head's process was killed (out of memory, a crash, a scheduler's kill), or "
            "its host went down.",
            "The head was frozen or partitioned from this node for longer than node_timeout.",
            "On the head: its own link was cut, or most nodes died within one keep-alive of "
            "each other (the head cannot tell that from a partition).",
        ],
        fixes=[
            "Start the same command on every node with fit(..., resume=True): the run goes "
            "on from the newest checkpoint in run_dir and loses no committed step (fsdp: "
            "the steps after the newest sharded checkpoint are computed again), when "
            "run_dir is a folder every node shares (NFS, a parallel file system).",
            "Let the launcher do it: torchrun --max-restarts N, or Slurm's --requeue with "
            "the batch script passing resume=True; exit status 75 means 'run me again'.",
            "Without a shared run_dir nothing is saved (the message says so): give fit() one.",
            "To go on without a restart when the head falls, run three nodes or more on a "
            "shared run_dir: the lowest surviving node takes over.",
        ],
        example="# [PX147] node 1: the head at 10.0.0.1:29410 was lost (its link closed, or "
        "no word for 10s); ... kept what the run had committed: step 1234 is in "
        "/shared/run/checkpoints/ckpt-000001234.pt (this node wrote it). Start the same "
        "command on every node with resume=True to go on from there.",
    ),
    Explanation(
        code="PX151",
        title="a run over several nodes has no token",
        meaning="Across machines, only processes that hold the run's token are heard: each "
        "node proves it when it joins, and every control message is signed with it. The "
        "token comes from PHALANX_TOKEN (the same on every node), or the head makes one and "
        "writes it to run_dir/token with owner-only permissions (mode 0600), where the "
        "nodes read it (run_dir is then a folder every node shares). Neither was there, "
        "or the token file can be read by others.",
        when="In fit(), on the head before it listens, on a node before it joins.",
        causes=[
            "No PHALANX_TOKEN and no run_dir.",
            "run_dir is not shared: the nodes never see the head's token file.",
            "run_dir/token was copied with wider permissions.",
        ],
        fixes=[
            "export PHALANX_TOKEN=$(openssl rand -hex 32) on every node (a job scheduler's "
            "secret store, or the batch script that starts the nodes).",
            "Or give fit() a run_dir on a shared file system; chmod 600 run_dir/token.",
        ],
        example="# before\nlearner.fit(data, strategy='ddp')   # on 2 nodes, no token\n"
        "# after\nPHALANX_TOKEN=... python train.py     # the same value on every node",
    ),
    Explanation(
        code="PX150",
        title="a control message that is not this run's was ignored",
        meaning="A ddp worker read a value from the run's store (a generation announcement, "
        "the stop or abort key, the control counter, a member's arrival) that was not signed "
        "with this run's token: a bad MAC, not a signed message at all (a pickle, say), a "
        "message of an earlier run (each run signs with its own key, made from the token), a "
        "genuine message replayed under another key or older than one already read, or "
        "under the unsigned hint gen/latest a value that is not a number. The worker "
        "ignored it and the run went on; this warning is given once per such value. "
        "torch's store does not record who writes a key, so the address is not known.",
        when="During a ddp run, when a worker reads the store's control keys; across "
        "machines also when the head refuses a connection to its node port that does not "
        "prove the token in time, or pushes one out because more than 16 were proving "
        "themselves at once (then the address is named).",
        causes=[
            "Another process that can reach the store's port wrote to it: a stray script, "
            "a second run pointed at the same port, or someone probing the port.",
            "Workers started with a different PHALANX_TOKEN than the supervisor's.",
        ],
        fixes=[
            "Keep the store's port on a private network (on one host it listens on "
            "127.0.0.1 only); find the process that connects to it.",
            "Across machines, give every node the same PHALANX_TOKEN.",
            "Nothing to do for the run itself: the message was ignored.",
        ],
        example="# warning: PX150: ignored a control message under store key "
        "'control/abort' that is not this run's (a bad MAC ...)\n"
        "# check who else connects to the store's port, e.g. `ss -tnp | grep <port>`",
    ),
]

CATALOG: dict[str, Explanation] = {e.code: e for e in _ENTRIES}


def normalize_code(code: str) -> str:
    """``"px113"``, ``" PX113 "`` and ``"113"`` -> ``"PX113"``."""
    text = code.strip().upper()
    return f"PX{text}" if text.isdigit() else text


def lookup(code: str) -> Explanation:
    """The entry for ``code``; KeyError listing close matches when it is unknown."""
    key = normalize_code(code)
    if key in CATALOG:
        return CATALOG[key]
    close = difflib.get_close_matches(key, list(CATALOG), n=4, cutoff=0.6)
    message = f"unknown error code {code!r}."
    if close:
        message += f" Did you mean {', '.join(close)}?"
    raise KeyError(message + " Run `phalanx explain` to list every code.")


def _section(title: str, body: str) -> str:
    return f"{title}\n{textwrap.indent(body, '  ')}"


def explain(code: str) -> str:
    """``code`` explained, in sections: What it means, When it happens, Common causes,
    What to do, Example fix. Raises KeyError (listing close codes) for an unknown code."""
    e = lookup(code)
    causes = "\n".join(
        textwrap.fill(c, 86, initial_indent="- ", subsequent_indent="  ") for c in e.causes
    )
    fixes = "\n".join(
        textwrap.fill(f, 86, initial_indent=f"{i}. ", subsequent_indent="   ")
        for i, f in enumerate(e.fixes, start=1)
    )
    return "\n\n".join(
        [
            f"{e.code}: {e.title}",
            _section("What it means", textwrap.fill(e.meaning, 88)),
            _section("When it happens", textwrap.fill(e.when, 88)),
            _section("Common causes", causes),
            _section("What to do", fixes),
            _section("Example fix", e.example),
        ]
    )


def list_codes() -> str:
    """One line per code, in code order: ``PX113  global batch smaller than ...``."""
    return "\n".join(f"{code}  {CATALOG[code].title}" for code in sorted(CATALOG))
