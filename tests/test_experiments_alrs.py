"""The ALRS study's bookkeeping in minimal_asymloop.experiments (the runs themselves are precomputed)."""

from minimal_asymloop import experiments as ex


def test_best_lr_uses_the_mean_over_seeds_and_only_complete_lrs():
    runs = [dict(arm="uniform", lr=1e-3, seed=0, val_loss=4.0), dict(arm="uniform", lr=1e-3, seed=1, val_loss=4.4),
            dict(arm="uniform", lr=2e-3, seed=0, val_loss=4.1), dict(arm="uniform", lr=2e-3, seed=1, val_loss=4.2),
            dict(arm="uniform", lr=4e-3, seed=0, val_loss=3.0),  # best, but seed 1 is missing
            dict(arm="alrs", lr=1e-3, seed=0, val_loss=1.0), dict(arm="alrs", lr=1e-3, seed=1, val_loss=1.0)]
    assert ex.best_lr(runs, "uniform", (0, 1)) == 2e-3  # mean 4.15 < 4.2; seed 0 alone would pick 1e-3
    assert ex.best_lr(runs, "uniform", (0,)) == 4e-3
    assert ex.best_lr(runs, "alrs_hill", (0, 1)) is None


def test_alrs_records_reads_logged_allocations():
    rows = [dict(step=1, loss=5.0), dict(step=1, alrs_step=0, alrs_alpha={"a": 2.0}, alrs_multiplier={"a": 1.0}),
            dict(step=11, alrs_step=10, alrs_alpha={"a": 3.0}, alrs_multiplier={"a": 5.0}), dict(step=250, val_loss=4.0)]
    assert ex.alrs_records(rows) == [dict(step=0, alpha={"a": 2.0}, multiplier={"a": 1.0}),
                                     dict(step=10, alpha={"a": 3.0}, multiplier={"a": 5.0})]


def test_alrs_study_setting_fits_two_tokens_per_param_and_tunes_every_matrix():
    from minimal_asymloop import alrs
    from minimal_asymloop.model import LoopedLM, ModelConfig
    from minimal_asymloop.trainer import TrainConfig

    cfg = ModelConfig(arch="asymloop", n_iter=3, **ex.ALRS_LM)
    budget = ex.describe_budget(cfg, TrainConfig(**{**ex.ALRS_TRAIN, "max_steps": 250}))
    assert budget["tokens_per_param"] >= 2
    model = LoopedLM(cfg)
    n_matrices = sum(1 for p in model.parameters() if p.dim() == 2)
    assert len(alrs.tuned_matrices(model)) == n_matrices  # d_model 64: every matrix has >= 50 eigenvalues
