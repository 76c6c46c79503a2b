"""What a loaded model can do besides generating, and the pooler that does it.

Decided once at load time from the model class, its HF config, its sentence-transformers
files and the tokenizer:
- causal LM: generate + embed (last-token pooling unless told otherwise) + score/rerank by
  the probability of a "yes" answer (when the tokenizer has a chat template and single
  "yes"/"no" tokens);
- encoder (BertModel, XLMRobertaModel), or a decoder without its LM head (MistralModel...):
  embed + score/rerank by cosine of embeddings;
- *ForSequenceClassification: classify, + score/rerank as a cross-encoder when the head has
  a single logit (ms-marco MiniLM, bge-reranker).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.runner.pooler import POOLING_METHODS, ModelPooler, PoolerConfig

logger = logging.getLogger(__name__)

TASKS = ("generate", "embed", "classify", "score", "rerank")  # the server's Task values
# sentence-transformers' pooling modes (1_Pooling/config.json) -> our pooling method
_ST_MODES = {"cls": "cls", "mean": "mean", "max": "max", "lasttoken": "last"}
# before sentence-transformers 6 the file held one boolean switch per mode, not "pooling_mode"
_ST_MODE_SWITCHES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")  # module types we reproduce exactly
# a cross-encoder's activation as sentence-transformers' CrossEncoder config names it -> ours
_CE_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",  # ms-marco cross-encoders: raw logits
    "torch.nn.modules.activation.Tanh": "tanh",
}
# a Dense module's activation_function -> the torch module (the ones embedding models use)
_ST_DENSE_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": nn.Tanh,
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.ReLU": nn.ReLU,
    "torch.nn.modules.activation.GELU": nn.GELU,
    "torch.nn.modules.activation.Sigmoid": nn.Sigmoid,
}


@dataclass(frozen=True)
class SentenceTransformersInfo:
    """What a sentence-transformers folder says about pooling."""

    method: str | None  # from 1_Pooling/config.json; None without a Pooling module
    normalize: bool  # a Normalize module follows the pooling
    max_seq_length: int | None  # sentence_bert_config.json: inputs are truncated to this
    dense: tuple[Path, ...] = ()  # folders of the Dense modules after pooling, in order
    # config_sentence_transformers.json: named prompts (prepended to a text before it is
    # tokenised) and the one sentence-transformers' encode() uses when told none
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None


@dataclass(frozen=True)
class PoolingSetup:
    """An engine's tasks and how it serves the pooling ones."""

    tasks: tuple[str, ...]  # subset of TASKS, in TASKS order
    pooler: ModelPooler | None  # None when the model does no pooling task
    score_method: str | None  # "cross-encoder" | "cosine" | "yes-token"; None = cannot score
    labels: tuple[str, ...] = ()  # classifier label names, by label id
    embedding_size: int | None = None  # full embedding dimension; None when it cannot embed
    max_input_len: int | None = None  # pooling inputs' token limit (sentence-transformers)
    yes_no_ids: tuple[int, int] | None = None  # yes-token scoring: the "yes" and "no" ids
    # Embed's default when a request leaves normalize unset: False only where the model's
    # sentence-transformers pipeline has no Normalize module (dot-product models)
    normalize: bool = True
    prompts: tuple[tuple[str, str], ...] = ()  # sentence-transformers' named prompts
    default_prompt_name: str | None = None  # the prompt texts get when a request names none

    @functools.cached_property
    def pooler_tasks(self) -> frozenset[str]:
        """PoolingParams tasks this engine's pooler computes (cosine scoring uses "embed")."""
        tasks: set[str] = {t for t in ("embed", "classify") if t in self.tasks}
        if self.score_method in ("cross-encoder", "yes-token"):
            tasks.add("score")
        return frozenset(tasks)


def read_sentence_transformers(folder: Path) -> SentenceTransformersInfo | None:
    """Reads modules.json and its Pooling module; None when the folder has no modules.json.
    Raises UnsupportedModel for modules we would not reproduce exactly (Dense, ...)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    unknown = sorted(set(kinds) - set(_ST_MODULES))
    if unknown:
        raise UnsupportedModel(f"sentence-transformers modules {unknown} are not supported")
    method = None
    if "Pooling" in kinds:
        method = _st_pooling_method(folder / kinds["Pooling"].get("path", "") / "config.json")
    dense = tuple(
        folder / m.get("path", "") for m in modules if str(m.get("type", "")).endswith("Dense")
    )
    prompts, default_prompt = _st_prompts(folder)
    return SentenceTransformersInfo(
        method, "Normalize" in kinds, _st_max_seq_length(folder), dense, prompts, default_prompt
    )


def _st_prompts(folder: Path) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """config_sentence_transformers.json's prompts and default prompt name (a name that is
    not among the prompts is refused, as sentence-transformers refuses it)."""
    config = _st_config(folder)
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise UnsupportedModel("config_sentence_transformers.json: prompts is not a name -> text map")
    default = config.get("default_prompt_name") or None
    if default is not None and default not in prompts:
        raise UnsupportedModel(
            f"config_sentence_transformers.json: default_prompt_name {default!r} is not "
            f"among its prompts {sorted(prompts)}"
        )
    return tuple((str(k), v) for k, v in prompts.items()), default


def _st_config(folder: Path | None) -> dict[str, Any]:
    """config_sentence_transformers.json; {} when the folder has none."""
    config_file = None if folder is None else folder / "config_sentence_transformers.json"
    if config_file is None or not config_file.is_file():
        return {}
    config = json.loads(config_file.read_text())
    return config if isinstance(config, dict) else {}


def st_dense_head(folders: tuple[Path, ...]) -> tuple[nn.Sequential, int]:
    """sentence-transformers' Dense modules as one [R, in] -> [R, out] module (float32), and
    out: each is activation(linear(x)), weights in its folder's model.safetensors (older:
    pytorch_model.bin) as linear.weight / linear.bias."""
    layers: list[nn.Module] = []
    out = 0
    for folder in folders:
        config = json.loads((folder / "config.json").read_text())
        name = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
        if name not in _ST_DENSE_ACTIVATIONS:
            raise UnsupportedModel(
                f"sentence-transformers Dense activation {name!r}; supported: "
                f"{sorted(_ST_DENSE_ACTIVATIONS)}"
            )
        linear = nn.Linear(
            config["in_features"], config["out_features"], bias=config.get("bias", True)
        )
        linear.load_state_dict(_st_dense_weights(folder))
        layers += [linear, _ST_DENSE_ACTIVATIONS[name]()]
        out = linear.out_features
    return nn.Sequential(*layers).requires_grad_(False).eval(), out


def _st_dense_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A Dense module's {"weight", "bias"} (its checkpoint names them linear.*)."""
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(folder / "model.safetensors"))
    else:
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return {k.removeprefix("linear."): v.float() for k, v in state.items()}


def _st_pooling_method(config_file: Path) -> str:
    config = json.loads(config_file.read_text())
    mode = config.get("pooling_mode")  # one name, or a list of them (concatenated vectors)
    if mode is None:
        used = [name for key, name in _ST_MODE_SWITCHES.items() if config.get(key)]
    else:
        used = [mode] if isinstance(mode, str) else list(mode)
    if len(used) != 1 or used[0] not in _ST_MODES:
        raise UnsupportedModel(
            f"sentence-transformers pooling {used}: only one of {list(_ST_MODES)}"
        )
    if config.get("include_prompt") is False:
        raise UnsupportedModel("sentence-transformers pooling with include_prompt false")
    return _ST_MODES[used[0]]


def _st_max_seq_length(folder: Path) -> int | None:
    config_file = folder / "sentence_bert_config.json"
    if not config_file.is_file():
        return None
    value = json.loads(config_file.read_text()).get("max_seq_length")
    return int(value) if value else None


def pooling_setup(
    model: Any, hf_config: Any, folder: Path | None, tokenizer: Any, method_flag: str | None = None
) -> PoolingSetup:
    """Decides the engine's tasks and builds its pooler. method_flag (ModelConfig.pooling)
    overrides the embedding pooling method read from sentence-transformers files or implied
    by the architecture; classifier heads always read the token they were trained on."""
    if method_flag is not None and method_flag not in POOLING_METHODS:
        raise InvalidArgument("pooling", f"{method_flag!r} is not one of {POOLING_METHODS}")
    if model.capabilities.classifier:
        return _classifier_setup(model, hf_config, folder)
    if model.capabilities.dual_encoder:  # CLIP/SigLIP: the runner pools text and images
        size = int(model.hidden_size)
        return PoolingSetup(("embed", "score"), None, "cosine", embedding_size=size)
    st = read_sentence_transformers(folder) if folder is not None else None
    # decoders pool their last token ("last"), which sees the whole input
    default = model.capabilities.default_pooling
    method = method_flag or (st.method if st else None) or default
    tasks: tuple[str, ...]
    score: str | None
    yes_no = None
    caps = model.capabilities
    if not caps.uses_kv_cache or caps.embeds_only:  # embeddings, cosine scores
        tasks, score = ("embed", "score", "rerank"), "cosine"
    else:
        yes_no = yes_no_token_ids(tokenizer)
        tasks, score = ("generate", "embed"), None
        if yes_no is not None:
            tasks, score = ("generate", "embed", "score", "rerank"), "yes-token"
    config = PoolerConfig(method, score=None if score == "cosine" else score, yes_no_ids=yes_no)
    head, size = None, model.hidden_size
    if st and st.dense:
        head, size = st_dense_head(st.dense)
        param = next(model.parameters())  # the head runs on the model's device, in its dtype
        head.to(param.device, param.dtype)
    return PoolingSetup(
        tasks,
        ModelPooler(model, config, head),
        score,
        embedding_size=size,
        max_input_len=st.max_seq_length if st else None,
        yes_no_ids=yes_no,
        normalize=st.normalize if st else True,
        prompts=st.prompts if st else (),
        default_prompt_name=st.default_prompt_name if st else None,
    )


def _classifier_setup(model: Any, hf_config: Any, folder: Path | None) -> PoolingSetup:
    num_labels = int(model.num_labels)
    multi_label = getattr(hf_config, "problem_type", None) == "multi_label_classification"
    activation = "sigmoid" if num_labels == 1 or multi_label else "softmax"
    cross_encoder = num_labels == 1  # one relevance logit: the pair is scored jointly
    score_activation = cross_encoder_activation(hf_config, folder) if cross_encoder else "sigmoid"
    config = PoolerConfig(
        method=model.capabilities.default_pooling,
        activation=activation,
        score="cross-encoder" if cross_encoder else None,
        score_activation=score_activation,
    )
    tasks = ("classify", "score", "rerank") if cross_encoder else ("classify",)
    return PoolingSetup(
        tasks,
        ModelPooler(model, config),
        "cross-encoder" if cross_encoder else None,
        labels=label_names(hf_config, num_labels),
    )


def cross_encoder_activation(hf_config: Any, folder: Path | None) -> str:
    """What sentence-transformers' CrossEncoder.predict applies to a single-logit head by
    default: the activation_fn of config_sentence_transformers.json (read, as CrossEncoder
    reads it, only in a folder with modules.json), else of config.json's
    `sentence_transformers` (else its older sbert_ce_default_activation_function), else the
    sigmoid. A name outside torch is passed over, as CrossEncoder passes it over without
    trust_remote_code; a torch one we do not have is refused, listing ours."""
    saved_by_st = folder is not None and (folder / "modules.json").is_file()
    from_st = _st_config(folder).get("activation_fn") if saved_by_st else None
    st = getattr(hf_config, "sentence_transformers", None)
    if isinstance(st, dict) and "activation_fn" in st:
        from_config = st["activation_fn"]
    else:
        from_config = getattr(hf_config, "sbert_ce_default_activation_function", None)
    for name in (from_st, from_config):
        if isinstance(name, str) and name.startswith("torch."):
            if name not in _CE_ACTIVATIONS:
                raise UnsupportedModel(
                    f"cross-encoder activation {name!r}; supported: {sorted(_CE_ACTIVATIONS)}"
                )
            return _CE_ACTIVATIONS[name]
    return "sigmoid"


def label_names(hf_config: Any, num_labels: int) -> tuple[str, ...]:
    """id2label in id order; "LABEL_i" for ids the config does not name."""
    id2label = {int(k): str(v) for k, v in (getattr(hf_config, "id2label", None) or {}).items()}
    return tuple(id2label.get(i, f"LABEL_{i}") for i in range(num_labels))


def yes_no_token_ids(tokenizer: Any) -> tuple[int, int] | None:
    """("yes", "no") token ids for yes-token scoring: only for chat models (the question is
    asked as a user turn) whose tokenizer spells each answer as one token."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    ids = [tokenizer.encode(word, add_special_tokens=False) for word in ("yes", "no")]
    if any(len(i) != 1 for i in ids):
        return None
    return ids[0][0], ids[1][0]
