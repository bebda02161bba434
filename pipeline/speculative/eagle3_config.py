"""An EAGLE-3 head's config (speculators' layout), derived from a target's. Pure."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    target_layers: int = 0  # the target's decoder layers (the aux ids index them)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        d = dict(d)
        d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return cls(**d)


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """vLLM's low/middle/high depths 2, L // 2, L - 3; where they coincide (L < 7) first, middle,
    last; L < 3 repeats one (a head only Phoenix serves)."""
    low, mid, high = min(2, n_layers - 1), n_layers // 2, max(0, n_layers - 3)
    if len({low, mid, high}) < 3 and n_layers >= 3:
        low, high = 0, n_layers - 1
    return tuple(sorted((low, mid, high)))


def rope_theta_of(cfg) -> float:
    """A transformers config's RoPE base (transformers 5 keeps it in `rope_parameters`)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


def config_from_target(
    tcfg, draft_vocab: int, aux_layers: tuple[int, ...] | None = None
) -> Eagle3Config:
    """The head's config for a target (a transformers config): its widths, heads and RoPE."""
    n = tcfg.num_hidden_layers
    aux = tuple(sorted(aux_layers or default_aux_layers(n)))  # ascending, as vLLM sorts them
    if len(aux) != 3 or any(not 0 <= a < n for a in aux):
        raise ValueError(f"eagle3 reads three target layers in [0, {n}), got {list(aux)}")
    heads = tcfg.num_attention_heads
    return Eagle3Config(
        hidden_size=tcfg.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tcfg, "num_key_value_heads", heads) or heads,
        head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
        intermediate_size=tcfg.intermediate_size,
        rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(tcfg),
        vocab_size=tcfg.vocab_size,
        draft_vocab_size=min(draft_vocab or tcfg.vocab_size, tcfg.vocab_size),
        aux_layer_ids=aux,
        max_position_embeddings=getattr(tcfg, "max_position_embeddings", 4096),
        target_layers=n,
    )
