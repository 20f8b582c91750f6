"""Evaluate a checkpoint: held-out cross-entropy and perplexity, and the paper's commonsense tasks.

    python -m minimal_asymloop.evaluate --ckpt out                      # val CE and perplexity (the run's own data)
    python -m minimal_asymloop.evaluate --ckpt out --n-iter 5           # at test-time depth K=5
    python -m minimal_asymloop.evaluate --ckpt out --data notes/*.txt   # on the held-out part of other data
    python -m minimal_asymloop.evaluate --ckpt out --tasks paper --num-fewshot 0   # + the paper's table (lm-eval)
    python -m minimal_asymloop.evaluate --ckpt out --all-checkpoints --tasks paper  # every kept checkpoint (Figure 6)

Results are printed and written as JSON (default: eval_k{K}.json in the checkpoint folder; with
--all-checkpoints, downstream_k{K}.json and a plot downstream_k{K}.png in the run's folder). The
tasks run through lm-evaluation-harness with its standard prompts, via the adapter in harness.py;
lm-eval is an optional extra: pip install -e ".[eval]".
"""

import argparse
import importlib.metadata
import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

from minimal_asymloop.metrics import perplexity
from minimal_asymloop.runfolder import naming
from minimal_asymloop.system import ConfigError, default_device, pick_device

# The paper's seven zero/five-shot tasks in its Table 1's order: our name -> (column, lm-eval task name)
PAPER_TASKS = {
    "openbookqa": ("OBQA", "openbookqa"),
    "winogrande": ("WinoGrande", "winogrande"),
    "arc_challenge": ("ARC-c", "arc_challenge"),
    "arc_easy": ("ARC-e", "arc_easy"),
    "hellaswag": ("HellaSwag", "hellaswag"),
    "siqa": ("SIQA", "social_iqa"),
    "piqa": ("PIQA", "piqa"),
}
LM_EVAL_MISSING = 'lm-eval is not installed; install the optional extra with  pip install -e ".[eval]"  (or pip install "lm-eval>=0.4.3")'


# ----------------------------------------------------------------------------- held-out perplexity


def held_out_tokens(meta: dict, tokenizer, source: str | None, n_tokens: int | None, quiet: bool = False):
    """The held-out token split to score, as `data.Tokens`.

    No source: the run's own prepared val split (data_cache). A source: its held-out documents
    (the same hash rule the trainer uses), tokenized with the checkpoint's tokenizer, streamed
    until n_tokens (None: all). The run's data, when its cache is gone, is streamed the same way.
    """
    from minimal_asymloop import data as D
    from minimal_asymloop import sources as S

    tc, dm = meta["train_config"], meta["data"]
    if source is None:
        try:  # the exact arguments the run prepared with: same cache key, no re-preparation
            tk = dm["tokenizer"]
            bpe = dict(bpe_vocab=tk["vocab"], bpe_sample_chars=tk["sample_chars"]) if tk["name"] == "bpe" else {}
            prepared = D.prepare(tc["data"], tc["tokenizer"], cache_dir=tc["data_cache"], max_tokens=dm["identity"]["max_tokens"],
                                 val_fraction=tc["val_fraction"], build=False, **bpe)
            if prepared.tokenizer.to_str() == tokenizer.to_str():
                return prepared.val
        except (FileNotFoundError, S.DataError):
            pass
        source = tc["data"]
        if not quiet:
            print(f"the run's prepared data is not in {tc['data_cache']}; tokenizing the held-out documents of {source!r} again")
    ident = S.source_identity(source, None)
    # the checkpoint's held-out rule; (ours) data.prepare's default fraction when the run left it unset
    val_fraction = tc["val_fraction"] or S.default_val_fraction(ident)
    eot, ids = S.eot_id(tokenizer), []
    for key, text in S.iter_documents(source, ident):
        if S.is_val(key, val_fraction):
            ids += tokenizer.encode(text, add_special_tokens=False).ids + [eot]  # documents joined as in training
            if n_tokens and len(ids) >= n_tokens:
                break
    if len(ids) < max(2, n_tokens or 0):
        raise S.DataError(f"{source!r} has {len(ids)} held-out tokens (val_fraction={val_fraction}), fewer than the "
                          f"{n_tokens} needed; pass --eval-batches all or a smaller number, or use more data")
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
    fd, path = tempfile.mkstemp(suffix=".bin")
    os.close(fd)
    np.asarray(ids, dtype=dtype).tofile(path)
    tokens = D.Tokens([Path(path)], dtype)
    try:
        os.unlink(path)  # the memory map keeps the data alive (POSIX); on Windows the temp file stays
    except OSError:
        pass
    return tokens


@torch.no_grad()
def held_out_loss(model, tokens, seq_len: int, batch_size: int, n_batches: int | None, device, dtype,
                  micro_batch: int | None = None) -> dict:
    """Mean CE (nats/token) and perplexity through the trainer's own `evaluate_loss`.

    n_batches=None covers the whole split: evaluate_loss spreads its windows evenly, so with
    (len-1)//seq_len of them they tile it (ours).
    """
    from minimal_asymloop.batches import evaluate_loss

    if n_batches is None:
        n_batches = max(1, (len(tokens) - 1) // seq_len // batch_size)
    ce = evaluate_loss(model, tokens, seq_len, batch_size, n_batches, device, dtype, micro_batch)
    return dict(ce=ce, ppl=perplexity(ce), tokens=n_batches * batch_size * seq_len, seq_len=seq_len,
                batch_size=batch_size, n_batches=n_batches)


# ----------------------------------------------------------------------------- lm-eval tasks


def load_tasks(names: list[str], include_path: str | None = None):
    """(task manager, {name: lm-eval Task}) for our task names (paper names map to lm-eval's); fails fast, saying why."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager, get_task_dict

    lm_names = [PAPER_TASKS[n][1] if n in PAPER_TASKS else n for n in names]
    # index only the paper's task folders (+ yours): seconds, where all ~15k built-in tasks take ~20 s
    root = Path(lm_eval.tasks.__file__).parent
    dirs = sorted({str(root / d) for d in ("piqa", "siqa", "hellaswag", "winogrande", "arc", "openbookqa")})
    tm = TaskManager(include_defaults=False, include_path=dirs + ([include_path] if include_path else []))
    if any(n not in tm.all_tasks for n in lm_names):
        tm = TaskManager(include_path=include_path)
    unknown = [n for n in lm_names if n not in tm.all_tasks]
    if unknown:
        raise SystemExit(f"error: unknown task(s) {', '.join(unknown)}; the paper's are {', '.join(PAPER_TASKS)}, "
                         f"any lm-eval task name works (list them with `lm_eval ls tasks`), or pass --include-path DIR for your own YAML")
    from minimal_asymloop.sources import hub_offline_reason

    offline = hub_offline_reason("the tasks' data")
    try:  # TaskManager.load is lm-eval >= 0.4.10's API; get_task_dict the older one
        return tm, (tm.load(lm_names)["tasks"] if hasattr(tm, "load") else get_task_dict(lm_names, tm))
    except (ConnectionError, FileNotFoundError) as e:  # OfflineModeIsEnabled and "not on the Hub" are among these
        raise SystemExit(f"error: cannot load the task data ({e}): {offline or 'the Hub did not serve it'}. lm-eval's tasks "
                         f"download their data from the Hub once and then read it from the local cache: run once with the Hub "
                         f"reachable, and offline works after that.") from None


def run_tasks(lm, tasks, num_fewshot: int, limit=None) -> dict:
    """lm-eval's simple_evaluate over load_tasks' result -> {task name: {metric: value}}, plus its version."""
    import lm_eval

    tm, task_dict = tasks  # passing our task manager spares simple_evaluate a full index of lm-eval's tasks
    out = lm_eval.simple_evaluate(model=lm, tasks=list(task_dict.values()), num_fewshot=num_fewshot, limit=limit,
                                  log_samples=False, task_manager=tm)
    res = {name: {k.split(",")[0]: v for k, v in r.items() if "," in k} for name, r in out["results"].items()}
    return dict(results=res, lm_eval_version=importlib.metadata.version("lm_eval"))  # old lm-evals have no __version__


def paper_table(results: dict, names: list[str], metric: str, label: str) -> tuple[str, float, dict]:
    """The paper's table layout: one row, a column per task (%), and the unweighted mean; also {column: %}."""
    cols, vals = [], []
    for n in names:
        col, lm_name = PAPER_TASKS.get(n, (n, n))
        r = results[lm_name]
        vals.append(100 * r.get(metric, r["acc"]))  # SIQA and WinoGrande report acc only
        cols.append(col + ("" if metric in r or metric == "acc" else "†"))
    mean = sum(vals) / len(vals)
    rows = [f"| Model | {' | '.join(cols)} | Avg. |", "|---|" + "---:|" * (len(cols) + 1),
            f"| {label} | {' | '.join(f'{v:.2f}' for v in vals)} | {mean:.2f} |"]
    return "\n".join(rows), mean, dict(zip(cols, vals))


# ----------------------------------------------------------------------------- command line


def write_json(path: Path, obj: dict):
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)  # atomic


def _batches(s: str):
    if s == "all" or (s.isdigit() and int(s) > 0):
        return s if s == "all" else int(s)
    raise argparse.ArgumentTypeError(f"expected a positive integer or 'all', got {s!r}")


def kept_checkpoints(run_dir) -> list[Path]:
    """The checkpoint folders of a run (ckpt_NNNNNNN, kept every N steps by --keep-every), by step; of a step saved twice
    (ckpt_NNNNNNN.1, the re-save after a fallback past a corrupt one) the newest save."""
    run_dir = Path(run_dir)
    newest = {}
    for p in run_dir.glob("ckpt_*"):
        if (m := re.fullmatch(r"ckpt_(\d{7})(?:\.(\d+))?", p.name)) and (p / "meta.json").exists():
            key = (int(m.group(1)), int(m.group(2) or 0))
            newest[key[0]] = max(newest.get(key[0], (key, p)), (key, p))
    found = [p for _, (_, p) in sorted(newest.items())]
    if not found:
        raise SystemExit(f"error: no checkpoint folders (ckpt_NNNNNNN) in {run_dir}; --all-checkpoints needs a run's out_dir "
                         f"trained with --keep-every N (or at least one checkpoint)")
    return found


def plot_over_training(rows: list[dict], title: str):
    """Figure 6 layout: accuracy (%) per task and their mean against the step, beside held-out perplexity.
    Returns a matplotlib Figure (no pyplot state)."""
    from matplotlib.figure import Figure

    steps = [r["step"] for r in rows]
    with_tasks = any("tasks" in r for r in rows)
    fig = Figure(figsize=(11 if with_tasks else 5.5, 4), layout="constrained")
    axes = fig.subplots(1, 2 if with_tasks else 1, squeeze=False)[0]
    if with_tasks:
        ax, metric = axes[0], rows[-1]["tasks"]["metric"]
        for name in rows[-1]["tasks"]["columns"]:
            ax.plot(steps, [r["tasks"]["columns"][name] for r in rows], "o-", lw=1, ms=3, alpha=0.7, label=name)
        ax.plot(steps, [r["tasks"]["mean"] for r in rows], "o-", c="k", lw=2.5, label="mean")
        ax.set(title=f"Downstream {metric} over training", xlabel="optimizer step", ylabel=f"{metric} (%)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    ax.plot(steps, [r["val"]["ppl"] for r in rows], "o-")
    ax.set(title="Held-out perplexity over training", xlabel="optimizer step", ylabel="perplexity")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    return fig


def evaluate_checkpoint(ckpt: str, args, names, tasks, say=print) -> dict:
    """One checkpoint: held-out CE and perplexity, then (with names) the lm-eval tasks; the report dict."""
    from minimal_asymloop.checkpoint import CheckpointError, load_model
    from minimal_asymloop.sources import DataError

    try:
        model, tokenizer, meta = load_model(ckpt, device=args.device)
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    cfg, tc = model.config, meta["train_config"]
    if args.n_iter is not None:
        if args.n_iter < 1 or cfg.arch == "dense":
            raise SystemExit(f"error: --n-iter {args.n_iter}: K must be >= 1, and only full_loop/asymloop loop (this is {cfg.arch})")
        cfg.n_iter = args.n_iter  # states() reads K from the config, so the trainer's evaluate_loss runs at this depth
    dtype = getattr(torch, args.dtype)
    batch, micro = tc["global_batch"], tc.get("micro_batch")  # the trainer's eval windows: batches of global_batch
    n_batches = None if args.eval_batches == "all" else args.eval_batches or tc["eval_batches"]
    n_tokens = None if n_batches is None else n_batches * batch * tc["seq_len"] + 1
    try:
        tokens = held_out_tokens(meta, tokenizer, args.data, n_tokens)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    report = dict(ckpt=meta["path"], step=meta.get("step"), arch=cfg.arch, n_iter=cfg.n_iter, trained_n_iter=meta["model_config"]["n_iter"],
                  data=args.data or meta["data"]["source"], dtype=args.dtype, hub_repo=meta.get("hub_repo"))
    try:
        report["val"] = held_out_loss(model, tokens, tc["seq_len"], batch, n_batches, args.device, dtype, micro)
    except DataError as e:  # more windows than the split holds (--eval-batches 1000000)
        raise SystemExit(f"error: {e}") from None
    v = report["val"]
    say(f"{cfg.arch} K={cfg.n_iter} step {report['step']} on {report['data']} (held out, {v['tokens']:,} tokens): "
        f"cross-entropy {v['ce']:.4f} nats/token, perplexity {v['ppl']:.2f}")

    if names:
        from minimal_asymloop.harness import AsymLoopLM

        lm = AsymLoopLM(model=model, tokenizer=tokenizer, n_iter=cfg.n_iter, batch_size=args.batch_size, device=args.device,
                        dtype=args.dtype)
        out = run_tasks(lm, tasks, args.num_fewshot, args.limit)
        table, mean, columns = paper_table(out["results"], names, args.metric, f"{cfg.arch} K={cfg.n_iter}")
        report["tasks"] = dict(out, num_fewshot=args.num_fewshot, metric=args.metric, mean=mean, columns=columns, limit=args.limit)
        note = "; † acc (the task has no acc_norm)" if "†" in table else ""
        say(f"\nlm-eval {out['lm_eval_version']}, {args.num_fewshot}-shot, {args.metric} (%){note}"
            f"{f', first {args.limit} examples per task' if args.limit else ''}:\n{table}")
    return report


def over_training(args, names, tasks) -> dict:
    """--all-checkpoints: evaluate every kept checkpoint of a run (resuming a partly written JSON), plot against the step."""
    from minimal_asymloop.checkpoint import CheckpointError, read_meta

    folders = kept_checkpoints(args.ckpt)
    try:  # verified against each checkpoint's manifest: a damaged meta.json is one line, not a JSON traceback
        metas = {f: read_meta(f) for f in folders}
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    settings = {k: getattr(args, k) for k in ("data", "n_iter", "eval_batches", "tasks", "num_fewshot", "metric", "limit", "dtype")}
    k = args.n_iter or metas[folders[-1]]["model_config"]["n_iter"]
    out_path = Path(args.out) if args.out else Path(args.ckpt) / f"downstream_k{k}.json"
    old = json.loads(out_path.read_text()) if out_path.exists() else {}
    done = {r["step"]: r for r in old.get("checkpoints", [])} if old.get("settings") == settings else {}
    rows = []
    for i, folder in enumerate(folders):
        step = metas[folder].get("step")
        if step in done:  # evaluated by an earlier, interrupted call with the same settings
            rows.append(done[step])
            continue
        print(f"[{i + 1}/{len(folders)}] {folder.name}")
        rows.append(evaluate_checkpoint(str(folder), args, names, tasks))
        write_json(out_path, dict(run=str(Path(args.ckpt).resolve()), settings=settings, checkpoints=rows))  # after each one
    report = dict(run=str(Path(args.ckpt).resolve()), settings=settings, checkpoints=rows)
    write_json(out_path, report)
    fig = plot_over_training(rows, f"{rows[-1]['arch']} K={rows[-1]['n_iter']}: {Path(args.ckpt).resolve().name}")
    with naming(out_path.with_suffix(".png")):
        fig.savefig(out_path.with_suffix(".png"), dpi=120)
    print(f"wrote {out_path} and {out_path.with_suffix('.png')} ({len(rows)} checkpoints)")
    report["plot"] = str(out_path.with_suffix(".png"))
    return report


def main(argv=None):
    from minimal_asymloop.runfolder import os_error_line

    try:
        return _main(argv)
    except OSError as e:  # --out under a file, unwritable, a full disk: one line with the path and the fix
        raise SystemExit(f"error: {os_error_line(e)}") from None


def _main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a run's out_dir (its latest checkpoint), a checkpoint folder, an exported "
                                                 "folder, or a Hub repo id (owner/name, or hf:owner/name)")
    p.add_argument("--all-checkpoints", action="store_true", help="evaluate every kept checkpoint (ckpt_NNNNNNN) of the run in --ckpt "
                   "and plot the results against the step (the paper's Figure 6)")
    p.add_argument("--data", default=None, help="score the held-out part of this source instead of the run's own data")
    p.add_argument("--n-iter", type=int, default=None, help="test-time depth K (default: the trained K)")
    p.add_argument("--eval-batches", type=_batches, default=None, help="val batches (default: the run's eval_batches, so the loss matches "
                                                         "its log), or 'all' for the whole held-out split")
    p.add_argument("--tasks", default=None, help=f"comma-separated lm-eval tasks, or 'paper' for {','.join(PAPER_TASKS)}")
    p.add_argument("--num-fewshot", type=int, default=0, help="the paper reports 0 and 5")
    p.add_argument("--metric", default="acc", choices=["acc", "acc_norm"], help="table metric (acc_norm where the task has it)")
    p.add_argument("--limit", type=int, default=None, help="at most this many examples per task (quick checks only)")
    p.add_argument("--include-path", default=None, help="a folder of your own lm-eval task YAMLs")
    p.add_argument("--batch-size", type=int, default=16, help="lm-eval requests per forward pass")
    p.add_argument("--device", default=default_device(), help="cuda, cuda:N, mps or cpu (default: CUDA, then MPS, then CPU)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", default=None, help="JSON path (default: <checkpoint>/eval_k{K}.json; for a Hub repo "
                   "./eval_<owner>--<name>_k{K}.json; with --all-checkpoints <run>/downstream_k{K}.json)")
    args = p.parse_args(argv)
    if args.num_fewshot < 0:
        p.error(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    try:
        pick_device(args.device)  # --device tpu, or cuda without a GPU: one line before anything loads
    except ConfigError as e:
        p.error(str(e))

    names = tasks = None
    if args.tasks:  # check lm-eval and the task data first: a missing extra or an offline Hub fails in seconds
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise SystemExit(f"error: --tasks needs lm-eval: {LM_EVAL_MISSING}") from None
        names = list(PAPER_TASKS) if args.tasks == "paper" else [t.strip() for t in args.tasks.split(",") if t.strip()]
        tasks = load_tasks(names, args.include_path)
    if args.all_checkpoints:
        return over_training(args, names, tasks)
    report = evaluate_checkpoint(args.ckpt, args, names, tasks)
    # a Hub download sits in the Hugging Face cache, which is not ours to write into
    default = Path(f"eval_{report['hub_repo'].replace('/', '--')}_k{report['n_iter']}.json") if report["hub_repo"] else \
        Path(report["ckpt"]) / f"eval_k{report['n_iter']}.json"
    out_path = Path(args.out) if args.out else default
    write_json(out_path, report)
    print(f"wrote {out_path}")
    return report


if __name__ == "__main__":
    main()
