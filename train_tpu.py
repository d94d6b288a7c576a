"""train_tpu.py: the reference PyTorch/XLA trainer. It trains a small CNN on MNIST on every TPU core (xmp.spawn), or
with --spmd from one process. The training path comes first, in the order a run executes; the instruments it calls
follow. Your own model takes two edits, to the sections marked "your own". README.md has the rest.

  python train_tpu.py                              # a TPU VM: train on every core
  python train_tpu.py --smoke                      # is this TPU VM fit to train on? exit 0 or 5
  python train_tpu.py --spmd --resume runs/<run>   # continue a run, converting its checkpoint
  PJRT_DEVICE=CPU python train_tpu.py --cores 1 --data synthetic --epochs 1   # no TPU: the CPU
"""

import multiprocessing
import signal

# xmp.spawn's replica processes import this file first. Before torch loads, they take SIGTERM (a preemption reaches
# every process) and SIGINT with a handler that does nothing: the launcher acts on them. libtpu, as the runtime starts,
# keeps a Python handler but kills a process whose signal was ignored (the stack traces of pytorch/xla#8234).
if multiprocessing.current_process().name != "MainProcess":
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: None)
# ruff: noqa: E402 (the imports follow those statements on purpose)

import argparse
import collections
import contextlib
import itertools
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, StackDataset

USER_DEVICE = os.environ.get("PJRT_DEVICE")  # read before `import torch_xla`, which sets it when unset
XLA_IMPORT_ERROR = None
try:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs
    import torch_xla.distributed.xla_multiprocessing as xmp
    import torch_xla.runtime as xr
    from torch_xla._internal import tpu
except Exception as e:  # a torch_xla built for another torch; on a TPU VM, its metadata server unreachable
    XLA_IMPORT_ERROR = e

SMOKE = dict(data="synthetic", epochs=2, steps_per_epoch=40, log_steps=10, target_accuracy=90.0)  # --smoke's presets
WARMUP_STEPS = 2  # each epoch's first steps compile, or fill the pipeline: left out of samples/s
KEEP_CHECKPOINTS = 2  # the newest stay in the run folder
STOP_GRACE = 25  # seconds from a stop signal to a forced exit: a preempted TPU VM has about 30


# ---- flags --------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    p = Parser(allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    one_or_more = in_range(int, ">= 1", lambda v: v >= 1)
    zero_or_more = in_range(int, ">= 0", lambda v: v >= 0)
    positive = in_range(float, "> 0", lambda v: v > 0)
    nonnegative = in_range(float, ">= 0", lambda v: v >= 0)
    probability = in_range(float, "in [0, 1]", lambda v: 0 <= v <= 1)
    # devices and data
    p.add_argument("--cores", type=one_or_more, help="1: one device, in this process; default: every device")
    p.add_argument("--spmd", action="store_true", help="one process shards each batch over every device")
    p.add_argument("--data", choices=("mnist", "synthetic"), default="mnist", help="synthetic: generated, offline")
    p.add_argument("--data-dir", default="data", help="MNIST's folder (DIR/MNIST/raw), or where to download it")
    # training
    p.add_argument("--epochs", type=one_or_more, default=3, help="passes over the training set")
    p.add_argument("--batch-size", type=one_or_more, default=128, help="samples per device per step")
    p.add_argument("--lr", type=positive, default=0.05, help="as given: not scaled by the number of devices")
    p.add_argument("--momentum", type=in_range(float, "in [0, 1)", lambda v: 0 <= v < 1), default=0.9, help="SGD's")
    p.add_argument("--steps-per-epoch", type=one_or_more, help="cut every epoch after N steps")
    p.add_argument("--seed", type=zero_or_more, default=0, help="seeds the weights, shuffles and layerdrop's coins")
    p.add_argument("--bf16", action="store_true", help="autocast the training forward pass to bfloat16")
    p.add_argument("--target-accuracy", type=nonnegative, default=0.0, help="exit 21 if final accuracy (%%) is below")
    # layerdrop: a graph that changes from step to step recompiles
    p.add_argument("--layerdrop", choices=("off", "dynamic", "static"), default="off", help="dynamic: recompiles")
    p.add_argument("--layerdrop-prob", type=probability, default=0.5, help="the chance that each fc2 application drops")
    p.add_argument("--max-recompiles", type=zero_or_more, help="exit 3 if more graphs compile after the first epoch")
    # the smoke test
    presets = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in SMOKE.items())
    p.add_argument("--smoke", action="store_true", help=f"a short run and a verdict, exit 0 or 5; presets: {presets}")
    p.add_argument("--smoke-timeout", type=positive, default=900.0, help="seconds, from before any device starts")
    # logging, checkpoints, preemption
    p.add_argument("--log-steps", type=one_or_more, default=20, help="log every N steps")
    p.add_argument("--out-dir", help="the run folder; if not given, runs/<time>, or the resumed run's")
    p.add_argument("--save-steps", type=one_or_more, help="also checkpoint every N steps")
    p.add_argument("--resume", metavar="PATH", help="a checkpoint in either format, or a run folder (its newest)")
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    if args.smoke and args.resume:
        raise Exit(2, "error: --smoke checks a fresh run: leave out --resume")
    if args.resume:  # a resumed run takes the settings saved with its checkpoint, unless given now
        p.set_defaults(**read_checkpoint(find_checkpoint(args.resume))["config"])
        args = p.parse_args(argv)
    return args


# ---- data: your own goes here (edit 1 of 2) -----------------------------------------------------------------------
def load_split(args, train):
    """One split as in-memory tensors: uint8 images (N, 1, 28, 28) and labels (N,)."""
    if args.data == "synthetic":
        return synthetic_digits(30_000 if train else 5_000, seed=1234 + train)
    mnist = torchvision.datasets.MNIST(args.data_dir, train=train, download=False)
    return mnist.data.unsqueeze(1), mnist.targets  # read once: no PIL image, no transform per sample


def model_input(images):
    """On the device: uint8 pixels (a quarter of float32's bytes through the host), scaled as Normalize() would."""
    if images.dtype != torch.uint8:  # load_split replaced and this not: never rescale floats silently
        raise TypeError(f"model_input expects uint8 pixels, got {images.dtype}: replace it too")
    return (images.float() / 255 - 0.1307) / 0.3081


def prepare_data(args):  # once, before any replica starts: replicas never race to download
    if args.data != "mnist":
        return
    try:
        with quietly():  # torchvision prints every attempt
            for train in (True, False):
                torchvision.datasets.MNIST(args.data_dir, train=train, download=True)
    except Exception as e:
        why = f"MNIST is not in --data-dir {args.data_dir}, and its download failed ({type(e).__name__})"
        raise Exit(2, f"error: {why}: copy it there, or use --data synthetic") from e


# ---- model: your own goes here (edit 2 of 2) ----------------------------------------------------------------------
class ToyModel(nn.Module):
    """A small CNN that returns logits; with layerdrop, a shared fc2 applied up to 50 times, each on a coin flip."""

    def __init__(self, layerdrop="off"):
        super().__init__()
        self.layerdrop = layerdrop
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.pool = nn.MaxPool2d(2)
        if layerdrop == "off":
            self.fc1 = nn.Linear(1440, 10)
        else:
            self.fc1 = nn.Linear(1440, 20)
            self.fc2 = nn.Linear(20, 20)
            self.fc3 = nn.Linear(20, 10)

    def forward(self, x, keep=None):
        x = F.relu(self.conv1(x))
        x = self.pool(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        if self.layerdrop == "off":
            return x
        for i in range(50):  # keep[i]: does fc2's i-th application run? (None: every one does)
            if keep is None:
                x = self.fc2(x)
            elif self.layerdrop == "dynamic":  # a Python bool: the traced graph, so XLA compiles one per count kept
                if keep[i]:
                    x = self.fc2(x)
            else:  # static: a tensor of bools, chosen inside one graph
                x = torch.where(keep[i], self.fc2(x), x)
        return self.fc3(x)


def build_model(args):
    return ToyModel(args.layerdrop)


# ---- the loaders: DistributedSampler -> DataLoader -> MpDeviceLoader ----------------------------------------------
def train_loader(run, images, labels):
    """This replica's shard of the training set in whole batches (one shape: one graph), reshuffled by set_epoch."""
    data = StackDataset(image=images, label=labels)  # a dict per list of indices: ~10x collating sample by sample
    shard = DistributedSampler(data, run.world, run.rank, seed=run.args.seed, drop_last=True)
    return DataLoader(data, sampler=BatchSampler(shard, run.load_batch, drop_last=True), batch_size=None)


def on_device(run, loader, skip=0, stop=None):
    """MpDeviceLoader copies the next batches (the loader's skip to stop) to the device while a step runs, and cuts the
    step's graph as it hands each out. Under SPMD it shards every field along the batch (docs: perf/spmd_advanced)."""
    spec = None
    if run.mesh is not None:
        fields = loader.dataset.datasets.items()
        spec = {name: xs.ShardingSpec(run.mesh, ("data",) + (None,) * (t.dim() - 1)) for name, t in fields}
    return pl.MpDeviceLoader(itertools.islice(loader, skip, stop), run.device, input_sharding=spec)


# ---- the step and evaluation --------------------------------------------------------------------------------------
def train_step(run, batch, keep):
    """One step, traced lazily: it runs on the device when MpDeviceLoader cuts the graph."""
    run.optimizer.zero_grad()
    with torch.autocast("xla", dtype=torch.bfloat16, enabled=run.args.bf16):  # --bf16 (docs: perf/amp)
        x = model_input(batch["image"])
        logits = run.model(x) if keep is None else run.model(x, keep)
        loss = F.cross_entropy(logits, batch["label"])
    loss.backward()
    if run.mesh is None:
        xm.optimizer_step(run.optimizer)  # all-reduce (average) the gradients over the replicas, then step
    else:
        run.optimizer.step()  # one program over every device: GSPMD inserts the all-reduce itself
    return loss.detach()


def evaluate(run):
    """The test loss and accuracy (%), each test sample counted once over the replicas, summed on the device."""
    run.model.eval()
    totals = torch.zeros(3, device=run.device)
    with torch.no_grad():
        for b in on_device(run, run.test):
            logits = run.model(model_input(b["image"]))
            loss = F.cross_entropy(logits, b["label"], reduction="none")
            hits = (logits.argmax(1) == b["label"]).float()
            totals += torch.stack([loss @ b["valid"], hits @ b["valid"], b["valid"].sum()])
    run.model.train()
    if run.world > 1:
        totals = xm.all_reduce(xm.REDUCE_SUM, totals)
    loss, hits, count = totals.cpu().double().tolist()  # a deliberate wait, once per evaluation
    return TestResult(loss / count, 100 * hits / count, int(count))


# ---- the epochs: steps with logging, then evaluation and the save -------------------------------------------------
def train_epoch(run, loader, epoch, skip, last):
    """The epoch's steps after the `skip` that a resumed run did, to `last`. It waits for the device only to save."""
    args = run.args
    timed_from = skip + WARMUP_STEPS
    run.log.start_epoch(epoch, timed_from, last)
    step = skip
    for step, batch in enumerate(on_device(run, loader, skip, last), skip + 1):
        run.log.add(step, train_step(run, batch, layerdrop_keep(args, epoch, step, run.device)))
        at_boundary = step % args.log_steps == 0 or step in (timed_from, last)
        if at_boundary:
            xm.add_step_closure(run.log.boundary, args=(step,))  # runs once this step's graph has launched
        saving = args.save_steps is not None and step % args.save_steps == 0
        if (at_boundary or saving) and step != last:  # (the epoch's end comes after the loader has cut its graph)
            checkpoint_or_stop(run, epoch, step)
    if step != last:  # MpDeviceLoader ends the epoch quietly when the DataLoader fails
        raise RuntimeError(f"epoch {epoch}'s input stopped at step {step} of {last}")
    run.log.end_steps()
    checkpoint_or_stop(run, epoch, step)


def train(run):
    """One replica's run (under SPMD, the one process's): model, data, then the epochs."""
    args = run.args
    run.model = initial_model(args).to(run.device)
    if run.world > 1:
        broadcast_weights(run.model)
    # foreach: one traced op updates every parameter (an op per parameter took a third of the host's step time)
    run.optimizer = torch.optim.SGD(run.model.parameters(), lr=args.lr, momentum=args.momentum, foreach=True)
    loader = train_loader(run, *load_split(args, train=True))
    run.test = test_loader(run, *load_split(args, train=False))
    steps = min(len(loader), args.steps_per_epoch or len(loader))
    if steps == 0:
        raise Exit(2, f"error: --batch-size {args.batch_size}: more than a replica's share of the training set")
    run.log = Log(run, steps)
    mode = "SPMD" if run.mesh is not None else "a replica each"
    sizes = f"{run.devices} devices, {mode} | global batch {run.global_batch} | lr {args.lr} | {steps} steps per epoch"
    writer = f"out {args.out_dir}, written by ordinal 0 on {socket.gethostname()}"
    print0(f"{args.kind} | {sizes} | {writer}")
    first_epoch, skip = resume(run, steps)  # (1, 0) for a fresh run
    run.control.set_stage(run, "training")
    try:
        for epoch in range(first_epoch, args.epochs + 1):
            loader.sampler.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every replica
            train_epoch(run, loader, epoch, skip, steps)
            skip = 0
    finally:
        run.log.close()  # TensorBoard's last scalars, on a stop too
    run.control.set_stage(run, "finishing")  # past the last checkpoint: a stop signal no longer ends the run
    finish(run)


# ---- launch: xmp.spawn, one replica per device, or SPMD in this process -------------------------------------------
def launch(args):
    """Refuses what it can before any device starts, then runs the replicas (docs: learn/pjrt)."""
    args.kind, hosts, cores = check_environment(args)  # (the replicas read args.kind)
    if args.spmd and args.kind == "CPU":
        os.environ["CPU_NUM_DEVICES"] = str(cores)  # the CPU runtime emulates that many devices
    prepare_out_dir(args, hosts)
    prepare_data(args)
    with Control(args) as control:
        try:
            if args.spmd:
                train(start_replica(args, control, spmd=True))
            else:  # None: a process per TPU chip
                xmp.spawn(_mp_fn, args=(args, control), nprocs=1 if args.cores == 1 else None)
        except Exit:
            raise  # every replica raised it at the same point
        except Exception as e:
            if control.explain(e) is None:
                raise  # a bug in the only replica: main() prints its traceback
            raise control.ended from e


def _mp_fn(index, args, control):  # xmp.spawn's entry, once per replica
    run = start_replica(args, control, spmd=False)
    try:
        train(run)
    except Exit:
        raise  # every replica raises it at the same point: xmp.spawn hands it to launch() once all have ended
    except Exception as e:
        if run.world == 1:
            raise
        control.fail_alone(run, e)  # the others would wait for this one in their next all-reduce


def main(argv=None):
    try:
        launch(parse_args(argv))
    except (Exception, KeyboardInterrupt) as e:
        code, line = describe(e)
        print(f"train_tpu.py: {line}", file=sys.stderr, flush=True)
        return code
    return 0


# ==== the instruments, each called by name from the training path above ============================================


# ---- at each log boundary: the stop agreement, and the saves that are due --------------------------------------------
def checkpoint_or_stop(run, epoch, step):
    """At a log boundary, and at the epoch's end: the replicas agree whether to stop, then it saves what is due."""
    args = run.args
    recompiles = 0 if run.log.warm_compiles is None else compiles()[0] - run.log.warm_compiles
    signum, recompiles = run.control.should_stop(run, recompiles)
    if step == run.log.last:  # the epoch's end: evaluated, saved, logged
        test = evaluate(run)
        run.log.end_epoch(epoch, test, save(run, epoch + 1, 0, test))
        if args.max_recompiles is not None and recompiles > args.max_recompiles and not args.smoke:
            why = f"{recompiles} graphs compiled after warm-up (the run's first epoch), over --max-recompiles"
            raise Exit(3, f"failed: {why} {args.max_recompiles}: the graph changes from step to step")
        epoch, step = epoch + 1, 0  # where a stop here continues from
        if epoch > args.epochs:  # a stop after the last epoch lets the run finish
            signum = 0
    elif signum:
        save(run, epoch, step)  # a stop saves without evaluating
    elif args.save_steps is not None and step % args.save_steps == 0:
        save(run, epoch, step, evaluate(run))
    if signum:
        name = signal.Signals(signum).name
        where = f"at epoch {epoch} step {step}, checkpoint saved: continue with --resume {args.out_dir}"
        raise Exit(128 + signum, f"stopped by {name} {where}")


# ---- errors, flag types ------------------------------------------------------------------------------------------
class Exit(Exception):
    """Ends a run with one line and an exit code: 2 is bad input (its line starts "error:"); README.md lists the rest.
    Raised in the replicas only where every replica raises it, with the same code."""

    def __init__(self, code, line):
        super().__init__(code, line)  # (the args pickle: xmp.spawn hands it from a replica process to the launcher)
        self.code = code
        self.line = line

    def __str__(self):
        return self.line


def describe(e):
    """(exit code, one line) for whatever ended a run."""
    if isinstance(e, Exit):
        return e.code, e.line
    if isinstance(e, KeyboardInterrupt):
        return 130, "interrupted"
    traceback.print_exception(e)  # a bug, in your model say: the traceback is what you need
    return 1, f"failed: {type(e).__name__}: {e} (traceback above)"


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise Exit(2, f"error: {message} (see --help)")


def in_range(kind, rule, ok):
    """An argparse type: the text as `kind`, refused when `ok` is false (the message names `rule`) or when NaN."""

    def parse(text):
        value = kind(text)
        if math.isnan(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's own words for a bad number: "invalid int value: 'x'"
    return parse


def print0(*args):  # the master prints; replica processes' output is piped: flush at once
    xm.master_print(*args, flush=True)


def first_line(e):
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return lines[0]


# ---- before any device starts: torch_xla, the device, hosts, --cores, --out-dir -----------------------------------
def check_environment(args):
    """(device kind, hosts, cores to train on). Nothing here starts the runtime: xmp.spawn refuses to run after."""
    if XLA_IMPORT_ERROR is not None:
        why = f"{type(XLA_IMPORT_ERROR).__name__}: {first_line(XLA_IMPORT_ERROR)}"
        raise Exit(2, f"error: import torch_xla failed: {why} (on a TPU VM it reads the VM's metadata)")
    from importlib.metadata import version

    xla = version("torch_xla")
    if xla.split(".")[:2] != torch.__version__.split(".")[:2]:  # torch_xla's C++ is built for one torch release
        raise Exit(2, f"error: torch {torch.__version__} with torch_xla {xla}: install the pair requirements.txt pins")
    chips = tpu.num_available_chips()  # the PCI bus, read without the runtime
    if chips and USER_DEVICE is None and not torch_xla._found_libtpu:  # torch_xla chose the CPU (__init__.py)
        raise Exit(2, "error: this TPU VM's torch_xla has no libtpu: pip install 'torch_xla[tpu]'")
    kind = os.environ["PJRT_DEVICE"]  # the user's, or what torch_xla's import chose
    if kind not in ("TPU", "CPU") or (kind == "TPU" and not chips):
        raise Exit(2, f"error: PJRT_DEVICE={kind}, and this machine has no such device: unset it to use the CPU")
    hosts = 1
    if kind == "TPU":
        try:
            hosts = tpu.num_tpu_workers()  # the TPU VM's metadata server
        except Exception as e:
            raise Exit(2, f"error: cannot read this TPU VM's slice from its metadata: {first_line(e)}") from e
    have = tpu.num_available_devices() if kind == "TPU" else int(os.environ.get("CPU_NUM_DEVICES", 1))
    cores = args.cores or have
    if hosts > 1 and (args.spmd or cores == 1):
        raise Exit(2, f"error: --spmd and --cores 1 train on one host, and this slice has {hosts}: leave them out")
    if kind == "CPU" and cores > 1 and not args.spmd:  # the replicas of one CPU process are threads
        why = "torch_xla's CPU collectives hang across replicas (pytorch/xla#5005)"
        raise Exit(2, f"error: --cores {cores} on the CPU: {why}; use --cores 1, or --spmd --cores N")
    if kind == "TPU" and args.spmd and cores != have:
        raise Exit(2, f"error: --cores {cores}: --spmd uses all {have} TPU devices of this machine")
    if kind == "TPU" and cores not in (1, have):
        raise Exit(2, f"error: --cores {cores}: this machine has {have} TPU devices; use --cores 1 or {have}")
    return kind, hosts, cores


def prepare_out_dir(args, hosts):
    """--out-dir, the resumed run's folder by default, made by every host: ordinal 0, which writes, need not be on
    host 0 (torch_xla/runtime.py)."""
    resumed = None
    if args.resume:
        resumed = os.path.dirname(os.path.abspath(find_checkpoint(args.resume)))
    if args.out_dir is None and hosts > 1 and resumed is None:
        raise Exit(2, "error: --out-dir is needed on a pod slice: a folder that every host can read")
    if args.out_dir is None:
        args.out_dir = resumed or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    holds_run = os.path.isdir(args.out_dir) and (
        checkpoints(args.out_dir) or "metrics.jsonl" in os.listdir(args.out_dir)
    )
    if holds_run and resumed != os.path.abspath(args.out_dir):
        raise Exit(2, f"error: --out-dir {args.out_dir} holds a run: continue it with --resume, or name another folder")
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        raise Exit(2, f"error: --out-dir {args.out_dir}: cannot make it ({e.strerror})") from e


def start_replica(args, control, spmd):
    """Starts the runtime: this replica's device, and its place in the run (under SPMD, the one process's)."""
    run = types.SimpleNamespace(args=args, control=control, mesh=None, world=1, rank=0)
    if spmd:
        xr.use_spmd()  # before the runtime starts: every tensor is one global tensor
        run.devices = xr.global_runtime_device_count()
        run.mesh = xs.Mesh(np.arange(run.devices), (run.devices,), ("data",))
    else:
        run.world = xr.world_size()
        run.rank = xr.global_ordinal()
        run.devices = run.world
    run.device = torch_xla.device()
    run.global_batch = args.batch_size * run.devices  # samples per step, over every device
    run.load_batch = args.batch_size  # what this process loads per step
    if spmd:
        run.load_batch = run.global_batch
    control.set_stage(run, "devices")  # the launcher now knows this replica's process, and that its runtime started
    return run


# ---- the model's first weights, the test shard, layerdrop's coin flips, synthetic digits --------------------------
COLLECTIVE_DTYPES = (torch.float32, torch.bfloat16)  # TPUs all-reduce no int64 (pytorch/xla#1952)
# TPU v2/v3 run two replica threads per process, which share the global RNG, sys.stdout and the warnings filters
ONE_REPLICA_AT_A_TIME = threading.RLock()


def initial_model(args):
    """The model's first weights, from --seed alone: the same on every replica, in every run."""
    with ONE_REPLICA_AT_A_TIME:
        torch.manual_seed(args.seed)
        return build_model(args)


def broadcast_weights(model):
    """Every replica takes the master's floating-point weights, should a model's initialisation not follow the seed.
    Integer buffers stay: TPUs all-reduce no int64 (pytorch/xla#1952), and a step count starts equal anyway."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    xm.collective_broadcast([t for t in tensors if t.dtype in COLLECTIVE_DTYPES])
    torch_xla.sync()


def test_loader(run, images, labels):
    """This replica's share of the test set, padded with valid=0: one batch shape, and each sample counted once."""
    index = torch.arange(run.rank, len(labels), run.world)
    share = math.ceil(len(labels) / run.world)
    size = math.ceil(share / run.load_batch) * run.load_batch  # the same on every replica
    valid = (torch.arange(size) < len(index)).float()
    index = torch.cat([index, index.new_zeros(size - len(index))])
    data = StackDataset(image=images[index], label=labels[index], valid=valid)
    return DataLoader(data, sampler=BatchSampler(range(size), run.load_batch, False), batch_size=None)


def layerdrop_keep(args, epoch, step, device):
    """The step's fc2 decisions, from (seed, epoch, step) only: the same on every replica (one that traced other drops
    would all-reduce other gradients), and after a resume."""
    if args.layerdrop == "off":
        return None
    keep = np.random.default_rng([args.seed, epoch, step]).random(50) >= args.layerdrop_prob
    if args.layerdrop == "dynamic":
        return keep.tolist()
    return torch.tensor(keep, device=device)


def synthetic_digits(n, seed):
    """Ten random stroke patterns, one per class, shifted by up to 8 pixels on noise: fixed pixel templates do poorly,
    a CNN learns them. Deterministic for (n, seed)."""
    g = torch.Generator().manual_seed(seed)
    glyphs = (torch.rand(10, 14, 14, generator=torch.Generator().manual_seed(0)) < 0.3).float()
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.rand(n, 28, 28, generator=g) * 0.3
    shifts = torch.randint(0, 9, (n, 2), generator=g)
    for down, right in itertools.product(range(9), range(9)):  # all the samples with one shift at once
        at = (shifts[:, 0] == down) & (shifts[:, 1] == right)
        images[at, 3 + down : 17 + down, 3 + right : 17 + right] += glyphs[labels[at]] * 0.7
    return (images.clamp(0, 1) * 255).to(torch.uint8).unsqueeze(1), labels


@contextlib.contextmanager
def quietly():  # torchvision's download attempts and DCP's notices, which say nothing about this use
    with ONE_REPLICA_AT_A_TIME, open(os.devnull, "w") as null, contextlib.redirect_stdout(null):  # noqa: SIM117
        with contextlib.redirect_stderr(null), warnings.catch_warnings(action="ignore"):  # (one `with`: 7 lines)
            yield


# ---- logging: log lines, metrics.jsonl, TensorBoard, compiles ----------------------------------------------------
class Log:
    """A replica's losses and compile counts; the master prints them and writes OUT/metrics.jsonl and TensorBoard
    scalars. A log line shows the previous boundary's loss, long computed: the loop never waits for it."""

    def __init__(self, run, steps):
        self.run = run
        self.steps = steps
        self.history = []  # every step's loss, as read back: the smoke's learning check
        self.accuracy = None
        self.warm_compiles = None  # graphs compiled in this process by the end of the run's first epoch
        self.recompiles = 0
        self.board = None
        if run.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(run.args.out_dir)
        self.start_epoch(0, 0, 0)

    def start_epoch(self, epoch, timed_from, last):
        self.epoch = epoch
        self.timed_from = timed_from  # samples/s counts the steps after this one
        self.last = last
        self.unread = []  # (step, loss on the device), not yet read back
        self.losses = {}  # step: loss, read back
        self.times = {}  # step: when its boundary's graph launched
        self.compiles_at_start = compiles()[0]

    def add(self, step, loss):
        self.unread.append((step, loss))

    def boundary(self, step):  # a step closure: runs once this step's graph has launched
        if self.times:  # the previous boundary's loss: long finished on the device, so no wait
            previous = max(self.times)
            self.read(upto=previous)
            self.print_step(previous)
        self.times[step] = time.perf_counter()

    def end_steps(self):  # a deliberate wait: the epoch's last losses
        self.read()
        self.times[self.last] = time.perf_counter()

    def print_step(self, step):
        print0(f"epoch {self.epoch} step {step}/{self.last} | loss {self.losses[step]:.4f}")

    def read(self, upto=None):
        """Reads back the losses up to step `upto` (all when None), and frees them: a live tensor per step would slow
        every graph cut a little more. The master appends them to metrics.jsonl."""
        rows = []
        while self.unread and (upto is None or self.unread[0][0] <= upto):
            step, loss = self.unread.pop(0)
            self.losses[step] = float(loss.cpu())
            self.history.append(self.losses[step])
            rows.append(dict(epoch=self.epoch, step=step, loss=self.losses[step]))
        if self.board:
            self.write(rows)
            for r in rows:
                self.board.add_scalar("train/loss", r["loss"], (r["epoch"] - 1) * self.steps + r["step"])

    def write(self, rows):
        with open(os.path.join(self.run.args.out_dir, "metrics.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    def close(self):
        if self.board:
            self.board.close()

    def end_epoch(self, epoch, test, path):
        """The epoch's lines and its record. Compiles are counted per process (TPU v2/v3 hold two replicas)."""
        self.print_step(self.last)
        total, seconds = compiles()
        if self.warm_compiles is None:
            self.warm_compiles = total  # the run's first epoch is its warm-up
        self.recompiles = total - self.warm_compiles
        self.accuracy = test.accuracy
        ops = fallback_ops()
        rate = None
        if self.last > self.timed_from:  # the warm-up steps left out
            seconds_timed = self.times[self.last] - self.times[self.timed_from]
            rate = (self.last - self.timed_from) * self.run.global_batch / seconds_timed
        speed = "untimed" if rate is None else f"{rate:,.0f} samples/s"
        tested = f"test loss {test.loss:.4f} | accuracy {test.accuracy:.2f}% ({test.samples:,} samples)"
        print0(f"epoch {epoch} done | {tested} | {speed} | checkpoint {path}")
        compiled = total - self.compiles_at_start
        counts = (
            f"this epoch {compiled} | recompiles after warm-up {self.recompiles} | {seconds:.1f} s compiling in all"
        )
        print0(f"epoch {epoch} compiles in this process | {counts} | CPU fallback ops: {ops}")
        if self.board:
            record = dict(epoch=epoch, test_loss=test.loss, accuracy=test.accuracy, samples_per_s=rate)
            self.write([dict(record, compiles=compiled, recompiles=self.recompiles, fallback_ops=ops)])
            self.board.add_scalar("test/accuracy", test.accuracy, epoch * self.steps)
            self.board.add_scalar("train/samples_per_s", rate or 0, epoch * self.steps)
            self.board.flush()


def read_metrics(out_dir):
    """{"history": a dict per step, "epochs": one per epoch} from OUT/metrics.jsonl. A step trained twice (before a
    kill, and after --resume) counts once, as last trained; a line torn by a kill, not at all."""
    steps, epochs = {}, {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if "loss" in row:
                    steps[row["epoch"], row["step"]] = row
                else:
                    epochs[row["epoch"]] = row
    return {"history": [steps[k] for k in sorted(steps)], "epochs": [epochs[k] for k in sorted(epochs)]}


def compiles():  # graphs compiled in this process so far, and the seconds it took (torch_xla's metrics)
    data = met.metric_data("CompileTime")  # (count, total ns, samples), or None before the first
    if data is None:
        return 0, 0.0
    return data[0], data[1] / 1e9


def fallback_ops():  # ops run on the host for want of an XLA lowering; `.item()` (a wait in the step) counts too
    names = [n for n in met.counter_names() if n.startswith("aten::")]
    return ", ".join(f"{n} x{met.counter_value(n)}" for n in names) or "none"


# ---- checkpoints: one dict, two formats ---------------------------------------------------------------------------
# A checkpoint is one dict: model, optimizer, position (the epoch to train next, and the samples of it trained on),
# settings, and the test loss and accuracy measured just before saving (None when saved on a stop), named by its
# position: checkpoint-EEEE-SSSSSSSSS. Multi-core, every replica calls xm.save and the global master writes NAME.pt;
# under SPMD, torch.distributed.checkpoint writes each device's shards into the folder NAME (docs:
# perf/spmd_distributed_checkpoint). The two formats differ, and an xm.save checkpoint loaded naively into an SPMD model
# can silently compute something else (pytorch/xla#6660): --resume reads either, converts, and checks the test loss.
RESUMED = ("data", "data_dir", "epochs", "batch_size", "lr", "momentum", "seed", "steps_per_epoch", "layerdrop")
RESUMED += ("layerdrop_prob", "bf16")  # a resumed run takes these from its checkpoint, unless they are given
TestResult = collections.namedtuple("TestResult", "loss accuracy samples")  # what evaluate() returns
NOT_TESTED = TestResult(None, None, 0)


def save(run, epoch, steps_done, test=NOT_TESTED):
    """Saves the run at its position (the epoch to train next, and the steps of it done), with the test loss and
    accuracy just measured (none on a stop). Returns the checkpoint's path."""
    torch_xla.sync()  # runs this step's log closure: its line comes before the save
    run.log.read()  # metrics.jsonl holds every step that the checkpoint holds
    args = run.args
    samples = steps_done * run.global_batch
    ckpt = {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "epoch": epoch,
        "samples": samples,
        "device": args.kind,
        "test_loss": test.loss,
        "accuracy": test.accuracy,
        "config": {name: getattr(args, name) for name in RESUMED},
    }
    path = os.path.join(args.out_dir, f"checkpoint-{epoch:04d}-{samples:09d}")
    if run.mesh is None:
        path += ".pt"
        xm.save(ckpt, path + ".tmp", master_only=True, global_master=True)  # every replica syncs; the master writes
    else:
        import torch.distributed.checkpoint as dcp
        import torch_xla.experimental.distributed_checkpoint as xc

        shutil.rmtree(path + ".tmp", ignore_errors=True)
        with quietly():
            dcp.save(ckpt, storage_writer=dcp.FileSystemWriter(path + ".tmp"), planner=xc.SPMDSavePlanner())
        shutil.rmtree(path, ignore_errors=True)  # the same position, saved again
    if run.rank == 0:
        os.replace(path + ".tmp", path)  # whole or not at all: a kill mid-write leaves the last good ones
        for old in checkpoints(args.out_dir)[:-KEEP_CHECKPOINTS]:
            if os.path.isdir(old):
                shutil.rmtree(old)
            else:
                os.remove(old)
    return path


def checkpoints(folder):
    """A run folder's complete checkpoints, either format, the newest written last."""
    paths = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith("checkpoint-") and (name.endswith(".pt") or is_dcp(path)):
            paths.append(path)
    return sorted(paths, key=lambda p: (os.path.getmtime(p), p))


def is_dcp(path):  # a complete torch.distributed.checkpoint folder
    return os.path.exists(os.path.join(path, ".metadata"))


def find_checkpoint(path):  # what --resume PATH means: a checkpoint, or a run folder's newest
    if os.path.isfile(path) or is_dcp(path):
        return path
    found = checkpoints(path) if os.path.isdir(path) else []
    if not found:
        raise Exit(2, f"error: --resume {path}: no checkpoint there")
    return found[-1]


def read_checkpoint(path):  # either format, as the one dict that torch.load gives for a file
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    try:
        if os.path.isdir(path):
            with tempfile.TemporaryDirectory() as tmp, quietly():
                dcp_to_torch_save(path, os.path.join(tmp, "c.pt"))
                ckpt = torch.load(os.path.join(tmp, "c.pt"), weights_only=True)
            # DCP keys the optimizer state by strings; load_state_dict would then silently drop the momentum
            ckpt["optimizer"]["state"] = {int(k): v for k, v in ckpt["optimizer"]["state"].items()}
        else:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        if not {"model", "optimizer", "epoch", "samples", "config"} <= ckpt.keys():
            raise KeyError("not the keys of a train_tpu.py checkpoint")
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        why = f"cannot read it ({type(e).__name__}): truncated, damaged, or not a train_tpu.py checkpoint"
        raise Exit(2, f"error: --resume {path}: {why}") from None
    return ckpt


def resume(run, steps):
    """Loads --resume and proves that it still gives the test loss saved with it, as a checkpoint converted between
    the formats can silently compute something else; one in the other format is saved in this run's at once. Returns
    (epoch, steps of it done)."""
    args = run.args
    if not args.resume:
        return 1, 0
    path = find_checkpoint(args.resume)
    ckpt = read_checkpoint(path)
    try:
        run.model.load_state_dict(ckpt["model"])  # onto the device; under SPMD, replicated
    except Exception as e:  # PyTorch's message spans lines: one line here
        raise Exit(2, f"error: --resume {path}: its model is not this run's: {' '.join(str(e).split())}") from e
    run.optimizer.load_state_dict(ckpt["optimizer"])
    for group in run.optimizer.param_groups:
        group.update(lr=args.lr, momentum=args.momentum)  # this run's, given or taken
    done, rest = divmod(ckpt["samples"], run.global_batch)
    if rest or done >= steps:
        why = f"{ckpt['samples']} samples into its epoch are no whole step of this run's {steps}"
        raise Exit(2, f"error: --resume {path}: {why}: resume with the batch size and --steps-per-epoch it had")
    test = NOT_TESTED
    if ckpt["test_loss"] is None:
        print0("resume check | skipped: saved on a stop, with no test loss measured")
    elif (ckpt["config"]["data"], ckpt["config"]["data_dir"]) != (args.data, args.data_dir):
        print0("resume check | skipped: the checkpoint was evaluated on other --data")
    else:
        test = evaluate(run)
        saved = ckpt["test_loss"]
        tol = tolerance(args, ckpt["device"])
        print0(f"resume check | test loss saved {saved:.6f}, now {test.loss:.6f} (tolerance {tol:.0e})")
        if not abs(test.loss - saved) <= tol:
            raise Exit(4, f"failed: resume check: {path} gives test loss {test.loss:.6f}, and was saved at {saved:.6f}")
    if os.path.isdir(path) != (run.mesh is not None):  # the other format: convert it now
        print0(f"resume | converted, saved as {save(run, ckpt['epoch'], done, test)}")
    print0(f"resume | {path}: continuing at epoch {ckpt['epoch']} of {args.epochs}, after step {done}")
    return ckpt["epoch"], done


def tolerance(args, other_device="CPU"):
    """How far two computations of the same numbers may differ: float32 on the CPU agrees to rounding; TPU matmuls
    round through one bfloat16 pass by default, and --bf16 rounds both sides. A wrong weight or layout moves them by
    O(1)."""
    if args.bf16:
        return 5e-2
    if args.kind == "CPU" and other_device == "CPU":
        return 1e-5
    return 2e-2


# ---- run control: stop signals, a replica that fails or dies, the smoke deadline -----------------------------------
class Control:
    """The launcher takes the stop signals, times --smoke's deadline, and watches the replicas: one that fails alone or
    whose process dies ends them all, as the others would wait for it in their next collective. Replicas may run in
    other processes, so both sides meet in a folder: `stop` (the signal's number), `replica-N` (replica N's process id
    and stage), `failed-N` (the line of a replica that failed alone)."""

    def __init__(self, args):
        self.args = args
        self.folder = tempfile.mkdtemp(prefix="train_tpu-")
        self.not_ours = {p.pid for p in multiprocessing.active_children()}  # a notebook's own, say
        self.ended = None  # the Exit of a run that the launcher ended
        self.seen = {}  # {process id: process} of the replica processes

    def __getstate__(self):  # what a replica process gets: not the launcher's handlers and timers
        return {"args": self.args, "folder": self.folder}

    def write(self, name, text):  # whole, or not there: another process may read it at any moment
        with open(os.path.join(self.folder, name + ".tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(self.folder, name + ".tmp"), os.path.join(self.folder, name))

    def read(self, prefix):  # {name: text} of the files whose names start with `prefix`, the oldest first
        paths = [os.path.join(self.folder, n) for n in os.listdir(self.folder) if n.startswith(prefix)]
        paths = sorted((p for p in paths if not p.endswith(".tmp")), key=os.path.getmtime)
        return {os.path.basename(p): open(p).read() for p in paths}

    def replicas(self):  # {rank: [process id, stage]} of the replicas whose runtime started, by rank
        return dict(sorted((int(name[8:]), json.loads(text)) for name, text in self.read("replica-").items()))

    # ---- the replicas' side
    def set_stage(self, run, stage):  # what the deadline names, should it pass
        self.write(f"replica-{run.rank}", json.dumps([os.getpid(), stage]))

    def should_stop(self, run, recompiles):
        """(the stop signal's number or 0, recompiles), each the largest over the replicas: every replica decides alike.
        With several replicas this waits for the step just launched, as the all-reduce is read at once."""
        values = [int(self.read("stop").get("stop", 0)), recompiles]
        if run.world == 1:
            return values
        torch_xla.sync()  # cut the step's graph where MpDeviceLoader would: the same graphs
        agreed = xm.all_reduce(xm.REDUCE_MAX, torch.tensor(values, dtype=torch.float32, device=run.device))
        return [int(v) for v in agreed.cpu().tolist()]  # float32: TPUs all-reduce no int64 (pytorch/xla#1952)

    def fail_alone(self, run, e):  # the launcher reads the line and ends every replica
        self.write(f"failed-{run.rank}", f"replica {run.rank}: {describe(e)[1]}")

    # ---- the launcher's side
    def __enter__(self):
        self.handlers = {}
        if threading.current_thread() is threading.main_thread():  # Python takes signals in its main thread only
            self.handlers = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self.timers = [self.after(0, self.watch)]
        if self.args.smoke:
            self.timers.append(self.after(self.args.smoke_timeout, self.deadline_passed))
        return self

    def __exit__(self, *exc):
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        for timer in self.timers:
            timer.cancel()
        shutil.rmtree(self.folder, ignore_errors=True)  # (which also ends the watch)

    def after(self, seconds, action, *args):  # a daemon thread: the process never waits for it
        timer = threading.Timer(seconds, action, args)
        timer.daemon = True
        timer.start()
        return timer

    def on_signal(self, signum, frame):  # the first asks every replica to save and stop at its next log boundary
        name = signal.Signals(signum).name
        stages = {stage for _, stage in self.replicas().values()}
        if self.read("stop"):
            self.end(128 + signum, f"stopped by a second {name}, at once: nothing saved")
        elif stages <= {"devices"}:
            self.end(128 + signum, f"stopped by {name} before training began: nothing to save")
        else:
            self.write("stop", str(signum))
            self.timers.append(self.after(STOP_GRACE, self.grace_over, name, 128 + signum))

    def grace_over(self, name, code):  # replicas past their last checkpoint are left to finish
        if "training" in [stage for _, stage in self.replicas().values()]:
            self.end(code, f"stopped by {name}: no log boundary within {STOP_GRACE} s, nothing saved")

    def watch(self):  # xmp.spawn's process pool may never look at a worker started after its first (Python 3.11)
        with contextlib.suppress(FileNotFoundError):  # the folder goes when the run ends
            while self.ended is None:
                if self.why_replicas_ended():
                    self.end(1, self.why_replicas_ended())
                time.sleep(0.5)

    def why_replicas_ended(self):  # a process that died first: a survivor's error in a collective only follows
        self.seen.update((p.pid, p) for p in multiprocessing.active_children() if p.pid not in self.not_ours)
        for p in self.seen.values():
            if p.exitcode not in (None, 0):
                how = f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                ranks = [str(rank) for rank, (pid, _) in self.replicas().items() if pid == p.pid] or ["?"]
                return f"failed: replica {' and '.join(ranks)}'s process died ({how}); its checkpoints stay"
        return next(iter(self.read("failed-").values()), None)

    def end(self, code, line):
        """Ends the run at once: kills the replica processes (one left behind would hold its TPU chip), so that
        xmp.spawn raises in the launcher, which exits with this line. A replica in this process cannot be stopped."""
        self.ended = Exit(code, line)
        children = [p for p in multiprocessing.active_children() if p.pid not in self.not_ours]
        if not children:
            print(f"train_tpu.py: {line}", file=sys.stderr, flush=True)
            os._exit(code)
        for child in children:
            child.kill()

    def explain(self, e):  # the Exit for what xmp.spawn (or the only replica) raised, or None: a bug
        if self.ended is None and self.why_replicas_ended():  # xmp.spawn's pool saw it before the watch did
            self.ended = Exit(1, self.why_replicas_ended())
        if self.ended is None and not self.replicas():
            self.ended = Exit(2, f"error: the {self.args.kind} runtime did not start: {first_line(e)}")
        return self.ended

    def deadline_passed(self):  # the replicas' stage FAILs (the lowest replica's, if they differ)
        stage = next(iter(self.replicas().values()), [0, "devices"])[1]
        line = f"{stage} did not finish within --smoke-timeout"
        publish(self.args, [dict(name=stage, passed=False, figure=f"{line} {self.args.smoke_timeout:g} s")])
        self.end(5, f"failed: smoke verdict FAIL: {line}")


# ---- the smoke verdict: is this machine fit to train on? ----------------------------------------------------------
def finish(run):  # the run's end: the smoke verdict (exit 5), or --target-accuracy (exit 21)
    args = run.args
    accuracy = run.log.accuracy or 0.0
    print0(f"done | {args.epochs} epochs | test accuracy {accuracy:.2f}%")
    if args.smoke:
        smoke_verdict(run)
    elif accuracy < args.target_accuracy:
        raise Exit(21, f"failed: test accuracy {accuracy:.2f}% is below --target-accuracy {args.target_accuracy:g}")


def smoke_verdict(run):
    """The checks, each a PASS, FAIL or SKIP (None) with its figure; every replica's, combined. Exit 5 if one FAILs."""
    checks = []
    for name, check in (
        ("devices", check_devices),
        ("numerics", check_numerics),
        ("checkpoint", check_checkpoint),
        ("compilation", check_compilation),
        ("learning", check_learning),
    ):
        run.control.set_stage(run, name)
        passed, figure = check(run)
        checks.append(dict(name=name, passed=passed, figure=figure))
    run.control.set_stage(run, "verdict")
    combine_replicas(run, checks)
    if run.rank == 0:
        publish(run.args, checks)
    failed = [c["name"] for c in checks if c["passed"] is False]
    if failed:
        raise Exit(5, f"failed: smoke verdict FAIL: {', '.join(failed)}")


def check_devices(run):
    """The devices the runtime found, against what the TPU metadata says the slice holds. Not the PCI bus: xmp.spawn
    counts chips there too, so a chip missing from it would lower both numbers."""
    found = xr.global_runtime_device_count()  # (world_size() equals it by construction)
    if run.args.kind != "TPU" or run.args.cores == 1:
        return None, f"{found} {run.args.kind} device(s); skipped off a TPU, or at --cores 1"
    bounds = tpu.get_tpu_env().get("CHIPS_PER_HOST_BOUNDS")  # e.g. "2,2,1": the tpu-env metadata
    if not bounds:
        return None, f"{found} TPU devices; skipped: the TPU metadata has no CHIPS_PER_HOST_BOUNDS"
    chips = math.prod(int(n) for n in bounds.split(","))
    per_chip = tpu.num_logical_cores_per_chip()  # from the metadata's ACCELERATOR_TYPE: 2 on v2/v3, else 1
    hosts = tpu.num_tpu_workers()  # the metadata's worker-network-endpoints
    expected = chips * per_chip * hosts
    per_host = f"{chips} chips per host (metadata CHIPS_PER_HOST_BOUNDS {bounds})"
    slice_size = (
        f"{per_host} x {per_chip} devices per chip (metadata ACCELERATOR_TYPE) x {hosts} hosts (metadata workers)"
    )
    return found == expected, f"{found} TPU devices found, {expected} in the slice: {slice_size}"


def check_numerics(run):
    """The first step from the run's initial weights and first batch, on the device and in eager PyTorch on the host:
    logits, loss and weight update (-lr x gradient), each compared by norm."""
    args = run.args
    images, labels = load_split(args, train=True)
    state = initial_model(args).state_dict()
    results = []
    for device in (run.device, torch.device("cpu")):
        model = build_model(args).to(device)
        model.load_state_dict(state)
        with torch.autocast(device.type, torch.bfloat16, enabled=args.bf16):
            logits = model(model_input(images[: run.load_batch].to(device)))
            loss = F.cross_entropy(logits, labels[: run.load_batch].to(device))
        loss.backward()
        update = torch.cat([-args.lr * p.grad.flatten() for p in model.parameters()])
        results.append([t.detach().float().cpu() for t in (logits, loss, update)])
    diffs = [float((a - b).norm() / b.norm()) for a, b in zip(*results, strict=True)]
    tol = tolerance(args)
    figure = f"logits {diffs[0]:.1e}, loss {diffs[1]:.1e}, update {diffs[2]:.1e} (tolerance {tol:.0e})"
    return max(diffs) <= tol, f"first step, device vs eager CPU, relative by norm: {figure}"


def check_checkpoint(run):  # the newest checkpoint, read back from disk: the weights and momentum in memory?
    if run.rank != 0:
        return None, "read back by the master"
    path = find_checkpoint(run.args.out_dir)
    saved = read_checkpoint(path)
    pairs = [(t, saved["model"][name]) for name, t in run.model.state_dict().items()]
    for i, state in run.optimizer.state_dict()["state"].items():  # whatever the optimizer keeps: SGD's momentum, Adam's
        pairs += [(t, saved["optimizer"]["state"][i][key]) for key, t in state.items() if torch.is_tensor(t)]
    same = sum(torch.equal(a.cpu(), b) for a, b in pairs)
    return same == len(pairs), f"{path} read back: {same}/{len(pairs)} tensors identical"


def check_compilation(run):
    allowed = run.args.max_recompiles or 0
    ops = fallback_ops()
    passed = run.log.recompiles <= allowed and ops == "none"
    figure = f"{run.log.recompiles} graphs compiled after warm-up in this process (allowed {allowed})"
    return passed, f"{figure}, CPU fallback ops: {ops}"


def check_learning(run):
    losses = run.log.history
    accuracy = run.log.accuracy
    target = run.args.target_accuracy
    k = max(1, len(losses) // 4)
    before = sum(losses[:k]) / k
    after = sum(losses[-k:]) / k
    passed = after < before and accuracy >= target
    figure = f"loss {before:.3f} -> {after:.3f} (first and last {k} steps)"
    return passed, f"{figure}, test accuracy {accuracy:.2f}% (target {target:g}%)"


def combine_replicas(run, checks):  # a check fails if it failed on any replica: one other than 0 must not go unseen
    if run.world == 1:
        return
    failed = torch.zeros(run.world, len(checks))
    failed[run.rank] = torch.tensor([float(c["passed"] is False) for c in checks])
    torch_xla.sync()
    failed = xm.all_reduce(xm.REDUCE_SUM, failed.to(run.device)).cpu()
    for check, column in zip(checks, failed.T, strict=True):
        where = column.nonzero().flatten().tolist()
        if where:
            check["passed"] = False
            check["figure"] += f" | FAILED on replica(s) {where}"


def publish(args, checks):
    """The verdict's table, and OUT/verdict.json: {"passed", "checks": [{"name", "passed", "figure"}]}."""
    mark = {True: "PASS", False: "FAIL", None: "SKIP"}
    passed = all(c["passed"] is not False for c in checks)
    rows = [f"  {mark[c['passed']]}  {c['name']:<12} {c['figure']}" for c in checks]
    print("\n".join(["smoke verdict", *rows, f"smoke verdict: {mark[passed]}"]), flush=True)
    path = os.path.join(args.out_dir, "verdict.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"passed": passed, "checks": checks}, f, indent=1)
    os.replace(path + ".tmp", path)


# ---- from Python: the results back in the caller ------------------------------------------------------------------
def fit(**flags):
    """The command line as a call: fit(cores=1, data="synthetic", epochs=2) trains, and returns the final model (on the
    host), its per-step history and epochs, and with smoke=True the verdict. It raises Exit where main() would exit
    non-zero, but for a failed smoke verdict, which comes back in .verdict."""
    argv = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(value)
    args = parse_args(argv)
    try:
        launch(args)
    except Exit as e:
        if e.code != 5:
            raise
    model = build_model(args)
    model.load_state_dict(read_checkpoint(find_checkpoint(args.out_dir))["model"])
    verdict = None
    if args.smoke:
        with open(os.path.join(args.out_dir, "verdict.json")) as f:
            verdict = json.load(f)
    return types.SimpleNamespace(model=model, out_dir=args.out_dir, verdict=verdict, **read_metrics(args.out_dir))


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # after an error mid-epoch, MpDeviceLoader's feeder can abort a normal exit (134)
