"""Offline data: the embedded corpus, the project's BPE tokenizer, and a user's local files."""

import json

import pytest

from coda_titan.titan import data
from coda_titan.titan.data import DataError, ensure_tokenizer
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset

from .conftest import CONFIGS, logged_losses, run_cli

DOCS = [f"def f{i}(x):\n    '''Document {i}.'''\n    return x * {i}\n" * 20 for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer(cache_dir, monkeypatch_module):
    monkeypatch_module.setenv("CODA_TITAN_CACHE", cache_dir)
    return HuggingFaceTokenizer(ensure_tokenizer("coda:stdlib-bpe-2048", log=lambda m: None))


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_embedded_corpus_is_real_python_text():
    files = data.stdlib_files()
    assert len(files) > 200 and files == sorted(files)
    texts = data.stdlib_texts(max_bytes=200_000)
    assert any("def " in t for t in texts) and any('"""' in t for t in texts)


def test_tokenizer_round_trip_and_cache(tokenizer, cache_dir):
    text = "def add(a, b):\n    return a + b  # sum\n"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id and tokenizer.bos_id != tokenizer.eos_id
    assert tokenizer.decode(ids[1:-1]) == text
    assert tokenizer.get_vocab_size() == 2048
    assert len(ids) < len(text) / 2  # merges learned, not bytes
    path = ensure_tokenizer("coda:stdlib-bpe-2048", log=lambda m: pytest.fail("retrained a cached tokenizer"))
    assert path.startswith(str(cache_dir))


@pytest.mark.parametrize("spec", ["coda:stdlib-bpe-abc", "coda:stdlib-bpe-12"])
def test_bad_tokenizer_spec(spec):
    with pytest.raises(DataError, match="coda:stdlib-bpe-<vocab>"):
        ensure_tokenizer(spec)


def test_missing_tokenizer_folder(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        ensure_tokenizer(str(tmp_path / "nope"))


def _write(tmp_path, kind):
    if kind == "jsonl":
        p = tmp_path / "corpus.jsonl"
        p.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    elif kind == "txt":
        p = tmp_path / "corpus.txt"
        p.write_text("\n\n".join(DOCS))  # DOCS hold no blank lines: one paragraph each
    else:
        from datasets import Dataset

        p = tmp_path / "corpus.parquet"
        Dataset.from_dict({"text": DOCS}).to_parquet(str(p))
    return p


@pytest.mark.parametrize("kind", ["jsonl", "txt", "parquet"])
def test_local_files_feed_torchtitan_dataset(tmp_path, tokenizer, kind):
    path = _write(tmp_path, kind)
    ds = HuggingFaceTextDataset("local", str(path), tokenizer, seq_len=64)
    batches = [b for _, b in zip(range(3), iter(ds))]
    assert len(batches) == 3
    (inp, labels) = batches[0]
    assert inp["input"].shape == (64,) and labels.shape == (64,)
    assert (inp["input"][1:] == labels[:-1]).all()
    text = tokenizer.decode(inp["input"].tolist())
    assert "Document" in text


def test_local_folder_and_bad_inputs(tmp_path):
    (tmp_path / "a").mkdir()
    _write(tmp_path / "a", "jsonl")
    assert data.local_files(tmp_path / "a")[0] == "json"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match="no .jsonl"):
        data.local_files(tmp_path / "b")
    with pytest.raises(DataError, match="does not exist"):
        data.local_files(tmp_path / "missing.jsonl")
    no_text = tmp_path / "notext.jsonl"
    no_text.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match="'text' field"):
        DATASETS["local"].loader(str(no_text))


def test_train_on_local_jsonl(tmp_path, cache_dir):
    path = _write(tmp_path, "jsonl")
    proc = run_cli(
        ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--training.dataset", "local", "--training.dataset_path",
         str(path), "--training.steps", "3", "--job.dump_folder", str(tmp_path / "out"),
         "--metrics.disable_color_printing"],
        cwd=tmp_path, cache_dir=cache_dir,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert sorted(logged_losses(proc.stdout + proc.stderr)) == [1, 2, 3]
