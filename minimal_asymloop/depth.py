"""Train once, run at any depth (ours, not in the paper): the number of decoder iterations K drawn per optimizer step.

The paper trains every model at one fixed K (`--depth-sampler fixed`, the default: nothing is drawn). The other
samplers follow the recurrent-depth models that train for test-time depth:
- Huginn (Geiping et al., 2025; github.com/seal-rg/recurrent-pretraining, recpre/model_dynamic.py,
  `randomized_iteration_sampler`, scheme "poisson-lognormal-filling") draws a rate from a log-normal with sigma 0.5 and
  mu = log(mean) - sigma^2 / 2 (so the rate's mean is `mean`), then K = Poisson(rate) + 1, and backpropagates only
  through the last `mean_backprop_depth` iterations (the first ones run under torch.no_grad()).
- LoopFormer (github.com/armenjeddi/loopformer) trains one nanoGPT-style loop for several depths at once.

Here K is drawn once per optimizer step from a `torch.Generator` seeded by the run's seed, on every rank alike (the
same seed and the same draws give the same K everywhere, no broadcast), and its state is saved in checkpoints.

    sampler = DepthSampler("lognormal_poisson", fixed_k=3, mean=3.0, cap=8, seed=1337)
    k = sampler.draw()          # this step's K, an int in 1..cap
    sampler.expected()          # E[K], what FLOP counts and MFU use
"""

import math
import time

import numpy as np
import torch

SAMPLERS = ("fixed", "uniform", "lognormal_poisson")
SIGMA = 0.5  # Huginn's log-normal sigma


class DepthSampler:
    """K per optimizer step: fixed (the model's n_iter), uniform over lo..hi, or Huginn's log-normal Poisson.

    (ours) lognormal_poisson: rate ~ LogNormal(log(mean - 1) - sigma^2/2, sigma), K = min(1 + Poisson(rate), cap), so
    E[K] = mean before the cap. Huginn's mean is that of the rate, its E[K] one more; here `mean` is K's own mean."""

    def __init__(self, kind: str = "fixed", fixed_k: int = 1, lo: int = 1, hi: int | None = None,
                 mean: float | None = None, cap: int | None = None, seed: int = 0):
        self.kind, self.fixed_k, self.lo, self.hi, self.mean, self.cap = kind, fixed_k, lo, hi, mean, cap
        check(kind, lo, hi, mean, cap)
        self.generator = torch.Generator().manual_seed(seed)

    def draw(self) -> int:
        """This step's K. Fixed draws nothing: the generator, and so a run's every other random number, is untouched."""
        if self.kind == "fixed":
            return self.fixed_k
        if self.kind == "uniform":
            return int(torch.randint(self.lo, self.hi + 1, (1,), generator=self.generator))
        mu = math.log(self.mean - 1) - SIGMA**2 / 2
        rate = torch.zeros(1).log_normal_(mu, SIGMA, generator=self.generator)
        return min(1 + int(torch.poisson(rate, generator=self.generator)), self.cap)

    def pmf(self) -> dict[int, float]:
        """{K: probability} (for lognormal_poisson by quadrature over the log-normal rate, the tail folded into the cap)."""
        if self.kind == "fixed":
            return {self.fixed_k: 1.0}
        if self.kind == "uniform":
            return {k: 1 / (self.hi - self.lo + 1) for k in range(self.lo, self.hi + 1)}
        return dict(enumerate(lognormal_poisson_pmf(self.mean, self.cap), 1))

    def expected(self) -> float:
        """E[K] under the sampler, the cap included."""
        return sum(k * p for k, p in self.pmf().items())

    def largest(self) -> int:
        return {"fixed": self.fixed_k, "uniform": self.hi, "lognormal_poisson": self.cap}[self.kind]

    def describe(self) -> str:
        what = {"fixed": lambda: f"fixed K={self.fixed_k}", "uniform": lambda: f"K uniform over {self.lo}..{self.hi}",
                "lognormal_poisson": lambda: f"K = min(1 + Poisson(log-normal rate), {self.cap}), mean {self.mean:g} before the cap"}
        return f"{what[self.kind]()}: E[K] = {self.expected():.3f}"

    def state_dict(self) -> dict:
        return dict(kind=self.kind, generator=self.generator.get_state())

    def load_state_dict(self, state: dict):
        self.generator.set_state(state["generator"])


def check(kind: str, lo: int = 1, hi: int | None = None, mean: float | None = None, cap: int | None = None):
    """Raise ValueError (one line, naming the fix) on a sampler setting that cannot work."""
    if kind not in SAMPLERS:
        raise ValueError(f"unknown depth_sampler {kind!r}; choose one of {', '.join(SAMPLERS)}")
    given = dict(depth_max=hi, depth_mean=mean, depth_cap=cap)
    needs = {"fixed": (), "uniform": ("depth_max",), "lognormal_poisson": ("depth_mean", "depth_cap")}[kind]
    for name, v in given.items():
        if v is not None and name not in needs:
            raise ValueError(f"{name}={v} applies only to --depth-sampler {'uniform' if name == 'depth_max' else 'lognormal_poisson'}; "
                             f"drop it or change the sampler (now {kind})")
        if v is None and name in needs:
            example = dict(depth_max=5, depth_mean=3, depth_cap=8)[name]
            raise ValueError(f"--depth-sampler {kind} needs --{name.replace('_', '-')} (e.g. {example})")
    if lo != 1 and kind != "uniform":
        raise ValueError(f"depth_min={lo} applies only to --depth-sampler uniform; drop it")
    if kind == "uniform":
        if not isinstance(lo, int) or lo < 1:
            raise ValueError(f"depth_min must be an integer >= 1 (K counts decoder iterations), got {lo!r}")
        if not isinstance(hi, int) or hi < lo:
            raise ValueError(f"depth_max must be an integer >= depth_min={lo}, got {hi!r}")
    if kind == "lognormal_poisson":
        if not isinstance(cap, int) or cap < 2:
            raise ValueError(f"depth_cap must be an integer >= 2 (the largest K drawn), got {cap!r}")
        if not isinstance(mean, (int, float)) or not 1 < mean <= cap:
            low = isinstance(mean, (int, float)) and mean <= 1
            raise ValueError(f"depth_mean must be in (1, depth_cap={cap}], got {mean!r}; "
                             f"{'raise it (K >= 1, so a mean of 1 is fixed K=1)' if low else 'lower it or raise --depth-cap'}")


def lognormal_poisson_pmf(mean: float, cap: int, nodes: int = 80) -> list[float]:
    """P(K = k) for k = 1..cap: 1 + Poisson(rate), rate log-normal (Gauss-Hermite over log rate), the tail folded into cap."""
    x, w = np.polynomial.hermite.hermgauss(nodes)
    rates = np.exp(math.log(mean - 1) - SIGMA**2 / 2 + math.sqrt(2) * SIGMA * x)
    w = w / math.sqrt(math.pi)
    pmf = [float(np.sum(w * np.exp(j * np.log(rates) - rates - math.lgamma(j + 1)))) for j in range(cap - 1)]
    return pmf + [1.0 - sum(pmf)]  # P(1 + Poisson >= cap)


def check_model(model_cfg, sampler: DepthSampler, backprop_depth: int | None):
    """Raise ValueError (one line) when a looping setting cannot work with this model: sampled K on a dense model, or
    truncated backprop where the loop's input reaches it only through z_0, which the no-grad iterations cut off."""
    if sampler.kind != "fixed" and model_cfg.arch == "dense":
        raise ValueError(f"--depth-sampler {sampler.kind} needs a looping model (arch full_loop or asymloop), got dense")
    if not backprop_depth or backprop_depth >= sampler.largest():
        return
    if model_cfg.arch == "dense":
        raise ValueError("--backprop-depth applies to looping models (arch full_loop or asymloop), got dense; drop it")
    if model_cfg.arch == "full_loop" or model_cfg.context == "none":
        what = "the embedding" if model_cfg.arch == "full_loop" else "the encoder and the embedding"
        raise ValueError(f"--backprop-depth {backprop_depth} < K={sampler.largest()} would leave {what} without gradient "
                         f"({model_cfg.arch}{'' if model_cfg.arch == 'full_loop' else ' without Global KV'} feeds its input "
                         f"to the loop only as z_0, before the no-grad iterations); use asymloop with Global KV or additive "
                         f"context, or --backprop-depth >= {sampler.largest()}")


# ----------------------------------------------------------------------------- python -m minimal_asymloop.bench depth


def bench(args):
    """Peak training memory and step time against backprop_depth n at one K: forward + backward of one micro-batch.
    CUDA: the allocator's peak above what was allocated before the step; elsewhere system.peak_new_bytes, the live tensor
    storages the step creates (autograd's saved tensors and the gradients included), not the process's RSS."""
    from minimal_asymloop.flops import train_flops_per_token
    from minimal_asymloop.model import LoopedLM, ModelConfig
    from minimal_asymloop.system import peak_new_bytes, timeit

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = ModelConfig.from_preset(args.size, args.arch, n_iter=args.k)
    torch.manual_seed(0)
    model = LoopedLM(cfg).to(device)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    how = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak live tensor bytes (system.peak_new_bytes)"
    print(f"{args.arch} {args.size} K={args.k}, batch {args.batch} x {args.seq}, {device} fp32; peak memory: {how}")
    print(f"{'backprop depth':>14} {'peak MiB':>9} {'ms/step':>9} {'train GFLOPs/token':>19}")
    rows = []
    for n in args.backprop_depths:
        def step(n=n):
            model.zero_grad(set_to_none=True)
            model(idx, idx, n_iter=args.k, return_logits=False, backprop_depth=n or None)[1].backward()
        if device.type == "cuda":
            step()
            torch.cuda.synchronize(device)
            model.zero_grad(set_to_none=True)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            model.zero_grad(set_to_none=True)
            peak = peak_new_bytes(step)
        seconds = timeit(step, device, warmup=0, min_time=args.min_time, max_iters=5)
        flops = train_flops_per_token(cfg, args.seq, backprop_depth=n or None)
        rows.append(dict(backprop_depth=n or args.k, peak_bytes=peak, step_s=seconds, train_flops_per_token=flops))
        print(f"{n or 'all':>14} {peak / 2**20:>9.1f} {seconds * 1e3:>9.0f} {flops / 1e9:>19.4f}")
    return rows


def bench_samplers(args):
    """Wall time per training token with K drawn per step against fixed K = 3, measured side by side: the recipes take
    turns step by step (round robin, each its own model and AdamW, the same init and batch), so a change in the machine's
    load hits every recipe alike and the ratio to fixed K holds where the absolute times do not. A step is forward,
    backward and the optimizer step at that step's K."""
    from minimal_asymloop.model import LoopedLM, ModelConfig
    from minimal_asymloop.system import synchronize

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = ModelConfig.from_preset(args.size, args.arch, n_iter=3)
    recipes = {"fixed K=3": DepthSampler("fixed", 3), "log-normal Poisson, mean 3.024, cap 8": DepthSampler(
        "lognormal_poisson", mean=3.024, cap=8, seed=0), "uniform 1..5": DepthSampler("uniform", lo=1, hi=5, seed=0)}
    torch.manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    runs = {}
    for name in recipes:
        torch.manual_seed(0)
        model = LoopedLM(cfg).to(device)
        runs[name] = dict(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-4), seconds=0.0, ks=[])
    print(f"{args.arch} {args.size}, batch {args.batch} x {args.seq}, {device} fp32, {args.steps} steps per recipe, round robin")
    for step in range(args.steps + 1):  # step 0 warms every recipe up and is not counted
        for name, sampler in recipes.items():
            r, k = runs[name], sampler.draw()
            synchronize(device)
            t0 = time.perf_counter()
            r["opt"].zero_grad(set_to_none=True)
            r["model"](idx, idx, n_iter=k, return_logits=False)[1].backward()
            r["opt"].step()
            synchronize(device)
            if step:
                r["seconds"] += time.perf_counter() - t0
                r["ks"].append(k)
    base = runs["fixed K=3"]
    print(f"{'recipe':<38} {'mean K drawn':>12} {'us/token':>9} {'vs fixed K=3':>12} {'per iteration':>13}")
    rows = []
    for name, r in runs.items():
        per_token = r["seconds"] / (args.steps * args.batch * args.seq)
        per_iter = (r["seconds"] / sum(r["ks"])) / (base["seconds"] / sum(base["ks"]))  # the draws' luck taken out
        rows.append(dict(recipe=name, mean_k=sum(r["ks"]) / len(r["ks"]), s_per_token=per_token,
                         vs_fixed=r["seconds"] / base["seconds"], per_iteration_vs_fixed=per_iter))
        print(f"{name:<38} {rows[-1]['mean_k']:>12.3f} {per_token * 1e6:>9.2f} {rows[-1]['vs_fixed']:>11.3f}x {per_iter:>12.3f}x")
    return rows
