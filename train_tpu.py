"""train_tpu.py: the reference PyTorch/XLA trainer. It trains the article's ToyModel CNN on MNIST on every TPU core
(xmp.spawn; each replica's DistributedSampler shard through MpDeviceLoader; xm.optimizer_step; xm.save), or with --spmd
from one process. The training path comes first, in the order a run executes; the instruments it calls follow. Your
own model takes two edits, to the sections marked "your own". README.md has the rest.

  python train_tpu.py                              # a TPU VM: train on every core
  python train_tpu.py --smoke                      # is this TPU VM fit to train on? exit 0 or 5
  python train_tpu.py --spmd --resume runs/<run>   # continue a run, converting its checkpoint
  PJRT_DEVICE=CPU python train_tpu.py --cores 1 --data synthetic --epochs 1   # no TPU: the CPU"""
import argparse, contextlib, itertools, json, math, multiprocessing, os, shutil, signal, socket, sys, tempfile
import threading, time, traceback, types, warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, StackDataset

XLA_IMPORT_ERROR = None
try:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs
    import torch_xla.distributed.xla_multiprocessing as xmp
    import torch_xla.runtime as xr
except ImportError as e:  # a torch_xla built for another torch: check_environment says so, in one line
    XLA_IMPORT_ERROR = e

SMOKE = dict(data="synthetic", epochs=2, steps_per_epoch=40, log_steps=10, target_accuracy=90.0)  # --smoke's presets
WARMUP_STEPS = 2  # each epoch's first steps compile, or fill the pipeline: left out of samples/s
KEEP_CHECKPOINTS = 2  # the newest stay in the run folder
STOP_GRACE = 25  # seconds from a stop signal to a forced exit: a preempted TPU VM has about 30

# ---- flags --------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    p = Parser(allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add, count, whole = p.add_argument, checked(int, lambda v: v >= 1, ">= 1"), checked(int, lambda v: v >= 0, ">= 0")
    # devices and data
    add("--cores", type=count, help="devices to train on: 1, or every one (default)")
    add("--spmd", action="store_true", help="one process shards each batch over every device")
    add("--data", choices=("mnist", "synthetic"), default="mnist", help="synthetic: generated, offline")
    add("--data-dir", default="data", help="MNIST's folder (DIR/MNIST/raw), or where to download it")
    # training
    add("--epochs", type=count, default=3)
    add("--batch-size", type=count, default=128, help="samples per device per step")
    add("--lr", type=checked(float, lambda v: v > 0, "> 0"), default=0.05, help="as given: not scaled by the devices")
    add("--momentum", type=checked(float, lambda v: 0 <= v < 1, "in [0, 1)"), default=0.9)
    add("--steps-per-epoch", type=count, help="cut every epoch after N steps")
    add("--seed", type=whole, default=0, help="seeds the weights, the shuffles and layerdrop's coin flips")
    add("--bf16", action="store_true", help="autocast the training forward pass to bfloat16")
    add("--target-accuracy", type=checked(float, lambda v: v >= 0, ">= 0"), default=0.0, help="exit 21 below it (%%)")
    # the article's lesson: a graph that changes recompiles
    add("--layerdrop", choices=("off", "dynamic", "static"), default="off",
        help="dynamic: host coin flips, a graph per count kept; static: the same drops in one graph")
    add("--layerdrop-prob", type=checked(float, lambda v: 0 <= v <= 1, "in [0, 1]"), default=0.5)
    add("--max-recompiles", type=whole, help="exit 3 if more graphs compile after the first epoch")
    # the smoke test
    add("--smoke", action="store_true", help="a short run ending in a PASS/FAIL verdict, exit 0 or 5; presets: "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMOKE.items()))
    add("--smoke-timeout", type=checked(float, lambda v: v > 0, "> 0"), default=900.0,
        help="seconds from before any device starts; then the smoke stage running FAILs")
    # logging, checkpoints, preemption
    add("--log-steps", type=count, default=20, help="log every N steps")
    add("--out-dir", help="the run folder (default: runs/<time>, or the resumed run's)")
    add("--save-steps", type=count, help="also checkpoint every N steps")
    add("--resume", metavar="PATH", help="a checkpoint in either format, or a run folder (its newest)")
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    args.given = {a.split("=")[0][2:].replace("-", "_") for a in argv if a.startswith("--")}
    if args.smoke and args.resume:
        raise UsageError("--smoke checks a fresh run: leave out --resume")
    return args

# ---- data: your own goes here (edit 1 of 2) -----------------------------------------------------------------------
def load_split(args, train):
    """One split as in-memory tensors: uint8 images (N, 1, 28, 28) and labels (N,)."""
    if args.data == "synthetic":
        return synthetic_digits(30_000 if train else 5_000, seed=1234 + train)
    import torchvision
    mnist = torchvision.datasets.MNIST(args.data_dir, train=train, download=False)
    return mnist.data.unsqueeze(1), mnist.targets  # read once: no PIL image, no transform per sample

def model_input(images):
    """In the step, on the device: uint8 pixels (a quarter of float32's bytes through the host) scaled as
    ToTensor() and Normalize() would."""
    if images.dtype != torch.uint8:  # load_split replaced and this not: never rescale floats silently
        raise TypeError(f"model_input expects uint8 pixels, got {images.dtype}: replace it too")
    return (images.float() / 255 - 0.1307) / 0.3081

def prepare_data(args):  # once, before any replica starts: replicas never race to download
    if args.data == "mnist":
        import torchvision
        try:
            with quietly():  # torchvision prints every attempt
                for train in (True, False):
                    torchvision.datasets.MNIST(args.data_dir, train=train, download=True)
        except Exception as e:
            raise UsageError(f"MNIST is not in --data-dir {args.data_dir}, and its download failed "
                             f"({type(e).__name__}): copy it there, or use --data synthetic")

# ---- model: your own goes here (edit 2 of 2) ----------------------------------------------------------------------
class ToyModel(nn.Module):
    """The article's ToyModel (with layerdrop, its second one: a shared fc2 applied up to 50 times). It returns
    logits, as F.cross_entropy applies the softmax that the article ends with."""

    def __init__(self, layerdrop="off"):
        super().__init__()
        self.layerdrop, self.conv1, self.mp1 = layerdrop, nn.Conv2d(1, 10, 5), nn.MaxPool2d(2)
        self.fc1 = nn.Linear(1440, 10 if layerdrop == "off" else 20)
        if layerdrop != "off":
            self.fc2, self.fc3 = nn.Linear(20, 20), nn.Linear(20, 10)

    def forward(self, x, keep=None):
        # keep[i]: does fc2's i-th application run (None: all do)? dynamic: Python bools, so the traced graph differs
        # with the count kept, and XLA compiles one per count; static: torch.where chooses inside one graph.
        x = self.fc1(torch.flatten(self.mp1(F.relu(self.conv1(x))), 1))
        if self.layerdrop == "off":
            return x
        for i in range(50):
            if keep is None or (self.layerdrop == "dynamic" and keep[i]):
                x = self.fc2(x)
            elif self.layerdrop == "static":
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
    spec = None if run.mesh is None else {name: xs.ShardingSpec(run.mesh, ("data",) + (None,) * (t.dim() - 1))
                                          for name, t in loader.dataset.datasets.items()}
    return pl.MpDeviceLoader(itertools.islice(loader, skip, stop), run.device, input_sharding=spec)

# ---- the step and evaluation --------------------------------------------------------------------------------------
def train_step(run, batch, keep):
    """One step, traced lazily: it runs on the device when MpDeviceLoader cuts the graph."""
    run.optimizer.zero_grad()
    with torch.autocast("xla", dtype=torch.bfloat16, enabled=run.args.bf16):  # --bf16 (docs: perf/amp)
        x = model_input(batch["image"])
        loss = F.cross_entropy(run.model(x) if keep is None else run.model(x, keep), batch["label"])
    loss.backward()
    if run.mesh is None:
        xm.optimizer_step(run.optimizer)  # all-reduce (average) the gradients over the replicas, then step
    else:
        run.optimizer.step()  # one program over every device: GSPMD inserts the all-reduce itself
    return loss.detach()

def evaluate(run):
    """(test loss, accuracy %, samples counted), each test sample counted once, summed on the device."""
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
    return loss / count, 100 * hits / count, int(count)

# ---- the epochs: steps with logging, then evaluation and the save -------------------------------------------------
def train_epoch(run, loader, epoch, skip, last):
    """The epoch's steps after the first `skip` (those a resumed run did), to `last`. The loop never waits for the
    device."""
    args = run.args
    run.log.start(epoch, skip, last)
    step = skip
    for step, batch in enumerate(on_device(run, loader, skip, last), skip + 1):
        run.log.pending.append(train_step(run, batch, layerdrop_keep(args, epoch, step, run.device)))
        saving = args.save_steps and step % args.save_steps == 0
        if step % args.log_steps == 0 or step in (run.log.warm, last) or saving:
            xm.add_step_closure(run.log.boundary, args=(step,))  # runs once this step's graph launches
            signum = agree_to_stop(run) if step < last else 0
            if signum or saving:  # (the epoch's end saves anyway)
                save(run, (epoch, step), None if signum else evaluate(run))  # a stop saves without evaluating
            if signum:
                raise stopped(signum, epoch, step, args)
    if step != last:  # MpDeviceLoader ends the epoch quietly when the DataLoader fails
        raise TrainingFailed(f"failed: epoch {epoch}'s input stopped at step {step} of {last}", 1)
    run.log.flush(end=True)  # a deliberate wait: the epoch's last losses

def train(args, spmd=False):
    """One replica's run (under SPMD, the one process's): devices, model, data, then the epochs."""
    run = start_replica(args, spmd)  # the runtime starts here
    torch.manual_seed(args.seed)
    run.model = build_model(args).to(run.device)
    if run.world > 1:  # TPU v2/v3 run two replicas per process, sharing one RNG: all take the master's weights
        xm.broadcast_master_param(run.model)
    # foreach: one traced op updates every parameter (an op per parameter took a third of the host's step time)
    run.optimizer = torch.optim.SGD(run.model.parameters(), lr=args.lr, momentum=args.momentum, foreach=True)
    loader = train_loader(run, *load_split(args, train=True))
    run.test = test_loader(run, *load_split(args, train=False))
    if not (steps := min(len(loader), args.steps_per_epoch or len(loader))):
        raise UsageError(f"--batch-size {args.batch_size}: more than a replica's share of the training set")
    run.log = Log(run, steps)
    print0(f"{args.kind} | {run.devices} devices, {'SPMD' if spmd else 'a replica each'} | global batch "
           f"{run.global_batch} | lr {args.lr} | {steps} steps per epoch | out {args.out_dir}, written by ordinal 0 "
           f"on {socket.gethostname()}")
    first, skip = resume(run, steps) if args.resume else (1, 0)
    for epoch in range(first, args.epochs + 1):
        loader.sampler.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every replica
        train_epoch(run, loader, epoch, skip, steps)
        measured, skip = evaluate(run), 0
        run.log.end_epoch(epoch, measured, save(run, (epoch + 1, 0), measured))  # exits 3 past --max-recompiles
        if (signum := agree_to_stop(run)) and epoch < args.epochs:
            raise stopped(signum, epoch + 1, 0, args)
    finish(run)

# ---- launch: xmp.spawn, one replica per device, or SPMD in this process -------------------------------------------
def main(argv=None):
    try:
        launch(parse_args(argv))
    except (Exception, KeyboardInterrupt) as e:
        code, line = describe(e)
        print(f"train_tpu.py: {line}", file=sys.stderr)
        return code
    return 0

def launch(args):  # refuses what it can before any device starts, then runs the replicas
    cores = check_environment(args)  # versions, the device, hosts, --cores
    prepare_out_dir(args)  # --resume's settings, --out-dir
    prepare_data(args)
    with run_files(args):  # the stop and failure files, the signal handlers, the smoke deadline
        try:  # nprocs=1: one device, in this process; None: a process per TPU chip (docs: learn/pjrt)
            train(args, spmd=True) if args.spmd else xmp.spawn(_mp_fn, args=(args,), nprocs=1 if cores == 1 else None)
        except Exception as e:
            raise replica_failure() or runtime_failure(args, e) or e

def _mp_fn(index, args):  # xmp.spawn's entry, once per replica
    try:
        train(args)
    except BaseException as e:
        if PROCESS["world"] == 1 and multiprocessing.parent_process() is None:
            raise  # the only replica, in this process: main() or fit() says what happened
        code, line = describe(e)
        end_this_replica(code, f"replica {PROCESS['rank']}: {line}")

# ==== the instruments, each called by name from the training path above ============================================

# ---- errors, flag types, the master -------------------------------------------------------------------------------
class UsageError(Exception):
    code = 2  # bad input: one line, exit 2
class TrainingFailed(Exception):  # args: the run's last line, and its exit code (both in args, so it pickles)
    code = property(lambda self: self.args[1])
def describe(e):  # (exit code, one line) for whatever ended a run
    if isinstance(e, (UsageError, TrainingFailed)):
        return e.code, f"error: {e}" if isinstance(e, UsageError) else e.args[0]
    if isinstance(e, KeyboardInterrupt):
        return 130, "interrupted"
    traceback.print_exc()  # a bug, in your model say: the traceback is what you need
    return 1, f"failed: {type(e).__name__}: {e} (traceback above)"
class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise UsageError(f"{message} (see --help)")
def checked(kind, ok, rule):  # an argparse type that refuses values outside `rule`, and NaN
    def parse(text):
        if not ok(value := kind(text)) or value != value:
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse's own words: "invalid int value: 'x'"
    return parse
def is_master():  # the one test of who prints and writes; before the runtime starts, only the launcher runs
    return not torch_xla._XLAC._xla_runtime_is_initialized() or xr.global_ordinal() == 0
def print0(*args):
    if is_master():
        print(*args, flush=True)

# ---- before any device starts: versions, the device, hosts, --cores, --resume, --out-dir --------------------------
def check_environment(args):  # the cores to train on; nothing here starts the runtime (xmp.spawn would then refuse)
    from importlib.metadata import version
    xla = version("torch_xla") if XLA_IMPORT_ERROR is None else XLA_IMPORT_ERROR
    if str(xla).split(".")[:2] != torch.__version__.split(".")[:2]:
        raise UsageError(f"torch {torch.__version__} with torch_xla {xla}: install the pair that requirements.txt "
                         "pins (torch_xla's C++ is built for one torch release)")
    from torch_xla._internal import tpu  # reads the PCI bus and the TPU VM's metadata, without the runtime
    chips = tpu.num_available_chips()
    args.kind = os.environ.setdefault("PJRT_DEVICE", "TPU" if chips else "CPU")
    if args.kind not in ("TPU", "CPU") or (args.kind == "TPU" and not chips):
        raise UsageError(f"PJRT_DEVICE={args.kind}, and this machine has no such device: unset it to use the CPU")
    try:  # the TPU VM's metadata server
        args.hosts = tpu.num_tpu_workers() if args.kind == "TPU" else 1
    except Exception as e:
        raise UsageError(f"cannot read this TPU VM's slice from its metadata: {str(e).strip().splitlines()[0]}")
    have = tpu.num_available_devices() if chips else int(os.environ.get("CPU_NUM_DEVICES", 1))
    cores = args.cores or have
    if args.hosts > 1 and (args.spmd or cores == 1):
        raise UsageError(f"--spmd and --cores 1 train on one host, and this slice has {args.hosts}: leave them out")
    if args.spmd and args.kind == "CPU":
        os.environ["CPU_NUM_DEVICES"] = str(cores)  # the runtime emulates that many devices
    elif args.kind == "CPU" and cores > 1:  # the replicas of one CPU process are threads
        raise UsageError(f"--cores {cores} on the CPU: torch_xla's CPU collectives hang across replicas "
                         "(pytorch/xla#5005); use --cores 1, or --spmd --cores N")
    elif cores not in ((have,) if args.spmd else (1, have)):
        raise UsageError(f"--cores {cores}: this machine has {have} {args.kind} devices; use "
                         + ("all of them with --spmd" if args.spmd else f"--cores 1 or {have}"))
    return cores
def prepare_out_dir(args):
    """--resume's settings; --out-dir, made by every host (ordinal 0 need not be on host 0: torch_xla/runtime.py)."""
    source = args.resume and os.path.dirname(os.path.abspath(find_checkpoint(args.resume)))
    if args.resume:
        saved = read_checkpoint(find_checkpoint(args.resume))["config"]
        vars(args).update(taken := {k: v for k, v in saved.items() if k not in args.given and getattr(args, k) != v})
        print(f"resume | settings saved with the checkpoint, and not given now: {taken}")
    if args.out_dir is None and args.hosts > 1 and not source:
        raise UsageError("--out-dir is needed on a pod slice: a folder that every host can read")
    args.out_dir = args.out_dir or source or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    held = os.path.isdir(args.out_dir) and (checkpoints(args.out_dir) or "metrics.jsonl" in os.listdir(args.out_dir))
    if held and source != os.path.abspath(args.out_dir):
        raise UsageError(f"--out-dir {args.out_dir} holds a run: continue it with --resume, or name another folder")
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out-dir {args.out_dir}: cannot make it ({e.strerror})")
def start_replica(args, spmd):  # starts the runtime: this replica's device, and its place in the run
    PROCESS.update(stage="devices", args=args)  # what the smoke deadline names
    run = types.SimpleNamespace(args=args, mesh=None, world=1, rank=0)
    if spmd:
        xr.use_spmd()  # before the runtime starts: every tensor is one global tensor
        run.devices = xr.global_runtime_device_count()
        run.mesh = xs.Mesh(np.arange(run.devices), (run.devices,), ("data",))
    else:
        run.world, run.rank = xr.world_size(), xr.global_ordinal()
        run.devices = run.world
    run.device = torch_xla.device()
    PROCESS.update(world=run.world, rank=run.rank)  # the runtime is up
    run.global_batch = args.batch_size * run.devices  # samples per step, over every device
    run.load_batch = run.global_batch if spmd else args.batch_size  # what this process loads per step
    return run

# ---- input: the test shard, layerdrop's coin flips, synthetic digits ----------------------------------------------
def test_loader(run, images, labels):  # this replica's share, padded with valid=0: one batch shape, each sample once
    index = torch.arange(run.rank, len(labels), run.world)
    size = math.ceil(math.ceil(len(labels) / run.world) / run.load_batch) * run.load_batch  # the same on every replica
    valid = (torch.arange(size) < len(index)).float()
    index = torch.cat([index, index.new_zeros(size - len(index))])
    data = StackDataset(image=images[index], label=labels[index], valid=valid)
    return DataLoader(data, sampler=BatchSampler(range(size), run.load_batch, False), batch_size=None)
def layerdrop_keep(args, epoch, step, device):
    """The step's fc2 decisions, from (seed, epoch, step) only: the same on every replica (one that traced other
    drops would all-reduce other gradients), and after a resume."""
    if args.layerdrop == "off":
        return None
    keep = np.random.default_rng([args.seed, epoch, step]).random(50) >= args.layerdrop_prob
    return keep.tolist() if args.layerdrop == "dynamic" else torch.tensor(keep, device=device)
def synthetic_digits(n, seed):
    """Ten random stroke patterns, one per class, shifted by up to 8 pixels on noise: fixed pixel templates do poorly,
    a CNN learns them. Deterministic for (n, seed)."""
    g = torch.Generator().manual_seed(seed)
    glyphs = (torch.rand(10, 14, 14, generator=torch.Generator().manual_seed(0)) < 0.3).float()
    labels, images = torch.randint(0, 10, (n,), generator=g), torch.rand(n, 28, 28, generator=g) * 0.3
    for i, (down, right) in enumerate(torch.randint(0, 9, (n, 2), generator=g).tolist()):
        images[i, 3 + down:17 + down, 3 + right:17 + right] += glyphs[labels[i]] * 0.7
    return (images.clamp(0, 1) * 255).to(torch.uint8).unsqueeze(1), labels
@contextlib.contextmanager
def quietly():  # torchvision's download attempts and DCP's notices, which say nothing about this use
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield

# ---- logging: log lines, metrics.jsonl, TensorBoard, compiles ----------------------------------------------------
class Log:
    """A replica's losses and compiles, printed and written to OUT/metrics.jsonl and TensorBoard by the master. Each log
    boundary prints the previous one's loss, long finished: the loop never waits. Saves and epoch ends read the rest."""
    def __init__(self, run, steps):
        self.run, self.steps, self.history, self.warm_total, self.accuracy = run, steps, [], None, None
        self.board = None
        if is_master():
            from torch.utils.tensorboard import SummaryWriter
            self.board = SummaryWriter(run.args.out_dir)
        self.start(0, 0, 0)
        PROCESS["stage"] = "training"  # (the smoke deadline's name for it)
    def start(self, epoch, skip, last):
        self.epoch, self.skip, self.warm, self.last = epoch, skip, skip + WARMUP_STEPS, last
        self.pending, self.values, self.times, self.compiles = [], {}, {}, compiles()[0]
    def boundary(self, step):  # a step closure: runs once this step's graph has launched
        if self.times:  # the previous boundary's window: long finished on the device, so no wait
            self.flush(upto=max(self.times))
            self.line(max(self.times))
        self.times[step] = time.perf_counter()
    def line(self, step):
        print0(f"epoch {self.epoch} step {step}/{self.last} | loss {self.values[step]:.4f}")
    def flush(self, upto=None, end=False):  # reads losses up to step `upto` (all: a deliberate wait), and frees them
        first = self.skip + len(self.values) + 1  # (a live tensor per step would slow every graph cut a little more)
        n = len(self.pending) if upto is None else max(0, upto - first + 1)
        rows = [dict(epoch=self.epoch, step=first + i, loss=float(t.cpu())) for i, t in enumerate(self.pending[:n])]
        del self.pending[:n]
        if end:  # the epoch's last step has finished on the device: its time, for samples/s
            self.times[self.last] = time.perf_counter()
        self.values.update((r["step"], r["loss"]) for r in rows)
        self.history += [r["loss"] for r in rows]
        for r in self.write(rows):
            self.board.add_scalar("train/loss", r["loss"], (r["epoch"] - 1) * self.steps + r["step"])
    def write(self, rows):  # the master appends to OUT/metrics.jsonl; returns what it wrote
        if not self.board:
            return []
        with open(os.path.join(self.run.args.out_dir, "metrics.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return rows
    def end_epoch(self, epoch, measured, path):  # the epoch's lines and record; exit 3 past --max-recompiles
        self.line(self.last)
        (total, seconds), (loss, self.accuracy, counted), args = compiles(), measured, self.run.args
        self.warm_total = total if self.warm_total is None else self.warm_total
        self.recompiles, ops = total - self.warm_total, fallback_ops()
        rate = (self.last - self.warm) * self.run.global_batch / (self.times[self.last] - self.times[self.warm]) \
            if self.last > self.warm else None  # the warm-up left out
        for _ in self.write([dict(epoch=epoch, test_loss=loss, accuracy=self.accuracy, samples_per_s=rate,
                                  compiles=total - self.compiles, recompiles=self.recompiles, fallback_ops=ops)]):
            self.board.add_scalar("test/accuracy", self.accuracy, epoch * self.steps)
            self.board.add_scalar("train/samples_per_s", rate or 0, epoch * self.steps)
            self.board.flush()
        print0(f"epoch {epoch} done | test loss {loss:.4f} | accuracy {self.accuracy:.2f}% ({counted:,} samples) | "
               + (f"{rate:,.0f} samples/s" if rate else "untimed") + f" | checkpoint {path}\nepoch {epoch} compiles"
               f" | this epoch {total - self.compiles} | recompiles after warm-up {self.recompiles} | {seconds:.1f} s "
               f"compiling in all | CPU fallback ops: {ops}")
        if None is not args.max_recompiles < self.recompiles and not args.smoke:
            raise TrainingFailed(f"failed: {self.recompiles} graphs compiled after warm-up (the run's first epoch), "
                                 f"over --max-recompiles {args.max_recompiles}: the graph changes from step to step", 3)
def read_metrics(out_dir):
    """{"history": a dict per step, "epochs": one per epoch} from OUT/metrics.jsonl. A step trained twice (before a
    kill, and after --resume) counts once, as last trained; a line torn by a kill, not at all."""
    rows = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            with contextlib.suppress(ValueError):
                r = json.loads(line)
                rows["loss" in r, r["epoch"], r.get("step", 0)] = r
    return {"history": [r for k, r in sorted(rows.items()) if k[0]],
            "epochs": [r for k, r in sorted(rows.items()) if not k[0]]}
def compiles():  # graphs compiled in this process so far, and the seconds it took (torch_xla's metrics)
    data = met.metric_data("CompileTime")  # (count, total ns, samples), or None before the first
    return (data[0], data[1] / 1e9) if data else (0, 0.0)
def fallback_ops():  # ops run on the host for want of an XLA lowering; `.item()` (a wait in the step) counts too
    return ", ".join(f"{n} x{met.counter_value(n)}" for n in met.counter_names() if n.startswith("aten::")) or "none"

# ---- checkpoints: one dict, two formats ---------------------------------------------------------------------------
# A checkpoint is one dict: model, optimizer, position (the epoch to train next, and the samples of it trained on),
# settings, and the test loss and accuracy measured just before saving (None when saved on a stop), named by its
# position: checkpoint-EEEE-SSSSSSSSS. Multi-core, every replica calls xm.save and the global master writes NAME.pt;
# under SPMD, torch.distributed.checkpoint writes each device's shards into the folder NAME (docs: perf/spmd_distributed
# _checkpoint). The formats differ (the seed thread, pytorch/xla#6660): --resume reads either, and converts.
RESUMED = ("data", "data_dir", "epochs", "batch_size", "lr", "momentum", "seed", "steps_per_epoch", "layerdrop",
           "layerdrop_prob", "bf16")  # a resumed run takes these from its checkpoint, unless they are given
def save(run, position, measured=None):  # at `position` (epoch, steps of it done); measured: (test loss, accuracy, n)
    torch_xla.sync()  # runs this step's log closure: its line comes before the save
    run.log.flush()  # metrics.jsonl holds every step that the checkpoint holds
    (loss, accuracy, _), args, samples = measured or (None, None, 0), run.args, position[1] * run.global_batch
    ckpt = {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "epoch": position[0],
            "samples": samples, "device": args.kind, "test_loss": loss, "accuracy": accuracy,
            "config": {k: getattr(args, k) for k in RESUMED}}
    path = os.path.join(args.out_dir, f"checkpoint-{position[0]:04d}-{samples:09d}" + ".pt" * (run.mesh is None))
    if run.mesh is None:
        xm.save(ckpt, path + ".tmp", master_only=True, global_master=True)  # every replica syncs; the master writes
    else:
        import torch.distributed.checkpoint as dcp
        import torch_xla.experimental.distributed_checkpoint as xc
        shutil.rmtree(path + ".tmp", ignore_errors=True)
        with quietly():
            dcp.save(ckpt, storage_writer=dcp.FileSystemWriter(path + ".tmp"), planner=xc.SPMDSavePlanner())
        shutil.rmtree(path, ignore_errors=True)  # the same position, saved again
    if is_master():
        os.replace(path + ".tmp", path)  # whole or not at all: a kill mid-write leaves the last good ones
        for old in checkpoints(args.out_dir)[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
    return path
def checkpoints(folder):  # a run folder's complete checkpoints, either format, the newest written last
    paths = [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("checkpoint-") and (
        n.endswith(".pt") or "." not in n and os.path.exists(os.path.join(folder, n, ".metadata")))]
    return sorted(paths, key=lambda p: (os.path.getmtime(p), p))
def find_checkpoint(path):  # what --resume PATH means: a checkpoint, or a run folder's newest
    if os.path.isfile(path) or os.path.exists(os.path.join(path, ".metadata")):
        return path
    if not (found := checkpoints(path) if os.path.isdir(path) else []):
        raise UsageError(f"--resume {path}: no checkpoint there")
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
        assert {"model", "optimizer", "epoch", "samples", "config"} <= ckpt.keys()
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise UsageError(f"--resume {path}: cannot read it ({type(e).__name__}): truncated, damaged, or not a "
                         "train_tpu.py checkpoint")
    return ckpt
def resume(run, steps):
    """Loads --resume, and proves it still gives the test loss saved with it (the seed thread's trap: a converted
    checkpoint silently computing something else); one in the other format is saved in this run's at once. Returns
    (epoch, steps of it done)."""
    args, path = run.args, find_checkpoint(run.args.resume)
    ckpt, measured = read_checkpoint(path), None
    try:
        run.model.load_state_dict(ckpt["model"])  # onto the device; under SPMD, replicated
    except RuntimeError as e:
        raise UsageError(f"--resume {path}: its model is not this run's: {str(e).splitlines()[1].strip()}")
    run.optimizer.load_state_dict(ckpt["optimizer"])
    for group in run.optimizer.param_groups:
        group.update(lr=args.lr, momentum=args.momentum)  # this run's, given or taken
    done, rest = divmod(ckpt["samples"], run.global_batch)
    if rest or done >= steps:
        raise UsageError(f"--resume {path}: {ckpt['samples']} samples into its epoch are no whole step of this run's "
                         f"{steps}: resume with the batch size and --steps-per-epoch it was saved with")
    if ckpt["test_loss"] is None:
        print0("resume check | skipped: saved on a stop, with no test loss measured")
    elif (ckpt["config"]["data"], ckpt["config"]["data_dir"]) != (args.data, args.data_dir):
        print0("resume check | skipped: the checkpoint was evaluated on other --data")
    else:
        measured, saved = evaluate(run), ckpt["test_loss"]
        tol = 1e-5 if {args.kind, ckpt["device"]} == {"CPU"} else 2e-2  # TPU matmuls round through bfloat16
        print0(f"resume check | test loss saved {saved:.6f}, now {measured[0]:.6f} (tolerance {tol:.0e})")
        if not abs(measured[0] - saved) <= tol:
            raise TrainingFailed(f"failed: resume check: {path} gives test loss {measured[0]:.6f}, and was saved "
                                 f"at {saved:.6f}", 4)
    if os.path.isdir(path) != (run.mesh is not None):  # the other format: convert it now
        print0(f"resume | converted, saved as {save(run, (ckpt['epoch'], done), measured)}")
    print0(f"resume | {path}: continuing at epoch {ckpt['epoch']} of {args.epochs}, after step {done}")
    return ckpt["epoch"], done

# ---- stopping early: SIGTERM, Ctrl-C, a failing replica -----------------------------------------------------------
# xmp.spawn runs each replica in a pool thread of a child process, and Python runs signal handlers only in a main
# thread. So every process of a run (the launcher, and each replica process as it imports this file: see the end)
# takes SIGTERM and Ctrl-C in its main thread and writes the stop file, which the replicas read at each log boundary,
# agreeing to stop together. A failing replica writes its line and exit code to the failure file, for the launcher.
PROCESS = {"stage": None, "checks": None, "args": None, "world": 1, "rank": None, "timers": []}
@contextlib.contextmanager
def run_files(args):
    """The stop and failure files, named in the environment that replicas inherit, the signal handlers, and with
    --smoke the deadline, which starts before any runtime does. None of them outlives the run (a notebook's might)."""
    os.environ["TRAIN_TPU_FILES"] = folder = tempfile.mkdtemp(prefix="train_tpu-")
    os.environ["TRAIN_TPU_DEADLINE"] = str(time.time() + args.smoke_timeout if args.smoke else 0)
    PROCESS.update(timers=[], checks=None, stage=None, rank=None, world=1)
    handlers = take_signals()
    start_deadline()
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for timer in PROCESS["timers"]:
            timer.cancel()
        del os.environ["TRAIN_TPU_FILES"], os.environ["TRAIN_TPU_DEADLINE"]
        shutil.rmtree(folder, ignore_errors=True)
def take_signals():  # a main thread only: Python refuses signal handlers in any other
    if threading.current_thread() is threading.main_thread():
        return {s: signal.signal(s, on_stop_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    return {}
def on_stop_signal(signum, frame):
    """The first signal asks every replica to save and stop at its next log boundary. A second, one while a failed run
    is torn down, or STOP_GRACE seconds without a boundary, end the process at once."""
    if any(t.function is os._exit for t in PROCESS["timers"]) or os.path.exists(run_file("failure")):
        os._exit(128 + signum)
    with open(run_file(f"stop.{os.getpid()}"), "w") as f:
        f.write(str(signum))
    os.replace(run_file(f"stop.{os.getpid()}"), run_file("stop"))  # whole, or not there
    start_timer(STOP_GRACE, os._exit, 128 + signum)
def run_file(name):
    return os.path.join(os.environ["TRAIN_TPU_FILES"], name)
def agree_to_stop(run):
    """The stop signal's number once any replica has seen one, else 0; the same on every replica, as one that stopped
    alone would leave the others waiting in an all-reduce."""
    signum = int(open(run_file("stop")).read()) if os.path.exists(run_file("stop")) else 0
    if run.world == 1:
        return signum
    torch_xla.sync()  # cut the step's graph where MpDeviceLoader would: the same graphs
    agreed = xm.all_reduce(xm.REDUCE_MAX, torch.tensor([signum], device=run.device))
    return int(agreed.cpu())  # a deliberate wait: at log boundaries, with replicas only
def stopped(signum, epoch, step, args):
    return TrainingFailed(f"stopped by {signal.Signals(signum).name} at epoch {epoch} step {step}, checkpoint saved: "
                          f"continue with --resume {args.out_dir}", 128 + signum)
def end_this_replica(code, line):
    """One failing replica ends the run, instead of the others waiting in an all-reduce for ever: it writes its line
    and ends its process; xmp.spawn's process pool then ends the others and raises in the launcher."""
    with open(run_file("failure"), "a") as f:
        f.write(json.dumps([line, code]) + "\n")
    if multiprocessing.parent_process() is None:  # no launcher to say it: say it here
        print(f"train_tpu.py: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)
def runtime_failure(args, e):  # no replica knew its place: the runtime did not start (a TPU held by another, say)
    if PROCESS["rank"] is None:
        return UsageError(f"the {args.kind} runtime did not start: {str(e).strip().splitlines()[0]}")
def replica_failure():  # in the launcher, once xmp.spawn has raised: the first failing replica's line and code
    if os.path.exists(run_file("failure")):
        with open(run_file("failure")) as f:
            return TrainingFailed(*json.loads(f.readline()))

# ---- the smoke verdict: is this machine fit to train on? ----------------------------------------------------------
def start_deadline():  # --smoke never hangs: every process of the run times the deadline, set before any runtime
    if float(os.environ.get("TRAIN_TPU_DEADLINE", 0)):
        start_timer(float(os.environ["TRAIN_TPU_DEADLINE"]) - time.time(), deadline_passed)
def start_timer(seconds, action, *args):  # a daemon thread: the process never waits for it
    PROCESS["timers"].append(timer := threading.Timer(seconds, action, args))
    timer.daemon = True
    timer.start()
def deadline_passed():  # the stage then running FAILs, the master prints the verdict, and the process exits 5
    stage, args = PROCESS["stage"], PROCESS["args"]
    line = f"{stage} did not finish within --smoke-timeout"
    try:  # the master's table (before the runtime is up, every process's)
        if args and is_master():
            failed = dict(name=stage, passed=False, figure=f"{line} {args.smoke_timeout:g} s")
            publish(args, (PROCESS["checks"] or []) + [failed])
    finally:
        end_this_replica(5, f"failed: smoke verdict FAIL: {line}")  # xmp.spawn's pool then ends the other replicas
def finish(run):  # the run's end: the smoke verdict (exit 5), or --target-accuracy (exit 21)
    accuracy = run.log.accuracy
    print0(f"done | {run.args.epochs} epochs | test accuracy " + ("n/a" if accuracy is None else f"{accuracy:.2f}%"))
    if run.args.smoke:
        smoke_verdict(run)
    elif (accuracy or 0) < run.args.target_accuracy:
        raise TrainingFailed(f"failed: test accuracy {accuracy or 0:.2f}% is below --target-accuracy "
                             f"{run.args.target_accuracy:g}", 21)
def smoke_verdict(run):
    """The checks, each a PASS, FAIL or SKIP with its figure; every replica's, combined. Exit 5 if one FAILs."""
    args, accuracy, losses, ops = run.args, run.log.accuracy, run.log.history, fallback_ops()
    k, allowed, checks = max(1, len(losses) // 4), args.max_recompiles or 0, []
    if is_master():
        PROCESS["checks"] = checks  # for the deadline's table
    before, after = sum(losses[:k]) / k, sum(losses[-k:]) / k
    for name, test in (("devices", check_devices), ("numerics", check_numerics), ("checkpoint", check_checkpoint)):
        PROCESS["stage"] = name  # (the deadline's name for what runs)
        checks.append(dict(zip(("name", "passed", "figure"), (name, *test(run)))))
    checks += [dict(name="compilation", passed=run.log.recompiles <= allowed and ops == "none",
                    figure=f"{run.log.recompiles} graphs compiled after warm-up (allowed {allowed}), CPU fallback ops: "
                    f"{ops}"),
               dict(name="learning", passed=after < before and accuracy >= args.target_accuracy, figure=f"loss "
                    f"{before:.3f} -> {after:.3f} (first and last {k} steps), test accuracy {accuracy:.2f}% (target "
                    f"{args.target_accuracy:g}%)")]
    combine_replicas(run, checks)
    if is_master():
        publish(args, checks)
    if failed := [c["name"] for c in checks if c["passed"] is False]:
        raise TrainingFailed(f"failed: smoke verdict FAIL: {', '.join(failed)}", 5)
def check_devices(run):  # the devices found, against what the PCI bus and the TPU metadata say the slice holds
    found = xr.global_runtime_device_count()  # (world_size() equals it by construction: it cannot see a missing chip)
    if run.args.kind != "TPU" or run.args.cores == 1:
        return None, f"{found} {run.args.kind} device(s); skipped off a TPU, or at --cores 1"
    from torch_xla._internal import tpu
    expected = tpu.num_expected_global_devices()  # chips on this host x cores per chip x hosts
    return found == expected, f"{found} TPU devices found, {expected} in the slice"
def check_numerics(run):
    """The first step from the run's initial weights (its seed) and first batch, on the device and in eager PyTorch on
    the host: logits, loss and weight update (-lr x gradient), each compared by norm."""
    images, labels = load_split(run.args, train=True)
    torch.manual_seed(run.args.seed)
    state, results = build_model(run.args).state_dict(), []
    for device in (run.device, torch.device("cpu")):
        model = build_model(run.args).to(device)
        model.load_state_dict(state)
        with torch.autocast(device.type, torch.bfloat16, enabled=run.args.bf16):
            logits = model(model_input(images[:run.load_batch].to(device)))
            loss = F.cross_entropy(logits, labels[:run.load_batch].to(device))
        loss.backward()
        update = torch.cat([-run.args.lr * p.grad.flatten() for p in model.parameters()])
        results.append([t.detach().float().cpu() for t in (logits, loss, update)])
    diffs = [float((a - b).norm() / b.norm()) for a, b in zip(*results)]
    # float32 on the CPU agrees to rounding; TPU matmuls default to one bfloat16 pass, and --bf16 rounds both sides.
    # A wrong weight or layout (the seed thread's symptom) moves these by O(1).
    tol = 5e-2 if run.args.bf16 else 1e-5 if run.args.kind == "CPU" else 2e-2
    return max(diffs) <= tol, (f"first step, device vs eager CPU, relative by norm: logits {diffs[0]:.1e}, loss "
                               f"{diffs[1]:.1e}, update {diffs[2]:.1e} (tolerance {tol:.0e})")
def check_checkpoint(run):  # the newest checkpoint, read back from disk: the weights and momentum in memory?
    if not is_master():
        return None, "read back by the master"
    saved = read_checkpoint(path := find_checkpoint(run.args.out_dir))
    pairs = [(t, saved["model"][k]) for k, t in run.model.state_dict().items()] + [
        (s["momentum_buffer"], saved["optimizer"]["state"][i]["momentum_buffer"])
        for i, s in run.optimizer.state_dict()["state"].items()]
    same = sum(torch.equal(a.cpu(), b) for a, b in pairs)
    return same == len(pairs), f"{path} read back: {same}/{len(pairs)} tensors identical"
def combine_replicas(run, checks):  # a check fails if it failed on any replica: one other than 0 must not go unseen
    if run.world > 1:
        PROCESS["stage"] = "verdict"
        failed = torch.zeros(run.world, len(checks))
        failed[run.rank] = torch.tensor([float(c["passed"] is False) for c in checks])
        torch_xla.sync()
        failed = xm.all_reduce(xm.REDUCE_SUM, failed.to(run.device)).cpu()
        for c, column in zip(checks, failed.T):
            if where := column.nonzero().flatten().tolist():
                c["passed"], c["figure"] = False, f"{c['figure']} | FAILED on replica(s) {where}"
def publish(args, checks):  # the table, and OUT/verdict.json: {"passed", "checks": [{"name", "passed", "figure"}]}
    mark, passed = {True: "PASS", False: "FAIL", None: "SKIP"}, all(c["passed"] is not False for c in checks)
    print("smoke verdict\n" + "".join(f"  {mark[c['passed']]}  {c['name']:<12} {c['figure']}\n" for c in checks)
          + f"smoke verdict: {mark[passed]}", flush=True)
    with open(os.path.join(args.out_dir, "verdict.json.tmp"), "w") as f:
        json.dump({"passed": passed, "checks": checks}, f, indent=1)
    os.replace(os.path.join(args.out_dir, "verdict.json.tmp"), os.path.join(args.out_dir, "verdict.json"))

# ---- from Python: the results back in the caller (the fastai discussion's point) ----------------------------------
def fit(**flags):
    """The command line as a call: fit(cores=1, data="synthetic", epochs=2) trains, and returns the final model (on the
    host) and the per-step history. It raises UsageError or TrainingFailed where main() exits non-zero, but for a
    failed smoke verdict, which comes back in .verdict."""
    args = parse_args([f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in flags.items()
                       if v is not False and v is not None])
    try:
        launch(args)
    except TrainingFailed as e:
        if e.code != 5:
            raise
    model = build_model(args)
    model.load_state_dict(read_checkpoint(find_checkpoint(args.out_dir))["model"])
    verdict = json.load(open(os.path.join(args.out_dir, "verdict.json"))) if args.smoke else None
    return types.SimpleNamespace(model=model, out_dir=args.out_dir, verdict=verdict, **read_metrics(args.out_dir))

if "TRAIN_TPU_FILES" in os.environ and multiprocessing.parent_process() is not None:
    # A replica process of xmp.spawn, importing this file in its main thread before its runtime starts: the one place
    # where it can take signals, and time the smoke deadline from.
    take_signals()
    start_deadline()

if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # after an error mid-epoch, MpDeviceLoader's feeder can abort a normal exit (134)
