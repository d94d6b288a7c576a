"""train_tpu.py: the reference PyTorch/XLA trainer, one file to read, run and copy.

It trains the article's ToyModel CNN on MNIST on every TPU core (a DistributedSampler shard per
replica, MpDeviceLoader, xm.optimizer_step, xm.save from the master, xmp.spawn), or in SPMD mode
in one process. The commands people run most:

  python train_tpu.py                                    # TPU VM: train on every core
  python train_tpu.py --smoke --report verdict.json      # is this new TPU VM fit to train on?
  PJRT_DEVICE=CPU python train_tpu.py --cores 1 --data synthetic --epochs 1   # no TPU: the CPU
  python train_tpu.py --resume runs/<run> --epochs 5     # continue, from either mode's format

The spine (flags, data, model, step, epoch, launch) comes first; the instruments it calls
(checks before the runtime, checkpoints, stopping early, logging, the smoke verdict,
benchmarks) follow. To train your own model, replace the two sections marked "your own".
README.md has the rest: what each output line means, exit codes, TPU pods, and the tests.
"""

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

try:
    import torch_xla
    import torch_xla.backends
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.xla_multiprocessing as xmp
    import torch_xla.runtime as xr
except ImportError as e:
    # A torch_xla built for another torch fails here (undefined C++ symbols): main() says so in
    # one line that names both versions (check_versions).
    XLA_IMPORT_ERROR = e
else:
    XLA_IMPORT_ERROR = None

# ---- settings --------------------------------------------------------------------------------

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # the MNIST training set's pixel statistics
SYNTHETIC_TRAIN, SYNTHETIC_TEST = 30_000, 5_000  # generated digits per split
SYNTHETIC_DATA_SEED = 1234  # fixed, so runs with different --seed see the same data
LAYERDROP_REPEATS = 50  # the article's loop: one shared fc2 applied up to 50 times
WARMUP_STEPS = 2  # steps per epoch left out of samples/s: steps 1 and 2 compile their graphs
PROFILE_STEPS = 10  # steps in a --profile trace
# --smoke: long enough to learn and to have an epoch after warm-up, short enough for a VM check.
SMOKE_PRESET = dict(data="synthetic", epochs=2, steps_per_epoch=40, log_steps=10,
                    target_accuracy=90.0)
# What a resumed run takes from its checkpoint unless the command line says otherwise.
RESUMED_SETTINGS = ("data", "data_dir", "epochs", "batch_size", "lr", "momentum", "seed",
                    "steps_per_epoch", "layerdrop", "layerdrop_prob", "bf16")
EXIT_BAD_INPUT, EXIT_RECOMPILES, EXIT_RESUME_MISMATCH, EXIT_SMOKE_FAILED = 2, 3, 4, 5
EXIT_BELOW_TARGET = 21  # as pytorch/xla's test_train_mp_mnist.py


class UsageError(Exception):
    """Bad input: one line, exit code 2 (the `code` attribute)."""
    code = EXIT_BAD_INPUT


class TrainingFailed(Exception):
    """The run ended but failed a check: one line, a non-zero exit code."""

    def __init__(self, message, code):
        super().__init__(message, code)  # both in args, so it survives pickling out of spawn
        self.message, self.code = message, code

    def __str__(self):
        return self.message


def is_master():
    """The one place that decides who prints and who writes: global ordinal 0.

    Before the runtime starts (the parent process, --export) there is only us; asking the
    runtime would start it, and xmp.spawn cannot run after that.
    """
    return not torch_xla._XLAC._xla_runtime_is_initialized() or xr.global_ordinal() == 0


def print0(*args, **kwargs):
    if is_master():
        print(*args, **kwargs, flush=True)


# ---- flags -----------------------------------------------------------------------------------


def flag(*names, **options):
    return names, options


# Every flag, in its --help group. Checked right after parsing by flag_rules (below).
FLAGS = {
    "devices": [
        flag("--cores", type=int, metavar="N",
             help="devices to train on: 1, or all of them (the default)"),
        flag("--spmd", action="store_true",
             help="one process drives every device; the batch is sharded by GSPMD")],
    "data": [
        flag("--data", choices=("mnist", "synthetic"), default="mnist",
             help="torchvision MNIST, or generated digits made in memory"),
        flag("--data-dir", default="data", metavar="DIR",
             help="where MNIST lives (DIR/MNIST/raw/*-ubyte) or is downloaded to"),
        flag("--num-workers", type=int, default=0, metavar="N",
             help="DataLoader worker processes per replica")],
    "training": [
        flag("--epochs", type=int, default=3, metavar="N", help="epochs to train in total"),
        flag("--batch-size", type=int, default=128, metavar="N", help="samples per core per step"),
        flag("--lr", type=float, default=0.05,
             help="SGD learning rate, used as given (not scaled with the world size)"),
        flag("--momentum", type=float, default=0.9, help="SGD momentum, in [0, 1)"),
        flag("--steps-per-epoch", type=int, metavar="N",
             help="stop each epoch after N steps (quick runs; default: the whole set)"),
        flag("--seed", type=int, default=0,
             help="seeds the weights, the shuffling and the layerdrop coin flips"),
        flag("--bf16", action="store_true",
             help="autocast the training forward pass and loss to bfloat16 on the device; "
                  "weights, optimizer and evaluation stay float32"),
        flag("--target-accuracy", type=float, default=0.0, metavar="PERCENT",
             help="exit 21 if the final test accuracy (0-100) is below this")],
    "layerdrop and recompilation": [
        flag("--layerdrop", choices=("off", "dynamic", "static"), default="off",
             help="off: ToyModel; dynamic: the article's host coin flips (recompiles); "
                  "static: the same drops decided on the device (one graph)"),
        flag("--layerdrop-prob", type=float, default=0.5, metavar="P",
             help="probability that each of the 50 fc2 applications is dropped"),
        flag("--max-recompiles", type=int, metavar="N",
             help="exit 3 when more than N graphs compile after warm-up (epoch 1)"),
        flag("--metrics-debug", action="store_true",
             help="print torch_xla's full metrics report after every epoch")],
    "smoke test and benchmarks": [
        flag("--smoke", action="store_true",
             help="a short run that ends with a PASS/FAIL verdict per check; exit 0 only if all "
                  "pass (presets, unless given: " + ", ".join(
                      f"--{k.replace('_', '-')} {v}" for k, v in SMOKE_PRESET.items()) + ")"),
        flag("--benchmark", choices=("layerdrop", "host"),
             help="layerdrop: dynamic vs static layerdrop on one device; host: input, steps/s "
                  "and host-device waits; print the figures and exit"),
        flag("--report", metavar="PATH",
             help="with --smoke or --benchmark host: also write the figures as JSON"),
        flag("--deadline-scale", type=float, default=1.0, metavar="X",
             help="with --smoke: multiply each check's deadline by X (a check that does not "
                  "finish in time FAILs, so a hang never blocks the verdict)"),
        flag("--matmul-precision", choices=("default", "high", "highest"), default="default",
             help="TPU matmul precision (default: one bfloat16 pass); the numerics check's "
                  "tolerance follows it")],
    "logging and checkpoints": [
        flag("--log-steps", type=int, default=20, metavar="N", help="log every N steps"),
        flag("--out-dir", metavar="DIR",
             help="checkpoints and metrics (default: runs/<time>, or the --resume run)"),
        flag("--overwrite", action="store_true",
             help="start clean in an --out-dir that already holds a run (deletes it)"),
        flag("--profile", metavar="DIR",
             help="write an XLA profiler trace of the first epoch's steps 3-12 to DIR"),
        flag("--save-steps", type=int, metavar="N",
             help="also checkpoint every N training steps (default: at epoch ends only)"),
        flag("--keep-checkpoints", type=int, default=2, metavar="K",
             help="checkpoints kept in --out-dir, the newest always among them"),
        flag("--resume", metavar="PATH",
             help="continue from a checkpoint: an xm.save file, an SPMD directory, or a run"),
        flag("--export", metavar="FILE",
             help="with --resume: write that checkpoint as one torch.save file, then exit")]}


def build_parser():
    p = _Parser(prog="train_tpu.py", description="Train the article's ToyModel on TPU cores.",
                allow_abbrev=False, formatter_class=_Help)
    for title, flags in FLAGS.items():
        group = p.add_argument_group(title)
        for names, options in flags:
            group.add_argument(*names, **options)
    return p


def flag_rules(a):
    """(what was given, is it bad, what to do): checked in order, right after parsing."""
    at_least_1 = ("epochs", "batch_size", "log_steps", "cores", "keep_checkpoints", "save_steps",
                  "steps_per_epoch")
    traced = WARMUP_STEPS + PROFILE_STEPS  # --profile traces the steps after warm-up
    no_folder = lambda path: path and not os.path.isdir(os.path.dirname(os.path.abspath(path)))
    return [(f"--{n.replace('_', '-')} {getattr(a, n)}", getattr(a, n) is not None and
             getattr(a, n) < 1, "must be at least 1") for n in at_least_1] + [
        (f"--num-workers {a.num_workers}", a.num_workers < 0, "must be 0 or more"),
        (f"--lr {a.lr}", not (a.lr > 0 and math.isfinite(a.lr)), "must be a positive number"),
        (f"--momentum {a.momentum}", not 0 <= a.momentum < 1, "must be in [0, 1)"),
        (f"--layerdrop-prob {a.layerdrop_prob}", not 0 <= a.layerdrop_prob <= 1,
         "must be in [0, 1]"),
        # Above 100 is allowed and unreachable: a way to see a run (or a smoke check) fail.
        (f"--target-accuracy {a.target_accuracy}", not 0 <= a.target_accuracy < math.inf,
         "a percentage, 0 or more"),
        (f"--deadline-scale {a.deadline_scale}", not 0 < a.deadline_scale < math.inf,
         "must be a positive number"),
        (f"--max-recompiles {a.max_recompiles}", (a.max_recompiles or 0) < 0, "must be 0 or more"),
        (f"--resume {a.resume}", a.resume is not None and not os.path.exists(a.resume),
         "no such file or directory"),
        (f"--export {a.export}", a.export is not None and os.path.isdir(a.export),
         f"a folder is there; name the file to write, e.g. "
         f"{os.path.join(a.export or '', 'model.pt')}"),
        ("--export needs --resume PATH", a.export is not None and a.resume is None,
         "the checkpoint to convert"),
        (f"--profile traces steps {WARMUP_STEPS + 1}-{traced}",
         a.profile is not None and (a.steps_per_epoch or traced + 1) <= traced,
         f"--steps-per-epoch must be more than {traced}"),
        (f"--profile {a.profile}", a.profile is not None and (not a.profile or
                                                         os.path.isfile(a.profile)),
         "a file is there; name a folder for the trace"),
        ("--report writes the smoke verdict or the host benchmark",
         a.report is not None and not (a.smoke or a.benchmark == "host"),
         "add --smoke or --benchmark host"),
        ("--smoke checks a fresh run", a.smoke and a.resume is not None, "leave out --resume"),
        (f"--steps-per-epoch {a.steps_per_epoch}",
         a.benchmark and (a.steps_per_epoch or 99) <= WARMUP_STEPS,
         f"the benchmark needs more than {WARMUP_STEPS} steps (the first {WARMUP_STEPS} "
         "compile)"),
        (f"--export {a.export}", no_folder(a.export),
         f"the folder {os.path.dirname(a.export or '')} does not exist"),
        (f"--report {a.report}", no_folder(a.report),
         f"the folder {os.path.dirname(a.report or '')} does not exist")]


def parse_args(argv=None):
    """Parses and validates the flags. Raises UsageError with a message that says what to do."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    # The flags given explicitly: a resumed run fills in the rest from its checkpoint.
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    args.explicit = [a.dest for a in parser._actions if given & set(a.option_strings)]
    if args.smoke:
        for name, value in SMOKE_PRESET.items():
            if name not in args.explicit:
                setattr(args, name, value)
    for given, bad, what in flag_rules(args):
        if bad:
            raise UsageError(f"{given}: {what}")
    return args


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints its whole usage first; one line is clearer
        raise UsageError(f"{message} (see --help)")


class _Help(argparse.HelpFormatter):
    def _get_help_string(self, action):  # show real defaults; "None" and "False" say nothing
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) \
                or "default" in action.help:
            return action.help
        return action.help + " (default: %(default)s)"


# ---- data: your own goes here (1 of 2 edits: load_split returns it, model_input prepares it) --


def load_split(args, train):
    """(images, labels) of one split as in-memory tensors: uint8 pixels (N, 1, 28, 28), (N,)."""
    if args.data == "synthetic":
        n = SYNTHETIC_TRAIN if train else SYNTHETIC_TEST
        return synthetic_digits(n, SYNTHETIC_DATA_SEED + (0 if train else 1))
    import torchvision

    # The raw uint8 tensor, read once: no PIL image and no transform per sample.
    mnist = torchvision.datasets.MNIST(args.data_dir, train=train, download=False)
    return mnist.data.unsqueeze(1), mnist.targets


def model_input(images):
    """On the device, inside the step: a batch of load_split's images -> the model's input.

    Pixels travel as uint8, a quarter of float32's bytes through the host's input pipeline and
    onto the device (--benchmark host); the device scales them. The result equals torchvision's
    ToTensor() + Normalize((0.1307,), (0.3081,)). Data that is float already: return it as is.
    """
    if images.dtype != torch.uint8:  # a new load_split, this function not yet replaced
        raise TypeError(f"model_input expects uint8 pixels, got {images.dtype}: replace it too")
    return (images.float() / 255.0 - MNIST_MEAN) / MNIST_STD


# Seven-segment strokes (row0, row1, col0, col1) in a 20 x 12 glyph, and each digit's strokes.
SEGMENTS = dict(a=(0, 2, 1, 11), b=(1, 10, 10, 12), c=(10, 19, 10, 12), d=(18, 20, 1, 11),
                e=(10, 19, 0, 2), f=(1, 10, 0, 2), g=(9, 11, 1, 11))
DIGITS = ("abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg")


def synthetic_digits(n, seed):
    """Digit-like 28 x 28 images: seven-segment glyphs, shifted, dimmed and noised at random.

    The glyph moves by up to 4 pixels, so fixed pixel templates do poorly (see the tests): a
    high accuracy shows the model really learns. Deterministic for a given (n, seed).
    """
    g = torch.Generator().manual_seed(seed)
    glyphs = torch.zeros(10, 20, 12)
    for digit, strokes in enumerate(DIGITS):
        for r0, r1, c0, c1 in (SEGMENTS[s] for s in strokes):
            glyphs[digit, r0:r1, c0:c1] = 1.0
    labels = torch.randint(0, 10, (n,), generator=g)
    shifts = torch.randint(-4, 5, (n, 2), generator=g)
    brightness = 0.5 + 0.5 * torch.rand(n, generator=g)
    images = torch.zeros(n, 28, 28)
    for i in range(n):
        top, left = 4 + shifts[i, 0].item(), 8 + shifts[i, 1].item()
        images[i, top:top + 20, left:left + 12] = glyphs[labels[i]] * brightness[i]
    images = (images + 0.2 * torch.randn(n, 28, 28, generator=g)).clamp(0, 1)
    return (images * 255).round().to(torch.uint8).unsqueeze(1), labels  # as MNIST stores them


def prepare_data(args):
    """Makes sure MNIST is in --data-dir before any replica starts, so replicas never race.

    Every host of a pod runs this (each needs its own copy). Hosts that share a disk would race,
    so each downloads into a private folder and renames the finished files into place.
    """
    if args.data != "mnist" or mnist_present(args.data_dir):
        return
    import torchvision

    private = None
    try:
        os.makedirs(args.data_dir, exist_ok=True)
        private = tempfile.mkdtemp(prefix=".download-", dir=args.data_dir)
        with quietly():  # torchvision prints each attempt; our one line says it all
            for train in (True, False):
                torchvision.datasets.MNIST(private, train=train, download=True)
        raw = os.path.join(args.data_dir, "MNIST", "raw")
        os.makedirs(raw, exist_ok=True)
        for name in os.listdir(os.path.join(private, "MNIST", "raw")):
            if name.endswith("-ubyte"):
                os.replace(os.path.join(private, "MNIST", "raw", name), os.path.join(raw, name))
    except Exception:
        pass  # the check below says what is missing
    finally:
        if private:
            shutil.rmtree(private, ignore_errors=True)
    if not mnist_present(args.data_dir):
        raise UsageError(
            f"MNIST is not in --data-dir {args.data_dir} (expected {args.data_dir}/MNIST/raw/"
            "*-ubyte) and could not be downloaded; copy it there, or use --data synthetic")


def mnist_present(data_dir):
    import torchvision

    try:
        with quietly():
            for train in (True, False):
                torchvision.datasets.MNIST(data_dir, train=train, download=False)
        return True
    except Exception:
        return False


def quietly():
    stack, sink = contextlib.ExitStack(), io.StringIO()
    stack.enter_context(contextlib.redirect_stdout(sink))
    stack.enter_context(contextlib.redirect_stderr(sink))
    return stack


# ---- model: your own goes here (2 of 2 edits: build_model builds it) -------------------------


class ToyModel(nn.Module):
    """The article's ToyModel, and with layerdrop its second, dynamic version.

    The article ends both with nn.Softmax; this returns logits, because F.cross_entropy applies
    log-softmax itself: softmax twice flattens the loss and slows learning.
    """

    def __init__(self, layerdrop="off", layerdrop_prob=0.5):
        super().__init__()
        self.layerdrop, self.layerdrop_prob = layerdrop, layerdrop_prob
        self.conv1 = nn.Conv2d(1, 10, 5)
        self.mp1 = nn.MaxPool2d(2)
        if layerdrop == "off":
            self.fc1 = nn.Linear(1440, 10)
        else:
            self.fc1 = nn.Linear(1440, 20)
            self.fc2 = nn.Linear(20, 20)  # shared: applied up to LAYERDROP_REPEATS times
            self.fc3 = nn.Linear(20, 10)

    def forward(self, x, keep=None):
        """keep: which fc2 applications run this step (None: all, as at evaluation).

        dynamic: a Python list of bools. Each False skips an op while tracing, so the graph
        changes with the number kept and XLA compiles a new one (up to 51).
        static: a bool tensor on the device. Every application is traced and torch.where picks
        fc2(x) or x, so one graph serves every step, at the price of computing fc2 each time.
        """
        x = self.fc1(torch.flatten(self.mp1(F.relu(self.conv1(x))), 1))
        if self.layerdrop == "off":
            return x
        for i in range(LAYERDROP_REPEATS):
            if keep is None or (self.layerdrop == "dynamic" and keep[i]):
                x = self.fc2(x)
            elif self.layerdrop == "static":
                x = torch.where(keep[i], self.fc2(x), x)
        return self.fc3(x)


def build_model(args):
    """The one place that builds the model (on the host): with the class above, what you
    replace to train your own. Nothing else reads its attributes or its input's shape."""
    return ToyModel(args.layerdrop, args.layerdrop_prob)


# ---- layerdrop: the article's recompilation example -------------------------------------------


def drop_pattern(seed, epoch, step, prob):
    """The keep decisions of one step: a pure function of (seed, epoch, step).

    Every replica must drop the same applications: one that skipped fc2 would have no fc2
    gradient, its all-reduce would carry other tensors than the others', and the collective
    hangs or mixes gradients. So the seed comes from (seed, epoch, step), never the replica.
    """
    key = hashlib.sha256(f"{seed}/{epoch}/{step}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key[:7], "little"))
    return (torch.rand(LAYERDROP_REPEATS, generator=g) >= prob).tolist()  # P=0 keeps all


def layerdrop_keep(args, epoch, step, device):
    """The `keep` argument for this step's forward (None with --layerdrop off)."""
    if args.layerdrop == "off":
        return None
    keep = drop_pattern(args.seed, epoch, step, args.layerdrop_prob)
    # static: 50 bools copied to the device, new data each step and the same graph.
    return keep if args.layerdrop == "dynamic" else torch.tensor(keep, device=device)


# ---- input: each replica's shard, a batch at a time, onto the device -------------------------


class Examples(Dataset):
    """Equal-length tensors served as dicts, so each field can get its own sharding.

    Given a whole batch of indices it returns the batch with one index_select per field: about
    ten times the samples/s of building it sample by sample and collating (--benchmark host),
    which matters under SPMD, where one process loads every device's batch.
    """

    def __init__(self, **fields):
        self.fields = fields

    def __len__(self):
        return len(next(iter(self.fields.values())))

    def __getitem__(self, i):
        if isinstance(i, (list, torch.Tensor)):  # a batch of indices
            i = torch.as_tensor(i)
            return {name: t.index_select(0, i) for name, t in self.fields.items()}
        return {name: t[i] for name, t in self.fields.items()}


def batches(dataset, batch_sampler, num_workers=0):
    """A DataLoader that asks the dataset for each batch whole (batch_sampler gives its indices)."""
    return DataLoader(dataset, sampler=batch_sampler, batch_size=None, num_workers=num_workers,
                      worker_init_fn=leave_signals_to_the_replica if num_workers else None)


def in_order(dataset, batch_size):
    """An evaluation's batches: the dataset in order (eval_shard pads it to whole batches)."""
    return batches(dataset, BatchSampler(SequentialSampler(dataset), batch_size, False))


def leave_signals_to_the_replica(worker_id):
    """A DataLoader worker ignores SIGTERM and Ctrl-C: its replica saves, stops and ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class EpochBatches(torch.utils.data.Sampler):
    """This replica's part of each epoch's shuffle, one tensor of indices per batch.

    --steps-per-epoch cuts the epoch's end, and a run resumed mid-epoch skips the samples it
    trained on (same order, so the rest is what the interrupted run would see). A last partial
    batch is dropped: every step has one shape, so it compiles no extra graph. The epoch's order
    is sliced as one tensor rather than batched index by index in Python (--benchmark host).
    """

    def __init__(self, sampler, batch_size, stop=None):
        self.sampler, self.batch_size, self.start, self.stop = sampler, batch_size, 0, stop

    def __iter__(self):
        order = torch.tensor(list(self.sampler), dtype=torch.long)[self.start:self.stop]
        return iter(order[:len(self) * self.batch_size].view(-1, self.batch_size))

    def __len__(self):
        samples = min(self.stop or len(self.sampler), len(self.sampler)) - self.start
        return max(0, samples) // self.batch_size

    def set_epoch(self, epoch, start=0):
        """The shuffle of `epoch` (the same on every replica), from its sample `start` on."""
        self.sampler.set_epoch(epoch)
        self.start = start


def train_loader(images, labels, batch_size, world, rank, seed, num_workers, max_steps=None):
    """Each replica's shard of the training set, reshuffled every epoch (call set_epoch)."""
    dataset = Examples(image=images, label=labels)
    shard = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed,
                               drop_last=True)
    sampler = EpochBatches(shard, batch_size, max_steps * batch_size if max_steps else None)
    return batches(dataset, sampler, num_workers), sampler


def eval_shard(images, labels, batch_size, world, rank):
    """This replica's share of the test set: every sample counted exactly once in all.

    DistributedSampler would repeat samples to even out the shards. Instead each shard is padded
    to whole batches with samples marked valid=0: one shape per batch, and padding counts nothing.
    """
    per_rank = math.ceil(len(labels) / world)
    padded = math.ceil(per_rank / batch_size) * batch_size
    index = torch.arange(rank, len(labels), world)
    valid = torch.zeros(padded)
    valid[:len(index)] = 1.0
    index = torch.cat([index, torch.zeros(padded - len(index), dtype=torch.long)])
    return Examples(image=images[index], label=labels[index], valid=valid)


@dataclasses.dataclass
class Topology:
    """Who this process is in the run, as the input pipeline and the logs need it."""
    device: torch.device
    world: int  # data-parallel replicas that each load their own shard (1 under SPMD)
    rank: int
    devices: int  # devices that share one global batch (the world, in multi-core mode)
    mesh: object = None  # the SPMD mesh; None in multi-core mode

    @staticmethod
    def of_this_replica(mesh=None):
        if mesh is None:
            return Topology(torch_xla.device(), xr.world_size(), xr.global_ordinal(),
                            xr.world_size())
        return Topology(torch_xla.device(), 1, 0, xr.global_runtime_device_count(), mesh)

    @property
    def spmd(self):
        return self.mesh is not None

    @property
    def emulated(self):
        """More replicas than devices: only the test suite's emulated world (README) does that."""
        return not self.spmd and self.world > xr.global_runtime_device_count()

    def loader(self, loader):
        """MpDeviceLoader: copies the next batches to the device while this step runs, and cuts
        the step's graph (a sync) each time it hands out a batch."""
        if not self.spmd:
            return pl.MpDeviceLoader(loader, self.device)
        import torch_xla.distributed.spmd as xs

        # Under SPMD it also shards each batch along the mesh's "data" axis, one spec per field:
        # https://docs.pytorch.org/xla/release/r2.8/perf/spmd_advanced.html
        spec = {name: xs.ShardingSpec(self.mesh, ("data",) + (None,) * (t.dim() - 1))
                for name, t in loader.dataset.fields.items()}
        return pl.MpDeviceLoader(loader, self.device, input_sharding=spec)

    def reduce(self, totals):
        # Under SPMD one program sees the global batch: its sums are global already.
        return totals if self.spmd else xm.all_reduce(xm.REDUCE_SUM, totals)

    def agree_max(self, *values):
        """Each value's maximum over the replicas, so all take the same decision (one that
        stopped alone would leave the others waiting in their next all-reduce)."""
        if self.spmd or self.world == 1:
            return values
        torch_xla.sync()  # cut the step's graph where the loader would: the same graphs
        shared = xm.all_reduce(xm.REDUCE_MAX, torch.tensor(values, dtype=torch.float32,
                                                           device=self.device))
        return tuple(int(v) for v in to_host(shared)[0])  # a deliberate wait, at boundaries only


# ---- the step --------------------------------------------------------------------------------


def build_optimizer(model, args):
    # foreach: one op per update for all the parameters at once. Lazy tensors trace every op on
    # the host; with one op per parameter, the optimizer took about a third of the host's time
    # per step at batch 8 (a cProfile of train_epoch on the CPU).
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, foreach=True)


def train_step(model, optimizer, images, labels, keep, spmd, bf16=False):
    """One step, traced lazily: nothing runs until MpDeviceLoader's next batch cuts the graph."""
    optimizer.zero_grad()
    x = model_input(images)
    # --bf16: matmuls and convolutions in bfloat16 from the float32 weights; the gradients and
    # the update stay float32. https://docs.pytorch.org/xla/release/r2.8/perf/amp.html
    with torch.autocast("xla", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        logits = model(x) if keep is None else model(x, keep)
        loss = F.cross_entropy(logits, labels)
    loss.backward()
    if spmd:
        optimizer.step()  # one program over every device: GSPMD inserts the all-reduce itself
    else:
        xm.optimizer_step(optimizer)  # all-reduce (average) the gradients over replicas, step
    return loss


def evaluate(model, batches, reduce_across_replicas=None):
    """Test loss and accuracy, every sample counted once, summed on the device.

    `batches` yields dicts with image, label and valid (see eval_shard), on the model's device.
    Returns (mean loss, accuracy in percent, samples counted).
    """
    model.eval()
    totals = None
    with torch.no_grad():
        for batch in batches:
            logits = model(model_input(batch["image"]))
            loss = F.cross_entropy(logits, batch["label"], reduction="none")
            correct = (logits.argmax(dim=1) == batch["label"]).float()
            sums = torch.stack([(loss * batch["valid"]).sum(), (correct * batch["valid"]).sum(),
                                batch["valid"].sum()])
            totals = sums if totals is None else totals + sums
    model.train()
    if reduce_across_replicas is not None:
        totals = reduce_across_replicas(totals)
    loss_sum, correct, count = to_host(totals)[0].double().tolist()  # a deliberate wait
    return loss_sum / count, 100.0 * correct / count, int(count)


# ---- the epoch: steps, then evaluation and the master's save --------------------------------


@dataclasses.dataclass
class Run:
    """What one replica trains, and how: shared by the functions of the training loop."""
    args: argparse.Namespace
    device_kind: str
    topo: Topology
    model: nn.Module
    optimizer: torch.optim.Optimizer
    test: DataLoader  # this replica's evaluation shard
    test_set: str = ""  # which test set (its fingerprint) the saved test losses are measured on

    @property
    def global_batch(self):
        return self.args.batch_size * self.topo.devices  # samples per step over all devices

    def save(self, position, measured=None):
        """Evaluates (unless `measured` already), then saves at `position` (epoch, steps of it
        done); the master writes."""
        loss, accuracy, counted = measured or evaluate(self.model, self.topo.loader(self.test),
                                                       self.topo.reduce)
        ckpt = checkpoint_dict(self.model, self.optimizer, position, self.args, loss, accuracy,
                               self.device_kind, self.global_batch, self.test_set)
        path = save_checkpoint(ckpt, self.args.out_dir, self.topo.spmd, self.args.keep_checkpoints)
        return path, loss, accuracy, counted


def train_epoch(run, loader, epoch, meter, profile=None):
    """TRAINING: the loop never waits for the device. Losses are read one log window late,
    when the device has long finished them (EpochMeter), and all of them at the epoch's end."""
    args, topo, step = run.args, run.topo, meter.start
    device_batches = iter(topo.loader(loader))
    try:
        for step, batch in enumerate(device_batches, meter.start + 1):
            if profile:
                profile.at(step)
            keep = layerdrop_keep(args, epoch, step, topo.device)
            meter.pending.append(train_step(run.model, run.optimizer, batch["image"],
                                            batch["label"], keep, topo.spmd, args.bf16))
            if (step % args.log_steps == 0 or step in (meter.warm, meter.steps)
                    or (args.save_steps and step % args.save_steps == 0)):
                # Runs once this step's graph is compiled and launched, not when it finishes.
                xm.add_step_closure(meter.log_previous_window, args=(step,))
                if step < meter.steps:  # the epoch's end has its own save
                    stop_or_save_at(run, epoch, step, meter)
    finally:
        if profile:
            profile.close()
        # Left early (a stop, an error), MpDeviceLoader's feeder thread would stay blocked on a
        # full queue, with DataLoader workers alive (torch_xla/distributed/parallel_loader.py).
        device_batches._loader.close()
    if step != meter.steps:  # MpDeviceLoader's feeder ends the epoch quietly when input fails
        if meter.progress:
            print()  # end the progress bar's line first
        raise TrainingFailed(f"the input pipeline stopped after step {step} of {meter.steps} in "
                             f"epoch {epoch} (an error in the dataset or a DataLoader worker)", 1)
    meter.log_the_rest()  # the epoch's end: waits for its last steps


def stop_or_save_at(run, epoch, step, meter):
    """At a boundary: save every --save-steps steps; stop, all replicas together, on a signal."""
    signum = run.topo.agree_max(stop_requested())[0]  # every replica stops here, or none
    if signum or (run.args.save_steps and step % run.args.save_steps == 0):
        torch_xla.sync()  # runs this step's closure: its log line comes before the save
        meter.log_the_rest()  # this step's log line first: metrics.jsonl never lags a save
        run.save((epoch, step))
    if signum:
        run.topo.agree_max(0)  # a barrier: no replica exits while the master is still writing
        raise stopped(signum, (epoch, step), run.args)


def train_epochs(run, loader, sampler, start, watch):
    """The epochs from `start` (epoch, steps of it done) to --epochs: train, evaluate, save.

    Returns (last checkpoint, its accuracy, every loss of this replica, last epoch's samples/s,
    its compile figures).
    """
    args, topo, steps = run.args, run.topo, len(loader)
    log, counter, losses = RunLog(args.out_dir), CompileCounter(), []
    for epoch in range(start[0], args.epochs + 1):
        first, skip = epoch == start[0], start[1] if epoch == start[0] else 0
        counter.start_epoch()
        # A new shuffle each epoch, the same on every replica; resumed mid-epoch, its rest.
        sampler.set_epoch(epoch, start=skip * run.global_batch // topo.world)
        meter = EpochMeter(epoch, steps, run.global_batch, topo, log, ProgressBar.create(),
                           start=skip)
        began = time.perf_counter()
        with watch.deadline("training", 300 + 2 * steps):  # compiles, steps, eval, save
            profile = Profile(args.profile, meter.warm + 1) if args.profile and first else None
            train_epoch(run, loader, epoch, meter, profile)
            path, test_loss, accuracy, counted = run.save((epoch + 1, 0))
        losses += meter.losses
        # Agreed before end_epoch, so that the agreement's own graph compiles in the warm-up.
        recompiles, signum = topo.agree_max(counter.recompiles_so_far(), stop_requested())
        compiles, rate = counter.end_epoch(first), meter.samples_per_s()
        log.write(kind="epoch", epoch=epoch, test_loss=test_loss, accuracy=accuracy,
                  samples_per_s=rate, seconds=time.perf_counter() - began, **compiles)
        report_epoch(args, epoch, first, test_loss, accuracy, counted, rate, path, compiles)
        if signum and epoch < args.epochs:  # after the last epoch there is nothing to stop
            raise stopped(signum, (epoch + 1, 0), args)
        if args.max_recompiles is not None and not args.smoke and recompiles > args.max_recompiles:
            raise TrainingFailed(f"recompiled {recompiles} graphs after warm-up, more than "
                                 f"--max-recompiles {args.max_recompiles}: the graph changes "
                                 "from step to step (see --metrics-debug)", EXIT_RECOMPILES)
    return path, accuracy, losses, rate, compiles


# ---- one replica's run, from devices to the last epoch --------------------------------------


def run_training(args, device_kind, mesh=None):
    """Everything one replica does; under SPMD, the one process over the whole mesh."""
    verdict = Verdict() if args.smoke else None
    watch = Watchdog(verdict, args)  # with --smoke: every stage below has a deadline
    with watch.deadline("devices", 120):  # the runtime starts here
        topo = Topology.of_this_replica(mesh)
    if args.matmul_precision != "default":
        torch_xla.backends.set_mat_mul_precision(args.matmul_precision)
    torch.manual_seed(args.seed)
    model = build_model(args).to(topo.device)
    if topo.world > 1:
        # Seeding is not enough on TPU v2/v3: two devices per chip run as threads of one
        # process and share the global RNG. Every replica takes the master's initial weights.
        xm.broadcast_master_param(model)
    optimizer = build_optimizer(model, args)

    # Each replica loads its own shard; under SPMD the one process loads the global batch.
    load_batch = args.batch_size * (topo.devices if topo.spmd else 1)
    images, labels = load_split(args, train=True)
    loader, sampler = train_loader(images, labels, load_batch, topo.world, topo.rank, args.seed,
                                   args.num_workers, args.steps_per_epoch)
    test_images, test_labels = load_split(args, train=False)
    shard = eval_shard(test_images, test_labels, load_batch, topo.world, topo.rank)
    run = Run(args, device_kind, topo, model, optimizer, in_order(shard, load_batch),
              fingerprint(test_images, test_labels))
    if len(loader) == 0:
        raise UsageError(f"--batch-size {args.batch_size}: a global batch of {run.global_batch}"
                         f" is larger than the {len(images)} training samples")
    print0(f"{device_kind} | {'spmd mesh' if topo.spmd else 'world'} {topo.devices} "
           f"{'devices' if topo.spmd else 'replicas'} | global batch {run.global_batch:,} "
           f"({args.batch_size} per core) | {len(loader)} steps per epoch | lr {args.lr} "
           f"(as given, not scaled) | model {type(model).__name__}, layerdrop {args.layerdrop}"
           f" | out {args.out_dir}")

    if verdict:
        smoke_checks_before_training(verdict, watch, run, images[:load_batch],
                                     labels[:load_batch])
    start, accuracy = resume(run, len(loader)) if args.resume else ((1, 0), None)
    path, accuracy, losses, rate, compiles = train_epochs(run, loader, sampler, start, watch) \
        if start[0] <= args.epochs else (None, accuracy, [], None, None)
    shown = "n/a" if accuracy is None else f"{accuracy:.2f}%"
    print0(f"done | {args.epochs} epochs | test accuracy {shown} | out {args.out_dir}")
    if compiles:
        print0(f"done {format_compiles(compiles, first_epoch=False, epoch='last epoch')}")
    if verdict:
        finish_verdict(verdict, watch, run, losses, rate, accuracy, path, compiles)
    elif (accuracy or 0.0) < args.target_accuracy:
        raise TrainingFailed(f"test accuracy {shown} is below --target-accuracy "
                             f"{args.target_accuracy}", EXIT_BELOW_TARGET)


# ---- launch: xmp.spawn (one process per TPU chip), or SPMD in this process -------------------


def run(args):
    """Does what the parsed flags ask. Raises UsageError or TrainingFailed."""
    check_versions(*installed_versions())
    device_kind, available = select_runtime()
    host, hosts = pod_hosts(device_kind)
    if args.resume:
        inspect_checkpoint(args.resume, args)  # fails fast, and takes the saved settings
    training = not (args.export or args.benchmark)
    cores = check_cores(args, device_kind, available, hosts) if training else 1
    if training:
        refuse_a_running_runtime(args, cores)
    prepare_data(args)
    if args.export:
        return export_checkpoint(args)
    if args.benchmark:
        return BENCHMARKS[args.benchmark](args, device_kind)
    prepare_out_dir(args, writer=host == 0)
    with run_files():
        if args.spmd:
            run_spmd(args, device_kind)
        else:
            spawn_replicas(args, device_kind, cores)


def spawn_replicas(args, device_kind, cores):
    """xmp.spawn, and the failing replica's code and line if one ended the run."""
    try:
        # nprocs=1 runs in this process; None starts one process per TPU chip, each driving
        # its chip's cores. https://docs.pytorch.org/xla/release/r2.7/learn/pjrt.html
        xmp.spawn(_mp_fn, args=(args, device_kind), nprocs=1 if cores == 1 else None)
    except Exception:
        first = ""
        if os.path.exists(os.environ[FAILURE_FILE]):
            with open(os.environ[FAILURE_FILE]) as f:
                first = f.readline()
        if not first:
            raise
        code, line = json.loads(first)
        raise TrainingFailed(line, code) from None


def _mp_fn(index, args, device_kind):
    """xmp.spawn's entry: called once per replica with its index."""
    try:
        run_training(args, device_kind)
    except BaseException as e:
        if xr.world_size() == 1:
            raise  # the only replica, in this process: main() or fit() reports it
        code, line = describe(e)
        end_this_replica(code, f"replica {xr.global_ordinal()}: {line}")


def run_spmd(args, device_kind):
    """One process, every device: the same training function, over a 1-D "data" mesh."""
    import torch_xla.distributed.spmd as xs

    xr.use_spmd()  # before the runtime starts: every tensor is now one global, shardable tensor
    n = xr.global_runtime_device_count()
    run_training(args, device_kind, xs.Mesh(np.arange(n), (n,), ("data",)))


def main(argv=None):
    try:
        run(parse_args(argv))
    except (Exception, KeyboardInterrupt) as e:
        code, line = describe(e)
        print(f"train_tpu.py: {line}", file=sys.stderr)
        return code
    return 0


def describe(error):
    """(exit code, one line) for whatever ended a run."""
    if isinstance(error, (UsageError, TrainingFailed)):
        return error.code, f"{'error' if isinstance(error, UsageError) else 'failed'}: {error}"
    if isinstance(error, KeyboardInterrupt):
        return 130, "interrupted"
    traceback.print_exc()  # a bug (in your model, say): the traceback is what you need
    return 1, f"failed: {type(error).__name__}: {error} (traceback above)"


def fit(**flags):
    """Python entry with the command line's flags as keywords: fit(cores=1, data="synthetic").

    Runs to the end and returns a Result. Raises UsageError or TrainingFailed where main()
    would exit non-zero, except for a failed smoke verdict: that comes back in Result.verdict.
    """
    args = parse_args(argv_from(**flags))
    try:
        run(args)
    except TrainingFailed as e:
        if e.code != EXIT_SMOKE_FAILED:
            raise
    if args.export or args.benchmark:
        return None  # no training run to collect: the figures were printed
    return collect_result(args)


def argv_from(**flags):
    """fit()'s keywords as command-line flags: True is a switch, False and None are left out."""
    argv = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:  # 0 is a value: momentum=0
            argv += [flag, str(value)]
    return argv


# ==== the instruments: each block below is called from the spine at one point =================

# ---- before the runtime starts: versions, the device, pod hosts, --cores ---------------------
# (run() calls these in the parent process. Nothing here may start the runtime: xmp.spawn
# refuses to run once it is up.)


def check_versions(torch_version, xla_version):
    """torch_xla's C++ is built against one torch release: refuse a pair that does not match."""
    def release(version):
        return tuple(version.split("+")[0].split(".")[:2])  # 2.9.0+cu128 -> ("2", "9")

    if xla_version is None or release(torch_version) != release(xla_version):
        raise UsageError(f"torch {torch_version} with torch_xla {xla_version}: torch_xla needs the "
                         "torch release it was built for; install the pair in requirements.txt")
    if XLA_IMPORT_ERROR is not None:
        raise UsageError(f"torch {torch_version} with torch_xla {xla_version}: import torch_xla "
                         f"failed ({XLA_IMPORT_ERROR}); reinstall the pair in requirements.txt")


def installed_versions():
    from importlib import metadata

    try:
        return torch.__version__, metadata.version("torch_xla")
    except metadata.PackageNotFoundError:
        return torch.__version__, None


def select_runtime():
    """(PJRT device kind, devices on this host), chosen as torch_xla would: TPU when TPU chips
    are on the PCI bus, otherwise the CPU. A TPU VM that cannot work fails here in one line."""
    from torch_xla._internal import tpu  # documented as safe to call before xmp.spawn

    if "PJRT_DEVICE" not in os.environ:
        os.environ["PJRT_DEVICE"] = "TPU" if tpu.num_available_chips() > 0 else "CPU"
    kind = os.environ["PJRT_DEVICE"]
    if kind == "CPU":
        return kind, int(os.environ.get("CPU_NUM_DEVICES", "1"))
    if kind != "TPU":
        raise UsageError(f"PJRT_DEVICE={kind}: this script supports TPU and CPU")
    if tpu.num_available_chips() == 0:
        # Without this torch_xla asks the GCE metadata server and ends in a traceback.
        raise UsageError("PJRT_DEVICE=TPU, but this machine has no TPU chip on its PCI bus; "
                         "unset PJRT_DEVICE (or set PJRT_DEVICE=CPU) to run on the CPU")
    holders = processes_holding(tpu_device_files())
    if holders:
        pid, command = holders[0]
        raise UsageError(f"the TPU is in use by process {pid} ({command}): only one process "
                         f"can hold it; stop that one (kill {pid}) and run again")
    return kind, tpu.num_available_devices()


def tpu_device_files():
    # libtpu opens the chips as /dev/accel* (TPU v2-v5e) or /dev/vfio/<n> (v5p, v6e); a second
    # process then fails with "TPU initialization failed" and no hint of who holds them.
    import glob

    return glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")


def processes_holding(paths):
    """[(pid, command)] of other processes with one of `paths` open, read from /proc."""
    wanted, found = {os.path.realpath(p) for p in paths}, []
    for pid in filter(str.isdigit, os.listdir("/proc") if wanted else []):
        if int(pid) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.path.realpath(f"/proc/{pid}/fd/{fd}") in wanted for fd in fds):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found.append((int(pid), f.read().replace(b"\0", b" ").decode().strip()))
        except OSError:  # gone, or not ours to read
            continue
    return found


def pod_hosts(kind):
    """(this host's index, hosts in the slice), from the TPU VM's metadata
    (torch_xla/_internal/tpu.py: worker_id, num_tpu_workers). The global master is on host 0."""
    if kind != "TPU":
        return 0, 1
    from torch_xla._internal import tpu

    try:
        return tpu.worker_id(), tpu.num_tpu_workers()
    except Exception as e:
        raise UsageError(f"cannot read this TPU VM's topology from its metadata server "
                         f"({type(e).__name__}); is this a Cloud TPU VM?")


def check_cores(args, kind, available, hosts=1):
    """Returns the number of devices to use on this host, or says why --cores cannot be."""
    cores = args.cores or available
    if hosts > 1 and args.spmd:
        # SPMD across hosts needs a process group for its checkpoints and one writer per file;
        # under SPMD every host's ordinal reads 0 (torch_xla/runtime.py), so all would write.
        raise UsageError(f"--spmd on a pod slice of {hosts} hosts: this script runs SPMD on one "
                         "host only; leave out --spmd to train data-parallel on every host")
    if hosts > 1 and cores == 1:
        raise UsageError(f"--cores 1 on a pod slice of {hosts} hosts: each host would train alone "
                         "and write the same checkpoint; leave out --cores to use the whole slice")
    if args.spmd and kind == "CPU":
        os.environ["CPU_NUM_DEVICES"] = str(cores)  # the runtime emulates as many as asked
        return cores
    if args.spmd and cores != available:
        raise UsageError(f"--spmd --cores {cores}: SPMD uses every device, and this machine has "
                         f"{available} {kind} devices; leave out --cores")
    if cores > 1 and kind == "CPU":
        # torch_xla runs the replicas of one CPU process as threads, and its collectives across
        # them hang (pytorch/xla issues 5005 and 9089): the gradient all-reduce never returns.
        raise UsageError(
            f"--cores {cores} on the CPU: this machine has {available} CPU device(s), and "
            "torch_xla's CPU collectives hang across replicas (pytorch/xla#5005); use --cores 1,"
            " or --spmd --cores N to shard each batch over N emulated CPU devices")
    if cores not in (1, available):  # xmp.spawn runs one replica, or one per device
        raise UsageError(f"--cores {cores}: this machine has {available} {kind} devices; use "
                         f"--cores 1 (one device) or --cores {available} (all of them)")
    return cores


def refuse_a_running_runtime(args, cores):
    """A second run in one process (a notebook cell run again) would reuse the runtime, whose
    device count and SPMD mode are fixed at its start: another crashes the process (seen here)."""
    if torch_xla._XLAC._xla_runtime_is_initialized() and (args.spmd or cores > 1 or xr.is_spmd()):
        raise UsageError("the XLA runtime is already running in this process (an earlier run "
                         "or tensor on an XLA device) and cannot switch to SPMD or to another "
                         "core count; run this in a fresh process (restart the notebook kernel)")


# ---- compilations, host-device waits, and the epoch's report ---------------------------------

HOST_WAITS = threading.local()  # this replica's deliberate waits (to_host), a running total


def host_waits():
    return getattr(HOST_WAITS, "count", 0)


def to_host(*tensors, wait=True):
    """Device tensors as host tensors: the only place the training loop reads device values.

    wait=True marks a deliberate wait: the device may still be computing them, so the host stops
    until it has caught up. Each epoch's compile line counts them ("host-device waits"). A
    checkpoint's write is not counted: the evaluation before it has waited for the weights.
    """
    HOST_WAITS.count = host_waits() + bool(wait)
    return [t.detach().cpu() for t in tensors]


class CompileCounter:
    """Compilations and waits per epoch, from torch_xla's metrics; warm-up is the first epoch."""

    def __init__(self):
        self.at_epoch_start = self.at_warmup_end = None

    @staticmethod
    def read():
        data = met.metric_data("CompileTime")  # (count, total nanoseconds, samples) or None
        return (data[0], data[1] / 1e9) if data else (0, 0.0)

    def start_epoch(self):
        self.at_epoch_start, self.waits_at_start = self.read()[0], host_waits()

    def recompiles_so_far(self):
        return 0 if self.at_warmup_end is None else self.read()[0] - self.at_warmup_end

    def end_epoch(self, first_epoch):
        total, seconds = self.read()
        if first_epoch:
            self.at_warmup_end = total
        return dict(compiles_epoch=total - self.at_epoch_start, compiles_total=total,
                    compile_seconds=round(seconds, 3),
                    recompiles_after_warmup=total - self.at_warmup_end,
                    host_waits=host_waits() - self.waits_at_start,
                    cpu_fallback_ops=cpu_fallback_ops())


def cpu_fallback_ops():
    """Ops that ran on the CPU for want of an XLA lowering, by name and count (torch_xla's
    `aten::NAME` counters). `aten::_local_scalar_dense` is `.item()` itself: this script reads
    values with `.cpu()`, so it appears only if the model calls `.item()`."""
    return {name: met.counter_value(name) for name in met.counter_names()
            if name.startswith("aten::")}


def format_fallbacks(ops):
    return ", ".join(f"{name} x{count}" for name, count in ops.items()) or "none"


def format_compiles(c, first_epoch, epoch="this epoch"):
    """The epoch's compilations, the total, seconds compiling, recompiles after warm-up, the
    deliberate host-device waits, and the ops that fell back to the CPU."""
    warm = " (this epoch was the warm-up)" if first_epoch else ""
    return (f"compiles | {epoch} {c['compiles_epoch']} | total {c['compiles_total']} | "
            f"{c['compile_seconds']:.1f} s compiling | recompiles after warm-up "
            f"{c['recompiles_after_warmup']}{warm} | host-device waits {c['host_waits']} | "
            f"CPU fallback ops: {format_fallbacks(c['cpu_fallback_ops'])}")


def report_epoch(args, epoch, first, test_loss, accuracy, counted, rate, path, compiles):
    speed = f"{rate:,.0f} samples/s" if rate else "too few steps to time"
    print0(f"epoch {epoch} done | test loss {test_loss:.4f} | accuracy {accuracy:.2f}% "
           f"({counted:,} samples) | {speed} | checkpoint {path}")
    print0(f"epoch {epoch} {format_compiles(compiles, first)}")
    if args.metrics_debug:
        print0(met.metrics_report())
    if is_master():
        write_plot(args.out_dir)


# ---- checkpoints: two formats, one dict ------------------------------------------------------
#
# A checkpoint is one dict: model, optimizer, where training continues (epoch, and steps of it
# done, with the global batch they were counted in), the configuration, and the test loss and
# accuracy measured right before saving: a resumed or converted checkpoint must reproduce them.
# Multi-core: every replica calls xm.save, the master writes OUT/checkpoint.pt (through a
#   temporary file and an atomic rename, so a kill mid-write leaves the last good one).
# SPMD: torch.distributed.checkpoint with torch_xla's SPMD planners, each device's shard as it
#   is, into OUT/checkpoint-spmd/epoch-NNNN/ (a temporary name until complete).
#   https://docs.pytorch.org/xla/release/r2.8/perf/spmd_distributed_checkpoint.html
# The formats differ (the pytorch/xla#6660 thread in ../shared/seeds/004_*): --resume detects
# which one it is given, says so, and converts.


def checkpoint_dict(model, optimizer, position, args, test_loss, accuracy, device_kind,
                    global_batch=0, test_set=""):
    """position: where training continues, (epoch, steps of it already done)."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "epoch": position[0], "step": position[1], "global_batch": global_batch,
            "config": {k: getattr(args, k) for k in RESUMED_SETTINGS},
            "test_loss": test_loss, "accuracy": accuracy, "measured_on": device_kind,
            "test_set": test_set}


def fingerprint(*tensors):
    """A short hash of a test set (its tensors' dtypes, shapes and bytes): a checkpoint names the
    one its test loss was measured on."""
    digest = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        digest.update(f"{t.dtype} {tuple(t.shape)}".encode())
        digest.update(t.flatten().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def save_checkpoint(ckpt, out_dir, spmd, keep):
    """Writes `ckpt` into the run folder, keeping the newest `keep`; returns its path."""
    if spmd:
        return save_spmd_checkpoint(ckpt, out_dir, keep)
    path = os.path.join(out_dir, "checkpoint.pt")
    # Every replica calls xm.save; only the global master moves the tensors to the host and
    # writes, and it alone renames, so a pod's hosts never write one shared file. No barrier
    # after it: nothing reads the file until the run ends, and xm.rendezvous would read a size
    # with .item(), a host sync (xla_rendezvous in torch_xla/core/xla_model.py, 2.9).
    xm.save(ckpt, path + ".tmp", master_only=True, global_master=True)
    if not is_master():
        return path
    if keep > 1 and os.path.exists(path):  # the one replaced stays, named by its position
        replaced = position_name(plain_fields("xm.save", path))
        history = os.path.join(out_dir, f"checkpoint-{replaced}.pt")
        with contextlib.suppress(FileNotFoundError):
            os.remove(history)
        try:  # a second name for the same file: checkpoint.pt exists at every moment
            os.link(path, history)
        except OSError:  # a filesystem without hard links (some network mounts)
            shutil.copyfile(path, history)
    os.replace(path + ".tmp", path)
    older = sorted((os.path.join(out_dir, n) for n in os.listdir(out_dir)
                    if n.startswith("checkpoint-epoch-")),
                   key=lambda where: saved_position("xm.save", where))
    for where in older[:max(0, len(older) - (keep - 1))]:
        os.remove(where)
    return path


def save_spmd_checkpoint(ckpt, out_dir, keep):
    import torch.distributed.checkpoint as dcp
    import torch_xla.experimental.distributed_checkpoint as xc

    root = os.path.join(out_dir, "checkpoint-spmd")
    final = os.path.join(root, position_name(ckpt))
    shutil.rmtree(final + ".tmp", ignore_errors=True)
    with _quiet_dcp_warnings():
        dcp.save(ckpt, storage_writer=dcp.FileSystemWriter(final + ".tmp"),
                 planner=xc.SPMDSavePlanner())
    # The plain fields again, readable without loading the shards (and by people: cat it).
    with open(os.path.join(final + ".tmp", "train_tpu.json"), "w") as f:
        json.dump({k: v for k, v in ckpt.items() if k not in ("model", "optimizer")}, f, indent=1)
    if os.path.exists(final):  # the same position saved again: keep the old one until replaced
        os.replace(final, final + ".old")
    os.replace(final + ".tmp", final)
    shutil.rmtree(final + ".old", ignore_errors=True)
    # Keep the newest `keep` up to this one; never one taken later (a run resumed from further
    # back must not delete what it has not reached).
    here = saved_position("spmd", final)
    done = sorted((saved_position(kind, where), where) for kind, where in checkpoints_in(out_dir)
                  if kind == "spmd" and saved_position(kind, where) <= here)
    for _, old in done[:max(0, len(done) - keep)]:
        shutil.rmtree(old)
    return final


def position_name(ckpt):
    """epoch-0002 after epoch 2; epoch-0002-step-000050 after 50 steps of epoch 3: names sort in
    the order the checkpoints were taken."""
    name = f"epoch-{ckpt['epoch'] - 1:04d}"
    return name + (f"-step-{ckpt['step']:06d}" if ckpt.get("step") else "")


@contextlib.contextmanager
def _quiet_dcp_warnings():
    """Silences three DCP notices that say nothing about this use of it."""
    import warnings

    with warnings.catch_warnings():
        # No process group: DCP saves from one process, which is exactly the SPMD case.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # torch_xla's SPMD planners still use the older planner signature, and touch storages.
        warnings.filterwarnings("ignore", message="The function definition for SavePlanner")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


def checkpoints_in(folder):
    """[(kind, where)] of the complete checkpoints in a run folder, in either format."""
    found = []
    for root in (folder, os.path.join(folder, "checkpoint-spmd")):
        if os.path.isdir(root):
            found += [("spmd", os.path.join(root, d)) for d in os.listdir(root)
                      if d.startswith("epoch-") and not d.endswith((".tmp", ".old"))
                      and os.path.isfile(os.path.join(root, d, ".metadata"))]
    if os.path.isdir(folder):  # checkpoint.pt, and older ones kept by --keep-checkpoints
        found += [("xm.save", os.path.join(folder, n)) for n in os.listdir(folder)
                  if n == "checkpoint.pt" or (n.startswith("checkpoint-epoch-") and
                                              n.endswith(".pt"))]
    return found


def find_checkpoint(path):
    """('xm.save', file) or ('spmd', directory) for whatever --resume points at; in a run
    folder, the checkpoint furthest along (then the newest: a converted run holds both)."""
    if os.path.isfile(path):
        return "xm.save", path
    if os.path.isfile(os.path.join(path, ".metadata")):
        return "spmd", path
    found = checkpoints_in(path)
    if not found:
        raise UsageError(f"--resume {path}: no checkpoint there (neither a checkpoint.pt file "
                         "nor an SPMD directory with a .metadata file)")
    return max(found, key=lambda kind_where: (saved_position(*kind_where),
                                              os.path.getmtime(kind_where[1])))


def plain_fields(kind, where):
    """The checkpoint's dict without reading its tensors: mmap for a file, train_tpu.json for
    an SPMD directory. Raises UsageError if it cannot be read."""
    if kind == "xm.save":
        return load_file_checkpoint(where, mmap=True)
    try:
        with open(os.path.join(where, "train_tpu.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        raise UsageError(f"--resume {where}: train_tpu.json is missing or damaged; the "
                         "checkpoint is incomplete")


def saved_position(kind, where):
    """(epoch, samples of it trained on) where a checkpoint continues; (-1, 0) if unreadable.
    In samples, not steps: a resumed run may use another global batch."""
    try:
        plain = plain_fields(kind, where)
        return plain["epoch"], plain.get("step", 0) * (plain.get("global_batch") or 1)
    except (UsageError, KeyError):
        return -1, 0


def inspect_checkpoint(path, args):
    """Checks --resume in the parent, before any device starts, and takes its settings.
    Returns the (epoch, step) it continues at.

    An SPMD directory is checked against its own metadata: every shard file it names must exist
    and be long enough, so an interrupted copy fails here, not halfway through loading.
    """
    kind, where = find_checkpoint(path)
    if kind == "xm.save":
        plain = plain_fields(kind, where)
        shapes = {k: tuple(v.shape) for k, v in plain["model"].items()}
    else:
        metadata = read_spmd_metadata(where)
        needed = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                             info.offset + info.length)
        for name, size in needed.items():
            file = os.path.join(where, name)
            if not os.path.isfile(file) or os.path.getsize(file) < size:
                raise UsageError(f"--resume {where}: shard file {name} is missing or truncated; "
                                 "the checkpoint is incomplete")
        shapes = {k[len("model."):]: tuple(v.size)
                  for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
        plain = plain_fields(kind, where)
    apply_saved_settings(plain, args)
    check_model_fits(shapes, args, where)
    return plain["epoch"], plain.get("step", 0)


def apply_saved_settings(ckpt, args):
    """Settings not given on this command line come from the checkpoint's configuration."""
    taken = []
    for name, value in ckpt.get("config", {}).items():
        if name in RESUMED_SETTINGS and name not in args.explicit and getattr(args, name) != value:
            setattr(args, name, value)
            taken.append(f"--{name.replace('_', '-')} {value}")
    if taken:
        print(f"resume | from the checkpoint: {', '.join(taken)} (flags given now take precedence)")


def check_model_fits(have, args, where):
    """The checkpoint's parameters ({name: shape}) against the model this run builds."""
    want = {k: tuple(t.shape) for k, t in build_model(args).state_dict().items()}
    for name in sorted(have.keys() | want.keys()):
        if have.get(name) != want.get(name):
            raise UsageError(f"--resume {where}: its model does not fit the one this run builds "
                             f"({name}: {have.get(name, 'absent')} in the checkpoint, "
                             f"{want.get(name, 'absent')} here); resume it with the settings it "
                             "was saved with (--layerdrop off, or dynamic or static)")


def read_spmd_metadata(directory):
    import torch.distributed.checkpoint as dcp

    try:
        return dcp.FileSystemReader(directory).read_metadata()
    except Exception as e:
        raise UsageError(f"--resume {directory}: cannot read the SPMD checkpoint metadata "
                         f"({type(e).__name__}); it may be incomplete or damaged")


def load_file_checkpoint(path, mmap=False):
    """The reader of the xm.save format."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        raise UsageError(f"--resume {path}: cannot read the checkpoint ({type(e).__name__}); "
                         "it may be truncated or damaged, or not a torch.save file")
    if not isinstance(ckpt, dict) or not {"model", "optimizer", "epoch"} <= ckpt.keys():
        raise UsageError(f"--resume {path}: not a train_tpu.py checkpoint (needs model, "
                         "optimizer and epoch)")
    return ckpt


def read_checkpoint(kind, where):
    """Either format, read on the host as the one dict torch.load gives for a file."""
    if kind == "xm.save":
        return load_file_checkpoint(where)
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    read_spmd_metadata(where)
    handle, tmp = tempfile.mkstemp(suffix=".pt")  # not beside the checkpoint: it may be read-only
    os.close(handle)
    try:
        with _quiet_dcp_warnings():
            dcp_to_torch_save(where, tmp)
        ckpt = load_file_checkpoint(tmp)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        if isinstance(e, UsageError):
            raise
        raise UsageError(f"--resume {where}: cannot read the SPMD checkpoint "
                         f"({type(e).__name__}); it may be incomplete or damaged")
    finally:
        os.remove(tmp)
    # DCP stores the optimizer's per-parameter state under string keys ("0", "1", ...);
    # optimizer.load_state_dict matches integer ids and would silently drop the momentum.
    ckpt["optimizer"]["state"] = {int(k): v for k, v in ckpt["optimizer"]["state"].items()}
    return ckpt


def load_spmd_in_place(run, directory):
    """The reader of the SPMD format into a run's sharded model, each device reading its shard."""
    import torch.distributed.checkpoint as dcp
    import torch_xla.experimental.distributed_checkpoint as xc

    saved_keys = read_spmd_metadata(directory).state_dict_metadata
    # DCP loads into tensors that exist. A fresh SGD has no momentum buffers yet: make zero ones
    # where the checkpoint has them (a dummy optimizer step would move the weights).
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):  # numbered as optimizer.state_dict() numbers them
        if f"optimizer.state.{i}.momentum_buffer" in saved_keys:
            run.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    ckpt = checkpoint_dict(run.model, run.optimizer, (0, 0), run.args, 0.0, 0.0, "")
    for key in ("step", "global_batch", "test_set"):  # absent from older checkpoints
        if key not in saved_keys:
            del ckpt[key]
    try:
        with _quiet_dcp_warnings():
            dcp.load(ckpt, storage_reader=dcp.FileSystemReader(directory),
                     planner=xc.SPMDLoadPlanner())
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException: a BaseException
        raise UsageError(f"--resume {directory}: cannot load the SPMD checkpoint "
                         f"({type(e).__name__}); it may be incomplete, damaged, or saved with "
                         "other optimizer settings")
    run.model.load_state_dict(ckpt["model"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    return ckpt


def resume(run, steps):
    """Loads --resume, proves it still computes its saved test loss, converts it if needed.
    `steps`: this run's steps per epoch. Returns ((epoch, steps of it done) to continue at,
    the checkpoint's accuracy)."""
    args, topo = run.args, run.topo
    kind, where = find_checkpoint(args.resume)
    if kind == "spmd" and topo.spmd:
        ckpt = load_spmd_in_place(run, where)
        print0(f"resume | spmd checkpoint {where}: loaded shard by shard")
    else:
        ckpt = read_checkpoint(kind, where)
        run.model.load_state_dict(ckpt["model"])  # copies onto the device, keeping placement
        run.optimizer.load_state_dict(ckpt["optimizer"])  # momentum to the params' device
        print0(f"resume | {kind} checkpoint {where}: " + (
            "placed on the devices and replicated; later saves use the SPMD format"
            if topo.spmd else "loaded on every replica"))
    for group in run.optimizer.param_groups:  # this run's settings, not the saved ones
        group.update(lr=args.lr, momentum=args.momentum, foreach=True)
    # The samples of the epoch already trained on are the same on any device count (a prefix
    # of the epoch's shuffle): continue after that many samples, in whole steps of this run.
    samples = ckpt.get("step", 0) * (ckpt.get("global_batch") or run.global_batch)
    if samples % run.global_batch:
        raise UsageError(f"--resume {args.resume}: saved {samples} samples into epoch "
                         f"{ckpt['epoch']}, which is not a whole number of steps of this run's "
                         f"global batch {run.global_batch}; pick a --batch-size that divides it")
    position = ckpt["epoch"], samples // run.global_batch
    if position[1] >= steps:
        raise UsageError(f"--resume {args.resume}: saved {position[1]} steps into epoch "
                         f"{position[0]}, and this run's epochs have {steps} steps; give a "
                         "larger --steps-per-epoch, or resume with the batch it was saved with")
    measured = loss, accuracy, _ = evaluate(run.model, topo.loader(run.test), topo.reduce)
    compare_with_saved(ckpt, loss, accuracy, run.test_set, run.device_kind, "resume check")
    if is_master():
        continue_run_folder(args.out_dir, ckpt)
    if (kind == "spmd") != topo.spmd:  # converted: save it in this mode's format at once
        print0(f"resume | converted checkpoint saved as {run.save(position, measured)[0]}")
    if position[0] > args.epochs:
        print0(f"resume | nothing to train: the checkpoint finished epoch {position[0] - 1}, "
               f"--epochs is {args.epochs}")
    else:
        at = f" after step {position[1]}" if position[1] else ""
        print0(f"resume | continuing at epoch {position[0]} of {args.epochs}{at}")
    return position, accuracy


def compare_with_saved(ckpt, loss, accuracy, test_set, device_kind, label):
    """The proof a conversion kept the model: the test loss saved with it, reproduced on the
    same test set (`test_set`: the fingerprint of the one `loss` was measured on)."""
    if ckpt.get("test_loss") is None or ckpt.get("accuracy") is None:
        print0(f"{label} | skipped: the checkpoint carries no test loss to compare with")
        return
    if not ckpt.get("test_set"):
        print0(f"{label} | skipped: the checkpoint names no test set (an older train_tpu.py)")
        return
    if ckpt["test_set"] != test_set:
        print0(f"{label} | skipped: the checkpoint was evaluated on another test set")
        return
    # On the CPU both evaluations run in float32 and agree to rounding. TPU matmuls default
    # to bfloat16 passes, so a figure measured on a TPU can differ from a reload more than that.
    tol = 1e-5 if {device_kind, ckpt.get("measured_on", device_kind)} <= {"CPU"} else 2e-2
    diff = abs(loss - ckpt["test_loss"])
    print0(f"{label} | test loss saved {ckpt['test_loss']:.7f} vs now {loss:.7f} | "
           f"|diff| {diff:.1e} (tolerance {tol:.0e}) | accuracy saved {ckpt['accuracy']:.2f}% "
           f"vs now {accuracy:.2f}% | {'equal' if diff <= tol else 'DIFFERENT'}")
    if diff > tol:
        raise TrainingFailed(f"{label}: the loaded checkpoint gives test loss {loss:.7f}, it "
                             f"was saved at {ckpt['test_loss']:.7f}", EXIT_RESUME_MISMATCH)


def export_checkpoint(args):
    """--resume X --export FILE: one ordinary torch.save file, checked on the CPU (its test loss
    against the saved one) under a temporary name before it takes FILE's place."""
    kind, where = find_checkpoint(args.resume)
    ckpt = read_checkpoint(kind, where)
    torch.save(ckpt, args.export + ".tmp")
    try:
        model = build_model(args)
        model.load_state_dict(load_file_checkpoint(args.export + ".tmp")["model"])
        loss, accuracy, test_set = evaluate_on_cpu(model, args)
        compare_with_saved(ckpt, loss, accuracy, test_set, "CPU", "export check")
    except BaseException:
        os.remove(args.export + ".tmp")
        raise
    os.replace(args.export + ".tmp", args.export)
    print(f"export | {kind} checkpoint {where} -> {args.export} (torch.save; torch.load reads it)")


def evaluate_on_cpu(model, args):
    """The same evaluation in eager PyTorch on the host, the reference for export checks:
    (test loss, accuracy, the test set's fingerprint)."""
    images, labels = load_split(args, train=False)
    loss, accuracy, _ = evaluate(model, in_order(eval_shard(images, labels, 500, 1, 0), 500))
    return loss, accuracy, fingerprint(images, labels)


# ---- stopping early: SIGTERM, Ctrl-C, a failing replica ---------------------------------------
#
# xmp.spawn runs each replica in a thread of a child process, and Python runs signal handlers
# only in a process's main thread. So every process of the run (this one, and each replica
# process when it imports this file: see its end) takes SIGTERM and Ctrl-C in its main thread
# and creates the stop file; the replicas look for it at each boundary and agree to stop.
# A failing replica writes its exit code and line to the failure file for the parent.

FAILURE_FILE, STOP_FILE = "TRAIN_TPU_FAILURE_FILE", "TRAIN_TPU_STOP_FILE"  # environment
STOP_GRACE = 120  # seconds a process may take to save and exit after a signal
SIGNALS_TAKEN, GRACE_TIMERS = [], []  # this process's, in this run


@contextlib.contextmanager
def run_files():
    """The failure and stop files of one run, named in the environment the replicas inherit."""
    folder = tempfile.mkdtemp(prefix="train_tpu-")
    os.environ[FAILURE_FILE] = os.path.join(folder, "failure.jsonl")
    os.environ[STOP_FILE] = os.path.join(folder, "stop")
    SIGNALS_TAKEN.clear()
    GRACE_TIMERS.clear()
    saved = install_stop_handlers()
    try:
        yield
    finally:
        for timer in GRACE_TIMERS:  # the run ended in time: a notebook's kernel lives on
            timer.cancel()
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        del os.environ[FAILURE_FILE], os.environ[STOP_FILE]
        shutil.rmtree(folder, ignore_errors=True)


def install_stop_handlers():
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, on_stop_signal)
            for signum in (signal.SIGTERM, signal.SIGINT)}


def on_stop_signal(signum, frame):
    """Asks the replicas to save and stop at their next boundary (every --log-steps and
    --save-steps step). A second signal, or one while a failed run is being torn down
    (xmp.spawn's pool sends SIGTERM to the other replicas), ends this process at once."""
    failures, stop = os.environ.get(FAILURE_FILE, ""), os.environ[STOP_FILE]
    if SIGNALS_TAKEN or (os.path.exists(failures) and os.path.getsize(failures)):
        os._exit(128 + signum)
    SIGNALS_TAKEN.append(signum)
    with open(f"{stop}.{os.getpid()}", "w") as f:  # each process its own, then one rename
        f.write(str(signum))
    os.replace(f"{stop}.{os.getpid()}", stop)
    # A replica stuck in a collective never reaches a boundary: end the process after a while.
    deadline = threading.Timer(STOP_GRACE, os._exit, args=(128 + signum,))
    deadline.daemon = True
    deadline.start()
    GRACE_TIMERS.append(deadline)


def stop_requested():
    """The signal's number once a stop was asked for, else 0."""
    try:
        with open(os.environ[STOP_FILE]) as f:
            return int(f.read())
    except (KeyError, OSError, ValueError):
        return 0


def stopped(signum, position, args):
    return TrainingFailed(f"stopped by {signal.Signals(signum).name} at epoch {position[0]} "
                          f"step {position[1]}, checkpoint saved; continue with --resume "
                          f"{args.out_dir}", 128 + signum)


def end_this_replica(code, line):
    """Ends the whole run when one replica fails, instead of a hang.

    A replica that stops alone leaves the others blocked in their next all-reduce, and
    xmp.spawn would wait for ever. So it records its code and line in the failure file and ends
    its process at once; xmp.spawn's process pool then terminates the other replicas and raises
    in the parent (ProcessPoolExecutor; torch_xla/_internal/pjrt.py run_multiprocess).
    """
    if os.environ.get(FAILURE_FILE):
        with open(os.environ[FAILURE_FILE], "a") as f:
            f.write(json.dumps([code, line]) + "\n")
    if multiprocessing.parent_process() is None:  # no parent process to report it: say it here
        print(f"train_tpu.py: {line}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- the run folder: metrics.jsonl, log lines, progress bar, plot, results for the parent ---


def prepare_out_dir(args, writer=True):
    """Resolves --out-dir; a fresh run never mixes its history with an earlier run's.

    Every host checks (one failing alone would leave the others waiting for it); only host 0
    (`writer`) deletes or creates anything, as its master is the only replica writing there.
    """
    source_run = run_folder_of(*find_checkpoint(args.resume)) if args.resume else None
    if args.out_dir is None:
        args.out_dir = source_run or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise UsageError(f"--out-dir {args.out_dir}: a file is there, not a folder")
    earlier = [n for n in ("metrics.jsonl", "checkpoint.pt", "checkpoint-spmd")
               if os.path.exists(os.path.join(args.out_dir, n))]
    # A folder holding a run other than the one resumed (or any, for a fresh run) is not ours.
    foreign = earlier and (source_run is None or
                           os.path.realpath(source_run) != os.path.realpath(args.out_dir))
    if foreign and not args.overwrite:
        raise UsageError(f"--out-dir {args.out_dir} already holds a run ({', '.join(earlier)})"
                         "; continue it with --resume, pick another --out-dir, or pass "
                         "--overwrite to delete it and start clean")
    if not writer:
        return
    if foreign:
        for name in earlier + ["metrics.png", "verdict.json"] + [
                n for n in os.listdir(args.out_dir) if n.startswith("checkpoint-epoch-")]:
            target = os.path.join(args.out_dir, name)
            shutil.rmtree(target) if os.path.isdir(target) else (
                os.path.exists(target) and os.remove(target))
        print(f"out | --overwrite: deleted the earlier run in {args.out_dir}, starting clean")
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:  # a file where a parent folder should be, no permission, ...
        raise UsageError(f"--out-dir {args.out_dir}: cannot create it ({e.strerror})")


def run_folder_of(kind, where):
    """The run folder a checkpoint belongs to: OUT/checkpoint.pt, OUT/checkpoint-spmd/epoch-*."""
    folder = os.path.dirname(os.path.abspath(where))
    if kind == "spmd" and os.path.basename(folder) == "checkpoint-spmd":
        folder = os.path.dirname(folder)
    return folder


def continue_run_folder(out_dir, ckpt):
    """Once a resume has proven itself, the run folder continues from `ckpt`: checkpoints taken
    after it move to OUT/superseded/ (so --resume OUT continues this run), and metrics.jsonl
    drops the lines past it (steps about to run again)."""
    RunLog(out_dir).keep_before(ckpt["epoch"], ckpt.get("step", 0))  # in its steps
    resumed_at = ckpt["epoch"], ckpt.get("step", 0) * (ckpt.get("global_batch") or 1)
    later = [where for kind, where in checkpoints_in(out_dir)
             if saved_position(kind, where) > resumed_at]
    aside = os.path.join(out_dir, "superseded", time.strftime("%Y%m%d-%H%M%S"))
    for where in later:
        os.renames(where, os.path.join(aside, os.path.relpath(where, out_dir)))
    if later:
        print(f"resume | {len(later)} checkpoint(s) taken after this one moved to {aside}")


class RunLog:
    """OUT/metrics.jsonl: one line per logged step and one per epoch, written by the master."""

    def __init__(self, out_dir):
        self.path = os.path.join(out_dir, "metrics.jsonl")

    def keep_before(self, epoch, step=0):
        """Drops the lines past (epoch, step), and a line torn by a kill."""
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            kept = [line for line in f if (r := _parse(line)) and (
                (r["epoch"], r["step"]) <= (epoch, step) if r["kind"] == "log"
                else r["epoch"] < epoch)]
        with open(self.path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(self.path + ".tmp", self.path)

    def write(self, **record):
        if is_master():
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _parse(line):
    try:
        return json.loads(line)
    except ValueError:
        return None


def read_history(out_dir):
    """(per-step records, per-epoch records) from OUT/metrics.jsonl."""
    steps, epochs = [], []
    if not os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        return steps, epochs
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for r in filter(None, map(_parse, f)):
            if r["kind"] == "log":
                first = r["step"] - len(r["losses"]) + 1
                steps += [dict(epoch=r["epoch"], step=first + i, loss=v)
                          for i, v in enumerate(r["losses"])]
            else:
                epochs.append(r)
    return steps, epochs


class EpochMeter:
    """One epoch's losses, timing and log lines, without making the training loop wait.

    At each boundary a step closure, run once that step's graph is launched, notes the time and
    reads the previous window's losses: the device finished those long ago, so the read does not
    wait (a closure that read the new loss would stall the loop until the device caught up). Each
    log line thus appears one window late; the epoch's end reads the rest (log_the_rest).
    """

    def __init__(self, epoch, steps, global_batch, topo, log, progress, quiet=False, start=0):
        self.epoch, self.steps, self.global_batch = epoch, steps, global_batch
        self.start = start  # steps of this epoch done before (a run resumed mid-epoch)
        self.warm = start + WARMUP_STEPS  # the steps up to here compile: not timed
        self.devices, self.unit = topo.devices, "device" if topo.spmd else "replica"
        self.log, self.progress, self.quiet = log, progress, quiet
        self.pending, self.unread = [], []  # losses on the device: this window, earlier ones
        self.times = {}  # boundary step -> when its graph was launched
        self.losses = []  # this replica's loss at every step, in order

    def log_previous_window(self, step):
        self.times[step] = time.perf_counter()
        ready, self.unread = self.unread, [(step, self.pending)]
        self.pending = []
        for done, losses in ready:
            self.show(done, to_host(*losses, wait=False))

    def log_the_rest(self):
        """Reads every loss not read yet: a deliberate wait, at the epoch's end or a save."""
        windows, self.unread = self.unread, []
        if not windows:
            return
        values = to_host(*[t for _, losses in windows for t in losses])
        self.times[windows[-1][0]] = time.perf_counter()  # when the device was done
        for done, losses in windows:
            self.show(done, values[:len(losses)])
            values = values[len(losses):]

    def show(self, step, values):
        self.losses += [float(v) for v in values]
        rate = None
        if step > self.warm:
            since = max(s for s in self.times if s < step)
            rate = (step - since) * self.global_batch / (self.times[step] - self.times[since])
        if self.quiet:
            return
        self.log.write(kind="log", epoch=self.epoch, step=step, loss=self.losses[-1],
                       losses=self.losses[-len(values):], samples_per_s=rate)
        speed = "warm-up" if rate is None else (
            f"{rate:,.0f} samples/s ({rate / self.devices:,.0f} per {self.unit})")
        line = f"epoch {self.epoch} step {step}/{self.steps} | loss {values[-1]:.4f} | {speed}"
        if self.progress:
            self.progress.show(step, self.steps, line)
        else:
            print0(line)

    def samples_per_s(self):
        """Throughput of the epoch, its first WARMUP_STEPS steps (and their compiles) left out."""
        if self.steps <= self.warm:
            return None
        return ((self.steps - self.warm) * self.global_batch
                / (self.times[self.steps] - self.times[self.warm]))


class ProgressBar:
    """One redrawn line on the master, only when stdout is a terminal; plain lines otherwise."""

    @staticmethod
    def create():
        return ProgressBar() if is_master() and sys.stdout.isatty() else None

    def show(self, step, steps, text):
        filled = int(20 * step / steps)
        sys.stdout.write(f"\r[{'#' * filled}{'.' * (20 - filled)}] {text}\033[K")
        sys.stdout.write("\n" if step == steps else "")
        sys.stdout.flush()


def write_plot(out_dir):
    """Training loss per step and test accuracy per epoch, as OUT/metrics.png (master only).

    Figures drawn in spawned replicas never reach a screen, so the master writes a file. A plot
    that fails is reported, not raised: the other replicas would wait for the master.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a TPU VM
        import matplotlib.pyplot as plt

        history, epochs = read_history(out_dir)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ax1.plot(range(1, len(history) + 1), [h["loss"] for h in history])
        ax1.set(title="training loss (master replica)", xlabel="step", ylabel="loss")
        ax2.plot([e["epoch"] for e in epochs], [e["accuracy"] for e in epochs], marker="o")
        ax2.set(title="test accuracy", xlabel="epoch", ylabel="%")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "metrics.tmp.png"))
        plt.close(fig)
        os.replace(os.path.join(out_dir, "metrics.tmp.png"), os.path.join(out_dir, "metrics.png"))
    except Exception as e:
        print(f"plot | not written: {type(e).__name__}: {e}")


@dataclasses.dataclass
class Result:
    """What fit() gives the parent: the trained model and what the master recorded."""
    model: nn.Module  # on the host, with the final checkpoint's weights
    history: list  # one dict per training step: epoch, step, loss (master replica)
    epochs: list  # one dict per epoch: test loss, accuracy, samples/s, compile figures
    out_dir: str
    verdict: dict = None  # with --smoke: the same verdict as the printed table


def collect_result(args):
    """Reads back what the master wrote: the replicas' own objects ended with them."""
    ckpt = read_checkpoint(*find_checkpoint(args.out_dir))
    model = build_model(args)
    model.load_state_dict(ckpt["model"])
    verdict = None
    if args.smoke:
        with open(os.path.join(args.out_dir, "verdict.json")) as f:
            verdict = json.load(f)
    return Result(model, *read_history(args.out_dir), args.out_dir, verdict)


# ---- smoke verdict: is this machine fit to train on? -----------------------------------------


class Verdict:
    """PASS/FAIL checks with their figures; printed as a table and written as JSON.

    A check that cannot be true in the test suite's emulated world (README: "what runs where")
    is added with passed=None: shown as EMUL, counted neither as passed nor as failed.
    """

    def __init__(self):
        self.checks = []

    def add(self, name, passed, figure):
        self.checks.append({"name": name, "passed": None if passed is None else bool(passed),
                            "figure": figure})

    @property
    def passed(self):
        return all(c["passed"] is not False for c in self.checks)

    def table(self):
        mark = {True: "PASS", False: "FAIL", None: "EMUL"}
        failed = [c["name"] for c in self.checks if c["passed"] is False]
        checked = sum(c["passed"] is not None for c in self.checks)
        emulated = len(self.checks) - checked
        return "\n".join(["smoke verdict"] + [
            f"  {mark[c['passed']]}  {c['name']:<12} {c['figure']}" for c in self.checks] + [
            f"smoke verdict: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}, "
            f"{checked - len(failed)}/{checked} checks passed"
            + (f", {emulated} emulated (not checked)" if emulated else "")])

    def publish(self, args):
        """The master prints the table and writes OUT/verdict.json (and --report)."""
        if not is_master():
            return
        print(self.table(), flush=True)
        config = {k: v for k, v in vars(args).items() if k != "explicit"}
        write_json({"passed": self.passed, "checks": self.checks, "config": config,
                    "versions": versions()}, os.path.join(args.out_dir, "verdict.json"),
                   args.report)


def versions():
    import torchvision

    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "torch_xla": torch_xla.__version__, "torchvision": torchvision.__version__}


def write_json(data, *paths):
    for path in filter(None, paths):
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, indent=1)
        os.replace(path + ".tmp", path)


class Watchdog:
    """--smoke never hangs: each check, and the training it runs, has a deadline.

    A hung collective or compile cannot be interrupted from Python. When a deadline passes,
    this thread marks that check FAIL, prints the verdict with what did finish, and ends the
    process with exit 5 (xmp.spawn's pool then ends the other replicas: end_this_replica).
    The deadlines are generous for a TPU's first compiles; --deadline-scale multiplies them.
    """

    def __init__(self, verdict, args):
        self.verdict, self.args, self.current = verdict, args, None
        if verdict is not None:
            threading.Thread(target=self._watch, daemon=True).start()

    @contextlib.contextmanager
    def deadline(self, name, seconds):
        seconds *= self.args.deadline_scale
        self.current = (name, seconds, time.monotonic() + seconds)
        try:
            yield
        finally:
            self.current = None

    def _watch(self):
        while True:
            time.sleep(0.2)
            current = self.current
            if current and time.monotonic() > current[2]:
                name, seconds, _ = current
                self.verdict.add(name, False, f"did not finish within {seconds:.0f} s (a hang? "
                                 "more time: --deadline-scale)")
                try:
                    self.verdict.publish(self.args)
                finally:  # whatever publishing does, the process must not go on hanging
                    end_this_replica(EXIT_SMOKE_FAILED,
                                     f"failed: smoke verdict FAIL: {name} did not finish")


def smoke_checks_before_training(verdict, watch, run, images, labels):
    with watch.deadline("devices", 120):
        check_devices(verdict, run.topo, run.args, run.device_kind)
    with watch.deadline("collectives", 300):  # compiles, then meets every replica
        check_collectives(verdict, run.topo)
    with watch.deadline("numerics", 300):
        check_numerics(verdict, run.model, images, labels, run.topo, run.device_kind, run.args)


def check_devices(verdict, topo, args, device_kind):
    found = xr.global_runtime_device_count()  # in the whole slice, every host's devices
    # --cores counts this host's devices: 1, or all of them (then the run uses the slice).
    wanted = 1 if args.cores == 1 else found
    figure = (f"runtime {device_kind}, device kind {xm.xla_device_hw(topo.device)}, {found} "
              f"found, {wanted} wanted (--cores {args.cores or 'all'}), {topo.devices} in use")
    if topo.emulated:
        verdict.add("devices", None, figure + "; a world of more replicas than devices is the "
                    "emulation, not a machine")
    else:
        verdict.add("devices", topo.devices == wanted, figure)


def check_collectives(verdict, topo):
    """Multi-core: all-reduce each replica's ordinal. SPMD: a reduction over a sharded tensor."""
    n = topo.devices
    expected = n * (n - 1) / 2
    if topo.spmd:
        import torch_xla.distributed.spmd as xs

        values = torch.arange(n, dtype=torch.float32).to(topo.device)
        xs.mark_sharding(values, topo.mesh, ("data",))  # one value on each device
        got = float(values.sum().cpu())  # XLA sums each shard, then all-reduces the partials
        verdict.add("collectives", got == expected,
                    f"sharded sum over {n} devices = {got:g} (expected {expected:g})")
        return
    ordinal = torch.tensor([float(xr.global_ordinal())], device=topo.device)
    total = xm.all_reduce(xm.REDUCE_SUM, ordinal)
    agree = xm.all_reduce(xm.REDUCE_SUM, (total == expected).float())  # replicas that saw it
    got, agreeing = float(total.cpu()), int(agree.cpu())
    figure = (f"all-reduce of ordinals = {got:g} on {agreeing}/{n} replicas "
              f"(expected n(n-1)/2 = {expected:g})")
    if topo.emulated:  # one device plays every replica: its ordinal is 0 in each of them
        verdict.add("collectives", None, figure + "; the all-reduce ran, on 1 emulated device")
    else:
        verdict.add("collectives", got == expected and agreeing == n, figure)


def numerics_tolerance(device_kind, precision, bf16=False):
    # float32 on the CPU agrees with eager PyTorch to rounding. A TPU's "default" precision
    # multiplies in one bfloat16 pass (8-bit mantissa, relative error ~4e-3 per product, more
    # after summing 1,440 of them); "high" is 3 passes (~14 bits), "highest" 6 (~22 bits).
    # A wrong weight or layout (the third seed's symptom) moves logits by O(1), far above these.
    # --bf16 on both sides: each result is rounded to 8 mantissa bits (relative 3.9e-3), and the
    # two sides round in different places (seen here: 3.6e-3 in the logits), so a few of those.
    if bf16:
        return 5e-2
    if device_kind == "CPU":
        return 1e-5
    return {"default": 5e-2, "high": 1e-3, "highest": 1e-5}[precision]


def check_numerics(verdict, model, images, labels, topo, device_kind, args):
    """The same first step on the device and in eager PyTorch on the host CPU, from the same
    weights and batch, each a plain SGD step (on a copy: training itself is untouched).
    Compared: logits, loss, and the weight update (not the weights, whose size would hide it)."""
    def one_step(net, x, y):
        before = [p.detach().clone() for p in net.parameters()]
        x = model_input(x)  # as train_step does
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = net(x)
            loss = F.cross_entropy(logits, y)
        loss.backward()
        torch.optim.SGD(net.parameters(), lr=args.lr).step()
        update = torch.cat([(p.detach() - b).flatten() for p, b in zip(net.parameters(), before)])
        return logits.detach(), loss.detach(), update

    state = {k: v.cpu() for k, v in model.state_dict().items()}
    probe, reference = build_model(args).to(topo.device), build_model(args)
    probe.load_state_dict(state)
    reference.load_state_dict(state)
    on_device = one_step(probe, images.to(topo.device), labels.to(topo.device))
    on_device = [t.cpu() for t in on_device]  # deliberate sync: a one-off check before training
    on_host = one_step(reference, images, labels)
    diffs = [float((a.float() - b.float()).abs().max() / b.float().abs().max())
             for a, b in zip(on_device, on_host)]
    tol = numerics_tolerance(device_kind, args.matmul_precision, args.bf16)
    verdict.add("numerics", max(diffs) <= tol,
                f"first step, device vs eager CPU: rel diff logits {diffs[0]:.1e}, loss "
                f"{diffs[1]:.1e}, weight update {diffs[2]:.1e} (tolerance {tol:.0e}, " + (
                    "bfloat16 autocast on both sides)" if args.bf16 else
                    f"matmul precision {args.matmul_precision}; raise it with "
                    "--matmul-precision highest)"))


def check_checkpoint(verdict, model, optimizer, path):
    """What was saved, read back from disk, equals what is in memory, tensor for tensor."""
    ckpt = read_checkpoint(*find_checkpoint(path))
    live = {f"model.{k}": v.cpu() for k, v in model.state_dict().items()}
    saved = {f"model.{k}": v for k, v in ckpt["model"].items()}
    for i, state in optimizer.state_dict()["state"].items():
        live[f"momentum.{i}"] = state["momentum_buffer"].cpu()
    for i, state in ckpt["optimizer"]["state"].items():
        saved[f"momentum.{i}"] = state["momentum_buffer"]
    same = [k for k in live if k in saved and torch.equal(live[k], saved[k])]
    verdict.add("checkpoint", len(same) == len(live) == len(saved),
                f"saved, reloaded from {path}: {len(same)}/{len(live)} tensors identical")


def finish_verdict(verdict, watch, run, losses, rate, accuracy, path, compiles):
    """The checks that need the finished run; then the table, the JSON, and the exit code."""
    args, recompiles = run.args, compiles["recompiles_after_warmup"]
    allowed, fallbacks = args.max_recompiles or 0, cpu_fallback_ops()
    verdict.add("compilation", recompiles <= allowed and not fallbacks,
                f"{compiles['compiles_total']} compilations ({compiles['compile_seconds']:.1f} "
                f"s), {recompiles} after warm-up "
                f"(allowed {allowed}), CPU fallback ops: {format_fallbacks(fallbacks)}")
    verdict.add("throughput", bool(rate),
                f"{rate or 0:,.0f} samples/s global, {(rate or 0) / run.topo.devices:,.0f} per "
                f"device (last epoch, its first {WARMUP_STEPS} steps left out)")
    k = max(1, len(losses) // 4)
    before, after = (sum(losses[:k]) / k, sum(losses[-k:]) / k) if losses else (0.0, 0.0)
    verdict.add("learning", after < before and (accuracy or 0.0) >= args.target_accuracy,
                f"loss {before:.3f} -> {after:.3f} (mean of first and last {k} steps), "
                f"test accuracy {accuracy or 0.0:.2f}% (target {args.target_accuracy:g}%)")
    if not is_master():
        return  # the master's verdict is the one printed, written and acted on
    with watch.deadline("checkpoint", 120):  # reads what the master wrote; no collectives
        check_checkpoint(verdict, run.model, run.optimizer, path)
    verdict.publish(args)
    if not verdict.passed:
        failed = ", ".join(c["name"] for c in verdict.checks if c["passed"] is False)
        raise TrainingFailed(f"smoke verdict FAIL: {failed}", EXIT_SMOKE_FAILED)


# ---- the host side of a step: a profile trace, and the benchmarks ----------------------------


class Profile:
    """--profile DIR: an XLA profiler trace of PROFILE_STEPS steps after the warm-up, taken by
    the master (torch_xla.debug.profiler; TensorBoard's profile plugin or Perfetto opens it)."""

    def __init__(self, directory, first_step):
        self.directory, self.first, self.last = directory, first_step, first_step + PROFILE_STEPS
        self.started = False

    def at(self, step):
        import torch_xla.debug.profiler as xp

        if step == self.first and is_master():
            xp.start_trace(self.directory)
            self.started = True
        elif step == self.last:
            self.close()

    def close(self):
        """Stops the trace: after its last step, or when the epoch ends (or fails) before."""
        import torch_xla.debug.profiler as xp

        if not self.started:
            return
        self.started = False
        xm.wait_device_ops()  # the traced steps' device work belongs in the trace
        xp.stop_trace()
        print0(f"profile | steps {self.first}-{self.last - 1} traced into {self.directory}: "
               f"tensorboard --logdir {self.directory} (profile tab), or open the "
               "*.trace.json.gz in https://ui.perfetto.dev")


def one_timed_epoch(args, device_kind, images, labels, batch_size, steps, evaluation=False):
    """`steps` training steps on one device in this process (then, with `evaluation`, one
    evaluation, as at an epoch's end). Returns (meter, compilations, seconds compiling,
    host-device waits)."""
    topo, args = Topology(torch_xla.device(), 1, 0, 1), argparse.Namespace(**vars(args))
    args.save_steps, args.batch_size = None, batch_size  # it times steps: it saves nothing
    torch.manual_seed(args.seed)
    model = build_model(args).to(topo.device)
    optimizer = build_optimizer(model, args)
    loader, sampler = train_loader(images, labels, batch_size, 1, 0, args.seed,
                                   args.num_workers, steps)
    sampler.set_epoch(1)
    shard = eval_shard(images[:1000], labels[:1000], batch_size, 1, 0)
    run = Run(args, device_kind, topo, model, optimizer,
              in_order(shard, batch_size))
    meter = EpochMeter(1, len(loader), batch_size, topo, None, None, quiet=True)
    (compiles, seconds), waits = CompileCounter.read(), host_waits()
    train_epoch(run, loader, 1, meter)
    after, after_seconds = CompileCounter.read()
    if evaluation:  # as at an epoch's end: its wait counts too
        evaluate(model, topo.loader(run.test))
    return meter, after - compiles, after_seconds - seconds, host_waits() - waits


def benchmark_layerdrop(args, device_kind):
    """--benchmark layerdrop: the same steps, seeds and data with dynamic, then static drops.
    samples/s over steps 3..N: the first two compile in both modes; dynamic keeps compiling."""
    steps = args.steps_per_epoch or 40
    args.log_steps = steps  # read the loss only at the warm-up boundary and at the end
    images, labels = load_split(args, train=True)
    print(f"benchmark layerdrop | {device_kind} | {steps} steps x batch {args.batch_size} | "
          f"P {args.layerdrop_prob} | seed {args.seed}")
    rows = {}
    for mode in ("dynamic", "static"):
        args.layerdrop = mode
        meter, compiles, seconds, _ = one_timed_epoch(args, device_kind, images, labels,
                                                      args.batch_size, steps)
        rows[mode] = (compiles, seconds, meter.samples_per_s())
        print(f"{mode:8} | {compiles:3d} compilations | {seconds:6.1f} s compiling | "
              f"{rows[mode][2]:8,.0f} samples/s (steps 3-{steps}) | loss {meter.losses[-1]:.4f}")
    (dyn_compiles, dyn_seconds, dyn_rate), (static_compiles, static_seconds, static_rate) = \
        rows["dynamic"], rows["static"]
    print(f"ratio    | static runs {static_rate / dyn_rate:.1f}x the samples/s of dynamic, with "
          f"{dyn_compiles} vs {static_compiles} compilations ({dyn_seconds:.1f} s vs "
          f"{static_seconds:.1f} s compiling)")
    return rows


def benchmark_host(args, device_kind):
    """--benchmark host: what bounds a small model's step on a TPU is the host. Input samples/s
    (the DataLoader alone, no device), steps/s of the training loop (one device, --log-steps as
    given) and the host-device waits of one epoch's steps and evaluation."""
    images, labels = load_split(args, train=True)
    figures = {"input_samples_per_s": {}, "steps_per_s": {}, "host_waits_per_epoch": None,
               "device": device_kind, "versions": versions()}
    for batch in (128, 1024, 8192):
        loader, sampler = train_loader(images, labels, batch, 1, 0, args.seed, args.num_workers)

        def one_pass(epoch):
            sampler.set_epoch(epoch)
            return sum(len(b["label"]) for b in loader)

        one_pass(0)  # the first pass warms up the memory allocator: not timed
        began = time.perf_counter()
        samples = sum(one_pass(epoch) for epoch in range(1, 6))
        figures["input_samples_per_s"][batch] = rate = samples / (time.perf_counter() - began)
        print(f"host input | batch {batch:5,} | {rate:12,.0f} samples/s ({samples:,} samples, "
              "5 epochs after an untimed one)")
    steps = args.steps_per_epoch or 300
    for batch in (8, 128):
        meter, _, _, waits = one_timed_epoch(args, device_kind, images, labels, batch, steps,
                                             evaluation=True)
        figures["steps_per_s"][batch] = rate = meter.samples_per_s() / batch
        figures["host_waits_per_epoch"] = waits
        print(f"host steps | batch {batch:5,} | {rate:12,.1f} steps/s ({rate * batch:,.0f} "
              f"samples/s, steps 3-{meter.steps}, logged every {args.log_steps}) | "
              f"host-device waits {waits}")
    write_json(figures, args.report)
    return figures


BENCHMARKS = {"layerdrop": benchmark_layerdrop, "host": benchmark_host}

if os.environ.get(STOP_FILE):
    # Imported while a run is on: a replica process of xmp.spawn, importing this file in its
    # main thread, the one place where it can take SIGTERM and Ctrl-C (see on_stop_signal).
    install_stop_handlers()

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # After an error mid-epoch MpDeviceLoader's feeder thread may still be running, and the
    # interpreter's shutdown then aborts ("terminate called without an active exception",
    # exit 134) instead of exiting with our code. Nothing is left to flush or close here.
    os._exit(code)
