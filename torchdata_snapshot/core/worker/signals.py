"""What a worker (or the dispatching process) does with the signals a job's processes get.

A policy of its own: the child processes of a reading service leave SIGTERM and SIGINT to the
training process, which ends them (``shutdown()``, or at exit: see
:mod:`torchdata_snapshot.core.main.worker_processes`).
"""

from __future__ import annotations

import signal

__all__ = ["ignore_job_signals"]


def ignore_job_signals() -> None:
    """In a child process: SIGTERM and SIGINT are ignored. A child lives exactly as long as the
    training process needs it: it exits when asked, when the training process is gone (see
    :class:`~torchdata_snapshot.core.transport.channel.ParentWatch`), or is killed at shutdown
    (at the latest when the interpreter exits).

    * Preemption (SLURM's, a process group's) sends SIGTERM to every process of the job, and the
      training process then finishes its step and saves a checkpoint: a worker that died of the
      signal could fail that step instead. (With ``fork`` a child inherited the training
      process's Python handler; with ``spawn`` and ``forkserver`` it died.)
    * Ctrl-C sends SIGINT to the whole foreground process group: the training process gets its
      ``KeyboardInterrupt`` and shuts its workers down; a worker must neither print a traceback
      of its own nor die first, which the training process would report as a dead worker.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
