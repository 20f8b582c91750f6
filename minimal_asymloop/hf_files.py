"""The transformers files of an export: remote code generated from our source, config.json, and the tokenizer's config.

    configuration_asymloop.py   AsymLoopConfig and what it needs (ModelConfig, its checks): no torch
    modeling_asymloop.py        AsymLoopForCausalLM and what it needs (LoopedLM, kernels, the KV caches, ...)

Both are *bundles*: the top-level statements of our modules that the root class needs, found by following names from
hf.py through model.py, generate.py, kernels.py, loss.py, copied verbatim in dependency order, with our imports dropped
(one namespace: `from minimal_asymloop.x import a` is just `a`; `from minimal_asymloop import x as y` becomes
`y = _self`, the bundle itself). So the remote code is our code, regenerated at each export: it cannot drift.
`bundle()` refuses what it cannot copy this way (a name two modules define differently, an import inside a function).
"""

import ast
import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer

PACKAGE = "minimal_asymloop"
SOURCE = Path(__file__).resolve().parent
CONFIG_FILE, MODELING_FILE = "configuration_asymloop.py", "modeling_asymloop.py"
ROOTS = {CONFIG_FILE: ("AsymLoopConfig",), MODELING_FILE: ("AsymLoopForCausalLM",)}
HEADER = f"""# Generated from minimal-asymloop's source by {PACKAGE}/hf_files.py at export: do not edit, re-export.
# Each section is the named module's code that the model needs, less its imports of {PACKAGE} (one namespace here).
import sys

_self = sys.modules[__name__]  # stands for a module of ours imported under an alias (model.py's `generation`)
"""


class BundleError(ValueError):
    """Our source holds something the remote-code bundle cannot copy verbatim; the message says what."""


class Module:
    """One of our modules: its top-level statements, what each defines, and which of our names each import brings."""

    def __init__(self, name: str):
        self.name, self.path = name, SOURCE / f"{name}.py"
        self.text = self.path.read_text()
        self.tree = ast.parse(self.text)
        self.stmts = [s for s in self.tree.body if not _is_docstring(s) and not _is_main_guard(s)]
        self.defs: dict[str, list[int]] = {}
        self.ours: dict[str, tuple[str, str | None]] = {}  # local name -> (our module, name in it | None for the module)
        for i, s in enumerate(self.stmts):
            for n in _defined(s):
                self.defs.setdefault(n, []).append(i)
            for local, target in _our_imports(s).items():
                self.ours[local] = target

    def check_nested(self, i: int):
        for node in ast.walk(self.stmts[i]):
            if node is not self.stmts[i] and isinstance(node, (ast.Import, ast.ImportFrom)) and _our_imports(node):
                raise BundleError(f"{self.path.name}:{node.lineno} imports {PACKAGE} inside a function; move the import "
                                  f"to the top of the module so the remote-code bundle can resolve it")

    def source(self, i: int) -> str:
        """The statement's lines verbatim, decorators included."""
        s = self.stmts[i]
        first = min([s.lineno] + [d.lineno for d in getattr(s, "decorator_list", [])])
        return "\n".join(self.text.splitlines()[first - 1:s.end_lineno])


def _is_docstring(s) -> bool:
    return isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)


def _is_main_guard(s) -> bool:
    """`if __name__ == ...:` blocks run in our package only (hf.py registers the Auto classes in one)."""
    return isinstance(s, ast.If) and "__name__" in ast.unparse(s.test)


def _defined(s) -> set[str]:
    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {s.name}
    if isinstance(s, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in s.names}
    if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = s.targets if isinstance(s, ast.Assign) else [s.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _our_imports(s) -> dict[str, tuple[str, str | None]]:
    if isinstance(s, ast.ImportFrom) and s.module and s.module.split(".")[0] == PACKAGE:
        if s.module == PACKAGE:  # from minimal_asymloop import x as y
            return {a.asname or a.name: (a.name, None) for a in s.names}
        return {a.asname or a.name: (s.module.split(".", 1)[1], a.name) for a in s.names}
    if isinstance(s, ast.Import) and any(a.name.split(".")[0] == PACKAGE for a in s.names):
        raise BundleError(f"line {s.lineno}: write `from {PACKAGE} import x`, not `import {PACKAGE}.x`, so the bundle can resolve it")
    return {}


def _binding(src: str, name: str) -> str:
    """What a statement binds `name` to: the imported object for an import (two modules may import it differently)."""
    s = ast.parse(src.strip()).body[0]
    if isinstance(s, (ast.Import, ast.ImportFrom)):
        a = next(a for a in s.names if (a.asname or a.name).split(".")[0] == name)
        return f"{s.module}:{a.name}" if isinstance(s, ast.ImportFrom) else a.name
    return src


def _refs(s) -> tuple[set[str], set[tuple[str, str]]]:
    """Names a statement mentions, and (name, attribute) pairs for attribute access on a bare name."""
    names, attrs = set(), set()
    for node in ast.walk(s):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            attrs.add((node.value.id, node.attr))
    return names, attrs


def bundle(roots=("AsymLoopForCausalLM",), provided: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """(source, defined): the statements of our modules that `roots` (names in hf.py) need, in dependency order, and
    the names it defines -> their module. `provided` (name -> module): names another bundle defines, imported from it."""
    provided = provided or {}
    modules: dict[str, Module] = {}
    keep: dict[str, set[int]] = {}  # module -> indices of the statements kept
    order: list[str] = []  # modules, dependencies first
    imported: set[str] = set()  # provided names the bundle uses

    def module(name: str) -> Module:
        if name not in modules:
            modules[name] = Module(name)
            keep[name] = set()
            for i, s in enumerate(modules[name].stmts):  # side effects (e.g. kernels' env override) always run
                if not _defined(s) and not isinstance(s, ast.ImportFrom):
                    todo.append((name, i))
        return modules[name]

    def need(mod: str, name: str):
        if provided.get(name) == mod:
            imported.add(name)
            return
        m = module(mod)
        if name not in m.defs:
            raise BundleError(f"{PACKAGE}/{mod}.py defines no top-level {name!r}, which the bundle needs")
        todo.extend((mod, i) for i in m.defs[name])

    todo: list[tuple[str, int]] = []
    for r in roots:
        need("hf", r)
    while todo:
        mod, i = todo.pop()
        if i in keep[mod]:
            continue
        keep[mod].add(i)
        m = modules[mod]
        m.check_nested(i)
        names, attrs = _refs(m.stmts[i])
        for n in names:
            if n in m.ours:
                target_mod, target = m.ours[n]
                todo.extend((mod, j) for j in m.defs[n])  # the import itself: it becomes an alias line, or nothing
                if target is None:  # a module alias: what is read off it
                    module(target_mod)
                    for alias, attr in attrs:
                        if alias == n:
                            need(target_mod, attr)
                else:
                    need(target_mod, target)
            elif n in m.defs:
                need(mod, n)

    def visit(name: str, seen=()):
        if name in order:
            return
        for _, (dep, _) in modules[name].ours.items():
            if dep in modules and dep not in seen and dep != name:
                visit(dep, seen + (name,))
        order.append(name)

    for name in list(modules):
        visit(name)
    defined: dict[str, tuple[str, str]] = {}  # name -> (module, its statement's source)
    parts = [HEADER]
    if imported:
        parts.append(f"from .{Path(CONFIG_FILE).stem} import {', '.join(sorted(imported))}\n")
    for name in order:
        m, lines = modules[name], []
        for i in sorted(keep[name]):
            s, src = m.stmts[i], m.source(i)
            ours = _our_imports(s)
            if ours:  # our import: the names are in this namespace already; a module alias is the bundle itself
                lines += [f"{local} = _self" for local, (_, target) in ours.items() if target is None]
                lines += [f"{local} = {target}" for local, (_, target) in ours.items() if target not in (None, local)]
                continue
            for n in _defined(s):
                if n in defined and _binding(defined[n][1], n) != _binding(src, n):
                    raise BundleError(f"{PACKAGE}/{name}.py and {PACKAGE}/{defined[n][0]}.py both define {n!r}; the "
                                      f"remote-code bundle is one namespace, so rename one of them")
                defined[n] = (name, src)
            lines.append(src)
        if lines:
            parts.append(f"\n\n# {'-' * 60} from {PACKAGE}/{name}.py\n\n" + "\n\n".join(lines) + "\n")
    provides = {n: mod for n, (mod, src) in defined.items() if not src.lstrip().startswith(("import ", "from "))}
    return "".join(parts), provides


def remote_code() -> dict[str, str]:
    """{file name: source} of configuration_asymloop.py and modeling_asymloop.py, generated from our source now."""
    config_src, config_names = bundle(ROOTS[CONFIG_FILE])
    modeling_src, _ = bundle(ROOTS[MODELING_FILE], provided=config_names)
    return {CONFIG_FILE: config_src, MODELING_FILE: modeling_src}


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- config.json and the tokenizer


def hf_config(meta: dict, eot: int, weights_sha256: str) -> dict:
    """config.json: the checkpoint's meta (our loader reads it) + what transformers reads (model type, auto_map, every
    ModelConfig field at the top level, the end-of-text token as eos) + the sha256 the remote code checks weights against."""
    from importlib.metadata import PackageNotFoundError, version

    from minimal_asymloop.model import ModelConfig

    try:
        made_with = {"transformers_version": version("transformers")}
    except PackageNotFoundError:  # export needs no transformers: the folder records none
        made_with = {}

    fields = ModelConfig(**meta["model_config"]).to_dict()
    return {**meta, "model_type": "asymloop", "architectures": ["AsymLoopForCausalLM"],
            "auto_map": {"AutoConfig": f"{Path(CONFIG_FILE).stem}.AsymLoopConfig",
                         "AutoModelForCausalLM": f"{Path(MODELING_FILE).stem}.AsymLoopForCausalLM"},
            **fields, "tie_word_embeddings": False, "eos_token_id": eot, "pad_token_id": eot, "dtype": "float32",
            **made_with, "files_sha256": {"model.safetensors": weights_sha256}}


def hf_tokenizer(tok: Tokenizer, eot: int, max_len: int) -> tuple[Tokenizer, dict]:
    """(tokenizer.json to write, tokenizer_config.json) for transformers' fast tokenizer class.

    (ours) The post-processor goes: T5's appends </s> to every encoding, but the model never saw </s> after a
    prompt (training data is documents joined by end-of-text), and our sampler and lm-eval adapter encode without it."""
    data = json.loads(tok.to_str())
    data["post_processor"] = None
    data["padding"] = data["truncation"] = None
    out = Tokenizer.from_str(json.dumps(data))
    special = {"eos_token": tok.id_to_token(eot), "pad_token": tok.id_to_token(eot)}
    unk = (data.get("model") or {}).get("unk_token") or (
        tok.id_to_token(data["model"]["unk_id"]) if isinstance((data.get("model") or {}).get("unk_id"), int) else None)
    if unk:
        special["unk_token"] = unk
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": max_len,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
    return out, config


def write_hf_files(folder: Path, meta: dict, tok: Tokenizer, eot: int) -> dict:
    """Write model.safetensors' companions into `folder` (model.safetensors already there, HF names): the remote
    code, config.json, tokenizer.json and tokenizer_config.json. Returns config.json's content."""
    for name, src in remote_code().items():
        (folder / name).write_text(src)
    hf_tok, tok_config = hf_tokenizer(tok, eot, meta["model_config"]["max_seq_len"])
    hf_tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    (folder / "special_tokens_map.json").write_text(json.dumps({k: v for k, v in tok_config.items() if k.endswith("_token")},
                                                               indent=1))
    config = hf_config(meta, eot, sha256(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return config
