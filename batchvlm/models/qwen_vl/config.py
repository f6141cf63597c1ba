"""What the Qwen vision-language families share in `config.json`: the vision tower's settings
(Qwen3-VL's tower; Qwen3.5 has the same one without DeepStack), the text model's attention,
rotary and MLP settings (dense or mixture-of-experts: the `*_moe` model types differ from the
dense ones only by their MLP) and the family config around both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from ..base.errors import ConfigError


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    dim: int
    ff_dim: int
    n_heads: int
    out_dim: int  # the text width
    patch_size: int
    temporal_patch: int
    merge: int  # spatial merge: merge x merge patches -> one text token
    n_pos_embeddings: int  # a square learned grid, side = sqrt(n)
    deepstack_layers: tuple[int, ...]  # vision layers whose features feed text layers 0, 1, ... (none: no DeepStack)
    rope_theta: float
    in_channels: int = 3

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def pos_side(self) -> int:
        return int(self.n_pos_embeddings**0.5)


def vision_config(v: dict[str, Any], deepstack: bool) -> VisionConfig:
    """`vision_config` of config.json. `deepstack`: the family feeds vision layers into the text
    model (Qwen3-VL; default layers 8, 16, 24); without it the key must be absent (Qwen3.5)."""
    rope = v.get("rope_parameters") or {}
    patch, temporal = v.get("patch_size", 16), v.get("temporal_patch_size", 2)
    if not isinstance(patch, int) or not isinstance(temporal, int):
        raise ConfigError("vision patch_size / temporal_patch_size must be single numbers")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"vision hidden_act {act!r} is not supported (only gelu_pytorch_tanh)")
    if not deepstack and v.get("deepstack_visual_indexes"):
        raise ConfigError("vision deepstack_visual_indexes: this family's text model takes no DeepStack features")
    layers = v.get("deepstack_visual_indexes", (8, 16, 24)) if deepstack else ()
    c = VisionConfig(
        depth=int(v.get("depth", 27)), dim=int(v.get("hidden_size", 1152)), ff_dim=int(v.get("intermediate_size", 4304)),
        n_heads=int(v.get("num_heads", 16)), out_dim=int(v.get("out_hidden_size", 3584)), patch_size=patch,
        temporal_patch=temporal, merge=int(v.get("spatial_merge_size", 2)),
        n_pos_embeddings=int(v.get("num_position_embeddings", 2304)),
        deepstack_layers=tuple(int(i) for i in layers),
        rope_theta=float(rope.get("rope_theta", 10000.0)), in_channels=int(v.get("in_channels", 3)))
    if c.pos_side**2 != c.n_pos_embeddings:
        raise ConfigError(f"num_position_embeddings {c.n_pos_embeddings} is not a square")
    if any(not 0 <= i < c.depth for i in c.deepstack_layers):
        raise ConfigError(f"deepstack_visual_indexes {list(c.deepstack_layers)} outside the {c.depth} vision layers")
    return c


def text_rope(t: dict[str, Any]) -> dict[str, Any]:
    """The text rotary settings in either spelling: `rope_parameters` (transformers 5) or the
    `rope_theta` + `rope_scaling` pair the released checkpoints were written with."""
    rope = dict(t.get("rope_scaling") or {}) | dict(t.get("rope_parameters") or {})
    rope.setdefault("rope_theta", t.get("rope_theta", 5_000_000.0))
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"text rope_type {rope['rope_type']!r} is not supported (only default)")
    if not rope.get("mrope_interleaved", True):
        raise ConfigError("only interleaved multimodal rotary (mrope_interleaved: true) is supported")
    return rope


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: a router picks `top_k` of `n_experts` SwiGLU experts (width `ff_dim`) per
    token, weights renormalised over the picked ones; plus, where `shared_ff_dim` > 0, a
    shared SwiGLU expert every token goes through, scaled by sigmoid(shared_expert_gate x)."""

    n_experts: int
    top_k: int
    ff_dim: int  # moe_intermediate_size
    shared_ff_dim: int  # shared_expert_intermediate_size; 0: no shared expert
    dense_layers: tuple[int, ...]  # layers with a dense MLP of the text ff_dim instead


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    """The text settings both families share; each family's TextConfig adds its layer layout."""

    vocab_size: int
    dim: int
    ff_dim: int  # the dense MLP's width (intermediate_size)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dim: int  # the first rotary_dim of each head are rotated (Qwen3-VL: all of it)
    rope_theta: float
    mrope_section: tuple[int, int, int]  # rotary frequencies driven by t, h, w (sum = rotary_dim / 2)
    rms_eps: float
    max_context: int
    tie_embeddings: bool
    attention_bias: bool = False
    moe: MoEConfig | None = None  # None: every layer's MLP is dense

    def sparse(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers


def text_fields(raw: dict[str, Any], rotary_fraction: float, default_section: tuple[int, int, int],
                moe: bool, shared_expert: bool) -> dict[str, Any]:
    """TextConfig's fields from `raw` (the whole config.json). `rotary_fraction`: the default
    `partial_rotary_factor`; `moe`: the model type's MLP is sparse (`shared_expert`: with one)."""
    t = raw["text_config"]
    rope = text_rope(t)
    n_heads = int(t.get("num_attention_heads", 16))
    head_dim = int(t.get("head_dim") or t["hidden_size"] // n_heads)
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor",
                                                                               rotary_fraction))))
    section = tuple(int(s) for s in rope.get("mrope_section", default_section))
    if len(section) != 3 or sum(section) != rotary_dim // 2:
        raise ConfigError(f"mrope_section {list(section)} must be 3 numbers summing to the rotated dims / 2 = "
                          f"{rotary_dim // 2}")
    if t.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"text hidden_act {t['hidden_act']!r} is not supported (only silu)")
    tie = raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    ff_dim = int(t.get("intermediate_size") or 0) if moe else int(t["intermediate_size"])  # MoE: dense layers only
    return dict(
        vocab_size=int(t["vocab_size"]), dim=int(t["hidden_size"]), ff_dim=ff_dim,
        n_heads=n_heads, n_kv_heads=int(t.get("num_key_value_heads") or n_heads), head_dim=head_dim,
        rotary_dim=rotary_dim, rope_theta=float(rope["rope_theta"]), mrope_section=section,
        rms_eps=float(t.get("rms_norm_eps", 1e-6)), max_context=int(t.get("max_position_embeddings", 262144)),
        tie_embeddings=bool(tie), attention_bias=bool(t.get("attention_bias", False)),
        moe=moe_config(t, shared_expert) if moe else None)


def moe_config(t: dict[str, Any], shared_expert: bool) -> MoEConfig:
    """`text_config` of a `*_moe` model type. The router always renormalises its top-k weights
    (transformers' Qwen3-VL-MoE / Qwen3.5-MoE routers do, whatever `norm_topk_prob` says), so a
    checkpoint that asks for unnormalised weights is refused rather than run differently."""
    n = int(t.get("num_experts", t.get("num_local_experts", 0)))
    k = int(t.get("num_experts_per_tok", 0))
    if not 0 < k <= n:
        raise ConfigError(f"text num_experts_per_tok {k} must be between 1 and num_experts {n}")
    if t.get("norm_topk_prob", True) is not True:
        raise ConfigError("text norm_topk_prob: false is not supported (the router renormalises its top-k weights)")
    n_layers = int(t["num_hidden_layers"])
    step = int(t.get("decoder_sparse_step", 1))
    dense = {int(i) for i in t.get("mlp_only_layers") or ()} | {i for i in range(n_layers) if (i + 1) % step}
    if dense and not int(t.get("intermediate_size") or 0):
        raise ConfigError("text mlp_only_layers / decoder_sparse_step leave dense layers, but intermediate_size "
                          "is not set")
    shared = int(t.get("shared_expert_intermediate_size") or 0) if shared_expert else 0
    if shared_expert and not shared:
        raise ConfigError("text shared_expert_intermediate_size must be set (this model type has a shared expert)")
    return MoEConfig(n, k, int(t["moe_intermediate_size"]), shared, tuple(sorted(dense)))


C = TypeVar("C", bound="QwenVLConfig")


@dataclass(frozen=True)
class QwenVLConfig:
    """A family's config: its TextConfig, the vision tower and the image tokens. A family sets
    which `model_types` it reads (dense first, then its MoE variant), whether its tower has
    DeepStack, its default token ids and how its text config is read."""

    text: Any  # the family's TextConfig
    vision: VisionConfig
    image_token_id: int
    vision_start_id: int
    vision_end_id: int

    model_types: ClassVar[tuple[str, ...]]
    deepstack: ClassVar[bool]
    default_ids: ClassVar[tuple[int, int, int]]  # image, vision_start, vision_end

    @property
    def max_context(self) -> int:
        return self.text.max_context

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @classmethod
    def text_config(cls, raw: dict[str, Any], moe: bool) -> Any:
        raise NotImplementedError

    @classmethod
    def from_dict(cls: type[C], raw: dict[str, Any]) -> C:
        model_type = raw.get("model_type")
        if model_type not in cls.model_types:
            raise ConfigError(f"model_type {model_type!r} is not {' or '.join(cls.model_types)}")
        image, start, end = cls.default_ids
        try:
            c = cls(cls.text_config(raw, model_type.endswith("_moe")),
                    vision_config(raw.get("vision_config") or {}, deepstack=cls.deepstack),
                    int(raw.get("image_token_id", image)), int(raw.get("vision_start_token_id", start)),
                    int(raw.get("vision_end_token_id", end)))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"bad {model_type} config: {e!r}") from e
        if c.vision.out_dim != c.text.dim:
            raise ConfigError(f"vision out_hidden_size {c.vision.out_dim} != text hidden_size {c.text.dim}")
        return c
