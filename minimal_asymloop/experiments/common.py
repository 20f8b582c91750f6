"""What every experiment shares: the run settings the command line sets, training with reuse of finished runs,
the reuse of committed results, the training budget and atomic JSON."""

import json
import os
from dataclasses import asdict
from pathlib import Path

from minimal_asymloop.checkpoint import load_model, read_meta
from minimal_asymloop.config import TrainConfig
from minimal_asymloop.flops import count_params
from minimal_asymloop.metrics import read_metrics
from minimal_asymloop.model import ModelConfig
from minimal_asymloop.paths import OUT, RESULTS
from minimal_asymloop.trainer import train

RUNS = OUT / "experiments"

# run settings: `python -m minimal_asymloop.experiments` sets them from its flags (read them as common.NAME)
STEPS = 200  # LM experiments' training steps per run
STEPS_SET = None  # --steps, when given: it overrides every experiment's own default (the ALRS study's ALRS_STEPS too)
SEEDS = (0, 1, 2)  # every arm at >= 3 seeds, compared within seed (same init seed, same data order)
SEEDS_SET = False  # --seeds given: it overrides every experiment's own default (chain_task's CHAIN_SEEDS too)
CACHED_ONLY = False  # --cached-only: build the JSON from finished runs only, listing the arms not yet trained
FRESH = False  # --fresh: train again even the runs committed in notebooks/results/ at the same setting

# context access variants (the paper's Section 5 ablations); Global KV itself is the plain AsymLoop config
CONTEXTS = {"no_global": dict(context="none"),  # without Global KV: Local KV only, z_0 = H
            "additive": dict(context="additive"),  # no Global KV; z_0 = 0, z_k = Dec(z_{k-1} + H)
            "no_local": dict(local_kv=False)}  # without Local KV: decoder queries attend to Global KV only


def train_lm(model_cfg: ModelConfig, train_cfg: TrainConfig, lr_hook=None, reuse: bool = False):
    """Train with the package's trainer; return (result dict, trained model in eval mode).

    reuse=True (ours): if out_dir already holds the finished run of exactly these configs, load it instead
    of training again, so an interrupted `experiments` command continues where it stopped. The LR hook is
    not part of the check: give runs with and without one different out_dirs.
    """
    if reuse and finished(model_cfg, train_cfg):
        meta = read_meta(train_cfg.out_dir)
        model, _, _ = load_model(train_cfg.out_dir)
        history = read_metrics(train_cfg.out_dir)
        seconds = sum(r.get("step_s", 0.0) for r in history)  # training time of the original run (steps only)
        return dict(val_loss=meta["val_loss"], history=history, seconds=seconds, reused=True), model
    result = train(model_cfg, train_cfg, lr_hook=lr_hook)
    model, _, _ = load_model(train_cfg.out_dir)
    return result, model


def finished(model_cfg: ModelConfig, train_cfg: TrainConfig) -> bool:
    """out_dir holds the run of exactly these configs, trained to its last step."""
    if not (Path(train_cfg.out_dir) / "latest").exists():
        return False
    meta = read_meta(train_cfg.out_dir)
    return (meta["step"] == train_cfg.total_steps() and _same(meta["model_config"], model_cfg.to_dict())
            and _same(meta["train_config"], asdict(train_cfg)))


def _same(stored: dict, now: dict) -> bool:
    """A stored config equals the current one on every stored key (fields added to the dataclass later are new)."""
    return all(now.get(k) == v for k, v in stored.items() if k not in ("quiet", "resume"))


def describe_budget(model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict:
    tokens = train_cfg.total_steps() * train_cfg.global_batch * train_cfg.seq_len
    params = count_params(model_cfg)
    return dict(params=params, tokens=tokens, tokens_per_param=tokens / params)


def committed(name: str, setting: dict, ignore=()) -> dict | None:
    """notebooks/results/<name>.json when it was made at exactly `setting` (keys in `ignore` aside), else None.

    The committed results travel with the repository while out/experiments/ does not, so a fresh clone that adds
    an arm reuses the committed runs instead of training them all again (--fresh: train everything)."""
    path = RESULTS / f"{name}.json"
    if FRESH or not path.exists():
        return None
    old = json.loads(path.read_text())
    plain = lambda d: {k: v for k, v in json.loads(json.dumps(d, default=float)).items() if k not in ignore}
    return old if plain(old.get("setting", {})) == plain(setting) else None


def committed_rows(setting: dict, *names: str) -> dict:
    """{(run name, seed): row} of the committed LM runs made at `setting`, from the results files `names`."""
    rows = {}
    for name in names:
        old = committed(name, setting, ignore=("seeds",))  # rows are per seed: another seed list reuses the common ones
        rows.update({(r["name"], r["seed"]): r for r in (old or {}).get("runs", [])})
    return rows


def write_json(path: Path, obj: dict):
    """Write JSON atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=float))
    os.replace(tmp, path)
