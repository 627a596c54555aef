"""cachefs.torch: the sampler's indices and publications, and training end to end on a mount.

The end-to-end tests train a tiny CNN on an image-folder-like set of PNG files read through a
real mount, compare every batch with the same loader reading the source, and read the mount's
per-epoch stats; the two-rank tests run two gloo processes, against two mounts of one source and
against one mount that the two ranks share.
"""

from __future__ import annotations

import io
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as torch_mp  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset  # noqa: E402

from cachefs import order as order_mod  # noqa: E402
from cachefs import publish as publishing  # noqa: E402
from cachefs.torch import CachefsSampler  # noqa: E402

CLASSES = ("cat", "dog", "fox", "owl")
PER_CLASS = 40
IMAGE_SIDE = 16


class ImageFiles(Dataset):
    """The part of torchvision's ImageFolder the sampler relies on, without torchvision.

    `samples` lists (path, class index) by class, then by the number in the file name, so
    img_2.png comes before img_10.png: not the byte order of the mount's default manifest.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.samples = []
        for label, name in enumerate(CLASSES):
            files = sorted((self.root / name).iterdir(), key=lambda p: int(p.stem.split("_")[1]))
            self.samples += [(str(path), label) for path in files]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with open(path, "rb") as f:  # one open and a read to the end: one consumed file
            data = f.read()
        pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32)
        return torch.from_numpy(pixels).permute(2, 0, 1) / 255.0, label


def make_image_folder(root: Path) -> int:
    """PNGs of noise tinted by class; returns the total size in bytes."""
    rng = np.random.default_rng(7)
    total_bytes = 0
    for label, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(PER_CLASS):
            # noise of varying amplitude: PNGs of varying size, so bytes tell files apart
            noise = int(rng.integers(4, 160))
            pixels = rng.integers(0, noise, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
            pixels[..., label % 3] += 90
            path = root / name / f"img_{i}.png"
            Image.fromarray(pixels).save(path)
            total_bytes += path.stat().st_size
    return total_bytes


@pytest.fixture
def image_folder(tmp_path) -> tuple[Path, int]:
    src = tmp_path / "src"
    return src, make_image_folder(src)


@pytest.fixture
def one_torch_thread():
    """A tiny model: intra-op threads would only fight the loader's workers for 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, len(CLASSES)))


def epoch_record(stats: dict, epoch: int) -> dict:
    matching = [record for record in stats["epochs"] if record["epoch"] == epoch]
    assert matching, f"no stats for epoch {epoch}: {stats['epochs']}"
    return matching[0]


# -- without a mount -------------------------------------------------------------------------

def test_import_cachefs_does_not_import_torch():
    code = ("import cachefs, cachefs.order, cachefs.publish, sys; "
            "assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("length", [1, 3, 10, 161])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_unshuffled_indices_are_distributed_samplers(length, world_size, drop_last):
    for rank in range(world_size):
        ours = CachefsSampler(length, None, shuffle=False, num_replicas=world_size, rank=rank,
                              drop_last=drop_last)
        theirs = DistributedSampler(range(length), num_replicas=world_size, rank=rank,
                                    shuffle=False, drop_last=drop_last)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_ranks_split_the_documented_permutation(drop_last):
    length, world_size, seed, epoch = 23, 4, 5, 3
    samplers = [CachefsSampler(length, None, seed=seed, num_replicas=world_size, rank=rank,
                               drop_last=drop_last) for rank in range(world_size)]
    per_rank = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    full = order_mod.permutation(length, seed, epoch)
    expected_length = length // world_size if drop_last else math.ceil(length / world_size)
    assert all(len(indices) == expected_length for indices in per_rank)
    # position p of the (padded or cut) permutation goes to rank p % world_size
    interleaved = [per_rank[p % world_size][p // world_size]
                   for p in range(expected_length * world_size)]
    assert interleaved == list(np.resize(full, expected_length * world_size))


def test_rank_and_world_size_come_from_torch_distributed(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        sampler = CachefsSampler(10, None)
        assert (sampler.rank, sampler.num_replicas) == (0, 1)
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="Invalid rank 2"):
        CachefsSampler(10, None, num_replicas=2, rank=2)


def test_publishes_each_epoch_once_with_the_dataset_manifest(image_folder, monkeypatch):
    src, _ = image_folder
    calls = []
    monkeypatch.setattr(publishing, "publish", lambda mount, epoch, current, **kw: calls.append(
        dict(mount=mount, epoch=epoch, current=current, **kw)) or
        {"length": len(current), "total_length": len(current)})
    dataset = ImageFiles(src)  # the source directory stands in for a mount here
    sampler = CachefsSampler(dataset, src, seed=3, num_replicas=2, rank=1)
    sampler.set_epoch(4)
    first = list(sampler)
    assert [call["epoch"] for call in calls] == [4]  # not again at iter()
    call = calls[0]
    assert np.array_equal(call["current"], order_mod.permutation(len(dataset), 3, 4))
    assert np.array_equal(call["next"], order_mod.permutation(len(dataset), 3, 5))
    assert (call["rank"], call["world_size"]) == (1, 2)
    assert [os.fsdecode(path) for path in call["files"]] == \
        [os.path.relpath(path, src) for path, _ in dataset.samples]
    assert first == order_mod.rank_slice(call["current"], 1, 2).tolist()
    second = list(sampler)  # iterated again without set_epoch: the next epoch, like RandomSampler
    assert [call["epoch"] for call in calls] == [4, 5]
    assert second == order_mod.rank_slice(calls[1]["current"], 1, 2).tolist() != first
    sampler.set_epoch(5)  # already published
    assert len(calls) == 2
    # a Subset publishes its own samples, in its own index order
    subset = Subset(dataset, [7, 3, 100])
    CachefsSampler(subset, src, seed=0).set_epoch(0)
    assert [os.fsdecode(path) for path in calls[-1]["files"]] == \
        ["cat/img_7.png", "cat/img_3.png", "fox/img_20.png"]
    # a plain length publishes no manifest: indices into the mount's default one
    CachefsSampler(len(dataset), src).set_epoch(0)
    assert calls[-1]["files"] is None


def test_sample_path_outside_the_mount_is_a_clear_error(image_folder, tmp_path):
    src, _ = image_folder
    elsewhere = tmp_path / "mnt"
    elsewhere.mkdir()
    with pytest.raises(ValueError, match=r"img_0\.png.*is not under the cachefs mount"):
        CachefsSampler(ImageFiles(src), elsewhere)
    with pytest.raises(ValueError, match="2 paths in files but the data set has 3 samples"):
        CachefsSampler(3, elsewhere, files=["a", "b"])
    # explicit files: relative to the mount, absolute ones made relative
    sampler = CachefsSampler(2, elsewhere, files=["x/a.png", str(elsewhere / "y" / "b.png")])
    assert sampler.files.tolist() == [b"x/a.png", b"y/b.png"]


# -- on a real mount -------------------------------------------------------------------------

@pytest.mark.parametrize("tiers", ["ram", "ram+ssd"])
def test_training_reads_the_same_batches_and_hits_the_cache(image_folder, mounter, tmp_path,
                                                            tiers, one_torch_thread):
    src, total_bytes = image_folder
    ram_bytes = int(total_bytes * 0.4)  # the RAM tier holds 40 % of the data set
    ssd_args = ["--ssd-cache", tmp_path / "ssd", "--ssd-size", "16MiB"] if "ssd" in tiers else []
    mount = mounter(src, "--ram-cache", str(ram_bytes), "--block-size", "4KiB", *ssd_args)
    on_mount, on_source = ImageFiles(mount.mountpoint), ImageFiles(src)
    sampler = CachefsSampler(on_mount, mount.mountpoint, seed=0)
    reference_sampler = CachefsSampler(on_source, None, seed=0)
    loader = DataLoader(on_mount, batch_size=8, num_workers=2, sampler=sampler)
    reference = DataLoader(on_source, batch_size=8, num_workers=2, sampler=reference_sampler)
    torch.manual_seed(0)
    model = tiny_cnn()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    epochs = 3
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        reference_sampler.set_epoch(epoch)
        batches = 0
        for (inputs, labels), (expected_inputs, expected_labels) in zip(loader, reference,
                                                                        strict=True):
            assert torch.equal(inputs, expected_inputs)
            assert torch.equal(labels, expected_labels)
            optimiser.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            loss.backward()
            optimiser.step()
            batches += 1
        assert batches == len(on_mount) // 8
        assert math.isfinite(loss.item())
    # the published manifest is the dataset's order, not the mount's sorted listing
    with np.load(mount.order_file) as published:
        assert [os.fsdecode(p) for p in published["files"]] == \
            [os.path.relpath(path, mount.mountpoint) for path, _ in on_mount.samples]
    stats = mount.stats()
    assert stats["last_rejection"] is None
    for epoch in range(epochs):
        # the kernel reports a file's close just after the reader closed it
        record = wait_epoch_reads(mount, epoch, len(on_mount))
        assert record["reads"] == len(on_mount), record
        # the whole record (pytest cuts a dict short): which counters moved with a refetch
        assert record["refetched_blocks"] == 0, json.dumps(
            {"record": record, "ram": stats.get("ram"), "kernel": stats.get("kernel")})
        if epoch == 0:  # nothing cached yet: every file from the source, once
            assert record["backend_bytes"] == total_bytes, record
            continue
        assert record["hits_ram"] + record["hits_ssd"] > 0, record
        if "ssd" in tiers:  # the SSD tier keeps what epoch 0 read: no source read after it
            # SSD admission is asynchronous: an item consumed before its entry was written
            # stays in RAM for the next epoch (prefetch.priority_of), so some hits may be RAM's
            assert record["hits_ram"] + record["hits_ssd"] == len(on_mount), record
            assert record["hits_ssd"] > 0 and record["backend_bytes"] == 0, record
        else:  # RAM kept the head of this epoch; the rest came from the source again
            assert 0 < record["backend_bytes"] < total_bytes, record


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, mountpoints: list[str], epochs: int,
               results: str) -> None:
    """One trainer rank: gloo process group, its own mount, reads its share `epochs` times."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        dataset = ImageFiles(mountpoints[rank])
        sampler = CachefsSampler(dataset, mountpoints[rank], seed=1)  # rank from dist
        seen = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            indices = list(sampler)
            for index in indices:
                dataset[index]
            seen.append(indices)
        count = torch.tensor([sum(map(len, seen))])
        dist.all_reduce(count)  # the group works: both ranks read their share
        np.save(Path(results) / f"rank{rank}.npy", np.array(seen))
        assert count.item() == epochs * len(sampler) * world_size
    finally:
        dist.destroy_process_group()


def test_two_ranks_each_fetch_only_their_half(image_folder, mounter, tmp_path):
    src, total_bytes = image_folder
    lookahead = 4
    mounts = [mounter(src, "--lookahead", str(lookahead), "--block-size", "4KiB")
              for _ in range(2)]
    epochs, world_size = 2, 2
    # fork, not spawn: a spawned rank imports torch again, some 10 s each on a busy machine
    torch_mp.start_processes(_rank_main, nprocs=world_size, join=True, start_method="fork",
                             args=(world_size, _free_port(), [str(m.mountpoint) for m in mounts],
                                   epochs, str(tmp_path)))
    dataset = ImageFiles(src)
    sizes = np.array([os.path.getsize(path) for path, _ in dataset.samples])
    share = math.ceil(len(dataset) / world_size)
    for rank, mount in enumerate(mounts):
        seen = np.load(tmp_path / f"rank{rank}.npy")
        stats = mount.stats()
        assert (stats["order"]["rank"], stats["order"]["world_size"]) == (rank, world_size)
        for epoch in range(epochs):
            mine = order_mod.rank_slice(order_mod.permutation(len(dataset), 1, epoch), rank,
                                        world_size)
            following = order_mod.rank_slice(order_mod.permutation(len(dataset), 1, epoch + 1),
                                             rank, world_size)
            assert seen[epoch].tolist() == mine.tolist()
            record = wait_epoch_reads(mount, epoch, share)
            assert record["reads"] == share, record
            assert record["refetched_blocks"] == 0, record
            # what this epoch's record can hold: this rank's files of the epoch, and the head
            # of its next epoch's share (the read-ahead window crosses the epoch boundary)
            allowed = np.union1d(mine, following[:lookahead])
            assert record["backend_bytes"] <= sizes[allowed].sum(), (record, sizes[mine].sum())
            if epoch == 0:  # nothing cached before: all of this rank's files, once
                assert record["backend_bytes"] >= sizes[mine].sum(), record
            # and so well short of the whole data set, which the other rank reads
            assert record["backend_bytes"] < 0.6 * total_bytes, record


def _shared_mount_rank_main(rank: int, world_size: int, port: int, mountpoint: str, source: str,
                            epochs: int, results: str) -> None:
    """One rank of a node whose ranks share one mount; the barriers stand for the gradient
    all-reduce that keeps data-parallel ranks in step (every rank has published an epoch
    before any reads it, and has read it before any publishes the next)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        dataset = ImageFiles(mountpoint)
        sampler = CachefsSampler(dataset, mountpoint, seed=2)  # rank, world size from dist
        seen = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            dist.barrier()
            indices = list(sampler)
            for index in indices:
                path = Path(dataset.samples[index][0])
                expected = Path(source) / path.relative_to(mountpoint)
                assert path.read_bytes() == expected.read_bytes(), path
            seen.append(indices)
            dist.barrier()
        np.save(Path(results) / f"shared{rank}.npy", np.array(seen))
    finally:
        dist.destroy_process_group()


def test_two_ranks_share_one_mount_and_the_daemon_merges_their_slices(image_folder, mounter,
                                                                      tmp_path):
    src, total_bytes = image_folder
    mount = mounter(src, "--ram-cache", str(total_bytes // 2), "--block-size", "4KiB")
    epochs, world_size = 3, 2
    torch_mp.start_processes(_shared_mount_rank_main, nprocs=world_size, join=True,
                             start_method="fork",
                             args=(world_size, _free_port(), str(mount.mountpoint), str(src),
                                   epochs, str(tmp_path)))
    dataset = ImageFiles(src)
    share = math.ceil(len(dataset) / world_size)
    for rank in range(world_size):  # each rank read exactly its own slice
        seen = np.load(tmp_path / f"shared{rank}.npy")
        for epoch in range(epochs):
            assert seen[epoch].tolist() == order_mod.rank_slice(
                order_mod.permutation(len(dataset), 2, epoch), rank, world_size).tolist()
    # each rank published its own file, and the mount's order is both slices merged
    state = mount.order_file.parent
    assert not mount.order_file.exists()
    assert sorted(p.name for p in state.glob("order.rank*.npz")) == \
        ["order.rank0.npz", "order.rank1.npz"]
    # the last closes are counted a moment after the ranks ended, and the last of them
    # moves the order on
    wait_epoch_reads(mount, epochs - 1, world_size * share)
    stats = mount.stats()
    order = stats["order"]
    assert order["ranks"] == [0, 1] and order["world_size"] == world_size
    assert order["length"] == world_size * share == order["total_length"]
    assert len(order["files"]) == 2 and stats["rejections"] == []
    assert all(p["in_force"] for p in stats["publications"])
    assert order["epoch"] == epochs  # consumed the last epoch, moved on to its next order
    for epoch in range(epochs):
        record = wait_epoch_reads(mount, epoch, world_size * share)
        assert record["reads"] == world_size * share, record  # one epoch record, both ranks
        # no file read twice from the source; the whole record (pytest cuts a dict short)
        assert record["refetched_blocks"] == 0, json.dumps(
            {"record": record, "ram": stats.get("ram"), "kernel": stats.get("kernel"),
             "order": stats.get("order"), "publications": stats.get("publications")})
        assert record["backend_bytes"] <= total_bytes, record
        if epoch == 0:  # every file of the data set once: the node reads all of it
            assert record["backend_bytes"] == total_bytes, record
        else:  # RAM kept the head of the merged next epoch for both ranks
            assert record["hits_ram"] > 0, record
            assert record["backend_bytes"] < total_bytes, record


def wait_epoch_reads(mount, epoch: int, reads: int) -> dict:
    """The epoch's record once `reads` releases are counted (RELEASE comes after close())."""
    deadline = time.monotonic() + 10
    while True:
        record = epoch_record(mount.stats(), epoch)
        if record["reads"] >= reads or time.monotonic() > deadline:
            return record
        time.sleep(0.02)
