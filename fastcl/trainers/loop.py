"""The one training loop every method shares (see :mod:`fastcl.trainers.recipe`).

Per optimiser step: this rank's slice of the global batch (``--batch-size`` examples, taken
from a (seed, epoch)-seeded permutation, so the data position is the step number), the
recipe's ``collate`` and ``loss`` under autocast, backward (through the gradient cache with
``--chunk-size``; DDP averages gradients, fastcl losses gather negatives across ranks),
optional unscale + clipping, optimiser and scheduler step. Every ``--eval-steps`` rank 0
scores STS-B dev (Spearman x 100 of cosine, :mod:`fastcl.eval`) and saves the best model;
every ``--save-steps`` all ranks write a checkpoint that resumes bit-exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fastcl._fsio import atomic_write_text
from fastcl.trainers import checkpoint as ckpt
from fastcl.trainers.config import SetupError, resolve_precision
from fastcl.trainers.recipe import Recipe, StepContext
from fastcl.trainers.run import SUMMARY_FILE, RunPlan, plan_run

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The example order of ``epoch``: a permutation seeded by (seed, epoch), or data order."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def _setup_distributed(cfg):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        dev = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, torch.device(dev), None
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and (cfg.device or "cuda").startswith("cuda") else "gloo"
        dist.init_process_group(backend)
    rank = dist.get_rank()
    if torch.cuda.is_available() and (cfg.device or "cuda").startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return rank, dist.get_world_size(), device, dist.group.WORLD


def _to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _truncate_log(path: Path, last_step: int, run_id: str | None = None) -> None:
    """Keep the records of steps <= ``last_step`` (a resumed run logs the later ones again)
    of run ``run_id`` (when given); a partial last line left by a kill is dropped too."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or record.get("step", 0) > last_step:
            continue
        if run_id is not None and record.get("run_id") != run_id:
            continue
        kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))


class _Logger:
    """JSONL (always) and TensorBoard (when available and enabled) on rank 0.

    ``start_step``: the step training starts from (0, or the resumed checkpoint's): records
    of later steps, from the run that was interrupted, are removed so none appears twice.
    Every record carries ``run_id``.
    """

    def __init__(self, output_dir: Path, enabled: bool, tensorboard: bool, start_step: int = 0, run_id=None):
        self.enabled = enabled
        self.run_id = run_id
        if enabled:
            _truncate_log(output_dir / "log.jsonl", start_step, run_id)
        self.file = open(output_dir / "log.jsonl", "a") if enabled else None
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: TensorBoard hides the interrupted run's events past the resume point
                self.tb = SummaryWriter(str(output_dir / "tb"), purge_step=start_step + 1)
            except ImportError:  # tensorboard is optional
                self.tb = None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.run_id is not None:
            record = {**record, "run_id": self.run_id}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _dev_task(cfg):
    from fastcl.eval import load_sts
    from fastcl.eval.sts import protocol_data

    return load_sts("stsb", cfg.data_dir, **protocol_data("stsb", "senteval", "dev"))


def evaluate_dev(recipe: Recipe, model, task) -> float:
    """STS-B dev Spearman x 100 (cosine, no regressor) of the recipe's test-time embedding."""
    from fastcl.eval.sts import evaluate_task

    return evaluate_task(recipe.encoder(model), task).score


@dataclass
class Prepared:
    """Everything :func:`prepare` found out, before any model is loaded or file written."""

    rank: int
    world: int
    device: torch.device
    group: object
    n: int  # training examples used (--max-examples applied)
    steps_per_epoch: int
    total: int
    plan: RunPlan
    dev_task: object = None


def _say(rank: int, line: str) -> None:
    if rank == 0:
        print(f"fastcl train: {line}", file=sys.stderr, flush=True)


def prepare(recipe: Recipe, cfg) -> Prepared:
    """Every check of a start that needs no model: devices and precision, the data's size
    against the batch, the output folder and its run (:func:`fastcl.trainers.run.plan_run`:
    which checkpoint, if any, and whether another run's files are in the way), the dev
    data. Raises :class:`SetupError` (one line for the CLI); reads files, writes none."""
    recipe.validate(cfg)
    rank, world, device, group = _setup_distributed(cfg)
    cfg.precision = resolve_precision(cfg.precision, device)  # "auto" -> bf16/fp16 on CUDA, fp32 on CPU
    if cfg.batch_size % world:
        raise SetupError(f"--batch-size {cfg.batch_size} is not divisible by the {world} processes")
    if getattr(cfg, "cross_device", "gather") == "ring" and world == 1:
        raise SetupError(
            "--cross-device ring passes the candidates between processes, and this run has one: start it "
            "with torchrun --nproc_per_node N (N >= 2), or leave --cross-device out"
        )
    if cfg.precision == "fp16" and device.type != "cuda":
        raise SetupError("--precision fp16 needs a CUDA device (loss scaling); on the CPU use bf16 or auto")
    available = recipe.num_examples(cfg)
    n = available if cfg.max_examples is None else min(cfg.max_examples, available)
    steps_per_epoch = n // cfg.batch_size
    if steps_per_epoch == 0:
        capped = f" (--max-examples {cfg.max_examples} of {available})" if n < available else ""
        raise SetupError(
            f"--batch-size {cfg.batch_size} is larger than the {n} training examples{capped}: "
            "no full batch; lower --batch-size"
        )
    total = cfg.max_steps if cfg.max_steps is not None else cfg.epochs * steps_per_epoch
    plan = plan_run(cfg, Path(cfg.output_dir), total)
    if world > 1:  # a new run's id is drawn at random: rank 0's is everyone's
        chosen = [plan.run_id]
        dist.broadcast_object_list(chosen, src=0)
        plan.run_id = chosen[0]
    dev_task = None
    if cfg.eval_steps and rank == 0 and not plan.finished:
        try:
            dev_task = _dev_task(cfg)
        except (FileNotFoundError, ValueError) as e:
            raise SetupError(f"--eval-steps {cfg.eval_steps}: STS-B dev data: {e}") from e
    return Prepared(rank, world, device, group, n, steps_per_epoch, total, plan, dev_task)


def _finished_summary(output_dir: Path, run_id: str, total: int) -> dict | None:
    """The summary of run ``run_id`` when it finished all ``total`` steps and saved ``final/``."""
    try:
        summary = json.loads((output_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    done = isinstance(summary, dict) and summary.get("run_id") == run_id and summary.get("steps") == total
    return summary if done and (output_dir / "final").is_dir() else None


def train(recipe: Recipe, cfg) -> dict:
    """Train ``recipe`` with the resolved options ``cfg``; returns a summary dict (rank 0).

    Every check runs first (:func:`prepare`); a :class:`SetupError` means nothing was loaded
    or written. Then the model is built, the run's folder is (re)claimed (``--overwrite``
    removes another run's files only now) and training goes from the plan's step.
    """
    ready = prepare(recipe, cfg)
    rank, world, device, group, plan = ready.rank, ready.world, ready.device, ready.group, ready.plan
    n, steps_per_epoch, total = ready.n, ready.steps_per_epoch, ready.total
    output_dir = plan.output_dir
    for line in plan.notes:
        _say(rank, line)
    if plan.finished:
        done = _finished_summary(output_dir, plan.run_id, total)
        if done is not None:
            return done
    random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)

    dataset = recipe.build_dataset(cfg)
    if len(dataset) < n:
        raise RuntimeError(f"{recipe.name}: build_dataset gave {len(dataset)} examples, num_examples said {n}")
    per_rank = cfg.batch_size // world

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = recipe.build_model(cfg).to(device)
    torch.manual_seed(cfg.seed + rank)
    optimizer = recipe.build_optimizer(cfg, model)
    scheduler = recipe.build_scheduler(cfg, optimizer, total)
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
    progress = {"step": 0, "best_score": None, "best_step": None}
    resume_from = plan.resume_from
    if resume_from is not None:
        progress = ckpt.apply_state(
            plan.resume_state, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, cfg=cfg
        )
        plan.resume_state = None
        ckpt.load_rng(resume_from, rank)
    if rank == 0:
        plan.apply()  # --overwrite: the other run's files go now, once the model has loaded
    if world > 1:
        dist.barrier()
    output_dir.mkdir(parents=True, exist_ok=True)

    step_model = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        step_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    caches: dict[int, object] = {}

    def encode(module, **inputs):
        if cfg.chunk_size is None:
            return module(**inputs)
        from fastcl.gradcache import GradCache

        gc = caches.get(id(module))
        if gc is None:
            ddp = module if world > 1 and module is step_model else None
            gc = caches[id(module)] = GradCache(module, cfg.chunk_size, ddp=ddp)
        return gc(**inputs)

    dev_task = ready.dev_task
    logger = _Logger(output_dir, rank == 0, cfg.tensorboard, start_step=progress["step"], run_id=plan.run_id)
    autocast_dtype = _AUTOCAST[cfg.precision]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if rank == 0:
        atomic_write_text(output_dir / "config.json", json.dumps(vars(cfg), indent=2, default=str) + "\n")

    from tqdm.auto import tqdm

    bar = tqdm(
        total=total,
        initial=progress["step"],
        desc=f"train {recipe.name}",
        unit="step",
        disable=rank != 0 or not cfg.progress,
    )
    start, window = time.perf_counter(), []
    order_epoch, order = None, None
    step = progress["step"]
    while step < total:
        epoch, pos = divmod(step, steps_per_epoch)
        if order_epoch != epoch:
            order, order_epoch = epoch_order(n, cfg.seed, epoch, cfg.shuffle), epoch
        first = pos * cfg.batch_size + rank * per_rank
        examples = [dataset[i] for i in order[first : first + per_rank]]
        ctx = StepContext(
            cfg=cfg,
            step=step,
            epoch=epoch,
            rank=rank,
            world_size=world,
            device=device,
            process_group=group,
            cross_device=cfg.cross_device,
            rng=random.Random(f"{cfg.seed}-{step}-{rank}"),
            encode=encode,
        )
        batch = _to_device(recipe.collate(examples, ctx), device)
        model.train()
        autocast = (
            torch.autocast(device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            loss, metrics = recipe.loss(step_model, batch, ctx)
        if not torch.isfinite(loss.detach()).all():
            raise FloatingPointError(f"step {step}: loss is {loss.item()} (lower --lr, or use fp32/bf16)")
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = None
        if cfg.max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        progress["step"] = step
        ctx.step = step
        recipe.on_step_end(model, optimizer, ctx)
        window.append(loss.detach().float())
        bar.update(1)

        if step % cfg.log_steps == 0 or step == total:
            mean_loss = torch.stack(window).mean()
            if world > 1:
                dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
            record = {
                "step": step,
                "epoch": epoch,
                "loss": float(mean_loss),
                "lr": optimizer.param_groups[0]["lr"],
                "elapsed_s": round(time.perf_counter() - start, 3),
                **{k: float(v) for k, v in metrics.items()},
            }
            if grad_norm is not None:
                record["grad_norm"] = grad_norm
            logger.log(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}")
            window = []
        if dev_task is not None and (step % cfg.eval_steps == 0 or step == total):
            score = evaluate_dev(recipe, model, dev_task)
            improved = progress["best_score"] is None or score > progress["best_score"]
            if improved:
                progress["best_score"], progress["best_step"] = score, step
                recipe.save_pretrained(model, output_dir / "best", cfg)
            logger.log({"step": step, "stsb_dev": score, "best_stsb_dev": progress["best_score"]})
        if (cfg.save_steps and step % cfg.save_steps == 0) or step == total:
            folder = output_dir / f"{ckpt.PREFIX}{step}"
            written = ckpt.save_checkpoint(
                folder,
                rank=rank,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                scaler=scaler,
                progress=dict(progress),
                cfg=cfg,
                run_id=plan.run_id,
            )
            if world > 1:  # returns once every rank's files are on disk; rank 0 gets their digests
                everyone = [None] * world
                dist.all_gather_object(everyone, written)
                written = {name: d for part in everyone for name, d in part.items()}
            if rank == 0:
                ckpt.mark_complete(folder, world_size=world, step=step, written=written, run_id=plan.run_id)
                ckpt.prune(output_dir, cfg.save_total_limit, run_id=plan.run_id)
    bar.close()
    summary = {
        "method": recipe.name,
        "run_id": plan.run_id,
        "steps": step,
        "start_step": plan.start_step,
        "resumed_from": None if resume_from is None else str(resume_from),
        "wall_s": round(time.perf_counter() - start, 2),
        "best_stsb_dev": progress["best_score"],
        "best_step": progress["best_step"],
        "output_dir": str(output_dir),
    }
    if rank == 0:
        recipe.save_pretrained(model, output_dir / "final", cfg)
        atomic_write_text(output_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    logger.close()
    return summary
