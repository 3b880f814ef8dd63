"""Labels and captured states are the target's own, for every causal-LM family transformers
ships that eyas accepts (issue 39).

Labels: `load_target_head(folder).logits(h_N)` must be the logits of the model's own forward,
whatever the family does around lm_head (Granite's `logits_scaling`, Cohere's `logit_scale`,
Gemma-2's `final_logit_softcapping`, Falcon-H1's `lm_head_multiplier`, MiniCPM3's scaling of
the hidden state, ...). Each family of transformers' causal-LM mapping is built tiny and
random, with those knobs set where they change the logits, so that labels that ignored them
would fail here. A family is skipped, with its reason, only where it cannot be built tiny
(its config refuses the tiny sizes, or the tiny model does not run) or where eyas refuses it
in one line; the families named in MUST_COVER may not be skipped.

Captured states: HFCapturer's states against the eager float32 forward, at test_capture's
tolerances, so that a family whose config soft-caps attention scores (Gemma-2's
`attn_logit_softcapping`, which sdpa drops) is captured with the attention that computes it.

The whole enumeration takes 35-55 s on two idle CPU cores (minutes when they are busy), so the
default run (~8 s) covers LABELS_DEFAULT and STATES_DEFAULT: the required families, those with
soft-capped attention, the wrappers, most with an output knob, and one of each other shape (MoE,
MLA, attention sinks, lm_head with a bias, a final norm run twice); all the others are marked
slow and run with `-m slow` or without a marker filter.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from test_capture import ATOL, RTOL
from tiny import WRAPPERS, build_model
from transformers import CONFIG_MAPPING, AutoConfig, AutoTokenizer, Gemma2Config
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from eyas import distributed
from eyas.capture.hf import HFCapturer
from eyas.data.prepared import PreparedSample
from eyas.errors import EyasError
from eyas.models.layers import decoder_parts
from eyas.models.load import auto_model_class, exact_attention
from eyas.models.target_head import load_target_head
from eyas.regenerate.static import StaticGreedy, supports_static
from eyas.train import TrainConfig
from eyas.train.loop import _default_lm_head

VOCAB = 512
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Set where a family has them: defaults far from tiny (experts, MLA ranks, rotary and
# per-layer-embedding sizes). An MLA family also gets head_dim = qk_rope_head_dim, and as
# many KV heads as query heads, as tests/tiny.py's deepseek_v3.
SHRINK = dict(rotary_dim=8, num_experts=4, n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, n_shared_experts=1, shared_expert_intermediate_size=32,
              first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
              qk_nope_head_dim=8, vocab_size_per_layer_input=VOCAB)
# What families do around lm_head, at values that change the logits visibly: these random
# models' logits have a spread of ~0.6, so a cap of 0.5 bites and a scale of 8 is plain.
OUTPUT_KNOBS = dict(logits_scaling=8.0, logit_scale=0.25, final_logit_softcapping=0.5, logits_soft_cap=0.5,
                    output_logit_soft_cap=0.5, lm_head_multiplier=0.25)
ATTENTION_CAP = 0.5  # attn_logit_softcapping where a family has it: attention scores here are ~1
# The families whose config has attn_logit_softcapping (test_labels_... asserts that no other
# has it). Gemma-3's attention ignores the field in transformers 5; Gemma-2's and VaultGemma's cap.
SOFT_CAPPED_ATTENTION = ("gemma2", "gemma3", "gemma3_text", "vaultgemma")
CAPS_ATTENTION = {"gemma2", "vaultgemma"}
WRAPPED = [f"wrapper:{name}" for name in sorted(WRAPPERS)]  # tests/tiny.py's multimodal wrappers
MUST_COVER = {"llama", "qwen2", "qwen3", "granite", "cohere", "gemma2", "gemma3_text", "gemma3", "wrapper:gemma3_mm"}
# The default run (see the module docstring); everything else is marked slow.
LABELS_DEFAULT = MUST_COVER | set(SOFT_CAPPED_ATTENTION) | set(WRAPPED) | {
    "cohere2", "granitemoe", "falcon_h1", "minicpm3", "nanochat", "recurrent_gemma",  # logit transforms
    "qwen3_moe", "deepseek_v3", "gpt_oss", "phi"}  # MoE, MLA, attention sinks, lm_head with a bias
STATES_DEFAULT = MUST_COVER | set(SOFT_CAPPED_ATTENTION) | set(WRAPPED) | {"nanochat", "deepseek_v3"}
# logits_scaling, logit_scale, a soft-cap or lm_head_multiplier (set by OUTPUT_KNOBS), MiniCPM3's
# and Inkling's own scaling: their own logits are far from norm(h) @ lm_head.T
TRANSFORMS_LOGITS = {"granite", "cohere", "cohere2", "granitemoe", "gemma2", "gemma3_text", "vaultgemma", "falcon_h1",
                     "minicpm3", "nanochat", "recurrent_gemma", "inkling_text"}
MAX_PARAMS = 5_000_000  # "tiny": a family whose tiny build is larger keeps a default this file does not shrink
LABEL_ATOL = 1e-4  # float32 logits: the same products in the same order (0 seen), or up to a reordered sum
KL_MAX = 1e-7  # nats per position, KL(target || labels)


def _settable(config, name: str) -> bool:
    try:  # some configs raise more than AttributeError for a field that has no one value (Gemma-4's head_dim)
        return hasattr(config, name) and not isinstance(getattr(type(config), name, None), property)
    except Exception:  # noqa: BLE001
        return False


def _tiny_kwargs(default) -> dict:
    """TINY, SHRINK and the knobs, each where the config `default` has it (and can set it)."""
    kwargs = {k: v for k, v in {**TINY, **SHRINK, **OUTPUT_KNOBS}.items()
              if k in ("vocab_size", "hidden_size", "num_hidden_layers") or _settable(default, k)}
    if _settable(default, "attn_logit_softcapping"):
        kwargs["attn_logit_softcapping"] = ATTENTION_CAP
    if "qk_rope_head_dim" in kwargs:
        kwargs.update(head_dim=kwargs["qk_rope_head_dim"], num_key_value_heads=TINY["num_attention_heads"])
    return kwargs


def _tiny_config(model_type: str):
    default = CONFIG_MAPPING[model_type]()
    text = default.get_text_config()
    if text is default:
        return type(default)(**_tiny_kwargs(default))
    # A multimodal config in the causal-LM mapping: tiny text model, smallest vision tower.
    vision = getattr(default, "vision_config", None)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, depth=1, num_attention_heads=2, num_heads=2)
    return type(default)(text_config={"model_type": text.model_type, **_tiny_kwargs(text)},
                         vision_config={"model_type": vision.model_type, **{
                             k: v for k, v in small.items() if _settable(vision, k)}} if vision is not None else None,
                         tie_word_embeddings=False)


_BUILT: dict[str, tuple | str] = {}


def _skip(family: str, reason: str):
    if family in MUST_COVER:
        pytest.fail(f"{family} must be covered, but {reason}")
    pytest.skip(f"{family}: {reason}")


def _build(family: str, root, tokenizer_dir):
    """(folder, float32 model) of `family`, built tiny and random once, or the reason it
    cannot be built tiny (a string)."""
    if family not in _BUILT:
        folder = root / family.replace(":", "-")
        try:
            if family in WRAPPED:
                name = family.split(":", 1)[1]
                build_model(folder, name, layers=2, tokenizer_dir=tokenizer_dir)
                saved = json.loads((folder / "config.json").read_text())  # the output knob the text config has
                saved["text_config"].update({k: v for k, v in OUTPUT_KNOBS.items() if k in saved["text_config"]})
                (folder / "config.json").write_text(json.dumps(saved))
                model = auto_model_class(AutoConfig.from_pretrained(folder)).from_pretrained(folder)
            else:
                config = _tiny_config(family)
                with torch.device("meta"):  # the size first: some defaults eyas does not shrink are huge
                    params = sum(p.numel() for p in auto_model_class(config).from_config(config).parameters())
                if params > MAX_PARAMS:
                    raise ValueError(f"{params:,} parameters at the tiny sizes")
                torch.manual_seed(0)
                model = auto_model_class(config).from_config(config)
                with torch.no_grad():  # as tests/tiny.py: random weights of a visible scale, and biases
                    for name, p in model.named_parameters():  # (lm_head's, where it has one) that are not 0
                        if p.dim() > 1 or name.endswith(".bias"):
                            p.normal_(0, 0.08)
                model.save_pretrained(folder)
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)  # for HFCapturer
            model.float().eval()
            with torch.no_grad():
                model(input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=False)
            _BUILT[family] = (folder, model)
        except Exception as e:  # noqa: BLE001 - transformers' own refusals of tiny sizes, of any kind
            _BUILT[family] = f"cannot be built tiny ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]})"
    return _BUILT[family]


@pytest.fixture
def built(tmp_path_factory, tiny_tokenizer_dir):
    root = tmp_path_factory.getbasetemp() / "target-families"
    root.mkdir(exist_ok=True)

    def get(family: str):
        result = _build(family, root, tiny_tokenizer_dir)
        if isinstance(result, str):
            _skip(family, result)
        return result

    return get


def _input_ids(n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _reference(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The id-N state (the final norm's input, read by a pre-hook as eyas.models.states does;
    its last call, as NanoChat also runs it before its first layer) and the logits of the
    model's own forward: [1, T, H], [1, T, V]."""
    seen = {}

    def keep(module, args, kwargs):
        seen["h"] = args[0] if args else kwargs["hidden_states"]

    handle = decoder_parts(model).norm.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        handle.remove()
    return seen["h"], logits


def _reference_states(model, input_ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """[T, L, H], batch 1, unpadded: the input of decoder layer k for id k < N, the last layer's
    output for id N. (test_capture's reference reads transformers' `hidden_states`, which Mamba
    records after each layer instead of before.)"""
    layers = decoder_parts(model).layers
    seen = {}

    def keep_input(k: int):
        def hook(module, args, kwargs):
            seen.setdefault(k, args[0] if args else kwargs["hidden_states"])
        return hook

    def keep_output(module, args, output):
        seen.setdefault(len(layers), output[0] if isinstance(output, tuple) else output)

    handles = [layers[k].register_forward_pre_hook(keep_input(k), with_kwargs=True) for k in layer_ids if k < len(layers)]
    handles.append(layers[-1].register_forward_hook(keep_output))
    try:
        with torch.no_grad():
            model(input_ids=input_ids[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.stack([seen[k][0] for k in layer_ids], dim=1)


def _families(default: set[str]) -> list:
    """Every family of the causal-LM mapping and tests/tiny.py's wrappers; those outside
    `default` marked slow."""
    return [family if family in default else pytest.param(family, marks=pytest.mark.slow)
            for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) + WRAPPED]


@pytest.mark.parametrize("family", _families(LABELS_DEFAULT))
def test_labels_are_the_targets_own_logits(built, family):
    folder, model = built(family)
    text = model.config.get_text_config()
    assert getattr(text, "attn_logit_softcapping", None) is None or family in SOFT_CAPPED_ATTENTION, (
        f"{family} soft-caps attention: add it to SOFT_CAPPED_ATTENTION")
    try:
        head = load_target_head(folder)
    except EyasError as e:
        assert "\n" not in str(e)
        _skip(family, f"eyas refuses it: {e}")
    hidden, want = _reference(model, _input_ids())
    got = head.logits(hidden)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=LABEL_ATOL, rtol=0)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    assert kl.sum(-1).max() <= KL_MAX  # KL(target || labels) per position
    assert abs(got.std() / want.std() - 1) <= 1e-4  # the spread: 8-16x off when a scale was dropped
    rows = torch.tensor([5, VOCAB - 1, 17, 3])  # a draft vocabulary's rows alone give the same columns
    torch.testing.assert_close(head.logits(hidden, rows), want[..., rows], atol=LABEL_ATOL, rtol=0)
    if family in TRANSFORMS_LOGITS:  # the test can fail: the plain head, labels before this fix, is far off
        plain = head.norm(hidden) @ head.lm_head_weight.T
        assert (plain - want).abs().max() > 100 * LABEL_ATOL
    # --lm-head target/frozen copies lm_head into the drafter's plain head only where that is all there is:
    # where the family's own logits are the plain product of its normed state and lm_head
    product = head.lm_head_bias is None and torch.allclose(head.norm(hidden) @ head.lm_head_weight.T, want,
                                                           atol=LABEL_ATOL, rtol=0)
    assert head.logits_are_the_product() == product, family
    # so DFlash's default head is the target's rows, frozen, only there, and a new one elsewhere (said, not refused)
    dflash = TrainConfig(out="x", store="s", drafter="dflash")
    assert _default_lm_head(dflash, head, distributed.Dist()) == ("frozen" if product else "own"), family


def test_the_required_families_have_their_output_knobs():
    """The families the issue measured have the knobs this file sets (they would otherwise pass
    without testing anything): Granite's scale, Cohere's, Gemma-2's soft-cap."""
    for family, knob in (("granite", "logits_scaling"), ("cohere", "logit_scale"),
                         ("gemma2", "final_logit_softcapping")):
        assert getattr(_tiny_config(family), knob) == OUTPUT_KNOBS[knob]


@pytest.mark.parametrize("family", _families(STATES_DEFAULT))
def test_captured_states_are_the_targets_own(built, family):
    """HFCapturer (one padded batch) against the eager float32 forward, batch 1, unpadded, at
    test_capture's tolerances."""
    folder, _ = built(family)
    samples = [PreparedSample(_input_ids(n, seed)[0], torch.ones(n, dtype=torch.bool), i)
               for i, (n, seed) in enumerate([(23, 1), (9, 2), (16, 3)])]
    try:
        capturer = HFCapturer(str(folder), layers="0,1")
        captured = capturer.capture(samples)  # one padded batch
    except EyasError as e:
        assert "\n" not in str(e)
        _skip(family, f"eyas refuses it: {e}")
    if family in SOFT_CAPPED_ATTENTION:
        assert capturer.model.config._attn_implementation == "eager"
    config = capturer.model.config
    eager = auto_model_class(config).from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    for sample, got in zip(samples, captured):
        want = _reference_states(eager, sample.input_ids, capturer.layer_ids)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    if family in CAPS_ATTENTION:  # the cap bites: sdpa, which drops it, would fail this test
        sdpa = auto_model_class(config).from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)
        ids = samples[0].input_ids
        assert not torch.allclose(_reference_states(sdpa.eval(), ids, capturer.layer_ids),
                                  _reference_states(eager, ids, capturer.layer_ids), atol=ATOL, rtol=RTOL)


def test_soft_capped_attention_refuses_an_attention_that_drops_the_cap():
    config = Gemma2Config(attn_logit_softcapping=50.0)
    assert exact_attention(config) == "eager" and exact_attention(config, "eager") == "eager"
    with pytest.raises(EyasError, match="soft-caps its attention scores"):
        exact_attention(config, "sdpa")
    assert exact_attention(Gemma2Config(attn_logit_softcapping=None)) is None


def test_static_greedy_leaves_soft_capped_attention_to_generate():
    """Regeneration's greedy loop forces its own sdpa; a soft-capped model (here with no
    sliding window, so only the cap stands in the way) goes to `model.generate` instead."""
    full = dict(num_hidden_layers=2, sliding_window=None, layer_types=["full_attention"] * 2)
    capped = SimpleNamespace(config=Gemma2Config(attn_logit_softcapping=50.0, **full))
    assert supports_static(SimpleNamespace(config=Gemma2Config(attn_logit_softcapping=None, **full)))
    assert not supports_static(capped)
    with pytest.raises(EyasError, match="soft-capped attention"):
        StaticGreedy(capped, pad_id=0, stops=[2], cache_tokens=1024)
