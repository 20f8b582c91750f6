"""Checkpoints on the Hugging Face Hub, offline: export, push, and loading by repo id.

A local folder stands in for the Hub: `HfApi.upload_folder` copies into it and `snapshot_download`
serves from it, applying the allow_patterns it is given as the real one does. Under conftest's
HF_HUB_OFFLINE=1 the real `snapshot_download` shows the fail-fast path.
"""

import json
import pickle
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub.utils import LocalEntryNotFoundError, filter_repo_objects

from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop import evaluate, hub, sample
from minimal_asymloop.sources import DataError

DATA_FILES = {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
EXPORT = DATA_FILES | {"README.md", "configuration_asymloop.py", "modeling_asymloop.py"}  # the .py: transformers' remote code


class FakeHub:
    """A local folder per repo id; records the calls and what each download asked for."""

    def __init__(self, root: Path):
        self.root, self.created, self.allow = root, [], []

    def repo(self, repo_id: str) -> Path:
        return self.root / repo_id.replace("/", "--")

    def api(self):
        hub_ = self

        class Api:
            def create_repo(self, repo_id, private=False, exist_ok=False, **kw):
                hub_.created.append((repo_id, private, exist_ok))
                hub_.repo(repo_id).mkdir(parents=True, exist_ok=True)
                return f"https://huggingface.co/{repo_id}"

            def upload_folder(self, repo_id, folder_path, commit_message=None, **kw):
                shutil.copytree(folder_path, hub_.repo(repo_id), dirs_exist_ok=True)

        return Api

    def snapshot_download(self, repo_id, allow_patterns=None, **kw):
        self.allow.append(allow_patterns)
        src, dst = self.repo(repo_id), self.root / "cache" / repo_id.replace("/", "--")
        if not src.exists():
            raise LocalEntryNotFoundError(f"{repo_id} is not cached")
        dst.mkdir(parents=True, exist_ok=True)
        for name in filter_repo_objects([p.name for p in src.iterdir()], allow_patterns=allow_patterns):
            shutil.copyfile(src / name, dst / name)
        return str(dst)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    fake = FakeHub(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "HfApi", fake.api())
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    monkeypatch.setattr("minimal_asymloop.sources.require_hub", lambda *a, **k: None)  # "reachable"
    monkeypatch.chdir(tmp_path)  # bare owner/name ids must not meet a local folder of that name
    return fake


def logits(model):
    x = torch.arange(1, 17)[None] % model.config.vocab_size
    with torch.no_grad():
        return model(x)[0]


def test_export_is_a_hub_ready_folder_that_loads_like_the_checkpoint(tiny_checkpoint, tmp_path):
    folder = hub.export(tiny_checkpoint, tmp_path / "hf_model", repo="alice/tiny")
    assert {p.name for p in folder.iterdir()} == EXPORT
    model, tok, meta = ckpt.load_model(folder)
    ref, ref_tok, ref_meta = ckpt.load_model(tiny_checkpoint)
    assert torch.equal(logits(model), logits(ref)) and tok.to_str() == ref_tok.to_str()
    same = [k for k in ref_meta if k not in ("path", "checksums")]  # the export's own files have their own checksums
    assert {k: meta[k] for k in same} == {k: ref_meta[k] for k in same}
    assert set(meta["checksums"]) == {"model.safetensors", "tokenizer.json"}

    card = (folder / "README.md").read_text()
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert "library_name: minimal-asymloop\n" in front and "license: mit\n" in front and "- asymloop\n" in front
    tc = ref_meta["train_config"]
    tokens = ref_meta["step"] * tc["global_batch"] * tc["seq_len"]  # 30 steps x 8 x 32
    assert tokens == 7680 and f"| tokens seen | 7,680 ({ref_meta['step']} steps) |" in body
    assert f"| validation loss | {ref_meta['val_loss']:.4f} nats/token" in body
    assert "| loop iterations K | 3 |" in body and "AsymLoop K=3: 1 encoder + 1 decoder blocks, effective depth 4" in body
    assert "`stdlib`, tokenizer `bpe`" in body and 'load_model("hf:alice/tiny")' in body

    with pytest.raises(ckpt.CheckpointError, match="exists and is not an empty folder"):
        hub.export(tiny_checkpoint, folder)
    with pytest.raises(ckpt.CheckpointError, match="has no state.pt .* resuming needs a training checkpoint"):
        ckpt.load_state(folder)


def test_push_then_load_by_repo_id_fetches_weights_and_json_only(tiny_checkpoint, fake_hub, tmp_path, capsys):
    url = hub.push(tiny_checkpoint, "alice/tiny", private=True)
    assert url == "https://huggingface.co/alice/tiny" and fake_hub.created == [("alice/tiny", True, True)]
    repo = fake_hub.repo("alice/tiny")
    assert {p.name for p in repo.iterdir()} == EXPORT
    marker = tmp_path / "pwned"  # files a download must never fetch: a pickle that would run code, a module
    (repo / "pytorch_model.bin").write_bytes(pickle.dumps(0))
    (repo / "modeling_asymloop.py").write_text(f"open({str(marker)!r}, 'w')")

    ref, _, _ = ckpt.load_model(tiny_checkpoint)
    for spec in ("alice/tiny", "hf:alice/tiny", "hf://alice/tiny"):
        model, _, meta = ckpt.load_model(spec)
        assert torch.equal(logits(model), logits(ref)) and meta["hub_repo"] == "alice/tiny"
        assert {p.name for p in Path(meta["path"]).iterdir()} == DATA_FILES
    assert fake_hub.allow == [["*.safetensors", "*.json"]] * 3 and not marker.exists()
    assert "alice/tiny: no local folder of that name; loading the Hugging Face Hub repo alice/tiny" in capsys.readouterr().err

    texts = sample.main(["--ckpt", "alice/tiny", "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0", "--device", "cpu"])
    assert texts == sample.main(["--ckpt", str(tiny_checkpoint), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0",
                                 "--device", "cpu"])
    report = evaluate.main(["--ckpt", "alice/tiny", "--device", "cpu"])  # no --out: into the cwd, not the Hub cache
    local = evaluate.main(["--ckpt", str(tiny_checkpoint), "--device", "cpu", "--out", str(tmp_path / "local.json")])
    assert report["val"] == local["val"]
    assert json.loads((tmp_path / "eval_alice--tiny_k3.json").read_text())["val"] == local["val"]


def test_local_path_or_repo_id_is_unambiguous(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    shutil.copytree(Path(tiny_checkpoint).resolve(), tmp_path / "runs" / "mine", symlinks=True)
    assert hub.hub_repo_id("hf:alice/tiny") == hub.hub_repo_id("hf://alice/tiny") == hub.hub_repo_id("alice/tiny") == "alice/tiny"
    for local in ("runs/mine", "out/typo", "./alice/tiny", "/abs/alice", "a/b/c", "alice", "~/alice"):
        assert hub.hub_repo_id(local) is None, local
    assert ckpt.load_model("runs/mine")[2].get("hub_repo") is None
    # a missing local folder never becomes a download: ./out exists, so out/typo is a local path
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint at out/typo: read as a local path because \./out is a folder; "
                                                   r"for the Hub repo out/typo write hf:out/typo"):
        ckpt.load_model("out/typo")
    with pytest.raises(ckpt.CheckpointError, match="not a Hub repo id: write hf:owner/name"):
        ckpt.load_model("hf:alice")


def test_an_unreachable_hub_fails_fast_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # conftest sets HF_HUB_OFFLINE=1: the real snapshot_download, nothing cached
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_model("hf:nobody/not-in-any-cache-3f9c")
    msg = str(e.value)
    assert msg.startswith("cannot load nobody/not-in-any-cache-3f9c: the model nobody/not-in-any-cache-3f9c needs the Hugging "
                          "Face Hub, but offline mode is on")
    assert "not in the local Hugging Face cache" in msg and "\n" not in msg
    with pytest.raises(SystemExit, match="^error: cannot load nobody/x-3f9c: the model nobody/x-3f9c needs the Hugging Face Hub"):
        sample.main(["--ckpt", "nobody/x-3f9c", "--device", "cpu"])
    with pytest.raises(DataError, match="pushing to alice/tiny needs the Hugging Face Hub, but offline mode is on"):
        hub.push(tmp_path, "alice/tiny")
    with pytest.raises(SystemExit, match="^error: pushing to alice/tiny needs the Hugging Face Hub"):
        hub.main(["push", "--ckpt", str(tmp_path), "--repo", "alice/tiny"])
