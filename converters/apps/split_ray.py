"""`--ray [ADDRESS]` for one conversion split into parts (converters/split.py): each part is one Ray task
declaring one CPU and the memory its largest tensor needs, joined to the cluster at ADDRESS or to a local Ray
started for the conversion, as `batch --ray` does (batch.py: the same start, the same one-line failures).

A task runs `split.run_part_on_node` on whichever node Ray picks: it takes the driver's plan (put once in the
object store), opens the source's headers (once per worker process), refuses if the source's files are not
the ones the driver planned, and writes its part into the split's files, so every node needs the same install
and SRC and OUT on a shared filesystem."""

from __future__ import annotations

import logging

from ..errors import QConvertError
from ..split import Part, SplitJob, part_memory_bytes, run_part_on_node
from .batch import _LOCAL_OBJECT_STORE_BYTES, _check_reachable, _first_line, _ray_module, _stderr_held

__all__ = ["RayWorkers"]


class RayWorkers:
    def __init__(self, address: str | None, workers: int | None):
        ray = self._ray = _ray_module()
        quiet = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
        try:
            with _stderr_held():
                if address:
                    _check_reachable(address)
                    ray.init(address=address, **quiet)
                else:  # "local": never a cluster found through RAY_ADDRESS (see batch._RayJobs)
                    ray.init(address="local", object_store_memory=_LOCAL_OBJECT_STORE_BYTES, **quiet)
        except Exception as e:
            where = f"cannot join the Ray cluster at {address}" if address else "cannot start a local Ray"
            raise QConvertError(f"--ray: {where} ({_first_line(e)})") from None
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self.largest_node_memory = max((int(n["Resources"].get("memory", 0)) for n in nodes), default=0)
        self.workers = max(1, workers or int(ray.cluster_resources().get("CPU", 1)))
        # max_retries=0: a part whose worker died is reported failed in one line; the re-run redoes it
        self._task = ray.remote(num_cpus=1, max_retries=0)(run_part_on_node)

    def node_memory(self) -> int:
        return self.largest_node_memory

    def run(self, job: SplitJob, parts: list[Part], total: int, progress: bool) -> list[dict]:
        ray = self._ray
        todo, running, done = list(parts), {}, []
        job = ray.put(job)  # the plan once in the object store, not pickled into every task
        try:
            while todo or running:
                while todo and len(running) < self.workers:
                    part = todo.pop(0)
                    running[self._task.options(memory=part_memory_bytes(part)).remote(job, part)] = part
                ready, _ = ray.wait(list(running), num_returns=1)
                part = running.pop(ready[0])
                try:
                    manifest = ray.get(ready[0])
                except ray.exceptions.RayError as e:  # the task, its worker or its node died
                    raise QConvertError(f"{part.label(total)} failed: the Ray task failed ({_first_line(e)})") from None
                if "error" in manifest:
                    raise QConvertError(f"{part.label(total)} failed: {manifest['error']}")
                done.append(manifest)
        finally:
            for ref in running:
                ray.cancel(ref, force=True)
        return done

    def close(self) -> None:
        self._ray.shutdown()
