"""The compiled kernels' disk cache is named by our kernel sources (``coda_titan.kernels.kernel_cache``)."""

import os
import shutil
import types
from pathlib import Path

import pytest
import torch

from coda_titan.kernels import kernel_cache


def _tree(root: Path) -> Path:
    (root / "cute").mkdir(parents=True)
    (root / "ref.py").write_text("X = 1\n")
    (root / "cute" / "tstore.py").write_text("class Store:\n    def store(self):\n        return 1\n")
    (root / "notes.txt").write_text("not a source\n")
    return root


def test_digest_follows_every_source_file(tmp_path):
    root = _tree(tmp_path / "kernels")
    first = kernel_cache.sources_digest(root)
    assert first == kernel_cache.sources_digest(root)  # stable while nothing changes
    (root / "notes.txt").write_text("edited\n")
    assert kernel_cache.sources_digest(root) == first  # only .py files name the kernels
    changed = []
    for edit in (lambda: (root / "cute" / "tstore.py").write_text("class Store:\n    def store(self):\n        return 2\n"),
                 lambda: (root / "cute" / "new_epilogue.py").write_text(""),
                 lambda: (root / "ref.py").rename(root / "ref2.py")):
        edit()
        changed.append(kernel_cache.sources_digest(root))
    assert len({first, *changed}) == 4  # a method's body, a new file, a renamed file: each a new folder


def test_the_package_digest_covers_the_cute_kernels(tmp_path):
    """A change to a class of the cute backend alone (what quack's compile key misses) names a new folder."""
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_cache.KERNELS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert kernel_cache.sources_digest(copy) == kernel_cache.sources_digest()
    store = copy / "cute" / "tstore.py"
    store.write_text(store.read_text() + "\n# edited\n")
    assert kernel_cache.sources_digest(copy) != kernel_cache.sources_digest()


def test_pin_points_quack_at_the_sources_folder(tmp_path, monkeypatch):
    cache = types.SimpleNamespace(CACHE_DIR=None)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path))
    got = kernel_cache.pin(cache)
    assert got == cache.CACHE_DIR == os.path.join(str(tmp_path), f"kernels-{kernel_cache.sources_digest()}")
    assert kernel_cache.pin(cache) == got  # computed from $QUACK_CACHE_DIR, never nested in the folder before
    assert kernel_cache.pin(cache, digest="0" * 16) != got
    monkeypatch.delenv("QUACK_CACHE_DIR")
    with pytest.raises(RuntimeError, match="QUACK_CACHE_DIR is not set"):
        kernel_cache.pin(types.SimpleNamespace(CACHE_DIR=None))


def test_pin_in_a_compile_worker_keeps_its_jobs_folder(tmp_path, monkeypatch):
    """quack's pool worker sets CACHE_DIR from its job's path, then imports the job's module (which pins): a worker
    whose environment names another root must still export where the process that asked looks."""
    asked = os.path.join(str(tmp_path / "asker"), f"kernels-{kernel_cache.sources_digest()}")
    worker = types.SimpleNamespace(CACHE_DIR=asked)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "forkserver_env"))
    assert kernel_cache.pin(worker) == asked == worker.CACHE_DIR
    assert not (tmp_path / "forkserver_env").exists()  # nothing made or pruned under the other root
    stale = types.SimpleNamespace(CACHE_DIR=os.path.join(str(tmp_path / "asker"), "kernels-" + "0" * 16))
    assert kernel_cache.pin(stale) == os.path.join(str(tmp_path / "forkserver_env"), os.path.basename(asked))


def test_cache_root_defaults_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CODA_TITAN_CACHE", str(tmp_path))
    root = Path(kernel_cache.cache_root())
    assert root.parent == tmp_path / "quack" and root.name == kernel_cache.gpu_slug() and "/" not in root.name


@pytest.mark.gpu
def test_compiled_kernels_land_in_the_pinned_folder():
    """After the cute backend is imported, quack's compile cache is the sources' folder, and a kernel compiled
    through it is written there (the autotuning winners stay in ``$QUACK_CACHE_DIR`` itself)."""
    import quack.cache

    from coda_titan.kernels import get_backend

    cute = get_backend("cute")
    want = kernel_cache.compiled_dir(os.environ["QUACK_CACHE_DIR"], kernel_cache.sources_digest())
    assert quack.cache.CACHE_DIR == want
    s = torch.rand(256, 1, device="cuda") + 1.0
    cute.rstd_finalize(partials=s, dim=2048, eps=1e-5)
    torch.cuda.synchronize()
    if quack.cache.CACHE_ENABLED:
        assert any(Path(want).rglob("*.o")), f"no compiled kernel under {want}"


def test_pin_keeps_the_folders_used_last(tmp_path):
    """Each source version compiles into a folder of its own: pin keeps its own and the two used before it,
    removes older ones, and leaves the autotuning winners (other folders) alone."""
    tuned = tmp_path / "ABCDEF" / "gemm.autotune.json"
    tuned.parent.mkdir()
    tuned.write_text("{}")
    for age, digest in enumerate(["d0", "d1", "d2", "d3"]):
        folder = Path(kernel_cache.compiled_dir(str(tmp_path), digest))
        (folder / "fp").mkdir(parents=True)
        (folder / "fp" / "k.o").write_bytes(b"o")
        os.utime(folder, (1e9 - age * 100, 1e9 - age * 100))  # d0 used last, d3 first
    cache = types.SimpleNamespace(CACHE_DIR=None)
    kernel_cache.pin(cache, quack_dir=str(tmp_path), digest="new")
    left = sorted(p.name for p in tmp_path.glob("kernels-*"))
    assert left == ["kernels-d0", "kernels-d1", "kernels-new"]
    assert tuned.is_file() and Path(cache.CACHE_DIR).is_dir()
    kernel_cache.pin(cache, quack_dir=str(tmp_path), digest="d1")  # an A/B back to an earlier version: no removal
    assert sorted(p.name for p in tmp_path.glob("kernels-*")) == left


def test_pin_on_a_cache_it_cannot_write(tmp_path, caplog):
    """A cache path that cannot be made (here: under a file) is warned about, not raised at import."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = types.SimpleNamespace(CACHE_DIR=None)
    with caplog.at_level("WARNING"):
        got = kernel_cache.pin(cache, quack_dir=str(blocker / "quack"), digest="d")
    assert got == cache.CACHE_DIR and "Could not prepare the compiled-kernel cache" in caplog.text
