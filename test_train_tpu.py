"""Tests for train_tpu.py, on the CPU (PJRT_DEVICE=CPU): python -m pytest -q test_train_tpu.py

Pure pieces (model, data, sampler, layerdrop, flag checks) run in this process in eager
PyTorch. Anything that starts the XLA runtime runs train_tpu.py in a subprocess, as a user
would: a runtime, once started in a process, cannot switch to SPMD or change its device count.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_tpu as tt  # noqa: E402  (importing it must do nothing: no device, no parsing)


def run_cli(*args, cwd, env=None, timeout=900):
    """Runs train_tpu.py in a fresh process on the CPU; returns the CompletedProcess."""
    full_env = dict(os.environ, PJRT_DEVICE="CPU")
    full_env.pop("CPU_NUM_DEVICES", None)  # one CPU device unless a test asks for more
    full_env.update(env or {})
    return subprocess.run([sys.executable, os.path.join(HERE, "train_tpu.py"), *map(str, args)],
                          cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def epochs_of(out_dir):
    return tt.read_history(str(out_dir))[1]


def final_weights(out_dir):
    return tt.read_checkpoint(*tt.find_checkpoint(str(out_dir)))


# ---- model and data (in process) -------------------------------------------------------------


def test_model_shapes_and_parameters():
    x = torch.randn(3, 1, 28, 28)
    off = tt.ToyModel("off")
    assert off(x).shape == (3, 10)
    assert {k: tuple(v.shape) for k, v in off.state_dict().items()} == {
        "conv1.weight": (10, 1, 5, 5), "conv1.bias": (10,),
        "fc1.weight": (10, 1440), "fc1.bias": (10,)}
    for mode in ("dynamic", "static"):
        m = tt.ToyModel(mode)
        assert m(x).shape == (3, 10)
        assert tuple(m.fc1.weight.shape) == (20, 1440) and tuple(m.fc2.weight.shape) == (20, 20)
        assert tuple(m.fc3.weight.shape) == (10, 20)


def test_synthetic_data_is_deterministic_and_learnable():
    a_images, a_labels = tt.synthetic_digits(6000, 5)
    b_images, b_labels = tt.synthetic_digits(6000, 5)
    c_images, _ = tt.synthetic_digits(6000, 6)
    assert torch.equal(a_images, b_images) and torch.equal(a_labels, b_labels)
    assert not torch.equal(a_images, c_images)
    assert a_images.shape == (6000, 1, 28, 28)
    counts = torch.bincount(a_labels, minlength=10)
    assert counts.min() > 450  # all ten classes, roughly balanced

    test_images, test_labels = tt.synthetic_digits(1000, 99)
    torch.manual_seed(0)
    model = tt.ToyModel()
    assert a_images.dtype == torch.uint8  # pixels, as MNIST stores them
    a_images, test_images = tt.model_input(a_images), tt.model_input(test_images)
    with torch.no_grad():
        before = (model(test_images).argmax(1) == test_labels).float().mean().item()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(0, 6000, 64):
        optimizer.zero_grad()
        F.cross_entropy(model(a_images[i:i + 64]), a_labels[i:i + 64]).backward()
        optimizer.step()
    with torch.no_grad():
        after = (model(test_images).argmax(1) == test_labels).float().mean().item()
    assert before < 0.25  # not solved by an untrained network
    assert after > 0.90  # but learned from 94 steps, on held-out samples

    # Not trivial: the glyph moves, so the class mean image at fixed pixels is a poor guide.
    means = torch.stack([a_images[a_labels == d].mean(0) for d in range(10)])
    nearest = torch.cdist(test_images.flatten(1), means.flatten(1)).argmin(1)
    assert (nearest == test_labels).float().mean().item() < after - 0.1


def test_training_shards_are_disjoint_and_cover_the_set():
    images, labels = torch.zeros(1000, 1, 28, 28), torch.arange(1000)
    seen = []
    for rank in range(4):
        loader, sampler = tt.train_loader(images, labels, 25, 4, rank, seed=3, num_workers=0)
        sampler.set_epoch(2)
        seen += [int(i) for batch in loader for i in batch["label"]]
    assert sorted(seen) == list(range(1000))  # every sample once, across the 4 replicas


def test_epoch_batches_slice_the_shuffle_as_batching_it_one_index_at_a_time_would():
    # The reference: the replica's shuffle from `start` to `stop`, cut into whole batches.
    data = torch.utils.data.TensorDataset(torch.arange(1003))
    for world, rank, batch, start, stop in [(1, 0, 8, 0, None), (3, 2, 7, 37, None),
                                            (2, 1, 16, 100, 320), (4, 0, 5, 260, 100)]:
        shard = torch.utils.data.DistributedSampler(data, world, rank, seed=3, drop_last=True)
        sampler = tt.EpochBatches(shard, batch, stop)
        sampler.set_epoch(2, start=start)
        order = list(shard)[start:stop]
        expected = [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]
        got = [b.tolist() for b in sampler]
        assert got == expected and len(sampler) == len(expected), (world, rank, batch, start)
    assert len(expected) == 0  # start past stop: nothing, and len() says so


def test_evaluation_shards_count_every_sample_once():
    n = 1003  # not a multiple of the world size nor of the batch
    images, labels = torch.zeros(n, 1, 28, 28), torch.arange(n)
    counted, batches = [], set()
    for rank in range(4):
        shard = tt.eval_shard(images, labels, 64, 4, rank)
        valid = shard.fields["valid"].bool()
        counted += shard.fields["label"][valid].tolist()
        batches.add(len(shard) // 64)
        assert len(shard) % 64 == 0  # whole batches only: one shape, one compiled graph
    assert sorted(counted) == list(range(n))
    assert len(batches) == 1  # every replica runs the same number of batches (and collectives)


def write_idx_mnist(root, n_train, n_test):
    """MNIST-format IDX files (uint8, big-endian headers) under ROOT/MNIST/raw/."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    written = {}
    for split, n, seed in (("train", n_train, 11), ("t10k", n_test, 12)):
        images, labels = tt.synthetic_digits(n, seed)
        pixels = images[:, 0]
        (raw / f"{split}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, n, 28, 28) + pixels.numpy().tobytes())
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 2049, n) + labels.numpy().astype(np.uint8).tobytes())
        written[split] = (pixels, labels)
    return written


def test_mnist_idx_files_are_read_by_torchvision(tmp_path):
    written = write_idx_mnist(tmp_path, 300, 100)
    args = tt.parse_args(["--data", "mnist", "--data-dir", str(tmp_path)])
    tt.prepare_data(args)  # finds the files, no download
    images, labels = tt.load_split(args, train=False)
    pixels, expected_labels = written["t10k"]
    assert torch.equal(labels, expected_labels)
    assert torch.equal(images[:, 0], pixels)  # uint8 pixels, as read
    # On the device they become what torchvision's ToTensor() + Normalize() would give.
    normalise = torchvision.transforms.Normalize((0.1307,), (0.3081,))
    reference = torch.stack([normalise(torchvision.transforms.functional.to_tensor(p.numpy()))
                             for p in pixels[:10]])
    assert torch.allclose(tt.model_input(images[:10]), reference, atol=1e-6)
    with pytest.raises(TypeError, match="replace it too"):  # float data: not rescaled silently
        tt.model_input(reference)


# ---- layerdrop (in process) ------------------------------------------------------------------


def test_drop_pattern_depends_only_on_seed_epoch_step():
    torch.manual_seed(1)
    first = tt.drop_pattern(0, 2, 7, 0.5)
    torch.manual_seed(2)
    torch.rand(100)  # the global RNG moves on: a replica's own random state must not matter
    assert tt.drop_pattern(0, 2, 7, 0.5) == first
    assert len(first) == 50 and 10 < sum(first) < 40
    others = [tt.drop_pattern(0, 2, 8, 0.5), tt.drop_pattern(0, 3, 7, 0.5),
              tt.drop_pattern(1, 2, 7, 0.5)]
    assert all(o != first for o in others)
    assert all(tt.drop_pattern(5, 1, 1, 0.0)) and not any(tt.drop_pattern(5, 1, 1, 1.0))


def test_static_and_dynamic_compute_the_same_function():
    x, y = tt.synthetic_digits(16, 3)
    x = tt.model_input(x)
    torch.manual_seed(0)
    static = tt.ToyModel("static")
    dynamic = tt.ToyModel("dynamic")
    dynamic.load_state_dict(static.state_dict())  # and the reverse, below
    static.load_state_dict(dynamic.state_dict())
    with torch.no_grad():
        for p in (0.0, 0.5, 1.0):
            keep = tt.drop_pattern(0, 1, 1, p)
            a = F.cross_entropy(static(x, torch.tensor(keep)), y)
            b = F.cross_entropy(dynamic(x, keep), y)
            assert torch.allclose(a, b, atol=1e-6), p
        # P = 1 drops every application: the same as a model without fc2.
        skip = static.fc3(static.fc1(torch.flatten(static.mp1(F.relu(static.conv1(x))), 1)))
        none_kept = tt.drop_pattern(0, 1, 1, 1.0)
        assert torch.allclose(F.cross_entropy(dynamic(x, none_kept), y),
                              F.cross_entropy(skip, y), atol=1e-6)


# ---- bad input (in process: all of it fails before any device starts) -----------------------


@pytest.mark.parametrize("argv, message", [
    (["--cores", "0"], "--cores 0: must be at least 1"),
    (["--cores", "64", "--data", "synthetic"], "this machine has 1 CPU device(s)"),
    (["--spmd", "--cores", "0"], "--cores 0: must be at least 1"),
    (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["--layerdrop-prob", "1.5"], "--layerdrop-prob 1.5: must be in [0, 1]"),
    (["--epochs", "two"], "invalid int value"),
    (["--export", "x.pt"], "--export needs --resume"),
    (["--resume", ""], "--resume : no such file or directory"),  # "$RUN" with RUN unset
    (["--smoke", "--report", "no/such/dir/r.json"], "does not exist"),
    (["--smoke", "--resume", "."], "leave out --resume"),
    (["--benchmark", "layerdrop", "--steps-per-epoch", "2"], "needs more than 2 steps"),
])
def test_bad_flags_exit_2_with_one_line(argv, message, capsys):
    assert tt.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_core_count_the_tpu_does_not_have_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(tt, "select_runtime", lambda: ("TPU", 8))  # a v3-8, as torch_xla counts
    monkeypatch.setattr(tt, "pod_hosts", lambda kind: (0, 1))  # one host
    assert tt.main(["--cores", "3", "--data", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "this machine has 8 TPU devices" in err
    assert "--cores 1" in err and "--cores 8" in err
    assert tt.main(["--spmd", "--cores", "4", "--data", "synthetic"]) == 2
    assert "SPMD uses every device" in capsys.readouterr().err


def test_checkpoints_move_between_static_and_dynamic_but_not_off(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    model = tt.ToyModel("static")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    static_args = tt.parse_args(["--layerdrop", "static", "--data", "synthetic"])
    ckpt = tt.checkpoint_dict(model, optimizer, (2, 0), static_args, 1.0, 50.0, "CPU")
    torch.save(ckpt, tmp_path / "static.pt")
    directory = tmp_path / "spmd"
    with tt._quiet_dcp_warnings():
        dcp.save(ckpt, storage_writer=dcp.FileSystemWriter(str(directory)))
    (directory / "train_tpu.json").write_text(json.dumps({"config": ckpt["config"], "epoch": 2}))
    for path in (tmp_path / "static.pt", directory):
        dynamic_args = tt.parse_args(["--resume", str(path), "--layerdrop", "dynamic"])
        assert tt.inspect_checkpoint(str(path), dynamic_args) == (2, 0)  # accepted
        assert tt.main(["--resume", str(path), "--layerdrop", "off"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "its model does not fit the one this run builds (fc1.bias: (20,) in the checkpoint, (10,) here)" in err
    # And the weights really load into the other variant (strict: same names and shapes).
    tt.ToyModel("dynamic").load_state_dict(torch.load(tmp_path / "static.pt")["model"])


def test_multicore_on_cpu_is_refused_with_the_reason(capsys, monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert tt.main(["--cores", "4", "--data", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "collectives hang" in err and "--spmd" in err


def test_missing_mnist_without_network_exits_2(tmp_path, capsys, monkeypatch):
    import torchvision

    # Point the download at a closed local port: no network, whatever the machine has.
    monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", ["http://127.0.0.1:9/"])
    assert tt.main(["--data-dir", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--data-dir" in err and "--data synthetic" in err


def test_fit_keywords_become_the_same_flags():
    argv = tt.argv_from(cores=1, momentum=0, spmd=True, smoke=False, resume=None, data_dir="d")
    assert argv == ["--cores", "1", "--momentum", "0", "--spmd", "--data-dir", "d"]
    args = tt.parse_args(argv)
    assert args.momentum == 0 and args.cores == 1 and args.spmd and args.data_dir == "d"


def test_resume_from_a_run_directory_takes_the_newest_checkpoint(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"older")
    newer = tmp_path / "checkpoint-spmd" / "epoch-0002"
    newer.mkdir(parents=True)
    (newer / ".metadata").write_bytes(b"newer")
    os.utime(tmp_path / "checkpoint.pt", (1, 1))  # written long before the SPMD one
    assert tt.find_checkpoint(str(tmp_path)) == ("spmd", str(newer))
    os.utime(tmp_path / "checkpoint.pt", None)
    os.utime(newer / ".metadata", (1, 1))
    os.utime(newer, (1, 1))
    assert tt.find_checkpoint(str(tmp_path)) == ("xm.save", str(tmp_path / "checkpoint.pt"))


def test_history_survives_a_torn_line(tmp_path):
    log = tt.RunLog(str(tmp_path))
    log.write(kind="log", epoch=1, step=2, loss=1.0, losses=[2.0, 1.0])
    log.write(kind="epoch", epoch=1, accuracy=50.0)
    log.write(kind="log", epoch=2, step=1, loss=0.5, losses=[0.5])
    with open(log.path, "a") as f:
        f.write('{"kind": "log", "epo')  # a kill in the middle of a write
    log.keep_before(2)
    history, epochs = tt.read_history(str(tmp_path))
    assert [h["loss"] for h in history] == [2.0, 1.0] and [e["epoch"] for e in epochs] == [1]


def test_bad_flag_exits_2_from_the_command_line(tmp_path):
    r = run_cli("--batch-size", "0", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["train_tpu.py: error: --batch-size 0: must be at least 1"]


def test_damaged_checkpoints_exit_2(tmp_path, capsys):
    model = tt.ToyModel("static")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    args = tt.parse_args(["--layerdrop", "static", "--data", "synthetic"])
    good = tmp_path / "layerdrop.pt"
    torch.save(tt.checkpoint_dict(model, optimizer, (2, 0), args, 1.0, 50.0, "CPU"), good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:3000])
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    cases = [
        (["--resume", str(good), "--layerdrop", "off"], "its model does not fit"),
        (["--resume", str(truncated)], "truncated or damaged"),
        (["--resume", str(empty_dir)], "no checkpoint there"),
        (["--resume", str(tmp_path / "absent.pt")], "no such file"),
    ]
    for argv, message in cases:
        assert tt.main(argv + ["--out-dir", str(tmp_path / "out")]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert good.stat().st_size > 0  # nothing was overwritten by the refused runs


# ---- end to end: one replica through xmp.spawn -----------------------------------------------


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    """The README's CPU command, once: 1 core, synthetic data, 1 epoch, target 90%."""
    out = tmp_path_factory.mktemp("synthetic") / "run"
    r = run_cli("--cores", 1, "--data", "synthetic", "--epochs", 1, "--target-accuracy", 90,
                "--out-dir", out, cwd=out.parent)
    return r, out


def test_spawn_run_on_synthetic_data_reaches_90_percent(synthetic_run):
    r, out = synthetic_run
    assert r.returncode == 0, r.stderr
    (epoch,) = epochs_of(out)
    assert epoch["accuracy"] >= 90.0
    assert re.search(r"accuracy \d+\.\d+% \(5,000 samples\)", r.stdout)
    # A handful of graphs: two training steps (the first creates the momentum), evaluation.
    assert 2 <= epoch["compiles_total"] <= 6
    assert epoch["cpu_fallback_ops"] == {}
    assert "CPU fallback ops: none" in r.stdout


def test_checkpoint_written_once_and_plain_torch_load_reads_it(synthetic_run):
    r, out = synthetic_run
    names = sorted(os.listdir(out))
    assert names == ["checkpoint.pt", "metrics.jsonl", "metrics.png"]  # no .tmp left behind
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 2 and ckpt["step"] == 0
    assert ckpt["config"]["data"] == "synthetic"
    momentum = [s["momentum_buffer"] for s in ckpt["optimizer"]["state"].values()]
    assert len(momentum) == 4 and all(m.abs().sum() > 0 for m in momentum)


def test_target_accuracy_not_reached_exits_21(tmp_path):
    r = run_cli("--cores", 1, "--data", "synthetic", "--epochs", 1, "--steps-per-epoch", 3,
                "--target-accuracy", 99.9, "--out-dir", tmp_path / "run", cwd=tmp_path)
    assert r.returncode == 21
    assert "below --target-accuracy 99.9" in r.stderr


def test_mnist_format_files_end_to_end(tmp_path):
    write_idx_mnist(tmp_path / "data", 12_800, 2_000)
    r = run_cli("--cores", 1, "--data-dir", tmp_path / "data", "--epochs", 1,
                "--out-dir", tmp_path / "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "100 steps per epoch" in r.stdout  # 12,800 / 128: torchvision read our files
    (epoch,) = epochs_of(tmp_path / "run")
    assert epoch["accuracy"] > 90.0


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    common = ["--cores", 1, "--data", "synthetic", "--steps-per-epoch", 12, "--log-steps", 5]
    straight = run_cli(*common, "--epochs", 2, "--out-dir", tmp_path / "a", cwd=tmp_path)
    first = run_cli(*common, "--epochs", 1, "--out-dir", tmp_path / "b", cwd=tmp_path)
    resumed = run_cli("--resume", tmp_path / "b" / "checkpoint.pt", "--epochs", 2, cwd=tmp_path)
    for r in (straight, first, resumed):
        assert r.returncode == 0, r.stderr
    assert "continuing at epoch 2 of 2" in resumed.stdout
    assert "resume check" in resumed.stdout and "| equal" in resumed.stdout
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert b["epoch"] == 3
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name  # momentum and shuffle too
    # The history continues: epoch 1 once, then epoch 2; as many step losses as steps run.
    history, epochs = tt.read_history(str(tmp_path / "b"))
    assert [e["epoch"] for e in epochs] == [1, 2] and len(history) == 24


def test_fresh_run_refuses_an_out_dir_holding_a_run(synthetic_run, capsys):
    _, out = synthetic_run
    assert tt.main(["--data", "synthetic", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert (out / "checkpoint.pt").exists()


# ---- SPMD ------------------------------------------------------------------------------------


def test_spmd_run_on_4_devices_reaches_90_percent(tmp_path):
    r = run_cli("--spmd", "--cores", 4, "--data", "synthetic", "--epochs", 1,
                "--target-accuracy", 90, "--out-dir", tmp_path / "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "spmd mesh 4 devices | global batch 512" in r.stdout
    (epoch,) = epochs_of(tmp_path / "run")
    assert epoch["accuracy"] >= 90.0
    assert os.listdir(tmp_path / "run" / "checkpoint-spmd") == ["epoch-0001"]


STEP_SCRIPT = r"""
import os, sys
mode, out = sys.argv[1], sys.argv[2]
if mode == "spmd":
    os.environ["CPU_NUM_DEVICES"] = "4"
import numpy as np, torch, torch_xla, torch_xla.runtime as xr
import train_tpu as tt
if mode == "spmd":
    import torch_xla.distributed.spmd as xs
    xr.use_spmd()
    topo = tt.Topology(torch_xla.device(), 1, 0, 4, xs.Mesh(np.arange(4), (4,), ("data",)))
else:
    topo = tt.Topology(torch_xla.device(), 1, 0, 1)
images, labels = tt.synthetic_digits(512, 7)
loader = torch.utils.data.DataLoader(tt.Examples(image=images, label=labels), batch_size=512)
torch.manual_seed(0)
model = tt.ToyModel().to(topo.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for batch in topo.loader(loader):
    spec = torch_xla._XLAC._get_xla_sharding_spec(batch["image"])
    tt.train_step(model, optimizer, batch["image"], batch["label"], None, topo.spmd)
torch_xla.sync()
torch.save({"spec": spec, "model": {k: v.cpu() for k, v in model.state_dict().items()}}, out)
"""


def test_spmd_step_on_4_devices_equals_single_device_step(tmp_path):
    results = {}
    for mode in ("spmd", "single"):
        env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=HERE)
        env.pop("CPU_NUM_DEVICES", None)
        r = subprocess.run([sys.executable, "-c", STEP_SCRIPT, mode, str(tmp_path / mode)],
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        results[mode] = torch.load(tmp_path / mode, weights_only=True)
    # The batch really is split over 4 devices along its first dimension.
    assert results["spmd"]["spec"] == "{devices=[4,1,1,1]0,1,2,3}"
    assert results["single"]["spec"] == ""
    for name, w in results["single"]["model"].items():
        assert (w - results["spmd"]["model"][name]).abs().max() < 1e-5, name
    torch.manual_seed(0)
    initial = tt.ToyModel().state_dict()
    assert any((initial[k] - w).abs().max() > 1e-3 for k, w in results["single"]["model"].items())


def test_checkpoint_round_trip_multicore_to_spmd_and_back(synthetic_run, tmp_path):
    _, source = synthetic_run
    original = torch.load(source / "checkpoint.pt", weights_only=True)
    run_dir = tmp_path / "run"
    os.makedirs(run_dir)
    with open(source / "checkpoint.pt", "rb") as f, open(run_dir / "checkpoint.pt", "wb") as g:
        g.write(f.read())
    # Resume under SPMD with nothing left to train: the conversion is saved as it is.
    r = run_cli("--spmd", "--cores", 4, "--resume", run_dir / "checkpoint.pt", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "xm.save checkpoint" in r.stdout and "later saves use the SPMD format" in r.stdout
    check = re.search(r"resume check \| test loss saved ([\d.]+) vs now ([\d.]+) .*\| equal",
                      r.stdout)
    assert check and abs(float(check[1]) - float(check[2])) <= 1e-5
    assert os.path.isfile(run_dir / "checkpoint-spmd" / "epoch-0001" / ".metadata")

    back = tmp_path / "back.pt"
    assert tt.main(["--resume", str(run_dir / "checkpoint-spmd"), "--export", str(back)]) == 0
    exported = torch.load(back, weights_only=True)
    for name, t in original["model"].items():
        assert torch.equal(t, exported["model"][name]), name
    assert exported["optimizer"]["state"].keys() == original["optimizer"]["state"].keys()
    for i, state in original["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], exported["optimizer"]["state"][i]["momentum_buffer"])
    assert exported["epoch"] == original["epoch"]
    assert abs(exported["test_loss"] - original["test_loss"]) <= 1e-5


def test_damaged_spmd_checkpoint_exits_2(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    # A checkpoint in the SPMD layout, written on the host by the same DCP file writer.
    model = tt.ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    args = tt.parse_args(["--data", "synthetic"])
    ckpt = tt.checkpoint_dict(model, optimizer, (2, 0), args, 1.0, 50.0, "CPU")
    directory = tmp_path / "ckpt"
    with tt._quiet_dcp_warnings():
        dcp.save(ckpt, storage_writer=dcp.FileSystemWriter(str(directory)))
    (directory / "train_tpu.json").write_text(json.dumps({"config": ckpt["config"], "epoch": 2}))
    assert tt.inspect_checkpoint(str(directory), args) == (2, 0)
    shard = next(p for p in directory.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:500])
    assert tt.main(["--spmd", "--resume", str(directory), "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing or truncated" in err
    (directory / ".metadata").unlink()
    assert tt.main(["--spmd", "--resume", str(directory), "--out-dir", str(tmp_path / "o")]) == 2
    assert "no checkpoint there" in capsys.readouterr().err


# ---- recompilation ---------------------------------------------------------------------------


@pytest.mark.parametrize("layerdrop", ["off", "static"])
def test_no_recompiles_after_warmup(layerdrop, tmp_path):
    r = run_cli("--cores", 1, "--data", "synthetic", "--layerdrop", layerdrop, "--epochs", 2,
                "--steps-per-epoch", 8, "--max-recompiles", 0, "--out-dir", tmp_path / "run",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    first, second = epochs_of(tmp_path / "run")
    assert first["compiles_epoch"] >= 2  # the warm-up compiled the step and the evaluation
    assert second["compiles_epoch"] == 0 and second["recompiles_after_warmup"] == 0
    assert "recompiles after warm-up 0 |" in r.stdout


def independent_keep(seed, epoch, step, prob):
    """The documented layerdrop rule, written out again here so that the recompile tests do not
    take their expected figures from the code they check: sha256 of "seed/epoch/step", its
    first 7 bytes (little-endian) seed a generator, and application i is kept when its uniform
    draw is >= prob."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{step}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:7], "little"))
    return (torch.rand(50, generator=generator) >= prob).tolist()


def kept_counts(seed, epochs, steps):
    # From the rule itself, not from tt.drop_pattern: a broken key (say, one that ignores the
    # step) would otherwise predict its own wrong recompile counts and pass.
    return {(e, s): sum(independent_keep(seed, e, s, 0.5))
            for e in range(1, epochs + 1) for s in range(1, steps + 1)}


def test_dynamic_layerdrop_trips_max_recompiles_exactly_as_predicted(tmp_path):
    seed, steps = 0, 15
    counts = kept_counts(seed, 3, steps)
    # Step 1 of the run creates the momentum buffers (its own graph); every other step's graph
    # is set by how many fc2 applications it keeps. Predict the first epoch with a new one.
    warm = {counts[1, s] for s in range(2, steps + 1)}
    new = {counts[2, s] for s in range(1, steps + 1)} - warm
    assert new, "pick another seed: this one repeats epoch 1's graphs"
    r = run_cli("--cores", 1, "--data", "synthetic", "--layerdrop", "dynamic", "--epochs", 3,
                "--steps-per-epoch", steps, "--seed", seed, "--max-recompiles", 0,
                "--out-dir", tmp_path / "run", cwd=tmp_path)
    assert r.returncode == 3, r.stderr
    assert f"recompiled {len(new)} graphs after warm-up, more than --max-recompiles 0" in r.stderr
    assert r.stderr.count("\n") == 1
    first, second = epochs_of(tmp_path / "run")
    assert second["recompiles_after_warmup"] == len(new)
    assert (tmp_path / "run" / "checkpoint.pt").exists()  # the failing epoch was still saved


def test_layerdrop_benchmark_counts_one_graph_per_kept_count(tmp_path):
    steps, seed = 20, 0
    r = run_cli("--benchmark", "layerdrop", "--data", "synthetic", "--steps-per-epoch", steps,
                "--seed", seed, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    figures = dict(re.findall(r"^(dynamic|static)\s+\|\s+(\d+) compilations", r.stdout, re.M))
    counts = kept_counts(seed, 1, steps)
    distinct = len({counts[1, s] for s in range(2, steps + 1)})
    assert int(figures["dynamic"]) == distinct + 1  # + step 1, which creates the momentum
    assert 5 < int(figures["dynamic"]) <= 51 + 1
    assert int(figures["static"]) == 2
    assert "ratio" in r.stdout


# ---- smoke verdict, results in the parent, artifacts -----------------------------------------


def printed_checks(stdout):
    """The verdict table's rows as (name, passed, figure)."""
    rows = re.findall(r"^  (PASS|FAIL|EMUL)  (\S+)\s+(.*)$", stdout, re.M)
    passed = {"PASS": True, "FAIL": False, "EMUL": None}
    return [{"name": n, "passed": passed[p], "figure": f} for p, n, f in rows]


CHECKS = ["devices", "collectives", "numerics", "compilation", "throughput", "learning",
          "checkpoint"]


@pytest.mark.parametrize("mode", [["--cores", 1], ["--spmd", "--cores", 4]], ids=["1core", "spmd4"])
def test_smoke_passes_on_a_healthy_cpu(mode, tmp_path):
    r = run_cli("--smoke", *mode, "--report", tmp_path / "r.json", "--out-dir", tmp_path / "run",
                cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] is True
    assert [c["name"] for c in report["checks"]] == CHECKS
    assert report["checks"] == printed_checks(r.stdout)  # the JSON says what the table says
    assert report["versions"]["torch_xla"].startswith("2.9")
    assert report["config"]["smoke"] is True and report["config"]["data"] == "synthetic"
    figures = {c["name"]: c["figure"] for c in report["checks"]}
    n = 4 if "--spmd" in mode else 1
    assert f"{n} found, {n} wanted" in figures["devices"]
    assert f"= {n * (n - 1) // 2}" in figures["collectives"]
    assert "8/8 tensors identical" in figures["checkpoint"]
    assert json.loads((tmp_path / "run" / "verdict.json").read_text()) == report


def test_smoke_fails_and_names_the_check_for_an_impossible_target(tmp_path):
    r = run_cli("--smoke", "--cores", 1, "--target-accuracy", 101, "--report", tmp_path / "r.json",
                "--out-dir", tmp_path / "run", cwd=tmp_path)
    assert r.returncode == 5
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] is False
    assert [c["name"] for c in report["checks"] if not c["passed"]] == ["learning"]
    assert report["checks"] == printed_checks(r.stdout)
    assert "smoke verdict: FAIL (learning)" in r.stdout


def test_smoke_fails_compilation_on_a_forced_recompile(tmp_path):
    seed, steps = 0, 15
    counts = kept_counts(seed, 2, steps)
    new = {counts[2, s] for s in range(1, steps + 1)} - {counts[1, s] for s in range(2, steps + 1)}
    r = run_cli("--smoke", "--cores", 1, "--layerdrop", "dynamic", "--max-recompiles", 0,
                "--steps-per-epoch", steps, "--seed", seed, "--report", tmp_path / "r.json",
                "--out-dir", tmp_path / "run", cwd=tmp_path)
    assert r.returncode == 5
    report = json.loads((tmp_path / "r.json").read_text())
    compilation = next(c for c in report["checks"] if c["name"] == "compilation")
    assert compilation["passed"] is False
    assert f"{len(new)} after warm-up (allowed 0)" in compilation["figure"]
    assert report["checks"] == printed_checks(r.stdout)


FIT_SCRIPT = r"""
import sys, torch, train_tpu
result = train_tpu.fit(cores=1, data="synthetic", epochs=2, steps_per_epoch=9, log_steps=4,
                       out_dir=sys.argv[1])
smoke = train_tpu.fit(smoke=True, cores=1, steps_per_epoch=5, target_accuracy=101,
                      out_dir=sys.argv[1] + "-smoke")
try:  # a notebook cell run again, asking for what the running runtime cannot give
    train_tpu.fit(spmd=True, cores=4, data="synthetic", epochs=1, out_dir=sys.argv[1] + "-spmd")
    again = "no error"
except train_tpu.UsageError as e:
    again = str(e)
torch.save({"model": result.model.state_dict(), "history": result.history,
            "epochs": result.epochs, "smoke": smoke.verdict, "again": again}, sys.argv[2])
"""


def test_fit_returns_the_trained_model_and_history_to_the_parent(tmp_path):
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=HERE)
    env.pop("CPU_NUM_DEVICES", None)
    r = subprocess.run([sys.executable, "-c", FIT_SCRIPT, str(tmp_path / "run"),
                        str(tmp_path / "result.pt")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert saved["epoch"] == 3  # the final checkpoint: both epochs done
    for name, t in saved["model"].items():
        assert torch.equal(result["model"][name], t), name
    torch.manual_seed(0)
    initial = tt.ToyModel().state_dict()
    assert all(not torch.equal(initial[k], result["model"][k]) for k in initial)  # trained
    assert len(result["history"]) == 2 * 9  # every step of both epochs, in order
    assert [(h["epoch"], h["step"]) for h in result["history"]][:3] == [(1, 1), (1, 2), (1, 3)]
    assert [e["epoch"] for e in result["epochs"]] == [1, 2]
    assert result["history"][-1]["loss"] < result["history"][0]["loss"]
    # A failed smoke verdict comes back to the caller instead of being raised.
    assert result["smoke"]["passed"] is False
    assert [c["name"] for c in result["smoke"]["checks"] if not c["passed"]] == ["learning"]
    # The second SPMD fit() is refused before it touches a device (it used to segfault).
    assert "already running in this process" in result["again"]
    assert not (tmp_path / "run-spmd").exists()


def test_artifacts_written_by_the_master(synthetic_run):
    r, out = synthetic_run
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {line["kind"] for line in lines} == {"log", "epoch"}
    history, epochs = tt.read_history(str(out))
    assert len(history) == 234 and len(epochs) == 1  # 30,000 // 128 steps, each step's loss
    png = (out / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert width > 100 and height > 100
    import matplotlib.image

    assert matplotlib.image.imread(out / "metrics.png").std() > 0  # decodes, and is not blank
    assert "\r" not in r.stdout  # no progress bar when stdout is not a terminal


def test_progress_bar_draws_one_line_in_place(capsys):
    bar = tt.ProgressBar()
    bar.show(5, 10, "epoch 1 step 5/10 | loss 1.0000")
    out = capsys.readouterr().out
    assert out.startswith("\r[##########..........] epoch 1 step 5/10") and "\n" not in out
    bar.show(10, 10, "epoch 1 step 10/10 | loss 0.5000")  # the epoch's last: the line ends
    assert capsys.readouterr().out.startswith("\r[####################] epoch 1 step 10/10")


# ---- more than one replica, emulated on the CPU (README: "what runs where") ------------------
#
# torch_xla's CPU collectives hang across replicas, so a real world > 1 cannot run here. The
# emulation replaces the one seam, torch_xla.runtime.world_size, to return 2, and sets
# XLA_ALWAYS_ALLREDUCE=1 so that xm.all_reduce and xm.optimizer_step run real all-reduces on
# the one CPU device. Every `world > 1` branch of train_tpu.py then runs with real torch_xla
# calls; only what counts devices or sums ordinals cannot be true.

EMULATED = r"""
import sys, time
import torch_xla.runtime as xr
xr.world_size = lambda: 2
import train_tpu as tt
{patch}
sys.exit(tt.main(sys.argv[1:]))
"""


def run_emulated(*args, cwd, patch="", timeout=300):
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=HERE, XLA_ALWAYS_ALLREDUCE="1")
    env.pop("CPU_NUM_DEVICES", None)
    return subprocess.run([sys.executable, "-c", EMULATED.format(patch=patch), *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_emulated_world_2_smoke_has_no_fallback_ops(tmp_path):
    r = run_emulated("--smoke", "--cores", 1, "--out-dir", tmp_path / "run", "--report",
                     tmp_path / "r.json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "world 2 replicas | global batch 256" in r.stdout  # the world > 1 path ran
    compile_lines = [line for line in r.stdout.splitlines() if " compiles | " in line]
    assert len(compile_lines) == 3  # epoch 1, epoch 2, done
    assert all(line.endswith("CPU fallback ops: none") for line in compile_lines)
    # Per epoch: the replicas agree at each boundary before the last (steps 2, 10, 20, 30 of
    # 40), then the epoch's end reads its last losses, evaluates, and agrees once more.
    assert all("| host-device waits 7 |" in line for line in compile_lines)
    checks = {c["name"]: c["passed"] for c in json.load(open(tmp_path / "r.json"))["checks"]}
    assert checks["compilation"] is True
    # One device cannot show two devices or two ordinals: reported as emulated, never PASS.
    assert checks["devices"] is None and checks["collectives"] is None
    assert "EMUL  devices" in r.stdout and "2 emulated (not checked)" in r.stdout
    # Each replica evaluates its half of the 5,000 test samples; the all-reduce sums them.
    assert "accuracy" in r.stdout and "(2,500 samples)" in r.stdout


def test_emulated_world_2_a_failing_replica_ends_the_run_with_its_line(tmp_path):
    # The master's checkpoint write fails (a full disk, say) in the second epoch.
    patch = ("real_save = tt.xm.save\n"
             "def save(obj, path, **kw):\n"
             "    if obj['epoch'] == 3:\n"
             "        raise OSError(28, 'No space left on device')\n"
             "    real_save(obj, path, **kw)\n"
             "tt.xm.save = save")
    started = time.monotonic()
    r = run_emulated("--cores", 1, "--data", "synthetic", "--epochs", 3, "--steps-per-epoch", 5,
                     "--out-dir", tmp_path / "run", cwd=tmp_path, patch=patch)
    assert time.monotonic() - started < 120
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines()[-1] == (
        "train_tpu.py: replica 0: failed: OSError: [Errno 28] No space left on device "
        "(traceback above)")
    # The last good checkpoint (after epoch 1) is still there and loads.
    assert tt.load_file_checkpoint(str(tmp_path / "run" / "checkpoint.pt"))["epoch"] == 2


def test_emulated_world_2_stop_on_recompiles_counts_only_the_models_graphs(tmp_path):
    # The same prediction as at world 1: the replicas' agreement on the count (an all-reduce
    # at each epoch's end) compiles within the warm-up, so it adds no recompile of its own.
    counts = kept_counts(0, 3, 15)
    warm = {counts[1, s] for s in range(2, 16)}
    new = {counts[2, s] for s in range(1, 16)} - warm
    r = run_emulated("--cores", 1, "--data", "synthetic", "--layerdrop", "dynamic", "--epochs", 3,
                     "--steps-per-epoch", 15, "--max-recompiles", 0, "--out-dir", tmp_path / "run",
                     cwd=tmp_path)
    assert r.returncode == 3, r.stderr
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"train_tpu.py: replica 0: failed: recompiled {len(new)} graphs")


def test_parent_exits_with_the_failing_replicas_code_and_line(monkeypatch, tmp_path):
    from concurrent.futures.process import BrokenProcessPool

    def spawn(fn, args, nprocs):  # what xmp.spawn does when one replica process dies
        with open(os.environ[tt.FAILURE_FILE], "a") as f:
            f.write(json.dumps([5, "replica 3: failed: smoke verdict FAIL: learning"]) + "\n")
        raise BrokenProcessPool("a child process terminated abruptly")

    monkeypatch.setattr(tt.xmp, "spawn", spawn)
    with pytest.raises(tt.TrainingFailed) as e, tt.run_files():
        tt.spawn_replicas(None, "TPU", 8)
    assert e.value.code == 5 and str(e.value) == "replica 3: failed: smoke verdict FAIL: learning"
    assert tt.FAILURE_FILE not in os.environ


def test_smoke_check_that_stalls_fails_by_name_within_its_deadline(tmp_path):
    patch = "tt.check_collectives = lambda *a: time.sleep(3600)"
    started = time.monotonic()
    r = run_emulated("--smoke", "--cores", 1, "--deadline-scale", 0.05, "--out-dir",
                     tmp_path / "run", "--report", tmp_path / "r.json", cwd=tmp_path, patch=patch)
    assert time.monotonic() - started < 100
    assert r.returncode == 5, r.stderr
    assert "did not finish within 15 s" in r.stdout
    checks = {c["name"]: c["passed"] for c in json.load(open(tmp_path / "r.json"))["checks"]}
    assert checks == {"devices": None, "collectives": False}  # what finished, and the stall
    assert r.stderr.splitlines()[-1].endswith("collectives did not finish")


def test_pod_slice_configurations_that_cannot_work_are_refused(capsys, monkeypatch):
    monkeypatch.setattr(tt, "select_runtime", lambda: ("TPU", 4))  # a v4-32: 4 hosts x 4 chips
    monkeypatch.setattr(tt, "pod_hosts", lambda kind: (0, 4))
    for argv, words in ((["--spmd"], "one host only"), (["--cores", "1"], "each host would")):
        assert tt.main(argv + ["--data", "synthetic"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pod slice of 4 hosts" in err and words in err


def test_devices_check_counts_the_whole_slice(monkeypatch):
    # --cores 4 on each of 4 hosts: 16 replicas over 16 devices is right, not a mismatch.
    monkeypatch.setattr(tt.xr, "global_runtime_device_count", lambda: 16)
    monkeypatch.setattr(tt.xm, "xla_device_hw", lambda device: "TPU")
    args = tt.parse_args(["--cores", "4", "--smoke"])
    for in_use, passed in ((16, True), (4, False)):
        verdict = tt.Verdict()
        tt.check_devices(verdict, tt.Topology("xla:0", in_use, 0, in_use), args, "TPU")
        assert verdict.checks[0]["passed"] is passed, verdict.checks


def test_only_host_0_touches_the_out_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    args = tt.parse_args(["--out-dir", str(run_dir), "--overwrite"])
    tt.prepare_out_dir(args, writer=False)  # host 1 of a pod: leaves it alone
    assert (run_dir / "metrics.jsonl").exists()
    tt.prepare_out_dir(args, writer=True)  # host 0: deletes the earlier run
    assert not (run_dir / "metrics.jsonl").exists()


def test_tpu_requested_without_a_tpu_exits_2_quickly(tmp_path):
    started = time.monotonic()
    r = run_cli("--smoke", cwd=tmp_path, env={"PJRT_DEVICE": "TPU"}, timeout=120)
    assert time.monotonic() - started < 60
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.splitlines()) <= 3
    assert "no TPU chip" in r.stderr.splitlines()[-1]


def test_process_holding_the_tpu_is_named(tmp_path, capsys, monkeypatch):
    from torch_xla._internal import tpu

    device = tmp_path / "accel0"  # stands in for /dev/accel0
    device.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(device)!r}); "
                               "import time; print('open', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "open\n"
        monkeypatch.setenv("PJRT_DEVICE", "TPU")
        monkeypatch.setattr(tpu, "num_available_chips", lambda: 4)
        monkeypatch.setattr(tt, "tpu_device_files", lambda: [str(device)])
        assert tt.main(["--data", "synthetic"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert f"in use by process {holder.pid} ({sys.executable} -c" in err
        assert f"kill {holder.pid}" in err
    finally:
        holder.kill()
        holder.wait()
    assert tt.processes_holding([str(device)]) == []


def test_mismatched_torch_and_torch_xla_exit_2_naming_both(capsys, monkeypatch):
    tt.check_versions("2.9.0+cu128", "2.9.0")  # the pinned pair passes
    monkeypatch.setattr(tt, "installed_versions", lambda: ("2.8.0+cpu", "2.9.0"))
    assert tt.main(["--data", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torch 2.8.0+cpu with torch_xla 2.9.0" in err


def test_out_dir_under_a_file_and_export_to_a_folder_exit_2(synthetic_run, tmp_path):
    _, source = synthetic_run
    (tmp_path / "afile").write_text("x")
    r = run_cli("--cores", 1, "--data", "synthetic", "--out-dir", tmp_path / "afile" / "x",
                cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--out-dir" in r.stderr and "cannot create it" in r.stderr
    (tmp_path / "folder").mkdir()
    r = run_cli("--resume", source, "--export", tmp_path / "folder", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "a folder is there" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["afile", "folder"]  # nothing created, no .tmp


def test_a_bug_in_the_training_function_exits_1_with_one_last_line(tmp_path):
    # As a user adapting the template would: a model change that breaks the step.
    with open(os.path.join(HERE, "train_tpu.py")) as f:
        source = f.read()
    broken = source.replace("logits = model(x) if keep is None else model(x, keep)",
                            "logits = model.head(x)")
    assert broken != source
    (tmp_path / "train_tpu.py").write_text(broken)
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("CPU_NUM_DEVICES", None)
    # stdout to a file, as in a user's `> log`: with both streams piped the abort was not seen.
    r = subprocess.run([sys.executable, "train_tpu.py", "--cores", "1", "--data", "synthetic",
                        "--out-dir", "run"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 1, r.stderr  # not SIGABRT: the process is not aborted
    assert "Traceback" in r.stderr
    assert r.stderr.splitlines()[-1] == ("train_tpu.py: failed: AttributeError: 'ToyModel' "
                                         "object has no attribute 'head' (traceback above)")


# ---- added: reshuffling, SPMD input sharding, atomic saves, padded evaluation, layerdrop oracle


def test_each_epoch_reshuffles_the_same_way_on_every_replica():
    images, labels = torch.zeros(400, 1, 28, 28), torch.arange(400)

    def order(rank, epoch, max_steps=None):
        # A fresh loader each call: what a separate replica process would build.
        loader, sampler = tt.train_loader(images, labels, 10, 2, rank, seed=3, num_workers=0,
                                          max_steps=max_steps)
        sampler.set_epoch(epoch)
        return [int(i) for batch in loader for i in batch["label"]]

    for rank in (0, 1):
        assert order(rank, 1) != order(rank, 2)  # a new order each epoch
        assert order(rank, 2) == order(rank, 2)  # set by (seed, epoch) alone, not by chance
        # --steps-per-epoch takes the first steps of that epoch's order, so it reshuffles too.
        assert order(rank, 2, max_steps=3) == order(rank, 2)[:30]
        assert order(rank, 2, max_steps=3) != order(rank, 1, max_steps=3)
    for epoch in (1, 2):
        # One permutation per epoch, split between the replicas: shuffled with one seed, the
        # two halves are disjoint; shuffled per replica, they would overlap.
        assert sorted(order(0, epoch) + order(1, epoch)) == list(range(400))


def test_training_sees_a_new_order_each_epoch(tmp_path):
    # With lr 1e-9 the weights stay put (to float32 precision), so each step's loss is the
    # initial model's loss on that step's batch: it tells which batches each epoch trained on.
    steps, seed = 6, 0
    r = run_cli("--cores", 1, "--data", "synthetic", "--epochs", 2, "--steps-per-epoch", steps,
                "--log-steps", steps, "--lr", 1e-9, "--seed", seed, "--out-dir", tmp_path / "run",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    logged = {(h["epoch"], h["step"]): h["loss"] for h in tt.read_history(str(tmp_path / "run"))[0]}
    assert sorted(logged) == [(e, s) for e in (1, 2) for s in range(1, steps + 1)]

    # The reference, in eager PyTorch: the same initial weights on the batches of each
    # epoch's shuffle.
    images, labels = tt.synthetic_digits(tt.SYNTHETIC_TRAIN, tt.SYNTHETIC_DATA_SEED)
    torch.manual_seed(seed)
    model = tt.ToyModel()
    loader, sampler = tt.train_loader(images, labels, 128, 1, 0, seed, 0, steps)
    expected = {}
    with torch.no_grad():
        for epoch in (1, 2):
            sampler.set_epoch(epoch)
            expected[epoch] = [F.cross_entropy(model(tt.model_input(b["image"])),
                                               b["label"]).item()
                               for b in loader]
    for epoch in (1, 2):
        got = [logged[epoch, s] for s in range(1, steps + 1)]
        assert max(abs(a - b) for a, b in zip(got, expected[epoch])) < 1e-4, epoch
    # And the two epochs' batches really differ (same batches: the losses would agree to 1e-6).
    assert max(abs(a - b) for a, b in zip(expected[1], expected[2])) > 1e-3


SHARDING_SCRIPT = r"""
import json, os
os.environ["CPU_NUM_DEVICES"] = "4"
import numpy as np, torch, torch_xla, torch_xla.runtime as xr
import torch_xla.distributed.spmd as xs
import train_tpu as tt
xr.use_spmd()
topo = tt.Topology(torch_xla.device(), 1, 0, 4, xs.Mesh(np.arange(4), (4,), ("data",)))
images, labels = tt.synthetic_digits(64, 7)
train, sampler = tt.train_loader(images, labels, 16, 1, 0, seed=0, num_workers=0)
sampler.set_epoch(1)
test = torch.utils.data.DataLoader(tt.eval_shard(images[:50], labels[:50], 16, 1, 0),
                                   batch_size=16)
found = {}
for name, loader in (("train", train), ("eval", test)):
    for batch in topo.loader(loader):
        found[name] = {k: [torch_xla._XLAC._get_xla_sharding_spec(t), list(t.shape)]
                       for k, t in batch.items()}
print(json.dumps(found))
"""


def test_spmd_loader_shards_every_field_along_the_batch(tmp_path):
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=HERE)
    env.pop("CPU_NUM_DEVICES", None)
    r = subprocess.run([sys.executable, "-c", SHARDING_SCRIPT], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout.strip().splitlines()[-1])
    # Each field split 4 ways along dim 0 (a replicated label would read "{replicated}"): each
    # device then holds the labels and valid flags of its own quarter of the images.
    along_batch = {"image": "{devices=[4,1,1,1]0,1,2,3}", "label": "{devices=[4]0,1,2,3}",
                   "valid": "{devices=[4]0,1,2,3}"}
    assert found["train"] == {"image": [along_batch["image"], [16, 1, 28, 28]],
                              "label": [along_batch["label"], [16]]}
    assert found["eval"] == {k: [spec, [16, 1, 28, 28] if k == "image" else [16]]
                             for k, spec in along_batch.items()}


SAVE_FAILURE_SCRIPT = r"""
import io, json, os, sys
import torch
import torch.distributed.checkpoint as dcp
import train_tpu as tt
out = sys.argv[1]
real_save, real_dcp_save = torch.save, dcp.save


def half_written_save(obj, f, *args, **kwargs):  # a full disk or a kill, half-way through
    buffer = io.BytesIO()
    real_save(obj, buffer)
    with open(f, "wb") as g:
        g.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
    raise OSError("No space left on device")


def half_written_dcp_save(state, *, storage_writer, **kwargs):
    real_dcp_save(state, storage_writer=storage_writer, **kwargs)
    os.remove(storage_writer.path / ".metadata")  # DCP writes it last: not reached
    for shard in storage_writer.path.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    raise OSError("No space left on device")


def checkpoint(next_epoch, seed):
    torch.manual_seed(seed)
    model = tt.ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    args = tt.parse_args(["--data", "synthetic"])
    return tt.checkpoint_dict(model, optimizer, (next_epoch, 0), args, 1.0, 50.0, "CPU")


def failing(module, name, fake, save, *args):
    real = getattr(module, name)
    setattr(module, name, fake)
    try:
        save(*args)
    except OSError:
        return "raised"
    finally:
        setattr(module, name, real)
    return "returned"


raised = {}
os.makedirs(out + "/xm")
tt.save_checkpoint(checkpoint(2, seed=0), out + "/xm", False, 1)  # the last good one
raised["xm"] = failing(torch, "save", half_written_save, tt.save_checkpoint,
                       checkpoint(3, seed=1), out + "/xm", False, 2)
os.makedirs(out + "/spmd")
tt.save_spmd_checkpoint(checkpoint(2, seed=0), out + "/spmd", 1)  # epoch-0001
# The same epoch saved again (a resumed conversion does that), then the next epoch.
for label, next_epoch in (("spmd same epoch", 2), ("spmd next epoch", 3)):
    raised[label] = failing(dcp, "save", half_written_dcp_save, tt.save_spmd_checkpoint,
                            checkpoint(next_epoch, seed=1), out + "/spmd", 2)
print(json.dumps(raised))
"""


def test_a_save_that_fails_midway_leaves_the_last_good_checkpoint(tmp_path):
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=HERE)
    env.pop("CPU_NUM_DEVICES", None)
    r = subprocess.run([sys.executable, "-c", SAVE_FAILURE_SCRIPT, str(tmp_path)], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    # The failure reaches the caller: a run never reports a save that did not happen.
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {
        "xm": "raised", "spmd same epoch": "raised", "spmd next epoch": "raised"}
    torch.manual_seed(0)
    good = tt.ToyModel().state_dict()  # the weights of the last good save
    for run, kind, name in (("xm", "xm.save", "checkpoint.pt"),
                            ("spmd", "spmd", os.path.join("checkpoint-spmd", "epoch-0001"))):
        # --resume RUN_DIR still finds the last good checkpoint, intact, and nothing newer.
        assert tt.find_checkpoint(str(tmp_path / run)) == (kind, str(tmp_path / run / name))
        ckpt = final_weights(tmp_path / run)
        assert ckpt["epoch"] == 2, run
        for k, w in good.items():
            assert torch.equal(ckpt["model"][k], w), (run, k)


@pytest.mark.parametrize("world, batch", [(1, 16), (2, 7), (3, 64)])
def test_evaluation_counts_each_test_sample_once_whatever_the_padding(world, batch):
    n = 101  # leaves padding at every one of these world sizes and batch sizes
    images, _ = tt.synthetic_digits(n, 21)
    torch.manual_seed(0)
    model = tt.ToyModel()
    with torch.no_grad():
        predicted = model(tt.model_input(images)).argmax(1)
    # Two labellings: every prediction right, and one in three right. Sample 0 (the padding
    # repeats it) is right in both, so counting the padding would inflate the accuracy.
    one_in_three = torch.where(torch.arange(n) % 3 == 0, predicted, (predicted + 1) % 10)
    for labels, right in ((predicted, n), (one_in_three, len(range(0, n, 3)))):
        with torch.no_grad():  # the reference: plain PyTorch over the unpadded test set
            expected_loss = F.cross_entropy(model(tt.model_input(images)), labels).item()
        loss_sum = correct = count = 0.0
        for rank in range(world):
            shard = tt.eval_shard(images, labels, batch, world, rank)
            assert len(shard) > len(range(rank, n, world))  # this shard is padded
            loss, accuracy, counted = tt.evaluate(model, DataLoader(shard, batch_size=batch))
            assert counted == len(range(rank, n, world))  # its own samples, no padding
            assert 0.0 <= accuracy <= 100.0
            loss_sum, correct, count = (loss_sum + loss * counted,
                                        correct + accuracy * counted / 100, count + counted)
        assert count == n
        assert abs(correct - right) < 1e-6  # 101 of 101, then 34 of 101
        assert abs(loss_sum / n - expected_loss) < 1e-5


def test_drop_patterns_follow_the_rule_and_change_every_step_and_epoch():
    patterns = {}
    for seed in (0, 1):
        for epoch in (1, 2, 3):
            for step in range(1, 16):
                got = tt.drop_pattern(seed, epoch, step, 0.5)
                assert got == independent_keep(seed, epoch, step, 0.5), (seed, epoch, step)
                patterns[seed, epoch, step] = tuple(got)
    # 90 steps, 90 different patterns: a key missing the step, epoch or seed would repeat some.
    assert len(set(patterns.values())) == 90
    assert len({sum(p) for p in patterns.values()}) > 8  # and the kept counts vary (recompiles)
    assert tt.drop_pattern(4, 2, 9, 0.2) == independent_keep(4, 2, 9, 0.2)


# ---- preemption: step checkpoints, SIGTERM, kill -9, mid-epoch resume --------------------------

PREEMPT = ["--data", "synthetic", "--epochs", 2, "--seed", 3]
MODES = {"1core": ["--cores", 1, "--save-steps", 30, "--steps-per-epoch", 100],
         "spmd4": ["--spmd", "--cores", 4, "--save-steps", 10, "--steps-per-epoch", 40]}


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """The uninterrupted runs the interrupted ones must equal, one per mode."""
    runs = {}
    for mode, flags in MODES.items():
        out = tmp_path_factory.mktemp(mode) / "run"
        env = {"CPU_NUM_DEVICES": "4"} if "--spmd" in flags else None
        r = run_cli(*PREEMPT, *flags, "--out-dir", out, cwd=out.parent, env=env)
        assert r.returncode == 0, r.stderr
        runs[mode] = out
    return runs


def interrupt(argv, when, signum, cwd):
    """Runs train_tpu.py, sends `signum` once a stdout line starts with `when`; returns
    (exit code, seconds from the signal to the exit, stderr)."""
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("CPU_NUM_DEVICES", None)
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "train_tpu.py"), *map(str, argv)],
                         cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    for line in p.stdout:
        if line.startswith(when):
            p.send_signal(signum)
            break
    sent = time.monotonic()
    _, err = p.communicate(timeout=300)
    return p.returncode, time.monotonic() - sent, err


def assert_same_run(a, b):
    """Equal final weights, and metrics.jsonl with every step once, in order, same losses."""
    wa, wb = final_weights(a), final_weights(b)
    assert (wa["epoch"], wa["step"]) == (wb["epoch"], wb["step"]) == (3, 0)
    for name, w in wa["model"].items():
        assert (w - wb["model"][name]).abs().max() <= 1e-6, name
    ha, hb = tt.read_history(str(a))[0], tt.read_history(str(b))[0]
    assert [(h["epoch"], h["step"]) for h in hb] == [(h["epoch"], h["step"]) for h in ha]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(ha, hb)) <= 1e-6
    assert [e["epoch"] for e in epochs_of(b)] == [1, 2]


@pytest.mark.parametrize("mode", ["1core", "spmd4"])
def test_sigterm_mid_epoch_saves_where_it_stopped_and_resume_is_exact(mode, straight_runs,
                                                                      tmp_path):
    flags, out = MODES[mode], tmp_path / "run"
    spmd = ["--spmd", "--cores", 4] if mode == "spmd4" else []
    when = "epoch 2 step 40" if mode == "1core" else "epoch 2 step 20"
    code, seconds, err = interrupt([*PREEMPT, *flags, "--out-dir", out], when, signal.SIGTERM,
                                   tmp_path)
    assert code == 143 and seconds < 30, err
    last = err.strip().splitlines()[-1]  # (SPMD runs print XLA's own warnings before it)
    stopped_at = re.fullmatch(r"train_tpu.py: failed: stopped by SIGTERM at epoch 2 step (\d+), "
                              rf"checkpoint saved; continue with --resume {re.escape(str(out))}",
                              last)
    assert stopped_at and "Traceback" not in err, err
    step = int(stopped_at.group(1))
    saved = final_weights(out)
    assert (saved["epoch"], saved["step"]) == (2, step) and step < 100
    r = run_cli("--resume", out, *spmd, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"continuing at epoch 2 of 2 after step {step}" in r.stdout
    assert "| equal" in r.stdout  # the resume check: the saved test loss, reproduced
    assert_same_run(straight_runs[mode], out)


def test_kill_9_resumes_from_the_newest_step_checkpoint(straight_runs, tmp_path):
    out = tmp_path / "run"
    code, _, err = interrupt([*PREEMPT, *MODES["1core"], "--out-dir", out], "epoch 2 step 40",
                             signal.SIGKILL, tmp_path)
    assert code == -signal.SIGKILL, err
    saved = final_weights(out)
    assert (saved["epoch"], saved["step"]) == (2, 30)  # saved at step 30, killed after 40
    r = run_cli("--resume", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "continuing at epoch 2 of 2 after step 30" in r.stdout
    assert_same_run(straight_runs["1core"], out)  # steps 31-40 logged once, not twice


KEEP_SCRIPT = r"""
import json, os, sys
import train_tpu as tt
held, real = [], tt.save_checkpoint
def save(ckpt, out_dir, spmd, keep):
    path = real(ckpt, out_dir, spmd, keep)
    where = os.path.join(out_dir, "checkpoint-spmd") if spmd else out_dir
    held.append(sorted(n for n in os.listdir(where) if n.startswith(("checkpoint", "epoch-"))
                       and not n.endswith(".tmp")))
    return path
tt.save_checkpoint = save
code = tt.main(sys.argv[1:])
print(json.dumps(held))
sys.exit(code)
"""


@pytest.mark.parametrize("mode", ["1core", "spmd4"])
def test_frequent_saves_keep_at_most_k_checkpoints(mode, tmp_path):
    spmd = ["--spmd", "--cores", "4"] if mode == "spmd4" else ["--cores", "1"]
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=HERE)
    env.pop("CPU_NUM_DEVICES", None)
    r = subprocess.run([sys.executable, "-c", KEEP_SCRIPT, *spmd, "--data", "synthetic",
                        "--epochs", "2", "--steps-per-epoch", "30", "--save-steps", "10",
                        "--keep-checkpoints", "2", "--out-dir", str(tmp_path / "run")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    held = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(held) == 6  # steps 10 and 20, then the end, of each of 2 epochs
    # The loop waits for the device only to save: at steps 10 and 20 and at the end, each a read
    # of the losses not read yet and an evaluation. Logging (steps 2 and 20) adds no wait.
    waits = re.findall(r"^epoch \d compiles .*\| host-device waits (\d+) \|", r.stdout, re.M)
    assert waits == ["6", "6"]
    assert max(len(h) for h in held) == 2 and [len(h) for h in held][:1] == [1]
    # The newest is always kept: after the last save, the end of epoch 2 and the one before.
    if mode == "spmd4":
        assert held[-1] == ["epoch-0001-step-000020", "epoch-0002"]
    else:
        assert held[-1] == ["checkpoint-epoch-0001-step-000020.pt", "checkpoint.pt"]
        assert final_weights(tmp_path / "run")["epoch"] == 3


def test_host_benchmark_reports_input_steps_and_waits(tmp_path):
    r = run_cli("--benchmark", "host", "--data", "synthetic", "--steps-per-epoch", 30,
                "--log-steps", 10, "--report", tmp_path / "b.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    figures = json.load(open(tmp_path / "b.json"))
    printed = dict(re.findall(r"^host input \| batch\s+([\d,]+) \|\s+([\d,]+) samples/s", r.stdout,
                              re.M))
    assert sorted(figures["input_samples_per_s"], key=int) == ["128", "1024", "8192"]
    for batch, rate in figures["input_samples_per_s"].items():
        assert printed[f"{int(batch):,}"] == f"{rate:,.0f}" and rate > 0
    steps = dict(re.findall(r"^host steps \| batch\s+(\d+) \|\s+([\d.]+) steps/s", r.stdout, re.M))
    assert {b: f"{v:.1f}" for b, v in figures["steps_per_s"].items()} == steps
    # One epoch's steps (logged every 10, read a window late: no wait) and its evaluation:
    # the end's read of the last losses, and the evaluation's read of its sums.
    assert figures["host_waits_per_epoch"] == 2
    assert r.stdout.count("| host-device waits 2") == 2


# ---- added: mutation-testing gaps (overwrite, throughput, resume check, numerics tolerance,
# ---- checkpoint check, export check, verdict)


def test_overwrite_deletes_every_artifact_of_the_earlier_run(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoint-spmd" / "epoch-0001").mkdir(parents=True)
    artifacts = ["metrics.jsonl", "checkpoint.pt", "metrics.png", "verdict.json"]
    for name in artifacts:
        (run_dir / name).write_text("earlier run")
    args = tt.parse_args(["--out-dir", str(run_dir), "--overwrite"])
    tt.prepare_out_dir(args)
    # A verdict.json left behind would be read as this run's verdict (fit(smoke=True) does).
    assert [n for n in artifacts + ["checkpoint-spmd"] if (run_dir / n).exists()] == []
    assert run_dir.is_dir()


def test_throughput_leaves_out_the_warmup_steps(monkeypatch):
    # A fake clock: steps 1 and 2 take 10 s each (they compile), every later step 0.5 s.
    clock = {"now": 0.0}
    monkeypatch.setattr(tt.time, "perf_counter", lambda: clock["now"])
    steps, global_batch = 10, 128
    meter = tt.EpochMeter(1, steps, global_batch, tt.Topology("cpu", 1, 0, 1), None, None,
                          quiet=True)
    for step in range(1, steps + 1):
        clock["now"] += 10.0 if step <= tt.WARMUP_STEPS else 0.5
        meter.pending.append(torch.tensor(float(step)))  # the step's loss, "on the device"
        meter.log_previous_window(step)  # each step a boundary: reads the step before it
        assert meter.losses == [float(s) for s in range(1, step)]  # one window late
    meter.log_the_rest()  # the epoch's end
    assert meter.losses == [float(s) for s in range(1, steps + 1)]
    # Steps 3..10: 8 steps of 128 samples in 4 s. Counting all 10 steps would give 320.
    assert meter.samples_per_s() == pytest.approx(8 * 128 / 4.0)
    assert tt.EpochMeter(1, tt.WARMUP_STEPS, 128, tt.Topology("cpu", 1, 0, 1), None, None,
                         quiet=True).samples_per_s() is None  # nothing left to time


def test_resume_check_compares_the_test_loss(capsys):
    images, labels = tt.synthetic_digits(50, 1)
    test_set = tt.fingerprint(images, labels)
    ckpt = {"test_loss": 0.5, "accuracy": 90.0, "measured_on": "CPU", "test_set": test_set}
    tt.compare_with_saved(ckpt, 0.5 + 5e-6, 90.0, test_set, "CPU", "resume check")  # within 1e-5
    assert "| equal" in capsys.readouterr().out
    # Same accuracy, a loss 1e-3 away: a different model, exit 4.
    with pytest.raises(tt.TrainingFailed) as failed:
        tt.compare_with_saved(ckpt, 0.5 + 1e-3, 90.0, test_set, "CPU", "resume check")
    assert failed.value.code == 4
    assert "| DIFFERENT" in capsys.readouterr().out
    # Measured on a TPU: the tolerance is 2e-2 either side of it.
    tpu = dict(ckpt, measured_on="TPU")
    tt.compare_with_saved(tpu, 0.5 + 1e-2, 90.0, test_set, "CPU", "resume check")
    with pytest.raises(tt.TrainingFailed):
        tt.compare_with_saved(tpu, 0.5 + 3e-2, 90.0, test_set, "CPU", "resume check")
    # On another test set (one pixel changed) the losses cannot be compared: said, not failed.
    images[0, 0, 0, 0] += 1
    other = tt.fingerprint(images, labels)
    assert other != test_set
    tt.compare_with_saved(ckpt, 0.5 + 1e-3, 90.0, other, "CPU", "resume check")
    assert "skipped: the checkpoint was evaluated on another test set\n" in capsys.readouterr().out
    tt.compare_with_saved(dict(ckpt, test_set=""), 9.0, 90.0, test_set, "CPU", "resume check")
    assert "skipped: the checkpoint names no test set" in capsys.readouterr().out
    # Dtype and shape count, not only the bytes; any dtype can be hashed.
    assert tt.fingerprint(images.view(50, 784), labels) != other  # the same bytes
    assert tt.fingerprint(images.to(torch.bfloat16).requires_grad_(), labels) != test_set


def test_numerics_tolerance_follows_the_device_and_the_matmul_precision():
    # README: 1e-5 on the CPU whatever the flag; on a TPU 5e-2, 1e-3, 1e-5.
    for precision in ("default", "high", "highest"):
        assert tt.numerics_tolerance("CPU", precision) == 1e-5
    assert [tt.numerics_tolerance("TPU", p) for p in ("default", "high", "highest")] == [
        5e-2, 1e-3, 1e-5]


def test_checkpoint_check_compares_the_momentum_too(tmp_path):
    torch.manual_seed(0)
    model = tt.ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    images, labels = tt.synthetic_digits(32, 5)
    F.cross_entropy(model(tt.model_input(images)), labels).backward()
    optimizer.step()  # creates the momentum buffers
    args = tt.parse_args(["--data", "synthetic"])
    path = tmp_path / "checkpoint.pt"
    torch.save(tt.checkpoint_dict(model, optimizer, (2, 0), args, 1.0, 50.0, "CPU"), path)
    verdict = tt.Verdict()
    tt.check_checkpoint(verdict, model, optimizer, str(path))
    assert verdict.checks[0]["passed"] is True and "8/8 tensors identical" in verdict.checks[0]["figure"]
    # The weights still match the file; one momentum buffer no longer does.
    first = next(iter(model.parameters()))
    optimizer.state[first]["momentum_buffer"].add_(1e-3)
    verdict = tt.Verdict()
    tt.check_checkpoint(verdict, model, optimizer, str(path))
    assert verdict.checks[0]["passed"] is False and "7/8 tensors identical" in verdict.checks[0]["figure"]


def test_export_that_fails_its_check_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    torch.manual_seed(0)
    model = tt.ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    args = tt.parse_args(["--data", "synthetic"])
    loss, accuracy, test_set = tt.evaluate_on_cpu(model, args)
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    for path, saved_loss in ((good, loss), (bad, loss + 0.1)):
        torch.save(tt.checkpoint_dict(model, optimizer, (2, 0), args, saved_loss, accuracy, "CPU",
                                      test_set=test_set), path)
    out = tmp_path / "model.pt"
    out.write_bytes(b"an earlier export")
    # A checkpoint that does not give its saved test loss: exit 4, the earlier file untouched.
    assert tt.main(["--resume", str(bad), "--export", str(out)]) == 4
    assert "export check" in capsys.readouterr().err
    assert out.read_bytes() == b"an earlier export"
    assert sorted(os.listdir(tmp_path)) == ["bad.pt", "good.pt", "model.pt"]  # no .tmp left
    # The good one replaces it, and reads back as the same weights.
    assert tt.main(["--resume", str(good), "--export", str(out)]) == 0
    assert "export check | test loss saved" in capsys.readouterr().out  # compared, not skipped
    exported = torch.load(out, weights_only=True)
    for name, t in model.state_dict().items():
        assert torch.equal(exported["model"][name], t), name


def test_verdict_fails_when_any_one_check_fails():
    names = ["devices", "collectives", "numerics", "compilation", "throughput", "learning",
             "checkpoint"]
    for failing in names:
        verdict = tt.Verdict()
        for name in names:
            verdict.add(name, name != failing, "figure")
        assert verdict.passed is False, failing
        assert f"smoke verdict: FAIL ({failing}), 6/7 checks passed" in verdict.table()
    emulated = tt.Verdict()  # EMUL is neither: the rest decides
    for name in names:
        emulated.add(name, None if name in ("devices", "collectives") else True, "figure")
    assert emulated.passed is True


def test_resume_takes_unset_settings_from_the_checkpoint_and_keeps_given_ones(tmp_path, capsys):
    model = tt.ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    saved = tt.parse_args(["--data", "synthetic", "--lr", "0.01", "--momentum", "0.5",
                           "--seed", "7", "--batch-size", "32", "--steps-per-epoch", "9",
                           "--bf16"])
    path = tmp_path / "checkpoint.pt"
    torch.save(tt.checkpoint_dict(model, optimizer, (2, 0), saved, 1.0, 50.0, "CPU"), path)
    args = tt.parse_args(["--resume", str(path), "--lr", "0.2", "--epochs", "4"])
    assert tt.inspect_checkpoint(str(path), args) == (2, 0)
    assert args.bf16 is True  # saved with --bf16 (below), not given now
    # Every setting not on this command line is the checkpoint's (a momentum left at the
    # default 0.9 would train a different model than the one interrupted)...
    assert (args.data, args.momentum, args.seed, args.batch_size, args.steps_per_epoch) == (
        "synthetic", 0.5, 7, 32, 9)
    # ...and the flags given now win.
    assert (args.lr, args.epochs) == (0.2, 4)
    assert "--momentum 0.5" in capsys.readouterr().out


def test_a_resumed_run_steps_with_the_lr_and_momentum_it_was_given(synthetic_run, tmp_path):
    _, source = synthetic_run
    shutil.copytree(source, tmp_path / "run")
    r = run_cli("--resume", tmp_path / "run", "--epochs", 2, "--steps-per-epoch", 10,
                "--lr", 0.01, "--momentum", 0.5, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # The optimizer's saved settings (lr 0.05, momentum 0.9) must not override the flags.
    group = final_weights(tmp_path / "run")["optimizer"]["param_groups"][0]
    assert (group["lr"], group["momentum"], group["foreach"]) == (0.01, 0.5, True)
    # A position past this run's (shorter) epochs cannot be continued: exit 2, nothing written.
    torch.save(dict(final_weights(tmp_path / "run"), epoch=2, step=12, global_batch=128),
               tmp_path / "mid.pt")
    r = run_cli("--resume", tmp_path / "mid.pt", "--steps-per-epoch", 10, "--out-dir",
                tmp_path / "mid", cwd=tmp_path)
    assert r.returncode == 2 and "this run's epochs have 10 steps" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "mid" / "checkpoint.pt")


def test_spmd_resume_may_turn_the_momentum_on(tmp_path):
    run = tmp_path / "run"
    spmd = ["--spmd", "--cores", 2]
    r = run_cli(*spmd, "--data", "synthetic", "--epochs", 1, "--steps-per-epoch", 5,
                "--momentum", 0, "--out-dir", run, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # Saved without momentum buffers: the resumed run must not expect them in the checkpoint.
    r = run_cli(*spmd, "--resume", run, "--epochs", 2, "--momentum", 0.9, cwd=tmp_path)
    assert r.returncode == 0 and "| equal" in r.stdout, r.stderr
    ckpt = final_weights(run)
    assert ckpt["optimizer"]["param_groups"][0]["momentum"] == 0.9
    assert sorted(ckpt["optimizer"]["state"]) == [0, 1, 2, 3]  # buffers made by epoch 2's steps


CHILD_SCRIPT = r"""
import sys
import train_tpu as tt
args = tt.parse_args(sys.argv[1:])
tt.select_runtime()
tt.prepare_out_dir(args)
try:
    with tt.run_files():
        # nprocs=None, as on a TPU VM: the replica is a thread of a child process (one, on
        # the CPU), where Python cannot install a signal handler from the replica itself.
        tt.spawn_replicas(args, "CPU", cores=2)
except tt.TrainingFailed as e:
    print(f"train_tpu.py: failed: {e}", file=sys.stderr)
    sys.exit(e.code)
"""


@pytest.mark.parametrize("to, workers", [("launcher", 0), ("process group", 0),
                                        ("process group", 2)])
def test_sigterm_stops_replicas_that_run_in_a_child_process(to, workers, tmp_path):
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=HERE)
    env.pop("CPU_NUM_DEVICES", None)
    out = tmp_path / "run"
    # With DataLoader workers, they get the group's SIGTERM too and must leave it to the replica.
    p = subprocess.Popen([sys.executable, "-u", "-c", CHILD_SCRIPT, "--data", "synthetic",
                          "--epochs", "1", "--num-workers", str(workers), "--out-dir", str(out)],
                         env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    for line in p.stdout:  # printed by the replica, in the child process
        if line.startswith("epoch 1 step 40/"):
            # `kill PID` reaches the launcher only; a VM's shutdown reaches every process.
            (p.send_signal if to == "launcher" else
             lambda s: os.killpg(p.pid, s))(signal.SIGTERM)
            break
    _, err = p.communicate(timeout=200)
    assert p.returncode == 143, err
    stopped = re.search(r"stopped by SIGTERM at epoch 1 step (\d+), checkpoint saved", err)
    assert stopped, err
    saved = final_weights(out)
    assert (saved["epoch"], saved["step"]) == (1, int(stopped.group(1)))


def test_resume_from_further_back_sets_later_checkpoints_aside_in_this_runs_steps(tmp_path):
    common = ["--cores", 1, "--data", "synthetic", "--epochs", 1, "--steps-per-epoch", 30]
    r = run_cli(*common, "--batch-size", 64, "--save-steps", 10, "--keep-checkpoints", 10,
                "--out-dir", "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    early = tmp_path / "run" / "checkpoint-epoch-0000-step-000010.pt"  # 10 steps of 64 in
    later = sorted(os.listdir(tmp_path / "run"))
    # 640 samples are 6.67 steps of 96: refused, and the run folder is left as it was.
    r = run_cli("--resume", early, "--batch-size", 96, cwd=tmp_path)
    assert r.returncode == 2 and "not a whole number of steps" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path / "run")) == later
    # With 128 per step (-> 5 steps done of 15) it continues, and what came after is set aside.
    r = run_cli("--resume", early, "--batch-size", 128, "--steps-per-epoch", 15, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "continuing at epoch 1 of 1 after step 5" in r.stdout
    assert "2 checkpoint(s) taken after this one moved to" in r.stdout
    (aside,) = os.listdir(tmp_path / "run" / "superseded")
    assert sorted(os.listdir(tmp_path / "run" / "superseded" / aside)) == [
        "checkpoint-epoch-0000-step-000020.pt", "checkpoint.pt"]
    # --resume of the folder now finds this run's end, not the abandoned one's.
    assert tt.find_checkpoint(str(tmp_path / "run")) == (
        "xm.save", str(tmp_path / "run" / "checkpoint.pt"))
    assert final_weights(tmp_path / "run")["global_batch"] == 128


# ---- the host side: profiler trace, bf16 -------------------------------------------------------


def test_profile_leaves_a_trace_to_open(tmp_path):
    r = run_cli("--cores", 1, "--data", "synthetic", "--epochs", 1, "--steps-per-epoch", 16,
                "--profile", tmp_path / "trace", "--out-dir", tmp_path / "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"profile | steps 3-12 traced into {tmp_path / 'trace'}: tensorboard" in r.stdout
    traces = [os.path.join(root, n) for root, _, names in os.walk(tmp_path / "trace")
              for n in names if n.endswith((".xplane.pb", ".trace.json.gz"))]
    assert len(traces) == 2 and all(os.path.getsize(t) > 1000 for t in traces), traces
    r = run_cli("--steps-per-epoch", 12, "--profile", tmp_path / "t2", cwd=tmp_path)
    assert r.returncode == 2 and "must be more than 12" in r.stderr


def test_bf16_trains_in_bfloat16_and_passes_the_smoke_verdict(tmp_path):
    r = run_cli("--smoke", "--cores", 1, "--bf16", "--report", tmp_path / "r.json",
                "--out-dir", tmp_path / "run", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    checks = {c["name"]: c for c in json.load(open(tmp_path / "r.json"))["checks"]}
    assert all(c["passed"] for c in checks.values())
    assert "(tolerance 5e-02, bfloat16 autocast on both sides)" in checks["numerics"]["figure"]
    # The first step's loss, against float32 in eager PyTorch on the same weights and batch:
    # bfloat16 moves it a little (float32 on the device agrees to about 1e-7).
    images, labels = tt.synthetic_digits(tt.SYNTHETIC_TRAIN, tt.SYNTHETIC_DATA_SEED)
    loader, sampler = tt.train_loader(images, labels, 128, 1, 0, 0, 0)
    sampler.set_epoch(1)
    batch = next(iter(loader))
    torch.manual_seed(0)
    with torch.no_grad():
        logits = tt.ToyModel()(tt.model_input(batch["image"]))
        float32 = F.cross_entropy(logits, batch["label"]).item()
    first = tt.read_history(str(tmp_path / "run"))[0][0]
    assert (first["epoch"], first["step"]) == (1, 1)
    assert 1e-5 < abs(first["loss"] - float32) / float32 < 1e-2


# ---- the template: two edits make it train your own model on your own data -------------------

YOUR_DATA = '''
def prepare_data(args):
    pass  # in memory: nothing to download


def load_split(args, train):
    """Colour patches, 3 x 16 x 16: the class is the channel that is brighter."""
    g = torch.Generator().manual_seed(0 if train else 1)
    n = 4096 if train else 1000
    labels = torch.randint(0, 3, (n,), generator=g)
    images = torch.randn(n, 3, 16, 16, generator=g)
    images[torch.arange(n), labels] += 1.0
    return images, labels


def model_input(images):
    return images  # float already


'''

YOUR_MODEL = '''

class PatchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 16 * 16, 3)

    def forward(self, x):
        return self.head(torch.flatten(F.relu(self.conv(x)), 1))


def build_model(args):
    return PatchNet()


'''


def replace_section(source, banner, next_banner, text):
    start = source.index("\n# ---- " + banner)
    start = source.index("\n", start + 1) + 1
    end = source.index("\n# ---- " + next_banner)
    return source[:start] + text + source[end:]


@pytest.mark.parametrize("mode", [["--cores", "1"], ["--spmd", "--cores", "2"]],
                         ids=["1core", "spmd2"])
def test_two_edits_train_smoke_and_resume_your_own_model(mode, tmp_path):
    with open(os.path.join(HERE, "train_tpu.py")) as f:
        source = f.read()
    source = replace_section(source, "data: your own", "model: your own", YOUR_DATA)
    source = replace_section(source, "model: your own", "layerdrop:", YOUR_MODEL)
    (tmp_path / "train_tpu.py").write_text(source)
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("CPU_NUM_DEVICES", None)

    def run(*argv):
        return subprocess.run([sys.executable, "train_tpu.py", *mode, *map(str, argv)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    r = run("--smoke", "--steps-per-epoch", 10, "--report", "r.json", "--out-dir", "run")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert "model PatchNet" in r.stdout
    assert json.load(open(tmp_path / "r.json"))["passed"] is True  # every check, 90% included
    r = run("--resume", "run", "--epochs", 3)
    assert r.returncode == 0, r.stderr
    assert "continuing at epoch 3 of 3" in r.stdout and "| equal" in r.stdout
    assert [e["epoch"] for e in epochs_of(tmp_path / "run")] == [1, 2, 3]
    assert epochs_of(tmp_path / "run")[-1]["accuracy"] > 90.0


def test_the_newest_checkpoint_is_the_one_furthest_in_samples(tmp_path):
    model = tt.ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    args = tt.parse_args(["--data", "synthetic"])

    def save(name, step, global_batch):
        torch.save(tt.checkpoint_dict(model, optimizer, (2, step), args, 1.0, 50.0, "CPU",
                                      global_batch), tmp_path / name)

    # 100 steps of 128 (12,800 samples), then resumed with 256 per step and saved at step 60
    # (15,360 samples): the second is further along although its step number is smaller.
    save("checkpoint-epoch-0001-step-000100.pt", 100, 128)
    save("checkpoint.pt", 60, 256)
    assert tt.find_checkpoint(str(tmp_path)) == ("xm.save", str(tmp_path / "checkpoint.pt"))
    assert tt.saved_position("xm.save", str(tmp_path / "checkpoint.pt")) == (2, 15360)


def test_resume_into_a_folder_holding_another_run_is_refused(synthetic_run, tmp_path, capsys):
    _, source = synthetic_run
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"kind": "epoch", "epoch": 1}\n')
    assert tt.main(["--resume", str(source), "--out-dir", str(other)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (other / "metrics.jsonl").read_text() == '{"kind": "epoch", "epoch": 1}\n'


def test_a_stop_signal_leaves_nothing_behind_when_the_run_ends(monkeypatch):
    import threading

    before = signal.getsignal(signal.SIGTERM)
    with tt.run_files():
        stop = os.environ[tt.STOP_FILE]
        tt.on_stop_signal(signal.SIGTERM, None)  # as Python would call it
        assert tt.stop_requested() == signal.SIGTERM and os.path.exists(stop)
        (grace,) = tt.GRACE_TIMERS
        assert grace.is_alive()  # would end the process if the run did not end in time
    # The run ended: a notebook's kernel must not be killed 120 s later, nor keep the handler.
    assert grace.finished.is_set()
    grace.join(5)
    assert not grace.is_alive()
    assert signal.getsignal(signal.SIGTERM) == before
    assert tt.STOP_FILE not in os.environ and not os.path.exists(os.path.dirname(stop))
    assert tt.stop_requested() == 0


def test_a_failing_input_pipeline_fails_the_epoch_instead_of_ending_it(tmp_path):
    # MpDeviceLoader's feeder thread swallows the DataLoader's exception and ends the epoch.
    patch = ("real = tt.Examples.__getitem__\n"
             "calls = []\n"
             "def getitem(self, i):\n"
             "    calls.append(1)\n"
             "    if len(calls) == 6:\n"
             "        raise OSError('a bad disk block')\n"
             "    return real(self, i)\n"
             "tt.Examples.__getitem__ = getitem\n"
             "xr.world_size = lambda: 1")  # this one runs at world 1
    r = run_emulated("--cores", 1, "--data", "synthetic", "--epochs", 1, "--steps-per-epoch", 20,
                     "--out-dir", tmp_path / "run", cwd=tmp_path, patch=patch)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines()[-1] == ("train_tpu.py: failed: the input pipeline stopped after "
                                         "step 5 of 20 in epoch 1 (an error in the dataset or a "
                                         "DataLoader worker)")
    assert not (tmp_path / "run" / "checkpoint.pt").exists()  # no checkpoint claims the epoch


def test_emulated_world_2_sigterm_saves_waits_and_ends_every_replica(tmp_path):
    # The world > 1 stop: agreement at a boundary, the save, the barrier, end_this_replica.
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=HERE, XLA_ALWAYS_ALLREDUCE="1")
    env.pop("CPU_NUM_DEVICES", None)
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-u", "-c", EMULATED.format(patch=""), "--cores", "1",
                          "--data", "synthetic", "--epochs", "1", "--out-dir", str(out)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith("epoch 1 step 40/"):
            p.send_signal(signal.SIGTERM)
            break
    _, err = p.communicate(timeout=200)
    assert p.returncode == 143, err
    stopped = re.search(r"^train_tpu.py: replica 0: failed: stopped by SIGTERM at epoch 1 step "
                        r"(\d+), checkpoint saved", err, re.M)
    assert stopped, err
    saved = final_weights(out)
    assert (saved["epoch"], saved["step"], saved["global_batch"]) == (1, int(stopped[1]), 256)
