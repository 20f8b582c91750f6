"""Share a trained model on the Hugging Face Hub, and load one from it.

    python -m minimal_asymloop.hub export --ckpt out/tiny-asymloop-k3 --to hf_model/        # a Hub-ready folder
    python -m minimal_asymloop.hub push --ckpt out/tiny-asymloop-k3 --repo you/asymloop-tiny # export + upload
    python -m minimal_asymloop.sample --ckpt you/asymloop-tiny                               # load from the Hub

An exported folder holds model.safetensors (the weights), config.json (the checkpoint's meta.json: model
config, training config, step, val loss, data; and transformers' config), tokenizer.json + tokenizer_config.json,
README.md (a model card generated from config.json) and transformers' remote code (hf_files.py), so it also loads with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` without this package (docs/hub.md).
`checkpoint.load_model` reads such a folder, locally or from the Hub. A download fetches *.safetensors and *.json
only, so loading never runs code from it.

Which `--ckpt` is the Hub (ours): `hf:owner/name` always is; a path that exists is always local;
`owner/name` is the Hub unless `owner` is a local folder; anything else is a local path.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import Tokenizer

from minimal_asymloop.checkpoint import (  # noqa: F401 (the --ckpt rule, re-exported: hub.resolve)
    HUB_PREFIX,
    REPO_ID,
    CheckpointError,
    download,
    file_checksum,
    hub_repo_id,
    load_model,
    read_meta,
    read_weights,
    resolve,
    verify,
)
from minimal_asymloop.flops import count_params
from minimal_asymloop.hf_files import write_hf_files
from minimal_asymloop.model import ModelConfig
from minimal_asymloop.runfolder import os_error_line
from minimal_asymloop.sources import eot_id

ARCH_NAMES = {"dense": "Dense", "full_loop": "Full Loop", "asymloop": "AsymLoop"}


# ----------------------------------------------------------------------------- export: a Hub-ready folder


def tokens_seen(meta: dict) -> int | None:
    tc = meta.get("train_config", {})
    return meta["step"] * tc["global_batch"] * tc["seq_len"] if {"global_batch", "seq_len"} <= tc.keys() else None


def model_card(meta: dict, license: str, repo: str) -> str:
    """README.md for the Hub: YAML front matter, then the architecture, K, data, tokens seen and val loss."""
    cfg = ModelConfig(**meta["model_config"])
    tc, data = meta.get("train_config", {}), meta.get("data", {})
    tokens, val = tokens_seen(meta), meta.get("val_loss")
    arch = f"{ARCH_NAMES[cfg.arch]}" + (f" K={cfg.n_iter}" if cfg.arch != "dense" else "")
    blocks = (f"{cfg.n_enc} encoder + {cfg.n_layer - cfg.n_enc} decoder blocks" if cfg.arch == "asymloop"
              else f"{cfg.n_layer} blocks")
    tok = data.get("tokenizer", {})
    datasets = "\ndatasets:\n- HuggingFaceFW/fineweb-edu" if str(data.get("source", "")).startswith("fineweb-edu") else ""
    rows = [("architecture", f"{arch}: {blocks}, effective depth {cfg.effective_depth}"
                             + (f", context `{cfg.context}`" if cfg.arch == "asymloop" else "")),
            ("loop iterations K", cfg.n_iter if cfg.arch != "dense" else "1 (no loop)"),
            ("width", f"d_model {cfg.d_model}, {cfg.n_head} heads, d_ff {cfg.d_ff}, QKNorm {'on' if cfg.qk_norm else 'off'}, "
                      f"backbone {cfg.backbone}" + (f", MoE {cfg.moe_experts} experts top-{cfg.moe_top_k}" if cfg.moe_experts else "")),
            ("parameters", f"{count_params(cfg) / 1e6:.2f}M"),
            ("vocabulary, context", f"{cfg.vocab_size}, {cfg.max_seq_len} tokens"),
            ("data", f"`{data.get('source', tc.get('data', '?'))}`, tokenizer `{tok.get('name', tc.get('tokenizer', '?'))}`"),
            ("tokens seen", f"{tokens:,} ({meta['step']:,} steps)" if tokens is not None else f"{meta.get('step')} steps"),
            ("validation loss", f"{val:.4f} nats/token (perplexity {math.exp(val):.1f}) on the held-out split"
                                if val is not None else "not evaluated at this step")]
    if data.get("unigram_entropy"):
        rows.append(("context-free baseline", f"{data['unigram_entropy']:.4f} nats/token (unigram entropy of the held-out split)"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"""---
library_name: minimal-asymloop
license: {license}
tags:
- asymloop
- looped-transformer
- pytorch
- safetensors
- text-generation{datasets}
---

# {repo}

{"An" if arch[0] in "AEIOU" else "A"} {arch} language model trained with minimal-asymloop, a reference implementation of Asymmetric Looped
Transformers (Liang et al., 2026, arXiv 2610.28489). A causal encoder runs once and builds a Global KV for
every decoder layer; a weight-tied decoder then runs K times, attending to the Global KV and its own
Local KV under one softmax.

| | |
|---|---|
{table}

## Use

```bash
# with minimal-asymloop installed (pip install -e . in a clone of its repository)
python -m minimal_asymloop.sample --ckpt hf:{repo} --prompt "def main("
python -m minimal_asymloop.evaluate --ckpt hf:{repo}
```

```python
model, tokenizer, meta = load_model("hf:{repo}")
```

With transformers only (the modeling code travels in this repository, generated from minimal-asymloop's source):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("{repo}", trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained("{repo}", trust_remote_code=True)
print(tok.decode(model.generate(**tok("Looped transformers", return_tensors="pt"), max_new_tokens=20)[0]))
```

`model.generate(..., n_iter=6)` runs the decoder 6 times (test-time depth); `exit_threshold=0.01, max_iter=6` stops
each token once its prediction settles. `lm_eval --model hf --model_args pretrained={repo},trust_remote_code=True`
evaluates it.

Files: `model.safetensors` (weights), `config.json` (model and training configuration, step, validation
loss, data, checksums), `tokenizer.json` + `tokenizer_config.json`, and transformers' `configuration_asymloop.py`
and `modeling_asymloop.py`. minimal-asymloop's own loader reads only the weights and JSON, so it never runs code
from the repository; transformers runs the two .py files only with `trust_remote_code=True`.
"""


def export(ckpt, to, license: str = "mit", repo: str = "owner/name") -> Path:
    """Write the Hub-ready folder `to` from a checkpoint folder, a run's out_dir or an earlier export.
    `repo` is the Hub repo id the model card names."""
    meta = read_meta(resolve(ckpt))
    src, to = Path(meta.pop("path")), Path(to)
    meta.pop("hub_repo", None)
    verify(src, meta, ["model.safetensors", "tokenizer.json"])  # never share a corrupt checkpoint
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise CheckpointError(f"--to {to} exists and is not an empty folder; choose a new folder or remove it")
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{to.name}.tmp-", dir=to.parent))  # same file system: the final move is a rename
    try:
        weights = read_weights(src, meta)  # verified again: the bytes copied are the bytes checked
        save_file({f"model.{n}": t for n, t in weights.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
        meta["checksums"] = {}  # filled below, once tokenizer.json is written too
        write_hf_files(tmp, meta, tok, eot_id(tok))
        meta["checksums"] = {f: file_checksum(tmp / f) for f in ("model.safetensors", "tokenizer.json")}
        config = json.loads((tmp / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps({**config, "checksums": meta["checksums"]}, indent=1))
        (tmp / "README.md").write_text(model_card(meta, license, repo))
        if to.exists():
            to.rmdir()
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's folder is private; an export is meant to be shared
        tmp.rename(to)  # a half-written export never sits at `to`
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return to


def push(ckpt, repo: str, private: bool = False, license: str = "mit") -> str:
    """Export `ckpt` and upload it to the Hub repo `repo` (created if needed); returns the repo's URL."""
    from huggingface_hub import HfApi

    from minimal_asymloop.sources import require_hub

    if not REPO_ID.fullmatch(repo.removeprefix(HUB_PREFIX)):
        raise CheckpointError(f"--repo {repo!r} is not a Hub repo id: write owner/name")
    repo = repo.removeprefix(HUB_PREFIX)
    require_hub(f"pushing to {repo}", alternatives="export a folder now with `python -m minimal_asymloop.hub export` "
                                                  "and push it later with --ckpt FOLDER")
    with tempfile.TemporaryDirectory() as tmp:
        folder = export(ckpt, Path(tmp) / "model", license, repo)
        api = HfApi()
        url = api.create_repo(repo, private=private, exist_ok=True)
        meta = json.loads((folder / "config.json").read_text())
        api.upload_folder(repo_id=repo, folder_path=str(folder),
                          commit_message=f"{meta['model_config']['arch']} K={meta['model_config']['n_iter']} at step {meta['step']}")
    return str(url)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write a Hub-ready folder (weights, config, tokenizer, model card)")
    e.add_argument("--to", required=True, help="a new (or empty) folder")
    e.add_argument("--repo", default="owner/name", help="the Hub repo id the model card names (for a later upload)")
    u = sub.add_parser("push", help="export and upload to a Hub repo (created if needed)")
    u.add_argument("--repo", required=True, help="owner/name on the Hub")
    u.add_argument("--private", action="store_true")
    for s in (e, u):
        s.add_argument("--ckpt", required=True, help="a run's out_dir (its latest checkpoint), a checkpoint folder or an export")
        s.add_argument("--license", default="mit", help="the model card's license (ours: the code's MIT by default)")
    args = p.parse_args(argv)
    from minimal_asymloop.sources import DataError

    try:
        if args.cmd == "export":
            print(f"wrote {export(args.ckpt, args.to, args.license, args.repo)}")
        else:
            print(f"pushed to {push(args.ckpt, args.repo, args.private, args.license)}")
    except (CheckpointError, DataError) as err:
        sys.exit(f"error: {err}")
    except OSError as err:  # --to under a file, unwritable, a full disk
        sys.exit(f"error: {os_error_line(err)}")


if __name__ == "__main__":
    main()
