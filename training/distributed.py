"""Training on several processes: torch.distributed, one rank a device, launched by ``torchrun`` (or
``accelerate launch``, which starts torchrun's workers) on ``harness replay-train``.

Rank 0 leads. It alone runs the pipeline around the updates (select, reward, build, the recorded episodes, the
registry, the store's row of the run, checkpoints, metrics and plots); each time it trains (``train_sft``,
``train_rl``) it first hands the job to the other ranks, which wait for it in ``follow``. Every rank trains on
its share of each step's micro-batches; their gradients are summed across the ranks (``World.sum_``: one
all-reduce of a flat bucket, DDP's reduction without its overlap, which buys little for the few LoRA tensors)
before the optimizer step, so all ranks hold the same weights after every step, and a step on W ranks is the step
one process takes on the same global batch (W times the micro-batches). Under FSDP (``training/sharding.py``) each
rank holds its shards of the weights instead, and FSDP reduce-scatters the gradients itself. RL's rollouts and
validations run on rank 0; their results (the step's groups, the validation metrics) reach the others with
``World.share``, so every rank judges rollbacks alike. Validation between training jobs (SFT's checkpoints, the
correction and expert rounds, the gate) is itself handed out: each rank runs its share of the episodes on an
engine of its own, and rank 0 gathers them back in order (``training/evaluate.py``).

A rank that stops (an error, a kill) breaks the others' next collective: they raise ``RankFailure`` and the run
fails with nothing registered or published (torchrun also stops the remaining workers).
"""

from __future__ import annotations

import _thread
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger()

T = TypeVar("T")
Job = tuple[Callable[..., Any], dict[str, Any]]

_world: World | None = None
TERM_GRACE_SECONDS = 10.0


class RankFailure(RuntimeError):
    """A collective broke: another rank stopped. The message says during what."""


@dataclass(frozen=True)
class World:
    """This process's place among the training ranks."""

    rank: int
    size: int

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def mine(self, items: Sequence[T]) -> list[T]:
        """This rank's share of ``items``: every ``size``-th one from its rank on."""
        return list(items[self.rank::self.size])

    def share(self, value: Any = None, *, during: str = "a hand-over") -> Any:
        """Rank 0's ``value`` on every rank (pickled; the others' argument is ignored)."""
        holder = [value if self.leads else None]
        _collective(lambda: dist.broadcast_object_list(holder, src=0), during)
        return holder[0]

    def sum_(self, tensors: Sequence[torch.Tensor], *, during: str = "a training step") -> None:
        """Replace each tensor by its sum over the ranks, in one all-reduce of one flat buffer."""
        if not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        _collective(lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM), during)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def sum_grads(self, params: Sequence[torch.nn.Parameter], extra: torch.Tensor, *,
                  during: str = "a training step") -> None:
        """Sum each parameter's gradient (none on this rank: zeros) and ``extra`` (the step's own figures) over the
        ranks, in place."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.sum_([p.grad for p in params] + [extra], during=during)

    def gather(self, value: Any, *, during: str = "a hand-back") -> list[Any]:
        """Every rank's ``value`` (pickled), in rank order, on every rank."""
        gathered: list[Any] = [None] * self.size
        _collective(lambda: dist.all_gather_object(gathered, value), during)
        return gathered

    def sync(self, params: Sequence[torch.Tensor], *, during: str = "a weight sync") -> None:
        """Rank 0's values of ``params`` on every rank (pickled: the ranks' copies may lie on the CPU under NCCL,
        before FSDP moves them to the GPU a layer at a time)."""
        values = self.share([p.detach().cpu() for p in params] if self.leads else None, during=during)
        with torch.no_grad():
            for p, value in zip(params, values, strict=True):
                p.copy_(value)


def _collective(call: Callable[[], Any], during: str) -> None:
    try:
        call()
    except (RuntimeError, OSError) as exc:  # gloo and NCCL report a peer that went away as these
        raise RankFailure(f"a training rank stopped during {during}: {exc}".strip()) from exc


def current() -> World | None:
    """The world ``join`` joined, or None in a single-process run."""
    return _world


def join(timeout_seconds: float) -> World | None:
    """Under torchrun (or a launcher that starts its workers, as accelerate does): join the process group its
    environment describes, which torch.distributed reads itself; None in a plain process or a world of one.
    ``timeout_seconds``: how long a rank waits in a collective, as long as the longest stage rank 0 runs alone
    (the recorded episodes: RL's rollouts, correction rounds) while the others wait for their next job."""
    global _world
    if _world is None and dist.is_torchelastic_launched():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(dist.get_node_local_rank(fallback_rank=0))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_seconds))
        if dist.get_world_size() == 1:
            dist.destroy_process_group()
            return None
        _world = World(rank=dist.get_rank(), size=dist.get_world_size())
        signal.signal(signal.SIGTERM, _on_terminate)
        log.info("distributed.joined", rank=_world.rank, world_size=_world.size, backend=backend)
    return _world


def _on_terminate(signum: int, frame: Any) -> None:
    # torchrun stops the other workers as soon as one fails; the collective that failed with it says why (and the
    # run records it) a moment later, so the stop waits that moment, then interrupts as Ctrl-C would.
    log.warning("distributed.terminating", rank=_world.rank if _world else None, grace_seconds=TERM_GRACE_SECONDS)
    timer = threading.Timer(TERM_GRACE_SECONDS, _thread.interrupt_main)
    timer.daemon = True
    timer.start()


def device() -> torch.device:
    """Where this rank trains: its GPU under CUDA (``join`` picked it by ``LOCAL_RANK``), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def lead(function: Callable[..., Any], **kwargs: Any) -> None:
    """On rank 0 of a world: have the other ranks run ``function(**kwargs)`` alongside (it must be importable by
    name, and run the same collectives as rank 0's own call)."""
    world = current()
    if world is not None and world.leads:
        world.share((function, kwargs), during="handing out a training job")


def follow(world: World) -> list[Any]:
    """A rank other than 0: run each job rank 0 hands out, until it says the run is over; what the jobs returned."""
    results = []
    while (job := world.share(during="waiting for the next training job")) is not None:
        function, kwargs = job
        log.info("distributed.job", rank=world.rank, job=function.__qualname__)
        results.append(function(**kwargs))
    return results


def finish(world: World | None) -> None:
    """Rank 0, the run done: release the other ranks from ``follow``; every rank leaves the group."""
    global _world
    if world is None:
        return
    if world.leads:
        try:
            world.share(None, during="ending the run")
        except RankFailure as exc:  # the training was over: what it made stands
            log.warning("distributed.rank_gone_at_end", error=str(exc))
    dist.destroy_process_group()
    _world = None
