"""Hugging Face transformers: a LoopedLM as `AutoModelForCausalLM`, with transformers' generate(), pipelines and lm-eval's hf model.

    from minimal_asymloop import hf                       # registers model_type "asymloop" with the Auto classes
    model = hf.AsymLoopForCausalLM.from_looped(looped)    # around a LoopedLM, same weights
    model.generate(ids, max_new_tokens=20, n_iter=6)      # test-time depth; exit_threshold=, max_iter= for adaptive depth

An export (`python -m minimal_asymloop.hub export`) carries this module, bundled with the model code it needs
(hf_files.py), as configuration_asymloop.py and modeling_asymloop.py: a folder then loads with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` without minimal-asymloop installed.
So this module imports only model.py and generate.py of ours, and checks files with hashlib (xxhash may be absent).
transformers is an optional extra: `pip install -e ".[hf]"`. docs/hub.md says what carries over.
"""

import hashlib
import json
import os
from dataclasses import fields

import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from minimal_asymloop.generate import AdaptiveKVCache, KVCache, adaptive_states, check_adaptive_args
from minimal_asymloop.model import LoopedLM, ModelConfig, Rotary

# (ours) the range the tests ran on: 5.24 passes the cache as `cache=` (before: past_key_values, cache_position)
TRANSFORMERS_RANGE = ("5.24", "6")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_transformers_version(version: str) -> None:
    from packaging.version import Version

    low, high = TRANSFORMERS_RANGE
    if not Version(low) <= Version(version) < Version(high):
        raise ImportError(f"AsymLoop's transformers code needs transformers>={low},<{high}, this is {version}; "
                          f"pip install 'transformers>={low},<{high}'")


check_transformers_version(transformers.__version__)


class AsymLoopConfig(PretrainedConfig):
    """Every ModelConfig field (architecture, K, MoE, the ablations), checked by ModelConfig, plus the adaptive exit's
    defaults for generate(). An export's config.json also holds the checkpoint's meta (train_config, step, ...)."""

    model_type = "asymloop"
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
                     "intermediate_size": "d_ff", "max_position_embeddings": "max_seq_len"}

    def __init__(self, exit_threshold: float | None = None, max_iter: int | None = None, **kwargs):
        given = {f.name: kwargs.pop(f.name) for f in fields(ModelConfig) if f.name in kwargs}
        cfg = ModelConfig(**given)  # a bad value is ModelConfig's one-line ValueError
        recorded = kwargs.get("model_config")  # an export's copy of the checkpoint's model config
        if isinstance(recorded, dict) and ModelConfig(**recorded).to_dict() != cfg.to_dict():
            raise ValueError("config.json's fields differ from its model_config (a hand-edited export?); "
                             "re-export the checkpoint with `python -m minimal_asymloop.hub export`")
        for name, value in cfg.to_dict().items():
            setattr(self, name, value)
        self.exit_threshold, self.max_iter = exit_threshold, max_iter
        kwargs.setdefault("tie_word_embeddings", False)  # the head is untied from the embedding
        super().__init__(**kwargs)

    def to_model_config(self) -> ModelConfig:
        return ModelConfig(**{f.name: getattr(self, f.name) for f in fields(ModelConfig)})


# ----------------------------------------------------------------------------- the KV cache, as transformers' Cache


class LoopedCache(Cache):
    """transformers' Cache around our KVCache: per layer, and per iteration for looped layers, plus the Global KV of
    each decoder layer (generate.KVCache). adaptive=True holds an AdaptiveKVCache (Local KV reuse of exited tokens)."""

    def __init__(self, adaptive: bool = False):
        super().__init__(layers=[])  # ours are keyed (kind, iteration, layer), not a list of layers
        self.kv = AdaptiveKVCache() if adaptive else KVCache()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv.pos

    def __len__(self):
        return len(self.kv.layers)

    @property
    def is_linear(self):  # generate() asks before slicing a prompt against the cache
        return [False]

    @property
    def is_compileable(self):
        return False

    @property
    def is_croppable(self):
        return False

    def _rows(self, pick):
        for c in self.kv.layers.values():
            if c.k is not None:
                c.k, c.v = pick(c.k), pick(c.v)
        if getattr(self.kv, "exit_iter", None) is not None:
            self.kv.exit_iter = pick(self.kv.exit_iter)

    def reorder_cache(self, beam_idx):
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices):
        self._rows(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int):
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, max_length: int):
        raise NotImplementedError("AsymLoop's cache cannot be cropped (no assisted or speculative decoding)")


# ----------------------------------------------------------------------------- the causal LM


def check_padding(attention_mask) -> None:
    """The model has no padding mask: causal attention keeps right padding invisible to real tokens, nothing else."""
    if attention_mask is None or bool(attention_mask.all()):
        return
    if (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
        raise ValueError("AsymLoop has no padding mask: left padding (or a 0 before a 1 in attention_mask) is not supported; "
                         "pass rows of equal length, or pad on the right (tokenizer.padding_side = 'right') without a cache")


class AsymLoopForCausalLM(PreTrainedModel, GenerationMixin):
    """A LoopedLM (`.model`) as a transformers causal LM. forward and generate() take n_iter (test-time depth K) and
    exit_threshold / max_iter (adaptive depth, generate.adaptive_states); the config's values are their defaults."""

    config_class = AsymLoopConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config: AsymLoopConfig):
        super().__init__(config)
        self.model = LoopedLM(config.to_model_config())  # our init (LoopedLM.init_weights), skipped on the meta device
        self.post_init()

    @classmethod
    def from_looped(cls, looped: LoopedLM, **config_kwargs) -> "AsymLoopForCausalLM":
        """The same weights (shared, not copied) in the transformers wrapper."""
        model = cls(AsymLoopConfig(**looped.config.to_dict(), **config_kwargs))
        model.model = looped
        return model.to(next(looped.parameters()).device).eval()

    def _init_weights(self, module):
        # (ours) only the RoPE tables: they are buffers, never saved; every weight is loaded, or set by LoopedLM.init_weights
        if isinstance(module, Rotary):
            module.reset_parameters()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward makes a LoopedCache when use_cache is on

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.head

    def set_output_embeddings(self, value):
        self.model.head = value

    def forward(self, input_ids=None, attention_mask=None, cache=None, labels=None, use_cache=None, n_iter=None,
                exit_threshold=None, max_iter=None, logits_to_keep=0, output_hidden_states=None, return_dict=None,
                past_key_values=None, position_ids=None, **kwargs):
        """CausalLMOutputWithPast: logits (B, T, V), loss (next-token cross-entropy on labels, -100 ignored), the cache.
        position_ids are ignored: positions follow the cache (no padding mask, see check_padding)."""
        check_padding(attention_mask)
        cache = cache if cache is not None else past_key_values
        n_iter = n_iter or self.config.n_iter  # the config's K: from_pretrained(..., n_iter=6) sets test-time depth too
        exit_threshold = self.config.exit_threshold if exit_threshold is None else exit_threshold
        adaptive = exit_threshold is not None
        if cache is None and use_cache:
            cache = LoopedCache(adaptive)
        if cache is not None and not isinstance(cache, LoopedCache):
            raise ValueError(f"AsymLoop keeps its own cache (LoopedCache), got {type(cache).__name__}; leave cache unset")
        if cache is not None and adaptive != isinstance(cache.kv, AdaptiveKVCache):
            raise ValueError("this cache was filled at a different depth rule (adaptive vs fixed n_iter); start a new one")
        moe = self.model.moe_layers()
        for m in moe.values():
            m.reset_stats()
        if adaptive:
            max_iter = check_adaptive_args(self.model, exit_threshold, max_iter or self.config.max_iter or n_iter)
            kv = cache.kv if cache is not None else AdaptiveKVCache()  # no cache: the whole sequence, teacher-forced
            z, _ = adaptive_states(self.model, input_ids, exit_threshold, max_iter, kv)
            states = [z]
        else:
            states = self.model.states(input_ids, n_iter, cache.kv if cache is not None else None)
        z = states[-1] if not logits_to_keep else states[-1][:, -logits_to_keep:]
        logits = self.model.logits(z)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
            if moe and self.training:
                loss = loss + sum(self.model.moe_aux_losses().values())
        hidden = tuple(states) if output_hidden_states else None  # the decoder state after each iteration
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=hidden, **{CACHE_FIELD: cache})

    # ------------------------------------------------------------------------- loading: our checks first

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' from_pretrained, after our checks: the folder is an AsymLoop export with its tokenizer, its
        weights are safetensors and match the sha256 in config.json. Unpickling is never allowed (use_safetensors)."""
        if kwargs.get("use_safetensors") is False:
            raise ValueError("AsymLoop loads model.safetensors only (no pickles); drop use_safetensors=False")
        config_json = check_export(pretrained_model_name_or_path, **hub_kwargs(kwargs))
        verify_weights(pretrained_model_name_or_path, config_json, **hub_kwargs(kwargs))
        kwargs["use_safetensors"] = True
        want_info = kwargs.get("output_loading_info", False)
        kwargs["output_loading_info"] = True  # to refuse missing or unexpected weights, which transformers only logs
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        bad = {k: sorted(v)[:4] for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            raise ValueError(f"{pretrained_model_name_or_path}: model.safetensors does not match config.json ({bad}); re-export it")
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, then the sha256 of each weight file into config.json, as an export has them."""
        super().save_pretrained(save_directory, *args, **kwargs)
        names = sorted(f for f in os.listdir(save_directory) if f.endswith(".safetensors"))
        with open(os.path.join(save_directory, "config.json")) as f:
            config_json = json.load(f)
        config_json["files_sha256"] = {n: file_sha256(os.path.join(save_directory, n)) for n in names}
        with open(os.path.join(save_directory, "config.json"), "w") as f:
            json.dump(config_json, f, indent=1)


CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


def hub_kwargs(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in HUB_KWARGS if kwargs.get(k) is not None}


def check_export(path, **hub) -> dict:
    """config.json of an AsymLoop export, or a one-line ValueError saying what the folder is instead."""
    path = str(path)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            what = ("a minimal-asymloop training checkpoint" if os.path.exists(os.path.join(path, "meta.json")) or
                    os.path.exists(os.path.join(path, "latest")) else "not a model folder (no config.json)")
            raise ValueError(f"{path} is {what}; export it first: python -m minimal_asymloop.hub export --ckpt {path} --to DIR")
        missing = [f for f in TOKENIZER_FILES if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise ValueError(f"{path} has no tokenizer ({', '.join(missing)} missing), so it cannot be used as a language "
                             f"model; re-export it with `python -m minimal_asymloop.hub export`")
    from transformers.utils import cached_file

    with open(cached_file(path, "config.json", **hub)) as f:
        config_json = json.load(f)
    kind = config_json.get("model_type")
    if kind != "asymloop":
        old = "model_config" in config_json
        raise ValueError(f"{path} is {'an export from before transformers support' if old else f'a {kind!r} model, not asymloop'}"
                         + ("; re-export it with `python -m minimal_asymloop.hub export`" if old else ""))
    return config_json


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def verify_weights(path, config_json: dict, **hub) -> None:
    """Each weight file against the sha256 that the export (or save_pretrained) recorded in config.json ("files_sha256")."""
    from transformers.utils import cached_file

    sums = config_json.get("files_sha256") or {}
    if not sums:
        raise ValueError(f"{path}: config.json records no sha256 of its weights; re-export it with "
                         f"`python -m minimal_asymloop.hub export`")
    for name, want in sums.items():
        if file_sha256(cached_file(str(path), name, **hub)) != want:
            raise ValueError(f"{path}: {name} does not match the sha256 in config.json (its bytes changed after it was "
                             f"written: a disk, copy or transfer error); download or export it again")


def register() -> None:
    """model_type "asymloop" for AutoConfig and AutoModelForCausalLM (an export's auto_map does it for remote code)."""
    AutoConfig.register("asymloop", AsymLoopConfig, exist_ok=True)
    AutoModelForCausalLM.register(AsymLoopConfig, AsymLoopForCausalLM, exist_ok=True)


if __name__ == "minimal_asymloop.hf":  # imported from our package; the bundled copy in an export skips it
    register()
