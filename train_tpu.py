"""train_tpu.py: the reference PyTorch/XLA trainer. It trains a small CNN on MNIST on every TPU core (xmp.spawn), or
from one process that shards each batch over every device (--spmd). See README.md.
  python train_tpu.py                              # a TPU VM: train on every core
  python train_tpu.py --spmd --resume runs/<run>   # continue a run under SPMD
  PJRT_DEVICE=CPU python train_tpu.py --cores 1 --data synthetic --epochs 1   # no TPU: the CPU"""

# The trainer comes first. The instruments' block after it (--smoke, run control, fit()) adds to the run where the
# trainer calls hook(). Without it the trainer runs alone: sed '/^# ==== /,/^# ==== end/d' train_tpu.py > mine.py

import argparse
import atexit
import collections
import contextlib
import itertools
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
import types
import warnings

import fsspec
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, default_convert

USER_DEVICE = os.environ.get("PJRT_DEVICE")  # (for the instruments) as given: importing torch_xla sets it
XLA_IMPORT_ERROR = None
try:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs
    import torch_xla.distributed.xla_multiprocessing as xmp
    import torch_xla.runtime as xr
    from torch_xla._internal import tpu
except Exception as e:  # built for another torch, say, or on a TPU VM whose metadata server is away
    XLA_IMPORT_ERROR = e

HOOKS = {}  # {a point of the run: the function for it}, which the instruments' block fills


def hook(point, *args):
    return HOOKS[point](*args) if point in HOOKS else None


# ---- flags: each is a setting that a resume keeps unless given again, but for where and how this process runs -------
NOT_SETTINGS = ("cores", "spmd", "workers", "out_dir", "resume", "coordinator_port")


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]  # (a call may pass numbers)
    p = argparse.ArgumentParser(allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cores", type=int, help="1: one device, in this process; N: all N, a replica process each")
    p.add_argument("--spmd", action="store_true", help="one process shards each batch over every device")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per replica (0: in its own)")
    p.add_argument("--out-dir", help="the run folder, or gs://BUCKET/RUN; default: runs/<time>, or the resumed run's")
    p.add_argument("--resume", metavar="PATH", help="a checkpoint in either format, or a run folder (its newest)")
    p.add_argument("--coordinator-port", type=int, help="XLA's coordination service's; none: torch_xla's, 8547")
    p.add_argument("--data", choices=("mnist", "synthetic"), default="mnist", help="synthetic: generated, offline")
    p.add_argument("--data-dir", default="data", help="MNIST's folder (DIR/MNIST/raw), or where to download it")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=128, help="samples per device per step")
    p.add_argument("--lr", type=float, default=0.05, help="as given: not scaled by the number of devices")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    p.add_argument("--steps-per-epoch", type=int, help="cut every epoch after N steps")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, the shuffles and layerdrop's coins")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False, help="bfloat16 training forward")
    p.add_argument("--target-accuracy", type=float, default=0.0, help="exit 21 if the final accuracy (%%) is below")
    # Layerdrop, from the article "Training PyTorch on Cloud TPUs": a graph that changes from step to step recompiles.
    p.add_argument("--layerdrop", choices=("off", "dynamic", "static"), default="off", help="dynamic: recompiles")
    p.add_argument("--layerdrop-prob", type=float, default=0.5, help="the chance that each fc2 application drops")
    p.add_argument("--log-steps", type=int, default=20, help="log every N steps, and at each epoch's end")
    p.add_argument("--save-steps", type=int, help="also checkpoint every N steps of an epoch")
    hook("flags", p, argv)
    args = p.parse_args(argv)
    hook("parsed", p, args)
    if args.resume:  # Parsed again, with the checkpoint's settings as the defaults: the flags given win.
        path = find_checkpoint(args.resume)
        p.set_defaults(**load_checkpoint(path)["settings"])
        args = p.parse_args(argv)
        args.resume = path  # a run folder's newest: every replica loads the same
    return args


# ---- data: your own goes here (edit 1 of 3) --------------------------------------------------------------------------
def dataset(args, train):
    """One split: any map-style torch Dataset of (input, label) samples, torchvision's with their transforms too."""
    if args.data == "synthetic":
        images, labels = synthetic_digits(12_000 if train else 2_000, seed=1235 if train else 1234)
        digits = InMemory((images / 255 - 0.1307) / 0.3081, labels)
        digits.smoke_target = 90.0  # the accuracy (%) that --smoke asks of ToyModel on them
        return digits
    import torchvision  # Here, not at the top: it adds a second to every process's start.

    mnist = torchvision.datasets.MNIST(args.data_dir, train=train, download=True)  # It downloads what DIR lacks.
    # Normalized once, as Normalize() does: (N, 1, 28, 28) floats, and 4 ops fewer to trace each step.
    return InMemory((mnist.data.unsqueeze(1) / 255 - 0.1307) / 0.3081, mnist.targets)


def model_input(x):  # A batch's input as the model takes it, on the device: here as it comes.
    return x


# ---- model: your own goes here (edit 2 of 3) -------------------------------------------------------------------------
class ToyModel(nn.Module):
    """A small CNN that returns logits. With --layerdrop, a shared residual layer (fc2) runs up to 50 times."""

    depth = 50  # fc2's applications with layerdrop, before any drop

    def __init__(self, layerdrop="off"):
        super().__init__()
        self.layerdrop = layerdrop
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.pool = nn.MaxPool2d(2)
        if layerdrop == "off":  # fc1 is the classifier. With layerdrop, it is a hidden layer before fc2 and fc3.
            self.fc1 = nn.Linear(1440, 10)
        else:
            self.fc1 = nn.Linear(1440, 20)
            self.fc2 = nn.Linear(20, 20)
            self.fc3 = nn.Linear(20, 10)

    def forward(self, x, keep=None):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.fc1(torch.flatten(x, 1))
        if self.layerdrop == "off":
            return x
        for i in range(self.depth):  # keep[i] says whether fc2's i-th application runs; None means evaluation.
            if keep is None:  # Evaluation runs every application, as LayerDrop does at inference.
                x = x + self.fc2(x) / self.depth  # (scaled so that 50 applications stay small)
            elif self.layerdrop == "dynamic":  # Python bools shape the graph: one graph per number of applications.
                if keep[i]:
                    x = x + self.fc2(x) / self.depth
            else:  # Static: a tensor of bools, used on the device inside one graph.
                x = torch.where(keep[i], x + self.fc2(x) / self.depth, x)
        return self.fc3(x)


def build_model(args):
    return ToyModel(args.layerdrop)


# ---- optimizer and learning-rate schedule: your own goes here (edit 3 of 3) ------------------------------------------
def build_optimizer(args, model, steps):
    """The optimizer, and a torch.optim.lr_scheduler stepped after each of the run's `steps`. Here SGD with momentum:
    --lr reached over the first 5% of the steps (a large global batch can diverge at its full rate from the start),
    then a cosine down to a tenth of it, as nanoGPT's. foreach=True: one call updates every parameter (a loop over them
    took a third of the host's step time)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, foreach=True)
    warmup = max(1, steps // 20)

    def factor(step):  # --lr's multiplier at a step of the run, counted from 0
        if step < warmup:
            return (step + 1) / warmup
        done = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * (1 + math.cos(math.pi * done)) / 2

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---- the synthetic digits, a dataset in memory, the first weights ----------------------------------------------------
def synthetic_digits(n, seed):
    """Ten random stroke patterns, one per class, each shifted by up to 8 pixels on noise: (uint8 images, labels)."""
    g = torch.Generator().manual_seed(seed)
    glyphs = (torch.rand(10, 14, 14, generator=torch.Generator().manual_seed(0)) < 0.3).float()  # alike in both splits
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.rand(n, 28, 28, generator=g) * 0.3
    shifts = torch.randint(0, 9, (n, 2), generator=g)
    rows = 3 + shifts[:, 0, None, None] + torch.arange(14)[:, None]  # each sample's glyph: its 14 x 14 pixels
    cols = 3 + shifts[:, 1, None, None] + torch.arange(14)
    images[torch.arange(n)[:, None, None], rows, cols] += glyphs[labels] * 0.7
    return (images.clamp(0, 1) * 255).to(torch.uint8).unsqueeze(1), labels


class InMemory(TensorDataset):
    """Tensors in memory. DataLoader asks for a batch's samples at once (__getitems__): one indexing, not one each."""

    def __getitems__(self, indices):
        return [t[indices] for t in self.tensors]


ONE_REPLICA_AT_A_TIME = threading.RLock()  # TPU v2/v3 run two replica threads a process: they share the global RNG.


def initial_model(args):  # Its first weights come from --seed alone: the same on every replica, and in every run.
    with ONE_REPLICA_AT_A_TIME:
        torch.manual_seed(args.seed)
        return build_model(args)


# ---- the loaders: DistributedSampler -> DataLoader -> MpDeviceLoader -------------------------------------------------
def loader(run, data, order, drop_last=False):
    """The samples of `data` in the order given, in batches (whole batches only, with drop_last: one shape a step)."""
    whole = default_convert if isinstance(getattr(data, "dataset", data), InMemory) else None  # (batched already)
    # Workers leave a stop signal to their replica, which saves, then ends them. They are forked: in xmp.spawn's
    # processes Python would spawn them, each importing this file anew (7 CPU-s).
    return DataLoader(
        data,
        run.load_batch,
        sampler=order,
        drop_last=drop_last,
        collate_fn=whole,
        num_workers=run.args.workers,
        worker_init_fn=ignore_stop_signals,
        multiprocessing_context="fork" if run.args.workers and sys.platform == "linux" else None,
        generator=torch.Generator().manual_seed(run.args.seed),
    )


def on_device(run, batches, stop=None):
    """The first `stop` batches on the device, as {"input", "label"(, "valid")}. MpDeviceLoader copies the next while a
    step runs, and cuts the step's graph as it hands one out. Under SPMD it shards each along the batch axis."""
    batches = (dict(zip(("input", "label", "valid"), b, strict=False)) for b in itertools.islice(batches, stop))
    spec = None
    if run.mesh is not None:  # The first batch tells each field's axes (docs: perf/spmd_advanced).
        first = next(batches)
        batches = itertools.chain([first], batches)
        spec = {name: xs.ShardingSpec(run.mesh, ("data",) + (None,) * (t.dim() - 1)) for name, t in first.items()}
    return pl.MpDeviceLoader(batches, run.device, input_sharding=spec)


def ignore_stop_signals(worker_id=None):
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


# ---- the step and evaluation -----------------------------------------------------------------------------------------
def train_step(run, batch, keep):
    """One step, traced lazily: nothing runs on the device until MpDeviceLoader cuts the graph."""
    run.optimizer.zero_grad()
    with torch.autocast("xla", dtype=torch.bfloat16, enabled=run.args.bf16):  # --bf16 (docs: perf/amp)
        x = model_input(batch["input"])
        logits = run.model(x) if keep is None else run.model(x, keep)  # Your own model need not take `keep`.
        loss = F.cross_entropy(logits, batch["label"].long())  # (int32 labels too)
    loss.backward()
    if run.mesh is None:
        xm.optimizer_step(run.optimizer)  # It averages the gradients over the replicas (an all-reduce), then steps.
    else:
        run.optimizer.step()  # Under SPMD one program spans every device, and GSPMD inserts the all-reduce.
    run.schedule.step()  # The next step's lr: XLA takes it as data, not a constant, so a new lr compiles nothing.
    return loss.detach()


TestResult = collections.namedtuple("TestResult", "loss accuracy samples")


def evaluate(run):
    """The test loss and accuracy (%), each sample counted once, summed on the device until one all-reduce. BatchNorm's
    statistics, which drift apart on each replica, are the master's, as DDP's broadcast_buffers makes them."""
    broadcast(run, run.model.buffers())
    run.model.eval()
    totals = torch.zeros(3, device=run.device)  # the loss summed, the hits, the samples
    with torch.no_grad():
        for b in on_device(run, padded(run, run.test)):
            logits = run.model(model_input(b["input"]))
            loss = F.cross_entropy(logits, b["label"].long(), reduction="none")
            hits = (logits.argmax(1) == b["label"]).float()
            totals += torch.stack([(loss * b["valid"]).sum(), (hits * b["valid"]).sum(), b["valid"].sum()])
    run.model.train()
    if run.world > 1:
        totals = xm.all_reduce(xm.REDUCE_SUM, totals)
    loss, hits, count = totals.cpu().double().tolist()  # A deliberate wait for the device, once per evaluation.
    return TestResult(loss / count, 100 * hits / count, int(count))


def padded(run, batches):  # The last batch filled up with copies of a sample marked valid=0: one shape, one graph.
    for x, y in batches:
        fill = torch.arange(run.load_batch).clamp(max=len(y) - 1)
        yield x[fill], y[fill], (torch.arange(run.load_batch) < len(y)).float()


# Every replica takes the master's float32 and bfloat16 tensors: TPUs all-reduce no int64 (pytorch/xla#1952).
def broadcast(run, tensors):
    floats = [t for t in tensors if t.dtype in (torch.float32, torch.bfloat16)]
    if run.world > 1 and floats:
        xm.collective_broadcast(floats)
        torch_xla.sync()


# ---- a replica's run -------------------------------------------------------------------------------------------------
# A preemption sends SIGTERM to every process of the VM. In replica processes XLA's coordination service takes it, and
# names one step at which every process of the slice stops. They join it as torch_xla's CheckpointManager does, through
# the same private torch_xla._XLAC calls (torch_xla/experimental/distributed_checkpoint/manager.py: no public API).
STOP = types.SimpleNamespace(signum=0, joined=False, lock=threading.Lock(), highest=0, step=None)  # this process's


def start_replica(args):
    """Starts this replica's runtime (under SPMD, the one process's), and returns its state: its place in the run."""
    if args.spmd:
        xr.use_spmd()  # Before the runtime starts: every tensor is then one global tensor over the mesh.
    run = types.SimpleNamespace(args=args, device=torch_xla.device(), world=1, rank=0, mesh=None, history=[], epochs=[])
    if args.spmd:
        run.devices = xr.global_runtime_device_count()
        run.mesh = xs.Mesh(np.arange(run.devices), (run.devices,), ("data",))
    else:
        run.world = run.devices = xr.world_size()
        run.rank = xr.global_ordinal()
    run.master = run.rank == 0  # The one "am I the master": it prints, and writes the files.
    run.global_batch = args.batch_size * run.devices
    run.load_batch = args.batch_size if run.mesh is None else run.global_batch  # SPMD: one process loads it all.
    run.service = not args.spmd and args.cores != 1  # a replica process, which a stop reaches through the service
    # Once a process. Process 0, worker 0's first (torch_xla/_internal/tpu.py configure_topology), runs the service;
    # xr.get_master_ip() would name device 0's host, by a collective that v2/v3's second replica thread never joins.
    # An exit looks like a death to the service, and when process 0 ends first the others abort: so it ends 3 s after
    # its exit began (the others' take under 1 s here), and they at once.
    with STOP.lock:
        if run.service and not STOP.joined:
            process, count = xr.process_index(), xr.process_count()
            host = tpu.get_worker_ips()[0] if xr.device_type() == "TPU" else "localhost"
            torch_xla._XLAC._ensure_xla_coordinator_initialized(process, count, host, str(args.coordinator_port))
            torch_xla._XLAC._activate_preemption_sync_manager()  # Its SIGTERM handler replaces any other.
            if process == 0 and count > 1:
                atexit.register(time.sleep, 3)
            elif process > 0:
                atexit.register(os._exit, 0)
            STOP.joined = True
    hook("started", run)
    return run


def train(index, args):
    """One replica's run, from xmp.spawn (index: its global ordinal), or under SPMD the one process's."""
    with hook("replica", index) or contextlib.nullcontext():
        run = start_replica(args)
        run.model = initial_model(args).to(run.device)
        broadcast(run, [*run.model.parameters(), *run.model.buffers()])  # should your model's init ignore the seed
        data, test = hook("data", run) or (dataset(args, train=True), dataset(args, train=False))
        shard = DistributedSampler(data, run.world, run.rank, seed=args.seed, drop_last=True)  # this replica's part
        run.test = loader(run, test, range(run.rank, len(test), run.world))  # every world-th sample: each counts once
        run.steps = min(len(shard) // run.load_batch, args.steps_per_epoch or len(shard))
        if run.steps == 0:
            raise Exit(2, f"error: --batch-size {args.batch_size}: more than a replica's share of the training set")
        run.optimizer, run.schedule = build_optimizer(args, run.model, args.epochs * run.steps)
        mode = f"{run.devices} devices, {'SPMD' if run.mesh is not None else 'a replica each'}"
        sizes = f"{mode} | global batch {run.global_batch} | lr {args.lr} | {run.steps} steps per epoch"
        where = f"out {args.out_dir}, written by ordinal 0 on {os.uname().nodename}"
        port = f" | coordination service port {args.coordinator_port}" if run.service else ""
        say(run, f"{xr.device_type()} | {sizes} | {where}{port}")
        hook("before_training", run)

        first_epoch, skip = resume(run)  # (1, 0) if fresh
        hook("training", run)
        for epoch in range(first_epoch, args.epochs + 1):
            shard.set_epoch(epoch)  # The DistributedSampler shuffles anew, alike on every replica.
            order = list(shard)[skip * run.load_batch :]  # A resumed epoch starts after the samples done: none is read.
            train_epoch(run, loader(run, data, order, drop_last=True), epoch, skip)
            skip = 0
        accuracy = run.epochs[-1]["accuracy"]
        say(run, f"done | {args.epochs} epochs | test accuracy {accuracy:.2f}%")
        hook("finish", run)
        if accuracy < args.target_accuracy:
            raise Exit(21, f"failed: test accuracy {accuracy:.2f}% is below --target-accuracy {args.target_accuracy:g}")


WARMUP_STEPS = 2  # Each epoch's first steps compile or fill the pipeline, so samples/s leaves them out.


def train_epoch(run, batches, epoch, skip):
    """The epoch's steps after the first `skip` (a resumed run has done those), then its evaluation and checkpoint.
    A step's loss is read back at the next log boundary: it has long finished then, so no step waits for the device."""
    run.unread, started = [], None  # [(step, its loss on the device, its lr)] of the boundaries; when timing began
    hook("epoch", run, epoch)
    step = skip  # Steps count from 1. If the loop runs none, `step` stays `skip`.
    for step, batch in enumerate(on_device(run, batches, stop=run.steps - skip), start=skip + 1):
        lr = run.optimizer.param_groups[0]["lr"]  # this step's, which the schedule then moves on
        loss = train_step(run, batch, layerdrop_keep(run, epoch, step))
        if step == skip + WARMUP_STEPS + 1:  # MpDeviceLoader launched the steps before it: the clock starts here.
            started = time.perf_counter()
        if step % run.args.log_steps == 0 or step == run.steps:
            read_losses(run, epoch)
            run.unread.append((step, loss, lr))
        if step == run.steps:  # The epoch's last step: after the loop, it is evaluated, saved, and stopped at.
            break
        asked = stop_asked(run, (epoch - 1) * run.steps + step)
        on_steps = run.args.save_steps is not None and step % run.args.save_steps == 0
        if on_steps or asked or hook("save_now", run, epoch, step):
            torch_xla.sync()
            read_losses(run, epoch)  # A wait for the device: the checkpoint's history holds every step it logged.
            test = evaluate(run) if on_steps and not asked else None  # A stop evaluates nothing: its grace is short.
            save(run, next_epoch=epoch, steps_done=step, test=test)
        if asked:
            stop(run, asked, f"epoch {epoch} step {step}")
    if step != run.steps:  # A short epoch is a failed DataLoader: MpDeviceLoader ends the epoch quietly then.
        raise RuntimeError(f"epoch {epoch}'s input stopped at step {step} of {run.steps}")
    asked = stop_asked(run, epoch * run.steps)
    torch_xla.sync()
    read_losses(run, epoch)  # A wait for every step launched.
    rate = None  # samples/s after the warm-up steps
    if started is not None:
        rate = (run.steps - skip - WARMUP_STEPS) * run.global_batch / (time.perf_counter() - started)
    test = evaluate(run)
    tested = f"test loss {test.loss:.4f} | accuracy {test.accuracy:.2f}% ({test.samples:,} samples)"
    say(run, f"epoch {epoch} done | {tested} | {'untimed' if rate is None else f'{rate:,.0f} samples/s'}")
    run.epochs.append(dict(epoch=epoch, test_loss=test.loss, accuracy=test.accuracy, samples_per_s=rate))
    hook("epoch_done", run, run.epochs[-1])
    save(run, next_epoch=epoch + 1, steps_done=0, test=test)
    if asked and epoch < run.args.epochs:  # After the last epoch the run finishes.
        stop(run, asked, f"epoch {epoch + 1} step 0")


def read_losses(run, epoch):
    """Reads back the losses of the boundaries before, and frees them: live tensors slow every graph cut a little."""
    while run.unread:
        step, tensor, lr = run.unread.pop(0)
        loss = float(tensor.cpu())
        run.history.append(dict(epoch=epoch, step=step, loss=loss, lr=lr))
        hook("logged", run, run.history[-1])
        say(run, f"epoch {epoch} step {step}/{run.steps} | loss {loss:.4f}")


def layerdrop_keep(run, epoch, step):
    """The step's fc2 decisions, from (seed, epoch, step) only: one graph on every replica; a resume repeats them."""
    args = run.args
    if args.layerdrop == "off":
        return None
    coins = np.random.default_rng([args.seed, epoch, step]).random(run.model.depth)
    keep = coins >= args.layerdrop_prob  # each application kept with probability 1 - layerdrop_prob
    if args.layerdrop == "dynamic":
        return keep.tolist()
    return torch.tensor(keep, device=run.device)


def stop_asked(run, step):
    """After each step (counted over the epochs): the stop signal's number if this is the step to stop at, else 0."""
    if not run.service:
        return STOP.signum
    with STOP.lock:  # TPU v2/v3 run two replica threads a process: the service hears only the higher step.
        if step > STOP.highest:
            STOP.highest = step
            if torch_xla._XLAC._sync_point_reached(step):  # 0.2 us, no wait, until a SIGTERM came to any process
                STOP.step = step
    if STOP.step is None or step < STOP.step:
        return 0
    return signal.SIGTERM


def stop(run, signum, where):  # After a stop signal's checkpoint: exit 128 + the signal's number.
    signum = hook("stopping", run, signum) or signum
    why = f"stopped by {signal.Signals(signum).name} at {where}, checkpoint saved"
    raise Exit(128 + signum, f"{why}: continue with --resume {run.args.out_dir}")


def say(run, line):  # The master prints, and keeps the line in the run's log.txt.
    if run.master:
        with contextlib.suppress(OSError):  # A reader that died (ssh gone, its `tee` killed) ends no run: EPIPE, EIO.
            print(line, flush=True)
        with open(os.path.join(local_folder(run.args.out_dir), "log.txt"), "a") as f:
            f.write(line + "\n")


# ---- checkpoints: in a folder on this machine or in a Cloud Storage bucket -------------------------------------------
# One dict, checkpoint-EEEE-SSSSSSSSS.pt by its position (the epoch to train next, the samples of it done), written
# whole here first as NAME.tmp. A spot TPU VM is deleted when preempted, its disk too: --out-dir gs://BUCKET/RUN keeps
# the run, through fsspec (gcsfs); the logs are written here in runs/gs/BUCKET/RUN (an object cannot be appended to).
KEEP_CHECKPOINTS = 2  # The newest checkpoints stay in the run folder; older ones are deleted.


def save(run, *, next_epoch, steps_done, test=None):
    """Saves the run at its position, with the test loss just measured (None on a stop). Returns the path."""
    # Samples, not steps: a resume with another batch size goes on from the same sample, or refuses if it is mid-step.
    samples = steps_done * run.global_batch
    ckpt = {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "schedule": run.schedule.state_dict(),
        "epoch": next_epoch,
        "samples": samples,
        "device": xr.device_type(),
        "test_loss": None if test is None else test.loss,
        "history": run.history,
        "epochs": run.epochs,
        "settings": {name: value for name, value in vars(run.args).items() if name not in NOT_SETTINGS},
        "rng": xm.get_rng_state(run.device),  # the seed of the next step's random ops, dropout's
    }
    out = run.args.out_dir
    path = f"{out}/checkpoint-{next_epoch:04d}-{samples:09d}"
    if not hook("write", run, ckpt, path):  # (the instruments write SPMD's as a DCP folder, path/)
        path += ".pt"
        written = local_folder(path) + ".tmp"
        xm.save(ckpt, written, master_only=True, global_master=True)  # Each runs its steps; the master writes.
        # A kill mid-write, or before the move, leaves the last whole checkpoints. A bucket's object appears whole.
        if run.master and "://" in out:
            store(out).put_file(written, path)
            os.remove(written)
        elif run.master:
            os.replace(written, path)
    if run.master:
        for old in checkpoints(out)[:-KEEP_CHECKPOINTS]:
            store(out).rm(old, recursive=True)
    hook("saved", run)
    return path


def store(path):  # fsspec's file system for a path: the local disk's, or gcsfs's for gs://
    return fsspec.core.url_to_fs(path, use_listings_cache=False)[0]  # No listing cache: other processes write too.


def local_folder(out_dir):  # where this machine writes the run's logs, and each checkpoint first
    return os.path.join("runs", out_dir.replace("://", "/", 1)) if "://" in out_dir else out_dir


def checkpoints(folder):
    """A run folder's whole checkpoints (no *.tmp, no DCP folder without its .metadata), the newest written last: a run
    resumed from an older checkpoint goes on in the same folder."""
    fs = store(folder)
    written = {}
    for name in [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False)]:
        path = f"{folder}/{name}"
        if name.startswith("checkpoint-") and not name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):  # (deleted meanwhile, or a DCP folder being written)
                written[path] = fs.modified(path if path.endswith(".pt") else f"{path}/.metadata")
    return sorted(written, key=lambda p: (written[p], p))


def find_checkpoint(path):  # What --resume PATH names: a checkpoint, or the newest in a run folder.
    path = path.rstrip("/") or path  # (as a shell completes a folder: its parent is the run folder)
    fs = store(path)
    if fs.isfile(path) or fs.exists(f"{path}/.metadata"):
        return path
    found = checkpoints(path) if fs.isdir(path) else []
    if not found:
        raise Exit(2, f"error: --resume {path}: no checkpoint there")
    return found[-1]


def load_checkpoint(path):
    """Reads a checkpoint as the dict it saved (the instruments also read SPMD's DCP folder, and check it)."""
    ckpt = hook("read", path)
    if ckpt is None:
        with store(path).open(path, "rb") as f:
            ckpt = torch.load(f, map_location="cpu", weights_only=True)
    return ckpt


def resume(run):
    """Loads --resume into the model, the optimizer and the schedule. Returns (the epoch, the steps of it done)."""
    args, path = run.args, run.args.resume
    if not path:
        return 1, 0
    ckpt = load_checkpoint(path)
    try:
        run.model.load_state_dict(ckpt["model"])  # onto the device; under SPMD, replicated
        run.optimizer.load_state_dict(ckpt["optimizer"])  # with its param_groups as saved (Adam's betas, say)
    except Exception as e:  # PyTorch's message spans several lines; the error keeps to one.
        why = f"its model or optimizer is not this run's: {' '.join(str(e).split())}"
        raise Exit(2, f"error: --resume {path}: {why}") from e
    changed = {name for name, value in ckpt["settings"].items() if getattr(args, name, value) != value}  # given anew
    for group in run.optimizer.param_groups:  # as saved, but for a --momentum given anew (SGD's; Adam has none)
        if "momentum" in changed and "momentum" in group:
            group["momentum"] = args.momentum
    done, rest = divmod(ckpt["samples"], run.global_batch)  # the steps of this epoch done, at this run's batch
    if rest or done >= run.steps:
        why = f"{ckpt['samples']} samples into its epoch are no whole step of this run's {run.steps}"
        raise Exit(2, f"error: --resume {path}: {why}: resume with the batch size and --steps-per-epoch it had")
    # The schedule goes on as saved. It is reshaped from this step of the run on if --lr, --epochs or --steps-per-epoch
    # is given anew, or if a step is another size (another batch or device count: the steps it saved counted others),
    # or if the checkpoint has none (saved before it had; PyTorch's warning of a first step is of no matter then).
    at = (ckpt["epoch"] - 1) * run.steps + done
    saved = ckpt.get("schedule")
    if saved and saved.get("last_epoch", at) == at and not {"lr", "epochs", "steps_per_epoch"} & changed:
        run.schedule.load_state_dict(saved)
    else:
        run.schedule.last_epoch = at - 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.schedule.step()
    run.history, run.epochs = ckpt["history"], ckpt["epochs"]
    hook("resumed", run, ckpt, done)
    # Every torch_xla.sync() moves the device's RNG on: set now, dropout goes on with the masks it would have drawn.
    xm.set_rng_state(ckpt["rng"], run.device)
    say(run, f"resume | {path}: continuing at epoch {ckpt['epoch']} of {args.epochs}, after step {done}")
    return ckpt["epoch"], done


# ---- the command line: xmp.spawn, a replica per device, or SPMD in this process --------------------------------------
def main(argv=None):
    """Trains, and returns the exit code (README.md lists them) after printing the run's last line."""
    args, code, line = None, 0, None
    try:
        args = parse_args(argv)
        if XLA_IMPORT_ERROR is not None:
            why = f"{type(XLA_IMPORT_ERROR).__name__}: {str(XLA_IMPORT_ERROR).strip().splitlines()[0]}"
            raise Exit(2, f"error: import torch_xla failed: {why} (on a TPU VM it reads the VM's metadata)")
        hook("prepare", args)
        try:  # Once, before the replicas start: they never race to download it, and a missing one is one line here.
            dataset(args, train=True), dataset(args, train=False)
        except Exception as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise Exit(2, f"error: cannot read the dataset in --data-dir {args.data_dir}: {why}") from e
        resumed = os.path.dirname(args.resume) if args.resume else None
        args.out_dir = args.out_dir or resumed or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        os.makedirs(local_folder(args.out_dir), exist_ok=True)
        launch(args)
    except Exit as e:
        code, line = e.code, e.line
    except KeyboardInterrupt:
        code, line = 130, "interrupted"
    except Exception as e:  # a bug, in your model say: its traceback, then one line
        with contextlib.suppress(OSError):  # (a stderr whose reader died)
            traceback.print_exception(e)
        code, line = 1, hook("bug", e) or f"failed: {type(e).__name__}: {e} (traceback above)"
    if line is not None:
        with contextlib.suppress(OSError):
            print(f"train_tpu.py: {line}", file=sys.stderr, flush=True)
    hook("ended", args, code, line)
    return code


def launch(args):
    """Runs the replicas (docs: learn/pjrt) through xmp.spawn: a process per TPU chip, or one in this process (--cores
    1); or under SPMD this process, over every device."""
    # The service's port: torch_xla's default (csrc/runtime/xla_coordinator.h), alike on every host.
    args.coordinator_port = args.coordinator_port or 8547
    # SIGTERM: a replica in this process stops at its next step. Replica processes stop at the step their service names:
    # this process passes it on, as a container's first process (GKE's) may be the only one to get it.
    main_thread = threading.current_thread() is threading.main_thread()  # Python takes signals there only.
    if main_thread and (args.spmd or args.cores == 1):
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(STOP, "signum", signum))
    elif main_thread:
        signal.signal(signal.SIGTERM, pass_on)
    with hook("launch", args) or contextlib.nullcontext():
        if args.spmd:
            train(0, args)
        else:  # nprocs=1: the one replica, in this process; None: a process per TPU chip
            xmp.spawn(train, args=(args,), nprocs=1 if args.cores == 1 else None)


def pass_on(signum, frame):
    """Passes a stop signal on to the replica processes: xmp.spawn starts them as multiprocessing children."""
    for child in multiprocessing.active_children():
        os.kill(child.pid, signum)


class Exit(Exception):
    """Ends a run with an exit code and one line (README.md lists the codes), raised by every replica alike."""

    def __init__(self, code, line):
        super().__init__(code, line)  # An exception pickles as its args: xmp.spawn pickles a replica process's Exit.
        self.code, self.line = code, line

    def __str__(self):
        return self.line


# ==== the instruments: the smoke test, run control, the checks, the format conversion, fit() ==========================
# They add themselves to HOOKS (the table at the end of the block), which the trainer above calls at points of a run.
# ruff: noqa: E402 (the block's own imports are here, with it)
import functools
import hashlib
import importlib.metadata
import inspect
import json
import pickle
import shutil
import socket
import sysconfig
import tempfile

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

with contextlib.suppress(Exception):  # (main() says in one line that torch_xla failed to import)
    import torch_xla.debug.metrics as met
    import torch_xla.experimental.distributed_checkpoint as xc
    from torch_xla._internal import pjrt

# A replica process leaves stop signals to its launcher (Control), which passes them on as SIGTERM to XLA's
# coordination service. So it sets an idle handler as it imports this file, before its runtime starts: libtpu, when it
# starts, chains to a Python handler, but kills the process on a signal that was ignored (SIG_IGN; pytorch/xla#8234).
REPLICA_PROCESS = os.environ.get("TRAIN_TPU_LAUNCHER") == str(os.getppid())  # started by the launcher (Control)
if REPLICA_PROCESS:

    def on_stop_signal(signum, frame):  # Nothing while the launcher lives; a replica orphaned by its death ends.
        if str(os.getppid()) != os.environ["TRAIN_TPU_LAUNCHER"]:
            os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signum != signal.SIGHUP or signal.getsignal(signum) is not signal.SIG_IGN:  # (nohup's stays ignored)
            signal.signal(signum, on_stop_signal)


# ---- flags, and before any device starts: their ranges, torch_xla, the device, hosts, --cores, the dataset ----------
NOT_SETTINGS += ("smoke", "smoke_timeout")  # the instruments' flags that a resume does not keep


def add_flags(p, argv):
    smoke = dict(data="synthetic", epochs=2, steps_per_epoch=40, log_steps=10)  # its presets
    p.add_argument("--smoke", action="store_true", help=f"a short run and a verdict, exit 5 on a FAIL; sets {smoke}")
    p.add_argument("--smoke-timeout", type=float, default=900.0, help="seconds, from before any device starts")
    p.add_argument("--max-recompiles", type=int, help="exit 3 (--smoke: FAIL) if more graphs compile after epoch 1")
    p.add_argument("--save-minutes", type=float, default=10.0, help="also checkpoint after M minutes with none; 0: off")
    if "--smoke" in argv:  # Its presets replace the defaults, so that the flags given still win.
        p.set_defaults(**smoke)
    p.error = functools.partial(flag_error, p)  # argparse's prints the usage block: one line instead


def flag_error(p, message):
    raise Exit(2, f"error: {message} (see --help)")


def check_flags(p, args):
    ranges = (  # The flags' allowed values: (flags, the rule in words, the test). NaN fails every test.
        (("cores", "epochs", "batch_size", "steps_per_epoch", "log_steps", "save_steps"), ">= 1", lambda v: v >= 1),
        (("coordinator_port",), ">= 1", lambda v: v >= 1),
        (("seed", "max_recompiles", "target_accuracy", "workers", "save_minutes"), ">= 0", lambda v: v >= 0),
        (("lr", "smoke_timeout"), "> 0", lambda v: v > 0),
        (("momentum",), "in [0, 1)", lambda v: 0 <= v < 1),
        (("layerdrop_prob",), "in [0, 1]", lambda v: 0 <= v <= 1),
    )
    if args.smoke and args.resume:
        p.error("--smoke checks a fresh run: leave out --resume")
    for flag, path in (("--out-dir", args.out_dir), ("--resume", args.resume)):
        try:  # (gcsfs, for gs://: fsspec's message names the package)
            fs = store(path or ".")
        except ImportError as e:
            raise Exit(2, f"error: {path}: {first_line(e)}") from e
        if path and "://" in path:
            try:
                there = fs.exists(fs._strip_protocol(path).split("/")[0])
            except Exception as e:  # gcsfs's: no credentials, say
                raise Exit(2, f"error: {flag} {path}: {type(e).__name__}: {first_line(e)}") from e
            if not there:
                raise Exit(2, f"error: {flag} {path}: no such bucket, or no access to it")
    for names, rule, ok in ranges:
        for name in names:
            value = getattr(args, name)
            if value is not None and not ok(value):
                p.error(f"argument --{name.replace('_', '-')}: must be {rule}, got {value}")


def prepare(args):
    """Refuses what it can before any device starts, as xmp.spawn cannot start once one has."""
    kind, host, hosts, cores = check_environment(args)
    if args.spmd and args.cores and kind == "CPU":
        os.environ["CPU_NUM_DEVICES"] = str(args.cores)  # The CPU runtime emulates that many devices.
    if args.out_dir is None and hosts > 1 and args.resume is None:
        raise Exit(2, "error: --out-dir is needed on a pod slice: a folder that every host can read")
    model = initial_model(args)  # Layerdrop needs two hooks of the model's: a depth, and a forward that takes coins.
    hooks = hasattr(model, "depth") and "keep" in inspect.signature(model.forward).parameters
    if args.layerdrop != "off" and not hooks:
        raise Exit(2, f"error: --layerdrop: {type(model).__name__} has no `depth` or takes no `keep`, as ToyModel has")
    if args.smoke:  # A model that cannot take the smoke's data would end it in a traceback that says nothing of the VM.
        x = torch.utils.data.default_collate([smoke_shaped(model, dataset(args, train=False))[0]])[0]
        try:
            with torch.no_grad():
                model.eval()(model_input(x))
        except Exception as e:
            why = f"{type(model).__name__} cannot take --data {args.data}'s inputs ({' x '.join(map(str, x.shape))})"
            raise Exit(2, f"error: --smoke: {why}: {first_line(e)}: give --smoke the --data of your dataset") from e
    resumed = os.path.dirname(args.resume) if args.resume else None
    out = args.out_dir or resumed or "runs"  # the folder main() writes in (its default, runs/<time>, goes in runs)
    try:  # A folder with a checkpoint holds a run, which only a run resumed from it may go on writing.
        same = resumed is not None and os.path.abspath(resumed) == os.path.abspath(out)  # (URLs too)
        if args.out_dir and store(out).isdir(out) and checkpoints(out) and not same:
            raise Exit(2, f"error: --out-dir {out} holds a run: continue it with --resume, or name another")
        os.makedirs(local_folder(out), exist_ok=True)
    except OSError as e:
        raise Exit(2, f"error: --out-dir {out}: cannot make it ({e.strerror})") from e
    if args.coordinator_port is None and kind != "TPU":  # Off a TPU, a free one: two runs here would share 8547.
        with socket.socket() as s:  # (gRPC shares a busy port silently: SO_REUSEPORT)
            s.bind(("localhost", 0))
            args.coordinator_port = s.getsockname()[1]
    LAUNCHER.update(kind=kind, host=host, hosts=hosts, prepared=time.time())


def check_environment(args):
    """Returns (device kind, hosts, cores to train on). Nothing here starts the runtime."""
    xla = importlib.metadata.version("torch_xla")
    if xla.split(".")[:2] != torch.__version__.split(".")[:2]:  # torch_xla's C++ is built for one torch release.
        raise Exit(2, f"error: torch {torch.__version__} with torch_xla {xla}: install the pair requirements.txt pins")
    if downcast := [v for v in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16") if os.environ.get(v, "0") not in ("0", "false")]:
        why = "makes every float32 tensor bfloat16 on the device (torch_xla/csrc/dtype.cpp), its sums and checks too"
        raise Exit(2, f"error: {downcast[0]} {why}: unset it, and train in bfloat16 with --bf16 (autocast)")
    chips = tpu.num_available_chips()  # It reads the PCI bus, without starting the runtime.
    # On a TPU VM with no PJRT_DEVICE given, torch_xla's import chose the CPU if it found no libtpu (its __init__.py).
    if chips and USER_DEVICE is None and not torch_xla._found_libtpu:  # (private: its only record of that choice)
        raise Exit(2, "error: this TPU VM's torch_xla has no libtpu: pip install 'torch_xla[tpu]'")
    kind = os.environ.get("PJRT_DEVICE", "unset")  # the user's, or what torch_xla's import chose
    if kind not in ("TPU", "CPU") or (kind == "TPU" and not chips):
        raise Exit(2, f"error: PJRT_DEVICE={kind}, and this machine has no such device: unset it to use the CPU")
    have, accelerator = int(os.environ.get("CPU_NUM_DEVICES", 1)), ""
    try:  # On a TPU VM these ask its metadata server (the devices per chip come from its accelerator type).
        host, hosts = this_host(kind)
        if kind == "TPU":
            have, accelerator = tpu.num_available_devices(), tpu.get_tpu_env().get("ACCELERATOR_TYPE", "")
    except Exception as e:
        raise Exit(2, f"error: cannot read this TPU VM's slice from its metadata: {first_line(e)}") from e
    cores = args.cores or have
    # The number in a v4-8's or a v5p-8's name counts TensorCores, 2 a chip, and torch_xla sees a device a chip.
    if kind == "TPU" and cores != have and accelerator.endswith(f"-{cores}"):
        tensorcores = f"the {cores} TensorCores of this {accelerator}, here {have} devices"
        tell(None, f"--cores {cores}: {tensorcores}, a replica each")
        cores = have
    if hosts > 1 and (args.spmd or args.cores == 1):
        raise Exit(2, f"error: --spmd and --cores 1 train on one host, and this slice has {hosts}: leave them out")
    if kind == "CPU" and cores > 1 and not args.spmd:  # On the CPU, the replicas of one process are threads.
        why = "torch_xla's CPU collectives hang across replicas (pytorch/xla#5005)"
        raise Exit(2, f"error: --cores {cores} on the CPU: {why}; use --cores 1, or --spmd --cores N")
    if kind == "TPU" and args.spmd and cores != have:
        raise Exit(2, f"error: --cores {cores}: --spmd uses all {have} TPU devices of this machine")
    if kind == "TPU" and cores not in (1, have):
        raise Exit(2, f"error: --cores {cores}: this machine has {have} TPU devices; use --cores 1 or {have}")
    return kind, host, hosts, cores


def this_host(kind):  # (this host's worker number, the slice's hosts): from the TPU VM's metadata; (0, 1) off a TPU
    return (tpu.worker_id(), tpu.num_tpu_workers()) if kind == "TPU" else (0, 1)


# ---- a replica's instruments: its stages for the launcher, the smoke's data, counters, TensorBoard -------------------
@contextlib.contextmanager
def watched(index):
    """A replica's run (index: its global ordinal) under the launcher's watch: an error that may be its alone."""
    global CONTROL
    with ONE_REPLICA_AT_A_TIME:  # (TPU v2/v3: two replica threads share the process's)
        if CONTROL is None:  # a replica process: the launcher's copy
            with open(os.path.join(os.environ["TRAIN_TPU_CONTROL"], "control.pkl"), "rb") as f:
                CONTROL = pickle.load(f)
    control = CONTROL
    try:
        yield
    except Exception as e:
        # An Exit 3, 5, 21 or a stop is agreed: every replica raises it at once. Any other error, or an Exit 2 or 4 (a
        # checkpoint only this one cannot read or compute), may be its alone, while the others wait for it: end them.
        if not control.in_process and (not isinstance(e, Exit) or e.code in (2, 4)):
            ended = e if isinstance(e, Exit) else Exit(1, f"replica {index}: {report_bug(e)}")  # a bug's, or its own
            control.write(f"failed-{index}", [ended.code, ended.line, control.replicas().get(index, [0, "setup"])[1]])
        raise
    finally:
        if control.progress[index]:  # Its process may end now; one that ends before this died.
            control.set_stage(index, "ended")


def started(run):  # once the replica's runtime started
    control = run.control = CONTROL  # (loaded by watched())
    run.kind, run.out_dir = xr.device_type(), run.args.out_dir
    run.checks, run.places, run.untrained, run.board = [], None, None, None  # --smoke's; TensorBoard's writer
    run.warm_compiles, run.recompiles, run.save_every, run.over = None, 0, None, None  # (over: past --max-recompiles)
    control.devices[run.rank] = xr.local_ordinal()  # (its chip on this host, from v4 on; on v2/v3 a core of one)
    if run.service:  # Once the service takes SIGTERM, a replica process ends with its launcher.
        threading.Thread(target=end_if_orphaned, name="train_tpu orphaned", daemon=True).start()
    control.set_stage(run.rank, "setup")  # The launcher now knows this replica's process, and that its runtime started.


def smoke_data(run):  # --smoke: the synthetic digits shaped for your model, read as often as its steps need
    args = run.args
    if not args.smoke:
        return None
    data = smoke_shaped(run.model, dataset(args, train=True))
    # As many steps on 32 devices as on 1: the digits' 12,000 samples give 8 devices 11 steps of 1,024 an epoch.
    need, have = args.steps_per_epoch * run.global_batch, len(data)
    if have < need:
        steps = f"{args.epochs} epochs of {args.steps_per_epoch} steps of {run.global_batch}"
        say(run, f"smoke | {steps}: {need / have:.1f} passes over the training set's {have:,} samples an epoch")
        data = torch.utils.data.Subset(data, [i % have for i in range(need)])
    return data, smoke_shaped(run.model, dataset(args, train=False))


def before_training(run):
    if run.master:  # TensorBoard's scalars, in the run folder, if the package is there (it is no requirement)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            say(run, "tensorboard | not installed: no scalars written (pip install tensorboard)")
        else:
            run.board = SummaryWriter(local_folder(run.out_dir))
    if run.args.smoke:
        run.untrained = evaluate(run)  # the learning check's baseline: the initial weights' test loss
        smoke_check(run, check_devices)  # before training: a missing chip is the first FAIL, whatever follows


def start_epoch(run, epoch):
    run.epoch, run.epoch_began = epoch, time.perf_counter()
    run.compiles_at_start, run.transfers_at_start = compiles()[0], transfers()


def on_time(run, epoch, step):  # --save-minutes: every run.save_every steps, once the first epoch has been timed
    return run.save_every is not None and ((epoch - 1) * run.steps + step) % run.save_every == 0


def scalar(run, name, value, step):  # TensorBoard's x axis counts steps over every epoch.
    if run.board is not None and value is not None:  # (an epoch too short to time has no samples/s)
        run.board.add_scalar(name, value, (run.epoch - 1) * run.steps + step)


def count_epoch(run, row):
    """After the epoch's evaluation: its counters (row, line, TensorBoard). Past --max-recompiles, exit 3 once saved."""
    epoch_seconds = time.perf_counter() - run.epoch_began
    recompiles = 0 if run.warm_compiles is None else compiles()[0] - run.warm_compiles
    run.recompiles = int(agree(run, [recompiles])[0])  # the most of any replica, which --max-recompiles tests
    limit = run.args.max_recompiles
    if limit is not None and run.recompiles > limit and not run.args.smoke:
        why = f"{run.recompiles} graphs compiled after warm-up (the first epoch trained here)"
        run.over = Exit(3, f"failed: {why}, over --max-recompiles {limit}: the graph changes from step to step")
    if run.warm_compiles is None:
        run.warm_compiles = compiles()[0]  # counted after the first evaluation, whose graph is part of the warm-up
    total, seconds = compiles()
    row.update(compiles=total - run.compiles_at_start, recompiles=total - run.warm_compiles)
    row.update(fallback_ops=fallback_ops(), transfers=transfers() - run.transfers_at_start)
    counts = f"this epoch {row['compiles']} | recompiles after warm-up {row['recompiles']}"
    compiled = f"{counts} | {seconds:.1f} s compiling in all | CPU fallback ops: {row['fallback_ops']}"
    say(run, f"epoch {run.epoch} compiles in this process | {compiled} | device-to-host reads {row['transfers']}")
    tags = dict(test_loss="test/loss", accuracy="test/accuracy", samples_per_s="train/samples_per_s")
    for name, tag in tags.items():
        scalar(run, tag, row[name], run.steps)
    if run.save_every is None and run.args.save_minutes:  # On time from the first epoch trained here, as it took.
        seconds = float(agree(run, [epoch_seconds / run.steps])[0])  # the slowest replica's: one interval for all
        run.save_every = max(1, int(60 * run.args.save_minutes / seconds))


def stopping(run, signum):  # The stop's signal: the launcher's own, which it passed on as SIGTERM to the service.
    run.control.set_stage(run.rank, "stopping")  # Saved: the launcher's grace no longer applies.
    if run.service:
        return run.control.stop_signal() or signum
    return max(signum, run.control.stop_signal())  # SIGTERM, if it came with a SIGHUP taken first (on_signal)


# ---- SPMD's checkpoints: a DCP folder of each device's shards and a .metadata (docs: perf/spmd_distributed_checkpoint)
def write_dcp(run, ckpt, path):  # Under SPMD: written whole here first, as path.tmp/, then moved into place.
    if run.mesh is None:
        return False
    written = local_folder(path) + ".tmp"
    shutil.rmtree(written, ignore_errors=True)
    with warnings.catch_warnings():  # (not action=: Python 3.10, a TPU VM's, lacks it)
        warnings.simplefilter("ignore")  # DCP's, that no process group is set: this process is the whole run
        dcp.save(ckpt, storage_writer=dcp.FileSystemWriter(written), planner=xc.SPMDSavePlanner())
    # A DCP folder counts once its .metadata is in: it goes up after every shard (fsspec/asyn.py: put sends at once).
    if "://" not in path:
        shutil.rmtree(path, ignore_errors=True)  # os.replace cannot replace a folder that is not empty.
        os.replace(written, path)
    else:
        shards = [n for n in os.listdir(written) if n != ".metadata"]
        store(path).put([f"{written}/{n}" for n in shards], [f"{path}/{n}" for n in shards])
        store(path).put_file(f"{written}/.metadata", f"{path}/.metadata")
        shutil.rmtree(written)
    return True


def read_checkpoint(path):
    """Reads either format as the dict torch.load gives for a file; exits 2 in one line if not a whole checkpoint."""
    fs = store(path)
    try:
        if fs.isdir(path):
            with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (DCP's notices)
                if "://" in path:  # (a bucket's, fetched first)
                    fs.get(f"{path}/", f"{tmp}/dcp/", recursive=True)
                dcp_to_torch_save(f"{tmp}/dcp" if "://" in path else path, f"{tmp}/c.pt")
                ckpt = torch.load(f"{tmp}/c.pt", weights_only=True)
            # DCP keys the optimizer state by strings, and load_state_dict would then silently drop the momentum.
            ckpt["optimizer"]["state"] = {int(k): v for k, v in ckpt["optimizer"]["state"].items()}
        else:
            with fs.open(path, "rb") as f:
                ckpt = torch.load(f, map_location="cpu", weights_only=True)
        if not {"model", "optimizer", "epoch", "samples", "history", "epochs", "settings", "rng"} <= ckpt.keys():
            raise KeyError("not the keys of a train_tpu.py checkpoint")
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException.
        why = f"cannot read it ({type(e).__name__}): truncated, damaged, or not a train_tpu.py checkpoint"
        raise Exit(2, f"error: checkpoint {path}: {why}") from e
    return ckpt


def converted(run, ckpt, done):
    """After a resume loads: the check of what it computes (exit 4), then in the other format a save in this one's."""
    path = run.args.resume
    test = verify(run, path, ckpt)
    if store(path).isdir(path) != (run.mesh is not None):  # a DCP folder without SPMD, or a file under it
        xm.set_rng_state(ckpt["rng"], run.device)  # (which the evaluation moved on: saved as it was)
        saved = save(run, next_epoch=ckpt["epoch"], steps_done=done, test=test)
        say(run, f"resume | converted, saved as {saved}")


def finish(run):
    run.control.set_stage(run.rank, "finishing")  # Past the last checkpoint, a stop signal no longer ends the run.
    if run.board is not None:
        run.board.close()
    if run.args.smoke:
        smoke_verdict(run)


def agree(run, values):
    """The largest of `values` over the replicas, so that all decide alike. It waits for the step just launched."""
    values = torch.as_tensor(values, dtype=torch.float32)  # TPUs all-reduce no int64 (pytorch/xla#1952).
    if run.world == 1:
        return values
    torch_xla.sync()  # It launches the pending step first, as MpDeviceLoader would: the step's graph stays the same.
    return xm.all_reduce(xm.REDUCE_MAX, values.to(run.device)).cpu()


def first_line(e):  # (its type's name if the message is empty)
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def first_batch(run):  # the test set's first samples, alike on every replica: what the checks compute on
    return next(iter(loader(run, run.test.dataset, range(min(run.load_batch, len(run.test.dataset))))))


def compiles():  # graphs compiled in this process so far, and the seconds it took (torch_xla's metrics)
    count, nanoseconds, _ = met.metric_data("CompileTime") or (0, 0, None)  # None before the first compile
    return count, nanoseconds / 1e9


def transfers():  # device-to-host reads in this process so far, each a wait for the device: a batch of tensors is one
    return (met.metric_data("TransferFromDeviceTime") or (0,))[0]


def fallback_ops():  # Ops run on the host for want of an XLA lowering. `.item()`, a wait in the step, counts too.
    names = [n for n in met.counter_names() if n.startswith("aten::")]
    return ", ".join(f"{n} x{met.counter_value(n)}" for n in names) or "none"


def upload_logs(out_dir, since):
    """Copies the logs that this machine wrote since `since` (a time) into the bucket, whole."""
    folder = local_folder(out_dir)
    if "://" not in out_dir or not os.path.isdir(folder):
        return
    names = [n for n in os.listdir(folder) if not n.endswith(".tmp") and os.path.getmtime(f"{folder}/{n}") >= since]
    with contextlib.suppress(Exception):  # A copy of the logs: a failure here must not end the run.
        store(out_dir).put([f"{folder}/{n}" for n in names], [f"{out_dir}/{n}" for n in names])


def verify(run, path, ckpt):
    """Exits 4 unless the loaded weights, perhaps converted between the formats, compute what they should: the test loss
    saved with them, or (a stop saves none) eager PyTorch's logits on one test batch. Returns the TestResult or None."""
    saved = ckpt["test_loss"]
    if saved is None:
        x = model_input(first_batch(run)[0])
        eager = initial_model(run.args).eval()  # (dropout off on both sides)
        eager.load_state_dict(ckpt["model"])
        run.model.eval()
        with torch.no_grad():
            logits = eager(x)
            diff = float((run.model(x.to(run.device)).cpu() - logits).norm() / logits.norm())
        run.model.train()
        tol = tolerance(run)
        say(run, f"resume check | saved on a stop: one test batch's logits, device vs eager CPU {diff:.1e} ({tol:.0e})")
        if not diff <= tol:
            raise Exit(4, f"failed: resume check: {path} computes other logits here than in eager PyTorch ({diff:.1e})")
        return None
    if (ckpt["settings"]["data"], ckpt["settings"]["data_dir"]) != (run.args.data, run.args.data_dir):
        say(run, "resume check | skipped: the checkpoint was evaluated on other --data")
        return None
    test = evaluate(run)
    tol = tolerance(run, other_device=ckpt["device"])
    say(run, f"resume check | test loss saved {saved:.6f}, now {test.loss:.6f} (tolerance {tol:.0e})")
    if not abs(test.loss - saved) <= tol:  # (written so that a NaN fails too)
        raise Exit(4, f"failed: resume check: {path} gives test loss {test.loss:.6f}, and was saved at {saved:.6f}")
    return test


def tolerance(run, other_device="CPU", bf16=False):
    """How far two computations may differ: float32 on the CPU to rounding; TPU matmuls round through bfloat16, --bf16
    more. A wrong weight or layout differs by O(1)."""
    if bf16:
        return 5e-2
    return 1e-5 if run.kind == other_device == "CPU" else 2e-2


# ---- run control: stop signals, and a replica that fails or dies -----------------------------------------------------
def stop_signals():  # SIGHUP too: an ssh session's end, or a VM shutdown's after SIGTERM. Under nohup it stays ignored.
    hangup = [] if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else [signal.SIGHUP]
    return [signal.SIGTERM, signal.SIGINT, *hangup]


STOP_GRACE = 25  # Seconds from a SIGTERM to a forced exit: a preempted TPU VM has about 30. Ctrl-C and SIGHUP wait.
# Seconds: XLA's coordination service ends every process this long after one stops heartbeating. Its clients beat
# every 50 s, whatever this says (45 ended healthy runs here): 110 lets one beat come a whole beat late, as on a busy
# host, and still ends a slice within 150 s of a lost host. (JAX's default is 100. At 55, two replica processes ran
# 288 s beside 8 busy processes on this machine's 2 cores, and no beat came 5 s late.)
HEARTBEAT = 110
LAUNCHER = {}  # this launcher's: the device kind, its host and the slice's hosts, and when the run was prepared
FIT = types.SimpleNamespace(running=False, end=None)  # fit(): whether it runs main(), and how main() ended
CONTROL = None  # this process's Control: the launcher's own, or in a replica process its copy (watched())


class Control:
    """The launcher's watch over its replicas, and how a stop signal reaches them (README.md: Preemption and stops).
    Replicas tell the launcher their stage in files of this host (`replica-N`, `failed-N`); the launcher writes the
    signal (`stop`). Each host notes its end in the run folder (`ended-host-K`): every host names the first."""

    def __init__(self, args, out_dir, host=0, hosts=1, from_python=False):
        self.args = args
        self.from_python = from_python  # fit(): every end is an exception in the caller, never the process's exit
        self.out_dir = out_dir  # where a verdict goes when the launcher ends a smoke run
        self.host, self.hosts = host, hosts  # this host's worker number, and the slice's hosts
        self.folder = tempfile.mkdtemp(prefix="train_tpu-")
        self.not_ours = {p.pid for p in multiprocessing.active_children()}  # a notebook's own processes, say
        self.in_process = args.spmd or args.cores == 1  # The replica is here: children are DataLoader workers.
        self.progress = collections.Counter()  # {rank: stages so far} of this process's replicas
        self.devices = {}  # {rank: its device's number on this host} of this process's replicas
        self.seen = {}  # {process id: process}: every replica process seen, kept after it ends
        self.ended = None  # the Exit of a run that the launcher ended
        self.signalled = (None, 0.0)  # the first stop signal, and when it came
        self.grace_ends = math.inf  # when a stop signal's grace is over
        self.lock = threading.Lock()
        self.verdict = None  # the Exit of a smoke verdict the launcher wrote
        self.launched, self.closed = time.time(), False
        self.woken = threading.Event()  # set by a signal: the watch answers at once

    def __getstate__(self):  # What xmp.spawn pickles for a replica process: the folder, not the launcher's state.
        keep = ("args", "out_dir", "folder", "host", "hosts", "in_process", "from_python", "launched")
        return {name: getattr(self, name) for name in keep} | dict(progress=collections.Counter(), devices={})

    def __setstate__(self, state):
        self.__dict__.update(state, lock=threading.Lock())  # one a replica process

    def write(self, name, value):
        write_json(os.path.join(self.folder, name), value)

    def read(self, prefix):  # {name: value} of the files whose names start with `prefix`, the oldest first
        names = [n for n in os.listdir(self.folder) if n.startswith(prefix) and not n.endswith(".tmp")]
        paths = sorted((os.path.join(self.folder, n) for n in names), key=os.path.getmtime)
        return {os.path.basename(p): read_json(p) for p in paths}

    def replicas(self):  # {rank: [process id, stage, stages so far, device]} of the replicas whose runtime started
        ranks = {int(name.removeprefix("replica-")): value for name, value in self.read("replica-").items()}
        return dict(sorted(ranks.items()))

    # The replicas' side.
    def stop_signal(self):  # the number of the signal the launcher took, or 0
        return STOP.signum or self.read("stop").get("stop", 0)

    def set_stage(self, rank, stage):  # The launcher learns its process, device and how far it got.
        self.progress[rank] += 1
        self.write(f"replica-{rank}", [os.getpid(), stage, self.progress[rank], self.devices.get(rank)])

    # The launcher's side.
    def __enter__(self):
        global CONTROL
        os.environ["TRAIN_TPU_LAUNCHER"] = str(os.getpid())  # how a replica process knows its launcher at import
        os.environ["TRAIN_TPU_CONTROL"] = self.folder  # and where it finds this Control's copy, and reports an error
        os.environ.setdefault("DIST_SERVICE_HEARTBEAT_INTERVAL_IN_SEC", str(HEARTBEAT))  # (read as the service starts)
        with open(os.path.join(self.folder, "control.pkl"), "wb") as f:
            pickle.dump(self, f)
        CONTROL = self
        with contextlib.suppress(FileNotFoundError):  # this host's end of an earlier launch
            store(self.out_dir).rm(f"{self.out_dir}/ended-host-{self.host}")
        self.handlers = {}
        if threading.current_thread() is threading.main_thread():  # Python takes signals in its main thread only.
            self.handlers = {s: signal.signal(s, self.on_signal) for s in stop_signals()}
        self.deadline = (time.monotonic() + self.args.smoke_timeout) if self.args.smoke else math.inf
        threading.Thread(target=self.watch, name="train_tpu watch", daemon=True).start()
        return self

    def __exit__(self, kind, e, traceback):
        global CONTROL
        ended = self.exit_for(e, LAUNCHER.get("kind", "CPU")) if isinstance(e, Exception) else e
        self.closed = True  # The watch ends: its folder goes.
        CONTROL = None
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        for name in ("TRAIN_TPU_LAUNCHER", "TRAIN_TPU_CONTROL"):  # A process this one starts later is no replica.
            os.environ.pop(name, None)
        shutil.rmtree(self.folder, ignore_errors=True)
        if ended is not e:
            raise ended from e

    def on_signal(self, signum, frame):  # The first signal asks every replica to save and stop at one step.
        if self.ended is not None and self.from_python:
            raise self.ended  # end() sent this SIGINT to end the replica in this thread (fit())
        name = signal.Signals(signum).name
        first, at = self.signalled
        if {first, signum} == {signal.SIGTERM, signal.SIGHUP} and time.monotonic() - at < 5:
            if signum == signal.SIGTERM:  # Python runs SIGHUP's handler first when both wait: the stop is SIGTERM's.
                self.ask_stop(signum)
            return  # A shutdown's SIGTERM and an ssh session's SIGHUP: one preemption, not a second signal.
        self.signalled = (signum, time.monotonic())
        stages = {stage for _, stage, *_ in self.replicas().values()}
        if first is not None:
            self.end(self.conclude(Exit(128 + signum, f"stopped by a second {name}, at once: nothing saved")))
        elif stages <= {"setup", "devices"}:  # Every replica is before training, or none has started: nothing to save.
            self.end(self.conclude(Exit(128 + signum, f"stopped by {name} before training began: nothing to save")))
        else:
            self.ask_stop(signum)
            for child in self.children():  # Their coordination service takes it: one step, on every host.
                os.kill(child.pid, signal.SIGTERM)

    def ask_stop(self, signum):  # A preemption's SIGTERM has a deadline: a step that outlasts it ends the run.
        STOP.signum = signum
        self.write("stop", signum)
        if signum == signal.SIGTERM:
            why = f"a step (or its compilation) takes longer than the {STOP_GRACE} s grace: nothing saved"
            self.grace_over = Exit(128 + signum, f"stopped by {signal.Signals(signum).name}: {why}")
            self.grace_ends = time.monotonic() + STOP_GRACE
            self.woken.set()

    def watch(self):
        """Every half second: ends the run if a replica process died (xmp.spawn's pool can miss one in Python 3.11) or
        a replica failed alone, if a stop's grace is over while one trains, or at --smoke-timeout, verdict or not."""
        try:
            while self.ended is None and not self.closed:
                replicas = self.replicas()
                stages = [stage for _, stage, *_ in replicas.values()]
                if found := self.why_replicas_ended():
                    self.end(self.conclude(*found))
                elif time.monotonic() > self.grace_ends and "training" in stages:
                    self.end(self.conclude(self.grace_over))
                elif time.monotonic() > self.deadline:
                    self.end(self.deadline_passed(replicas))
                self.woken.wait(0.5)
                self.woken.clear()
        except Exception as e:  # A bug here must not leave the run unwatched. (The folder goes when the run ends.)
            if not self.closed:
                self.end(self.conclude(Exit(1, f"run control {report_bug(e)}")))

    def why_replicas_ended(self):  # (an Exit, its stage) of a process ended before its replicas, or of a failure
        replicas = self.replicas()
        self.seen.update((p.pid, p) for p in self.children())
        ended = {}  # {process: its replicas' stages} of the processes that ended before their replicas did
        for p in list(self.seen.values()):  # (a copy: the watch thread and exit_for() may both be here)
            stages = {rank: stage for rank, (pid, stage, *_) in replicas.items() if pid == p.pid}
            if p.exitcode is not None and not (stages and set(stages.values()) == {"ended"}):
                ended[p] = stages
        # A SIGABRT comes last: it is how the coordination service ends the other processes once one has died, so the
        # other death is the cause to name. A process that exits 0 did not die: xmp.spawn's pool ends so after a
        # failure, which the replicas that failed alone have named (a process that failed to start, say).
        order = sorted(ended, key=lambda p: (p.exitcode == 0, p.exitcode == -signal.SIGABRT))
        failed = list(self.read("failed-").values())  # the replicas that failed alone, the first first
        if failed and (not order or order[0].exitcode == 0):
            return Exit(*failed[0][:2]), failed[0][2]
        if not order:
            return None
        p, stages = order[0], ended[order[0]]
        how = f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exit code {p.exitcode}"
        if p.exitcode == -signal.SIGABRT:  # XLA's coordination service ends a process so, when another stopped
            how += ": the coordination service ended it, as a process elsewhere stopped (its log above names the"
            how += " unhealthy tasks: task K is the process of xr.process_index() K), or it aborted"
        ranks = " and ".join(f"{rank} (device {replicas[rank][3]})" for rank in stages)
        who = f"replica {ranks}'s process" if stages else f"replica process {p.pid}"
        stage = next(iter(stages.values()), "setup")
        return Exit(1, f"failed: {who} died ({how}) in {stage}; its checkpoints stay"), stage

    def children(self):  # the replica processes alive (none if the replica is in this process)
        return [] if self.in_process else [p for p in multiprocessing.active_children() if p.pid not in self.not_ours]

    def end(self, ended):  # Kills the replica processes; xmp.spawn then raises, and main() raises `ended`.
        if self.ended is not None:
            return  # The first end stands: the deaths that follow are its own doing.
        self.ended = ended
        if not self.in_process:
            for child in self.children():
                child.kill()
        elif self.from_python:  # fit(): the caller's process lives on, and its replica, in the main thread, raises.
            if threading.current_thread() is threading.main_thread():
                raise ended
            if self.handlers:  # (on_signal raises it there; without them, fit() off the main thread, it ends later)
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        else:  # A replica in this process cannot be killed: the process prints the line and exits.
            shutil.rmtree(self.folder, ignore_errors=True)
            tell(self.out_dir, f"train_tpu.py: {ended.line}", sys.stderr)
            upload_logs(self.out_dir, self.launched)
            os._exit(ended.code)

    def deadline_passed(self, replicas):  # The replicas furthest behind FAIL: the others wait for them in a collective.
        verdict = os.path.join(local_folder(self.out_dir), "verdict.json")
        if replicas and {stage for _, stage, *_ in replicas.values()} <= {"done", "ended"} and os.path.exists(verdict):
            code = 0 if read_json(verdict)["passed"] else 5  # The verdict is out; a join or a teardown hangs.
            return self.conclude(Exit(code, "the replica processes outlived --smoke-timeout after the verdict: killed"))
        timeout = f"within --smoke-timeout {self.args.smoke_timeout:g} s"
        started = {pid for pid, *_ in replicas.values()}
        if silent := [str(pid) for pid in self.seen if pid not in started]:  # stuck before any replica of theirs set up
            return self.conclude(Exit(5, f"replica process {' and '.join(silent)}: no runtime {timeout}"), "setup")
        behind = min((count for _, _, count, _ in replicas.values()), default=0)
        stuck = [str(rank) for rank, (_, _, count, _) in replicas.items() if count == behind]
        stuck = " and ".join(stuck) or "none started"
        stage = next((stage for _, stage, count, _ in replicas.values() if count == behind), "setup")
        return self.conclude(Exit(5, f"replica {stuck} did not finish {stage} {timeout}"), stage)

    def conclude(self, ended, stage=None):
        """The run's end, from what this launcher found. On a slice the first host's end is the run's, as the hosts
        note theirs in the run folder. With --smoke and a stage, a verdict: the checks done, then a FAIL row."""
        first = True  # whether the run's end is this host's
        if self.hosts > 1:  # This host's end, named, in OUT/ended-host-K; then the first of this launch's.
            prefix = next((p for p in ("failed: ", "error: ") if ended.line.startswith(p)), "")
            line = f"{prefix}host {self.host} ({os.uname().nodename}): {ended.line.removeprefix(prefix)}"
            mine = f"{self.out_dir}/ended-host-{self.host}"
            write_json(mine, dict(code=ended.code, line=line, stage=stage))
            time.sleep(1)  # Another host may end at the same moment: the earlier end is the run's, on every host.
            fs = store(self.out_dir)  # Its times are the store's clock: a bucket's, or the shared folder's.
            ends = [(fs.modified(mine).timestamp(), False, read_json(mine))]  # this host's, whatever the clocks say
            for name in [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(self.out_dir, detail=False)]:
                path = f"{self.out_dir}/{name}"
                with contextlib.suppress(OSError, ValueError):  # another host's, of this launch
                    written = fs.modified(path).timestamp() if name.startswith("ended-host-") else 0
                    if path != mine and written >= self.launched - 1:
                        ends.append((written, True, read_json(path)))
            _, theirs, end = min(ends, key=lambda e: e[:2])
            ended, stage, first = Exit(end["code"], end["line"]), end["stage"], not theirs
        if not (self.args.smoke and stage):
            return ended
        with self.lock:  # The watch and exit_for() may both be here: one verdict.
            if self.verdict is None:
                figure = ended.line.removeprefix("failed: ").removeprefix("error: ")
                checks = []  # the master's checks so far, and this row
                if first:
                    with contextlib.suppress(FileNotFoundError):
                        checks = read_json(os.path.join(local_folder(self.out_dir), "checks.json"))
                    publish(self.out_dir, [*checks, dict(name=stage, passed=False, figure=figure)])
                self.verdict = Exit(5, f"failed: smoke verdict FAIL: {stage}: {figure}")
            return self.verdict

    def exit_for(self, e, kind):  # The Exit for what xmp.spawn raised, or e (an Exit agreed, a bug in the only replica)
        if self.ended is None and (found := self.why_replicas_ended()):  # xmp.spawn raised before the watch looked.
            self.ended = self.conclude(*found)
        if self.ended is None and isinstance(e, Exit):
            return e  # Every replica raised it at the same point, and the launcher passes it on.
        if self.ended is None and not self.replicas():  # No replica has set a stage: none has a runtime.
            self.ended = self.conclude(Exit(2, f"error: the {kind} runtime did not start: {first_line(e)}"), "setup")
        if self.ended is None and self.args.smoke:  # (--cores 1, --spmd: with --smoke, a verdict)
            self.ended = self.conclude(Exit(1, f"replica 0: {report_bug(e)}"), self.replicas().get(0, [0, "setup"])[1])
        return self.ended or e


def end_if_orphaned():  # in a replica process once the service takes SIGTERM: it ends with its launcher, chips freed
    while str(os.getppid()) == os.environ["TRAIN_TPU_LAUNCHER"]:
        time.sleep(1)
    os._exit(1)


def run_replica_process(local_rank, *args, **kwargs):
    """torch_xla's _run_thread_per_device starts the runtime (a chip held by another process fails there), then train.
    xmp.spawn's pool raises in process order: an error here would wait behind replicas that wait for it. Report now."""
    try:
        return RUN_THREAD_PER_DEVICE(local_rank, *args, **kwargs)
    except Exception as e:
        if any(frame.f_code.co_name == "train" for frame, _ in traceback.walk_tb(e.__traceback__)):
            raise  # an error under the replica's watch (watched()), which reported it
        why = f"replica process {local_rank} (its local rank) failed to start: {type(e).__name__}: {first_line(e)}"
        write_json(os.path.join(os.environ["TRAIN_TPU_CONTROL"], f"failed-p{local_rank}"), [1, why, "setup"])
        raise  # (the pool's worker lives on, idle)


# What a replica process sets up as it imports this file (see the top). It takes effect when this file is the script
# run: the pool's task names torch_xla's function, which a replica of fit() looks up before it imports this module
# (there, a replica whose runtime never starts ends the run only at the smoke deadline).
if REPLICA_PROCESS and XLA_IMPORT_ERROR is None:
    RUN_THREAD_PER_DEVICE = pjrt._run_thread_per_device
    pjrt._run_thread_per_device = run_replica_process  # The pool's task names it by module and name: this one runs.


# ---- the run's end, and the smoke verdict: is this machine fit to train on? ------------------------------------------
def smoke_verdict(run):  # The checks after training. One FAILs if it failed on any replica; then exit 5.
    if run.control.hosts > 1:  # Every replica learns each one's host and device, which the rows name.
        places = torch.zeros(run.world, 2)
        places[run.rank] = torch.tensor([run.control.host, xr.local_ordinal()], dtype=torch.float32)
        run.places = agree(run, places).int().tolist()
    for check in CHECKS:
        smoke_check(run, check)
    run.control.set_stage(run.rank, "verdict")
    failures = torch.zeros(run.world, len(run.checks))  # a row per replica, 1 where its check failed
    failures[run.rank] = torch.tensor([float(c["passed"] is False) for c in run.checks])
    failures = agree(run, failures)  # The largest over the replicas holds every row: each sent zeros in the others'.
    for check, column in zip(run.checks, failures.T, strict=True):
        where = column.nonzero().flatten().tolist()
        if where and len(where) < run.world:  # A check that failed on every replica names the replica itself, if any.
            check["passed"] = False
            check["figure"] += f" | FAILED on replica(s) [{', '.join(place(run, r) for r in where)}]"
        if check["passed"] is False and check["name"] in POINTS_AT:
            check["figure"] += f" | points at {POINTS_AT[check['name']]}"
    run.control.set_stage(run.rank, "done")  # The verdict is agreed: the launcher's is no longer needed.
    if run.master:
        publish(run.out_dir, run.checks)
    if failed := [c["name"] for c in run.checks if c["passed"] is False]:
        raise Exit(5, f"failed: smoke verdict FAIL: {', '.join(failed)}")


def smoke_shaped(model, data):
    """--smoke's digits over as many channels as your model's first convolution takes (3: colour); yours as they are."""
    conv = next((m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    if getattr(data, "smoke_target", None) is None or conv is None or conv.in_channels == data.tensors[0].shape[1]:
        return data
    images, labels = data.tensors
    shaped = InMemory(images.expand(-1, conv.in_channels, -1, -1), labels)
    shaped.smoke_target = data.smoke_target
    return shaped


def smoke_check(run, check):  # Runs one: PASS (True), FAIL (False) or SKIP (None), kept in the run and the launcher's.
    name = check.__name__.removeprefix("check_")
    run.control.set_stage(run.rank, name)
    passed, figure = check(run)
    run.checks.append(dict(name=name, passed=passed, figure=figure))
    if run.master:  # for a verdict that a launcher writes
        write_json(os.path.join(local_folder(run.out_dir), "checks.json"), run.checks)


def check_devices(run):
    """The devices the runtime found, against the slice's in the TPU metadata (not the PCI bus: xmp.spawn reads it)."""
    found = xr.global_runtime_device_count()
    if run.kind != "TPU" or run.args.cores == 1:
        return None, f"{found} {run.kind} device(s); skipped off a TPU, or at --cores 1"
    # The tpu-env metadata of a v4-256, as printed in github.com/penghao-wu/cambrian's test_tpu.py, holds
    # CHIPS_PER_HOST_BOUNDS: '2,2,1'. With TPU_SKIP_MDS_QUERY (a GKE node, say) torch_xla builds it without that key.
    bounds = tpu.get_tpu_env().get("CHIPS_PER_HOST_BOUNDS")
    if not bounds:
        return None, f"{found} TPU devices; skipped: the TPU metadata has no CHIPS_PER_HOST_BOUNDS"
    chips = math.prod(int(n) for n in bounds.split(","))
    per_chip = tpu.num_logical_cores_per_chip()  # from the metadata's ACCELERATOR_TYPE: 2 on v2/v3, else 1
    hosts = tpu.num_tpu_workers()  # from the metadata's worker-network-endpoints
    expected = chips * per_chip * hosts
    per_host = f"{chips} chips per host (metadata CHIPS_PER_HOST_BOUNDS {bounds})"
    per_slice = f"{per_chip} devices per chip (metadata ACCELERATOR_TYPE) x {hosts} hosts (metadata workers)"
    return found == expected, f"{found} TPU devices found, {expected} in the slice: {per_host} x {per_slice}"


def check_arithmetic(run):
    """A known answer: a matmul, a convolution and a sum of small integers (-8 to 8), exact in bfloat16 and in float32
    sums of any order, so that any bit off is the chip's own."""
    m = (torch.arange(128 * 128) * 7 % 17 - 8).float().reshape(128, 128)  # every sum below 2**24
    got = known_answers(m.to(run.device)).cpu()
    exact = known_answers(m.double()).float()
    wrong = int((got.view(torch.int32) != exact.view(torch.int32)).sum())
    return wrong == 0, f"a matmul, a convolution and a sum of small integers: {wrong} of {len(exact)} values off"


def known_answers(m):  # a matmul, a convolution and a sum, of a 128 x 128 matrix's values
    image, kernel = m.reshape(2, 8, 32, 32), m.flatten()[:576].reshape(8, 8, 3, 3)
    return torch.cat([(m @ m.T).flatten(), F.conv2d(image, kernel, padding=1).flatten(), m.sum(0)])


def check_numerics(run):
    """One step (no update) from the initial weights on the first test samples, the device's against float64 on the host
    with eager float32's spread (inputs nudged by a rounding error) as the yardstick. O(1) apart or a NaN FAILs."""
    args = run.args
    x, y = first_batch(run)
    state = initial_model(args).state_dict()  # the same weights everywhere, whatever your initialisation does
    # The device's first: torch's autograd fails on a device it meets after its first backward ran on the host.
    got = first_step(args, state, x, y, run.device)[1]
    exact = first_step(args, state, x, y, torch.device("cpu"), torch.float64)[1]
    noise = [torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    inputs = [x] + [x * (1 + 2**-24 * n) for n in noise if x.is_floating_point()]  # moved by a rounding error each
    eager = [first_step(args, state, batch, y, torch.device("cpu"))[1] for batch in inputs]
    diffs = [distance(a, b) for a, b in zip(got, exact, strict=True)]
    spread = [max(distance(e[i], exact[i]) for e in eager) for i in range(3)]
    floor = tolerance(run, bf16=args.bf16)
    pairs = zip(("logits", "loss", "gradients"), diffs, spread, strict=True)
    figure = "first step vs float64 on the host, relative by norm, device (eager float32): "
    figure += ", ".join(f"{name} {d:.1e} ({e:.0e})" for name, d, e in pairs)
    if not max(diffs) <= WRONG:  # (written so that a NaN fails too)
        return False, f"{figure}: not rounding, another function ({likely_cause(args, state, x)}?)"
    if all(d <= max(floor, 10 * e) for d, e in zip(diffs, spread, strict=True)):
        return True, f"{figure}: within float32's own spread (or {floor:.0e})"
    return True, f"{figure}: beyond float32's spread, not the chip: likely {likely_cause(args, state, x)}"


def distance(a, b):  # relative, by norm
    return float((a.double() - b.double()).norm() / b.double().norm())


def likely_cause(args, state, x):
    """What makes XLA's result differ from eager PyTorch's, where known: a BatchNorm channel whose mean is large against
    its spread (XLA computes the variance in one pass, E[x²] - E[x]², which cancels: tensorflow/tensorflow#118701), or
    ties in max-pooling (flat regions: the gradient goes to another of equal inputs)."""
    model = one_function(initial_model(args).double(), state)
    ratios = [0.0]

    def measure(module, inputs):  # each channel's |mean| / std over the batch and the pixels
        t = inputs[0].transpose(0, 1).flatten(1)
        ratios.append(float((t.mean(1).abs() / t.std(1)).max()))

    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.register_forward_pre_hook(measure)
    with torch.no_grad():
        model(model_input(x).double())
    if max(ratios) >= 10:
        return f"BatchNorm's one-pass variance (a channel's mean is {max(ratios):.0f} x its spread)"
    if any(isinstance(m, nn.modules.pooling._MaxPoolNd) for m in model.modules()):
        return "max-pooling, whose ties XLA may break otherwise (equal inputs: another takes the gradient)"
    return "an op that XLA lowers otherwise than eager PyTorch"


def check_checkpoint(run):
    """The newest checkpoint, read back from disk: does it hold the weights and the optimizer state in memory?"""
    if not run.master:
        return None, "read back by the master"
    try:
        path = find_checkpoint(run.out_dir)
        saved = load_checkpoint(path)
    except Exit as e:  # A FAIL, not an exit: the other replicas would wait for this one in the verdict's all-reduce.
        return False, e.line
    pairs = [(t, saved["model"][name]) for name, t in run.model.state_dict().items()]
    for i, state in run.optimizer.state_dict()["state"].items():  # whatever the optimizer keeps: momentum, Adam's
        pairs += [(t, saved["optimizer"]["state"][i][key]) for key, t in state.items() if torch.is_tensor(t)]
    same = sum(torch.equal(a.cpu(), b) for a, b in pairs)
    return same == len(pairs), f"{path} read back: {same}/{len(pairs)} tensors identical"


def check_compilation(run):
    allowed = run.args.max_recompiles or 0
    ops = fallback_ops()
    figure = f"{run.recompiles} graphs compiled after warm-up, the most in any process (allowed {allowed})"
    if run.args.epochs == 1:
        figure = "one epoch, all of it the warm-up: no recompiles to count"
    return run.recompiles <= allowed and ops == "none", f"{figure}, CPU fallback ops: {ops}"


def check_learning(run):
    """At some epoch's end the test loss fell LEARNED below the untrained weights' (--lr 1e-12 moves it by 1e-12), and
    the accuracy reached --target-accuracy, or for ToyModel with SGD the data's `smoke_target` (the digits' 90%)."""
    start = run.untrained.loss
    best = min(e["test_loss"] for e in run.epochs)
    toy = type(run.model).__name__ == "ToyModel"  # (by its name: your copy may have deleted the class)
    known = toy and isinstance(run.optimizer, torch.optim.SGD) and getattr(run.test.dataset, "smoke_target", None)
    target = run.args.target_accuracy or known or 0.0
    accuracy = run.epochs[-1]["accuracy"]
    figure = f"test loss {start:.4f} untrained -> {best:.4f} at best (must fall {LEARNED:.0%})"
    figure += f", test accuracy {run.untrained.accuracy:.2f}% -> {accuracy:.2f}% (target {target:g}%)"
    return best <= (1 - LEARNED) * start and accuracy >= target, figure


def check_collectives(run):
    """SUM and MAX all-reduces and an all-gather, at three sizes, of integer-valued float32 that differ by replica, bit
    for bit against what they should give (exact in any order of the sum: see collective_values)."""
    if run.world == 1:
        return None, "one replica (under SPMD, one program over every device): no collective to check"
    found = torch.zeros(run.world, 3 * len(SIZES))  # per replica, size and operation: 0 if its result is right
    for k, n in enumerate(SIZES):
        sent = collective_values(run.world, n)
        mine = sent[run.rank].to(run.device)
        got = [xm.all_reduce(xm.REDUCE_SUM, mine), xm.all_reduce(xm.REDUCE_MAX, mine), xm.all_gather(mine)]
        should = [sum(t.double() for t in sent).float(), functools.reduce(torch.maximum, sent), torch.cat(sent)]
        for j, (result, expected) in enumerate(zip(got, should, strict=True)):
            wrong = (result.cpu().view(torch.int32) != expected.view(torch.int32)).nonzero()
            if len(wrong):  # (1 + for an all-gather, the replica its first wrong part came from)
                found[run.rank, 3 * k + j] = 1 + (int(wrong[0]) // n if j == 2 else 0)
    found = agree(run, found)  # every replica's row: each sent zeros in the others'
    wrong = []
    for r, i in found.nonzero().tolist():
        wrong.append(f"replica {place(run, r)}'s {('SUM', 'MAX', 'all-gather')[i % 3]} of {SIZES[i // 3]}")
        if i % 3 == 2:
            wrong[-1] += f" (the part from replica {int(found[r, i]) - 1})"
    figure = f"SUM, MAX, all-gather of {', '.join(map(str, SIZES))} floats on {run.world} replicas"
    return not wrong, f"{figure}: {', '.join(wrong) or 'bit for bit their closed form'}"


def collective_values(world, n):
    """What each replica sends: 1 to 64, shifted by its rank. Every partial sum stays below 64 x world, exact in float32
    (below 2**24) for any slice up to 262,144 replicas; a contribution missing or doubled changes every element."""
    return [((torch.arange(n) + rank) % 64 + 1).float() for rank in range(world)]


def check_replicas(run):
    """One step (forward and backward, no update) from the same weights on the same batch on every replica, three
    times: the programs traced must hash alike, and the loss and gradients agree bit for bit, before any all-reduce."""
    if run.world == 1:
        return None, "one replica (under SPMD, one program over every device): no other to compare with"
    state = initial_model(run.args).state_dict()
    x, y = first_batch(run)
    eager = torch.cat(first_step(run.args, state, x, y, torch.device("cpu"))[1])
    table = torch.zeros(run.world, 3, 9)  # per replica and run: program hash, results' hash (16-bit words), distance
    for k in range(3):
        program, parts = first_step(run.args, state, x, y, run.device)
        values = torch.cat(parts)
        digest = hashlib.blake2b(values.numpy().tobytes(), digest_size=8).digest()
        distance = float((values - eager).norm() / eager.norm())  # from eager PyTorch on the host
        table[run.rank, k] = torch.tensor([*np.frombuffer(program[:8] + digest, np.uint16).tolist(), distance])
    table = agree(run, table)  # every replica's rows
    programs = [tuple(t[0, :4].tolist()) for t in table]
    if len(set(programs)) > 1:
        why = "not a chip fault: the model traces a graph of its own on some replica"
        odd = ", ".join(place(run, r) for r in odd_ones(programs))
        return False, f"replica(s) [{odd}] traced other programs than the rest: {why}"
    differs = collections.Counter(r for k in range(3) for r in odd_ones([tuple(t[k, 4:8].tolist()) for t in table]))
    if not differs:
        return True, f"logits, loss and gradients ({len(eager)} values) bit-identical on {run.world} replicas, 3 times"
    how = ("not every time: transient", "every time: its chip")
    rows = [f"replica {place(run, r)} differs in {n}/3 steps ({how[n == 3]})" for r, n in sorted(differs.items())]
    if len(differs) == run.world:  # no majority: the eager reference tells the further off
        further = max(differs, key=lambda r: float(table[r, :, 8].max()))
        off = float(table[further, :, 8].max())
        rows.append(f"eager CPU is further from replica {place(run, further)} ({off:.1e})")
    return False, "; ".join(rows)


def first_step(args, state, x, y, device, dtype=torch.float32):
    """One step from `state` (forward and backward, no update) on the host or the device: the traced program's hash, and
    [the logits, the loss, the gradients] read back to the host."""
    model = one_function(initial_model(args).to(device, dtype), state)
    x = model_input(x.to(device))
    with torch.autocast(device.type, torch.bfloat16, enabled=args.bf16):  # (float64 never autocasts)
        logits = model(x.to(dtype) if x.is_floating_point() else x)
        loss = F.cross_entropy(logits, y.long().to(device))
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    tensors = [logits.detach().to(dtype), loss.detach().to(dtype), grads]
    program = torch_xla._XLAC._get_graph_hash(tensors) if device.type == "xla" else b""  # before it runs
    values = torch.cat([t.flatten() for t in tensors]).cpu()  # one read
    return program, list(values.split([tensors[0].numel(), 1, len(grads)]))


def one_function(model, state):
    """For the checks that compare two computations: eval() turns dropout off, but BatchNorm keeps to the batch's own
    statistics (every side has the same batch), as torch_xla cannot differentiate its eval mode (pytorch/xla#3361)."""
    model.load_state_dict(state)
    model.eval()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):  # (the base of torch's BatchNorm layers)
            m.train()
    return model


def place(run, rank):  # a replica's number, and on a slice its host and device there
    if run.places is None:
        return str(rank)
    host, device = run.places[rank]
    return f"{rank} (host {host}, device {device})"


def odd_ones(values):  # the replicas whose value differs from the majority's; all of them if no strict majority
    common, count = collections.Counter(values).most_common(1)[0]
    if 2 * count <= len(values):
        return list(range(len(values)))
    return [r for r, value in enumerate(values) if value != common]


LEARNED = 0.01  # the least fall of the test loss, as a fraction of the untrained's, that counts as learning
SIZES = (1, 4096, 1 << 14)  # floats per replica in each collective that check_collectives makes
WRONG = 0.3  # a difference from float64 of this order, relative by norm, is no rounding: another function
POINTS_AT = dict(  # what a FAIL of each check says about, and the first thing to try (README.md: a FAIL)
    devices="the VM: a chip missing from the slice",
    arithmetic="the chip: it computes a known answer wrong",
    numerics="the run: your model computes another function under XLA than in eager PyTorch",
    checkpoint="the VM's disk, or the run folder's storage",
    compilation="the run: its graph changes from step to step (see --max-recompiles)",
    learning="the run's settings (--lr, build_optimizer's optimizer and schedule, the steps), unless all else FAILs",
    collectives="the chips or their links: an all-reduce summed wrong",
    replicas="the chip of the replica named, or a model that traces other programs on some replica",
)
CHECKS = (check_arithmetic, check_numerics, check_checkpoint, check_compilation, check_learning)
CHECKS += (check_collectives, check_replicas)  # (check_devices runs before training)


def publish(out_dir, checks):
    """Prints the verdict's table, and writes OUT/verdict.json: {"passed", "checks": [{"name", "passed", "figure"}]}."""
    mark = {True: "PASS", False: "FAIL", None: "SKIP"}
    passed = all(c["passed"] is not False for c in checks)
    rows = [f"  {mark[c['passed']]}  {c['name']:<12} {c['figure']}" for c in checks]
    tell(out_dir, "\n".join(["smoke verdict", *rows, f"smoke verdict: {mark[passed]}"]))
    write_json(os.path.join(local_folder(out_dir), "verdict.json"), {"passed": passed, "checks": checks})


# ---- small helpers ---------------------------------------------------------------------------------------------------
def report_bug(e):  # A replica's bug, say in your model: its traceback, then its line (bug_line()).
    with contextlib.suppress(OSError):  # (a stderr whose reader died)
        traceback.print_exception(e)
    return bug_line(e)


def bug_line(e):
    """An unexpected exception's line: its first line, and where your code or this file raised it (not a library)."""
    libraries = tuple(sysconfig.get_paths()[name] for name in ("stdlib", "purelib", "platlib"))
    ours = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(libraries)]
    where = f"at {os.path.basename(ours[-1].filename)}:{ours[-1].lineno}; " if ours else ""
    return f"failed: {type(e).__name__}: {first_line(e)} ({where}traceback above)"


def tell(out_dir, line, stream=None, log="log.txt"):  # Prints a line, and keeps it in OUT/log.txt (or another log).
    with contextlib.suppress(OSError):  # A reader that died (ssh gone, its `tee` killed) ends no run: EPIPE, EIO.
        print(line, file=stream or sys.stdout, flush=True)
    if out_dir is not None:
        with contextlib.suppress(OSError), open(os.path.join(local_folder(out_dir), log), "a") as f:  # (a full disk)
            f.write(line + "\n")


def read_json(path):
    with store(path).open(path) as f:
        return json.load(f)


def write_json(path, data):  # Whole or not at all, as another process may read it at any moment.
    if "://" in str(path):  # (an object is)
        return store(path).pipe_file(path, json.dumps(data, indent=1).encode())
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # its own, should two threads write one file at once
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


# ---- the launcher's instruments, and the run's end ------------------------------------------------------------------
def launching(args):  # the run control over this launcher's replicas: a Control
    if "://" in args.out_dir:  # A resume on a new VM goes on with the logs that the bucket keeps.
        fs = store(args.out_dir)
        for log in fs.glob(f"{args.out_dir}/log*.txt"):
            if not os.path.exists(local := os.path.join(local_folder(args.out_dir), os.path.basename(log))):
                fs.get(log, local)
    LAUNCHER["prepared"] = time.time()  # A bucket gets the logs written here from now: not those fetched.
    return Control(args, args.out_dir, LAUNCHER["host"], LAUNCHER["hosts"], from_python=FIT.running)


def ended(args, code, line):
    """The run's last line, kept in its log (a slice: a log per host); a bucket gets the logs. fit() reads the end."""
    FIT.end = (args, code, line)
    out_dir = getattr(args, "out_dir", None)
    if out_dir is None or "prepared" not in LAUNCHER:
        return
    if line is not None:
        log = f"log-host-{LAUNCHER['host']}.txt" if LAUNCHER["hosts"] > 1 else "log.txt"
        with contextlib.suppress(OSError), open(os.path.join(local_folder(out_dir), log), "a") as f:
            f.write(f"train_tpu.py: {line}\n")
    upload_logs(out_dir, LAUNCHER["prepared"])


def saved(run):  # after each checkpoint, the master's scalars reach the disk, and its logs a bucket
    if run.board is not None:
        run.board.flush()
    if run.master:
        upload_logs(run.out_dir, run.control.launched)
    if run.over is not None:  # (count_epoch's)
        raise run.over


def log_scalars(run, row):  # a logged step's, in TensorBoard
    scalar(run, "train/loss", row["loss"], row["step"])
    scalar(run, "train/lr", row["lr"], row["step"])


def fit(*argv):
    """The command line as a call: fit("--cores", 1, "--smoke") returns the last checkpoint's model (host; or None),
    history, epochs and verdict. It raises Exit where main() fails, but for a verdict; never ends the process."""
    FIT.running, FIT.end, STOP.signum = True, None, 0  # (a run before this one may have stopped)
    previous = signal.getsignal(signal.SIGTERM)  # The run sets its own: the caller's takes it as before.
    try:
        main(argv)
    finally:
        FIT.running = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
    args, code, line = FIT.end
    if code not in (0, 5):  # (0: the smoke deadline passed after a PASS verdict, or a success)
        raise Exit(code, line)
    found = checkpoints(args.out_dir)  # none if a smoke deadline passed before the first
    r = argparse.Namespace(model=None, history=[], epochs=[], verdict=None, out_dir=args.out_dir)
    if found:
        ckpt = load_checkpoint(found[-1])
        r.model = initial_model(args)
        r.model.load_state_dict(ckpt["model"])
        r.history, r.epochs = ckpt["history"], ckpt["epochs"]
    if args.smoke:
        r.verdict = read_json(os.path.join(local_folder(args.out_dir), "verdict.json"))
    return r


HOOKS.update(flags=add_flags, parsed=check_flags, prepare=prepare, launch=launching, ended=ended, bug=bug_line)
HOOKS.update(replica=watched, started=started, data=smoke_data, before_training=before_training, finish=finish)
HOOKS.update(epoch=start_epoch, save_now=on_time, logged=log_scalars, epoch_done=count_epoch, saved=saved)
HOOKS.update(stopping=stopping, resumed=converted, write=write_dcp, read=read_checkpoint)
HOOKS["training"] = lambda run: run.control.set_stage(run.rank, "training")  # A stop signal now asks for a checkpoint.
# ==== end of the instruments =========================================================================================
if __name__ == "__main__":
    exit_code = main()
    if XLA_IMPORT_ERROR is None:  # torch_xla's own handler, which os._exit skips on purpose (below)
        atexit.unregister(torch_xla._prepare_to_exit)
    atexit._run_exitfuncs()  # Yours, registered while the run trained in this process: W&B's finish, a log's close.
    with contextlib.suppress(OSError):  # (a reader of stdout that died; stderr is line-buffered)
        sys.stdout.flush()
    os._exit(exit_code)  # After an error mid-epoch, MpDeviceLoader's feeder thread can abort a normal exit (134).
