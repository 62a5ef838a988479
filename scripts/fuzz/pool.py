"""The parent's fork server: ForkPool runs up to --jobs children at once, each a fork of this process (which
imported qconvert once and ran no torch op), and calls on_done(job, status, rusage, seconds, killed) as each
ends; a child past its job's timeout plus a grace is killed with its process group.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass


@dataclass
class Running:
    job: dict
    start: float
    on_done: object
    killed: bool = False


class ForkPool:
    def __init__(self, jobs: int):
        self.jobs = max(1, jobs)
        self.running: dict[int, Running] = {}

    def submit(self, job: dict, target, on_done) -> None:
        while len(self.running) >= self.jobs:
            self._reap(block=True)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            rc = 99
            try:
                rc = target(job)
            except BaseException:
                try:
                    traceback.print_exc()
                finally:
                    rc = 98
            finally:
                os._exit(rc)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        self.running[pid] = Running(job, time.monotonic(), on_done)

    def _reap(self, block: bool) -> None:
        while True:
            done = False
            for pid, r in list(self.running.items()):
                wpid, status, rusage = os.wait4(pid, os.WNOHANG)
                if wpid:
                    del self.running[pid]
                    r.on_done(r.job, status, rusage, time.monotonic() - r.start, r.killed)
                    done = True
                elif not r.killed and time.monotonic() - r.start > r.job["timeout"] + r.job.get("grace", 30):
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                    r.killed = True
            if done or not block or not self.running:
                return
            time.sleep(0.02)

    def drain(self) -> None:
        while self.running:
            self._reap(block=True)
