"""The drafter's configuration: one dataclass for every kind, written (by draft/checkpoint.py)
as an HF-style `config.json` that is also the one vLLM loads the kind with (its kind's writer,
draft/vllm_config.py), plus an `eyas` block recording the target and the training-time-test
settings."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from eyas.draft import kinds
from eyas.draft import mla_config as latent
from eyas.draft.rope import drafter_rope
from eyas.errors import EyasError
from eyas.models.identity import ModelIdentity, text_config
from eyas.validate import COUNT, Number
from eyas.versions import check_version

CONFIG_VERSION = 2  # the newest `eyas` block (and weight names) this eyas writes and reads, with every earlier one
# A drafter is written at the oldest version that holds it, so that an eyas reading only older ones refuses it
# in one line instead of dropping a field it does not know and drafting differently:
#   2: causal_layers (a block drafter's layers that attend causally within the block)



def _gqa_head_dim(tc) -> int:
    """The Llama layer's head width. An MLA target's `head_dim` is its rotary width (64 for
    DeepSeek-V3 and Kimi-K2.5), not an attention head's: there the head is v_head_dim wide,
    the width of the target's own heads and of published MHA drafters for it (Kimi-K2.5: 64 x 128)."""
    if latent.target_uses_mla(tc) and getattr(tc, "v_head_dim", None):
        return tc.v_head_dim
    return getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads

@dataclass(kw_only=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # vLLM convention: id k = input of target layer k
    label_layer_id: int  # N: the target's last-layer output before its final norm
    target: dict[str, Any]  # ModelIdentity.to_dict()
    rms_norm_eps: float = 1e-5
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    rope_source: str = "given"  # which of the target's settings the rope follows (see draft/rope.py)
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    fc_norm: bool = False  # an RMSNorm (own weight) on each aux state before `fc` (EAGLE 3.1; vLLM `fc_norm`)
    norm_output: bool = False  # feed the post-norm output back between steps (EAGLE 3.1; vLLM `norm_output`)
    norm_before_fc: bool = False  # one RMSNorm (own weight) over all aux states before `fc` (speculators' default)
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    chat_template: dict[str, Any] | None = None  # the training data's (data/template.py ChatTemplate), for eval
    attention: str = "gqa"  # the layer's attention: "gqa" (Llama) or "mla" (DeepSeek-V2 latent, draft/mla.py)
    mla: dict[str, Any] | None = None  # MLA's latent ranks and head dims (draft/mla.py MLA_FIELDS)
    drafter: str = kinds.DEFAULT  # the kind (draft/kinds.py)
    num_hidden_layers: int = 1  # decoder layers (a kind that is not `deep` has one)
    mask_token_id: int | None = None  # a kind with a `mask_token`: the token whose embedding marks the slots to fill
    # A block kind's layers whose block slots see only the slots up to their own (speculators'
    # sliding-window DFlash layers); the others see the whole block. `eyas train --causal-layers` and `eyas import`
    # set them.
    causal_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "draft_vocab_size", "label_layer_id", "ttt_steps", "max_position_embeddings"):
            COUNT.check(f"the drafter's `{name}`", getattr(self, name))
        Number(lo=0, lo_open=True, required=True).check("the drafter's `rms_norm_eps`", self.rms_norm_eps)
        ids = self.aux_layer_ids
        if not isinstance(ids, (list, tuple)) or not ids or not all(Number(lo=0, integer=True, required=True).accepts(k)
                                                                    for k in ids):
            raise EyasError(f"the drafter's `aux_layer_ids` {ids!r} is not a list of layer ids (integers >= 0).")
        self.aux_layer_ids = tuple(int(k) for k in ids)
        layers = self.causal_layers
        if not isinstance(layers, (list, tuple)) or not all(
                Number(lo=0, integer=True, required=True).accepts(k) and k < self.num_hidden_layers for k in layers):
            raise EyasError(f"the drafter's `causal_layers` {layers!r} is not a list of its layer indices "
                            f"(0..{self.num_hidden_layers - 1}).")
        self.causal_layers = tuple(sorted({int(k) for k in layers}))
        if self.draft_vocab_size > self.vocab_size:
            raise EyasError(f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocabulary {self.vocab_size}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise EyasError("num_attention_heads must be a multiple of num_key_value_heads.")
        if self.attention not in (latent.GQA, latent.MLA) or (self.attention == latent.MLA) != (self.mla is not None):
            raise EyasError(f"attention {self.attention!r} with mla sizes {self.mla}: MLA needs its sizes, GQA none.")
        if self.mla is not None:
            latent.check_sizes(self.mla)
            latent.check_rope(self.rope_parameters)
        if self.fc_norm and self.norm_before_fc:
            raise EyasError("fc_norm and norm_before_fc both norm fc's input; a drafter has one or the other.")
        self.kind.check_config(self)

    @property
    def kind(self) -> kinds.Kind:
        return kinds.get(self.drafter)

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity.from_dict(self.target)

    @property
    def depth(self) -> int:
        """Draft tokens per step wherever this drafter drafts unless told otherwise (`eyas eval`'s
        chain and tree, the exported serve command and speculators config): the depth it was
        trained to draft, its TTT steps (a block drafter's block size - 1). One rule, so that what
        eval measures is what the engines serve."""
        return self.ttt_steps

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Aux ids then the label id, exactly as a store records them."""
        return (*self.aux_layer_ids, self.label_layer_id)

    @classmethod
    def for_target(cls, target_config, identity: ModelIdentity, layer_ids: tuple[int, ...], draft_vocab_size: int,
                   attention: str = "gqa", mla_overrides: dict[str, Any] | None = None,
                   **overrides: Any) -> "DraftConfig":
        """A one-layer head with the target's (text model's) width, heads and the rotary
        settings of its full-attention layers; its attention Llama-style (gqa), or the
        target's MLA with its sizes (mla; `auto` picks by the target)."""
        tc = text_config(target_config)
        heads = tc.num_attention_heads
        rope, rope_source = drafter_rope(tc)
        if latent.resolve_attention(attention, tc) == "mla":
            sizes = latent.mla_sizes(tc, mla_overrides)
            overrides = {"attention": "mla", "mla": sizes, "num_key_value_heads": heads,
                         "head_dim": sizes["qk_rope_head_dim"], **overrides}
        kwargs = dict(
            hidden_size=tc.hidden_size,
            intermediate_size=getattr(tc, "intermediate_size", 4 * tc.hidden_size),
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=_gqa_head_dim(tc),
            vocab_size=tc.vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=layer_ids[:-1],
            label_layer_id=layer_ids[-1],
            target=identity.to_dict(),
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5),
            rope_parameters=rope,
            rope_source=rope_source,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 8192),
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json: the fields vLLM reads for the kind at top level, eyas's own under `eyas`."""
        return {**self.kind.vllm_config(self), "eyas": {"config_version": self.version, **asdict(self)}}

    @property
    def version(self) -> int:
        """The oldest `eyas` block version that holds this config (see CONFIG_VERSION)."""
        return 2 if self.causal_layers else 1

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], where: str) -> "DraftConfig":
        """The config of an eyas drafter's `config.json` (`where` names it in errors)."""
        if not isinstance(d.get("eyas"), dict):
            raise EyasError(f"{where} has no `eyas` block: not an eyas drafter (use `eyas import` for others).")
        own = dict(d["eyas"])
        check_version(own.pop("config_version", None), CONFIG_VERSION, "drafter", where)
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in own.items() if k in names})
        except TypeError as e:  # a field missing, or of the wrong kind
            raise EyasError(f"{where}: the `eyas` block is incomplete or damaged ({e}).") from None
        except EyasError as e:  # a field out of range
            raise EyasError(f"{where}: {e}") from None
