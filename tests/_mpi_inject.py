"""Faults injected into a real `mpihybrid train` (run under mpiexec):

    mpiexec -n 2 python tests/_mpi_inject.py MODE train --quiet --set ...

MODE:
    usr1      every rank sends itself SIGUSR1 twice in its third forward
    nan-grad  rank 0's stage gradient becomes nan in step 3 (the loss stays finite)
    commit    rank 0's rename of a checkpoint directory fails (EIO) while the others wait
    enospc    rank 1 finds the disk full writing the checkpoint of step 4
    kill      rank 1 is killed (SIGKILL, as the OS's OOM killer does) in its third forward
    int-one   rank 1 alone gets SIGINT in its third forward
    exit-one  rank 1 alone raises SystemExit(0) in its third forward (a library calling exit)
    usr1-end  every rank sends itself SIGUSR1 and SIGTERM in the held-out evaluation, after the
              last step
    usr1-ckpt every rank sends itself SIGUSR1 and SIGTERM inside every checkpoint it writes
    usr1-build rank 1 sends itself SIGUSR1 while the model is being built, before any step
    usr1-calib, term-calib  every rank sends itself SIGUSR1 (SIGTERM) in the third forward of
              train.schedule = "auto"'s calibration steps
    stop-end  rank 1 stops itself (SIGSTOP) once training returned, before MPI_Finalize
"""

from __future__ import annotations

import errno
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpihybrid import cli  # noqa: E402
from mpihybrid.nn import model  # noqa: E402
from mpihybrid.train import checkpoint  # noqa: E402

RANK = MPI.COMM_WORLD.rank
MODE = sys.argv[1]


def on_third_forward(action) -> None:
    original = model.Stage.forward
    calls = {"n": 0}

    def forward(self, x):
        calls["n"] += 1
        if calls["n"] == 3:
            action()
        return original(self, x)

    model.Stage.forward = forward


if MODE == "usr1":

    def twice() -> None:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)

    on_third_forward(twice)
elif MODE == "int-one" and RANK == 1:
    on_third_forward(lambda: os.kill(os.getpid(), signal.SIGINT))
elif MODE == "exit-one" and RANK == 1:

    def leave() -> None:
        raise SystemExit(0)

    on_third_forward(leave)
elif MODE == "usr1-end":
    from mpihybrid.train import evaluate

    original_evaluate = evaluate.heldout_accuracy

    def signalled_evaluate(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        return original_evaluate(*args, **kwargs)

    evaluate.heldout_accuracy = signalled_evaluate
elif MODE == "usr1-ckpt":
    from mpihybrid.train import loop

    original_save = checkpoint.save_all

    def save_all(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        return original_save(*args, **kwargs)

    loop.checkpoint.save_all = save_all
elif MODE == "usr1-build" and RANK == 1:
    from mpihybrid.train import build as run_build

    original_build = run_build.build_run

    def build(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        return original_build(*args, **kwargs)

    run_build.build_run = build
elif MODE in ("usr1-calib", "term-calib"):
    from mpihybrid.cli import auto

    original_calibration = auto.calibration_run
    sig = signal.SIGUSR1 if MODE == "usr1-calib" else signal.SIGTERM

    def calibration_signalled(*args, **kwargs):
        on_third_forward(lambda: os.kill(os.getpid(), sig))
        return original_calibration(*args, **kwargs)

    auto.calibration_run = calibration_signalled
elif MODE == "stop-end" and RANK == 1:
    from mpihybrid.train import loop

    original_run = loop.train

    def stopped_after(*args, **kwargs):
        out = original_run(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGSTOP)
        return out

    loop.train = stopped_after
elif MODE == "kill" and RANK == 1:
    on_third_forward(lambda: os.kill(os.getpid(), signal.SIGKILL))
elif MODE == "nan-grad" and RANK == 0:
    # counted per stage object (the memory check's kernel warm-up runs a stage of its own);
    # `alive` keeps every counted stage so that no later one reuses its id
    calls: dict[int, int] = {}
    alive: list = []
    for name in ("backward", "backward_weight"):
        original = getattr(model.Stage, name)

        def poisoned(self, *args, _original=original, **kwargs):
            out = _original(self, *args, **kwargs)
            if id(self) not in calls:
                alive.append(self)
            calls[id(self)] = calls.get(id(self), 0) + 1
            if calls[id(self)] > 8:  # 4 micro-batches a step: from step 3 on
                self.flat_grads[0] = np.nan
            return out

        setattr(model.Stage, name, poisoned)
elif MODE == "commit" and RANK == 0:

    def failing_commit_dir(partial, final):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(final))

    checkpoint.disk.commit_dir = failing_commit_dir
elif MODE == "enospc" and RANK == 1:
    original_write = checkpoint.disk.write_h5

    def full_disk(path, arrays, attrs):
        if attrs.get("step") == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return original_write(path, arrays, attrs)

    checkpoint.disk.write_h5 = full_disk

cli.main(sys.argv[2:])
