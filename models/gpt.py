"""GPT-2 as in the paper's code (a nanoGPT fork), with attention routed per layer and per head.

Learned absolute positions, pre-LayerNorm blocks, GELU MLP (4x), tied token embedding / LM head, no biases by default,
vocab 50304, nanoGPT init (std 0.02; residual projections 0.02 / sqrt(2 * n_layer)). Attention dropout is not
modelled (the flash kernels have none); `dropout` applies to embeddings and residual branches, and is 0 in the paper.

The model runs under the caller's autocast (AMP: FP32 master weights, BF16 forward); attention casts its own inputs
(models/attention.py). The loss is cross entropy in FP32.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from flash_forensics.kernels.config import AttentionConfig, AttentionKnobs
from flash_forensics.models.attention import attend, new_stats, prepare_device, resolve_backend, route_name
from flash_forensics.models.embedding import token_embedding

FAMILIES = ("gpt", "llama")  # model.family: this file's GPT-2, or a transformers Llama (models/hf.py)


def _bad(key: str, value, allowed: str) -> ValueError:
    return ValueError(f"{key}={value!r} is not allowed: expected {allowed}")


@dataclass
class ModelConfig:
    """GPT-2 shape; plain types so it doubles as a Hydra structured config (conf/model)."""

    name: str = "tiny"
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    dropout: float = 0.0
    bias: bool = False
    qk_norm: bool = False  # RMSNorm on q and k per head (a stabilizer to compare with SFA)
    attn_gate: bool = False  # a sigmoid output gate per head (gated attention; new parameters: CausalSelfAttention)
    z_loss: float = 0.0  # PaLM's z-loss coefficient on the output logits (no parameters: z_loss_term)
    # gpt: this file's GPT-2; llama: a transformers Llama (RoPE, GQA, SwiGLU, RMSNorm, tied embeddings) with
    # attn_implementation="forensics" (models/hf.py). The fields below are the llama family's.
    family: str = "gpt"
    n_kv_head: Optional[int] = None  # key/value heads (GQA); None = n_head
    mlp_hidden: Optional[int] = None  # SwiGLU width; None = 8/3 * n_embd rounded up to a multiple of 64
    rope_theta: float = 10000.0

    def validate(self, key: str = "model") -> "ModelConfig":
        """Raise ValueError naming key, value and what is allowed; return self."""
        if not isinstance(self.name, str) or not self.name:
            raise _bad(f"{key}.name", self.name, "a non-empty string")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise _bad(f"{key}.{name}", value, "an integer > 0")
        if self.n_embd % self.n_head:  # name both: the user may have typed either
            raise _bad(f"{key}.n_head", self.n_head, f"a divisor of {key}.n_embd={self.n_embd} (or change "
                                                     f"{key}.n_embd to a multiple of {key}.n_head)")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise _bad(f"{key}.dropout", self.dropout, "a number in [0, 1)")
        for name in ("bias", "qk_norm", "attn_gate"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(f"{key}.{name}", getattr(self, name), "true or false")
        if isinstance(self.z_loss, bool) or not isinstance(self.z_loss, (int, float)) or \
                not 0 <= self.z_loss < math.inf:
            raise _bad(f"{key}.z_loss", self.z_loss, "a finite number >= 0 (0: off; PaLM uses 1e-4)")
        self._validate_family(key)
        return self

    def _validate_family(self, key: str) -> None:
        """The family's own fields; a patch of models/gpt.py's attention is refused on a transformers family."""
        if self.family not in FAMILIES:
            raise _bad(f"{key}.family", self.family, "one of " + ", ".join(FAMILIES))
        if self.family == "gpt":
            for name, off in (("n_kv_head", None), ("mlp_hidden", None), ("rope_theta", 10000.0)):
                if getattr(self, name) != off:
                    raise _bad(f"{key}.{name}", getattr(self, name), f"{off} for {key}.family=gpt (a field of the "
                                                                     "transformers families: the GPT has none)")
            return
        for name, what in (("qk_norm", "RMSNorm on q and k inside models/gpt.py's attention"),
                           ("attn_gate", "the gated-attention output gate of models/gpt.py's attention")):
            if getattr(self, name):
                raise _bad(f"{key}.{name}", True, f"false for {key}.family={self.family}: it is {what}, which the "
                                                  f"transformers {self.family} model does not have (use family=gpt)")
        if self.dropout:
            raise _bad(f"{key}.dropout", self.dropout, f"0 for {key}.family={self.family} (it has no dropout)")
        kv = self.n_head if self.n_kv_head is None else self.n_kv_head
        if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or self.n_head % kv:
            raise _bad(f"{key}.n_kv_head", self.n_kv_head, f"a divisor of {key}.n_head={self.n_head} or null")
        if self.mlp_hidden is not None and (isinstance(self.mlp_hidden, bool) or not isinstance(self.mlp_hidden, int)
                                            or self.mlp_hidden <= 0):
            raise _bad(f"{key}.mlp_hidden", self.mlp_hidden, "an integer > 0 or null")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) or \
                not 0 < self.rope_theta < math.inf:
            raise _bad(f"{key}.rope_theta", self.rope_theta, "a finite number > 0")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def preset(cls, name: str, **changes) -> "ModelConfig":
        """tiny (trains on a 2-core CPU), gpt2_s (124M, the paper's), gpt2_m (350M)."""
        shapes = {
            "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
            "gpt2_s": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
            "gpt2_m": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
        }
        if name not in shapes:
            raise _bad("model.name", name, "one of " + ", ".join(shapes))
        return cls(name=name, **{**shapes[name], **changes}).validate()

    @classmethod
    def from_any(cls, cfg) -> "ModelConfig":
        """Build from a ModelConfig, a dict or an OmegaConf node."""
        if isinstance(cfg, ModelConfig):
            return cfg
        try:
            from omegaconf import OmegaConf
            if OmegaConf.is_config(cfg):
                cfg = OmegaConf.to_container(cfg, resolve=True)
        except ImportError:
            pass
        data = dict(cfg)
        allowed = {f.name for f in fields(cls)}
        if set(data) - allowed:
            raise ValueError(f"model: unknown keys {sorted(set(data) - allowed)}; allowed: {sorted(allowed)}")
        return cls(**data)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (torch's has no bias=False before 2.1; kept explicit like nanoGPT)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    """Fused QKV projection, per-head attention through the layer's route, output projection."""

    def __init__(self, cfg: ModelConfig, knobs: AttentionKnobs, layer: int):
        super().__init__()
        self.n_head, self.n_embd, self.layer = cfg.n_head, cfg.n_embd, layer
        self.knobs = knobs
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # rows [0, C) are W_Q
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # QK-norm: RMSNorm over each head's q and k, gains shared across heads.
        self.q_norm = nn.RMSNorm(self.n_embd // self.n_head, eps=1e-6) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.n_embd // self.n_head, eps=1e-6) if cfg.qk_norm else None
        # Gated attention, head-wise variant (Qiu et al. 2025, "Gated Attention for LLMs", G1 after SDPA): head h's
        # output is scaled by sigmoid(x W_g)_h, W_g: n_embd -> n_head from the block's normed input x. Init: the
        # model's std-0.02 normal (_init_weights), so every gate starts near sigmoid(0) = 0.5.
        self.gate = nn.Linear(cfg.n_embd, cfg.n_head, bias=cfg.bias) if cfg.attn_gate else None
        self.stats = new_stats(cfg.n_head, "cpu")
        self.probe = False  # set on logging steps: lets sdpa compute max_logit with an extra pass
        # qk_observer(q, k): called on training forwards with the (B, H, T, D) q and k this layer attends with, e.g.
        # by a train hook that needs per-head logits (orchestrator/interventions/qk_clip.py); None costs nothing
        self.qk_observer = None
        # probe_capture(x, q, k, v, o): called with this layer's input and the q, k, v, O of `attend` (graph kept, so
        # the mechanism probes get dO and dQ by autograd.grad; orchestrator/monitor/probes/runner.py);
        # None costs nothing
        self.probe_capture = None

    def _stats_on(self, device):
        if self.stats.max_logit.device != device:  # model moved since the stats were made: start fresh there
            self.stats = new_stats(self.n_head, device)
        return self.stats

    def _apply(self, fn, recurse=True):
        # .to() / .cuda(): the counters (and the kernels' device constants) follow the weights now, not at the first
        # forward: made inside a compiled forward they would be its outputs, which a CUDA graph's next replay
        # overwrites (torch.compile mode="reduce-overhead")
        out = super()._apply(fn, recurse)
        device = self.c_attn.weight.device
        self._stats_on(device)
        prepare_device(self.knobs, self.n_head, device)
        return out

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if self.q_norm is not None:  # norms in FP32 whatever autocast says; attention casts per its recipe
            with torch.autocast(device_type=x.device.type, enabled=False):
                q, k = self.q_norm(q.float()), self.k_norm(k.float())
        if self.qk_observer is not None and self.training:
            self.qk_observer(q, k)
        y = attend(q, k, v, self.knobs, self._stats_on(x.device), self.probe, layer=self.layer)
        if self.probe_capture is not None:
            self.probe_capture(x, q, k, v, y)
        # Back to the stream's dtype (exact for BF16 -> FP32) where c_proj needs it (_c_proj_input): the numbers are
        # those of a BF16 O either way (FP32 O heads stay FP32 for the backward).
        if self.gate is not None:  # gate logits from the projection's GEMM (BF16 under autocast); sigmoid and product
            g = torch.sigmoid(self.gate(x).float()).transpose(1, 2).unsqueeze(-1)  # in FP32: (B, H, T, 1)
            y = (y.float() * g).to(x.dtype)  # x: the FP32 stream (c_proj's autocast rounds it once to BF16)
        y = _c_proj_input(y.transpose(1, 2).contiguous().view(B, T, C), x)
        return self.resid_dropout(self.c_proj(y))


def _c_proj_input(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """O (B, T, C) as c_proj takes it: in the stream's dtype (x's), except where autocast would cast it straight back
    to O's own dtype (a BF16 O under BF16 autocast, FP32 stream): there O goes in as it is, the same operand without
    the two copies (BF16 -> FP32 -> BF16) forward and backward, whose round trips are exact (bit for bit the same)."""
    dev = x.device.type
    if y.dtype != x.dtype and torch.is_autocast_enabled(dev) and y.dtype == torch.get_autocast_dtype(dev):
        return y
    return y.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, knobs: AttentionKnobs, layer: int):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, knobs, layer)
        self.ln_2 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, model_cfg, attention_cfg=None):
        super().__init__()
        cfg = ModelConfig.from_any(model_cfg).validate()
        att = AttentionConfig.from_any(attention_cfg if attention_cfg is not None else AttentionConfig())
        att.validate(cfg.n_head, n_layer=cfg.n_layer)  # bad layer/head indices fail here, before any compute
        self.config, self.attention_config = cfg, att
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg, att.for_layer(i), i) for i in range(cfg.n_layer)]),
            ln_f=LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied embeddings
        # the token embedding's backward sorted, in a fixed order, compiled or not (models/embedding.py), so compiled
        # training reproduces its bits; False: nn.Embedding's own, which inductor lowers to a scatter-add, atomic on a
        # GPU. A job sets it per train.deterministic (eager jobs: False, nn.Embedding's bits as recorded)
        self.sorted_embedding_grad = True
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual projections, GPT-2 paper's scaling
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # ------------------------------------------------------------------------------------------------- compute
    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        """idx (B, T) token ids -> (logits (B, T, V), loss or None). Loss: FP32 cross entropy, targets -1 ignored."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds model.block_size={self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        wte = self.transformer.wte
        tok = token_embedding(idx, wte.weight) if self.sorted_embedding_grad else wte(idx)
        # (the positions are distinct: wpe's scatter never adds twice to one row)
        x = self.transformer.drop(tok + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            if self.config.z_loss and self.training:
                z = self.config.z_loss * z_loss_term(logits, targets)
                loss = loss + (z - z.detach())  # the gradient of CE + z-loss; the value stays the cross entropy
        return logits, loss

    # ---------------------------------------------------------------------------------------------- monitoring
    @property
    def probe(self) -> bool:
        """When True, implementations without free stats (sdpa) spend an extra pass to fill max_logit."""
        return any(b.attn.probe for b in self.transformer.h)

    @probe.setter
    def probe(self, on: bool) -> None:
        for b in self.transformer.h:
            b.attn.probe = bool(on)

    def attention_stats(self) -> list:
        """One AttnStats per layer, on the parameters' device (device tensors; read them only when logging)."""
        device = self.lm_head.weight.device
        return [b.attn._stats_on(device) for b in self.transformer.h]

    def reset_attention_stats(self) -> None:
        for s in self.attention_stats():
            s.reset()

    @torch.no_grad()
    def wq_spectral_norms(self, iters: int = 30) -> torch.Tensor:
        """Top singular value of each head's W_Q block, (n_layer, n_head) FP32 on the parameters' device.

        W_Q is rows [0, n_embd) of the fused c_attn weight; head h owns rows [h*D, (h+1)*D), a (D, n_embd) block.
        torch.linalg.svdvals / matrix_norm(ord=2) synchronise the host on CUDA, so this uses repeated squaring of the
        Gram matrix G = W W^T (D x D): A_k = G^(2^k) normalised tends to the top eigenprojector, and
        trace(A_k G) / trace(A_k) to the top eigenvalue sigma_max^2. Batched over all heads, no host sync.
        """
        cfg = self.config
        D = cfg.head_dim
        w = torch.stack([b.attn.c_attn.weight[: cfg.n_embd] for b in self.transformer.h]).float()
        return top_singular_values(w.view(cfg.n_layer * cfg.n_head, D, cfg.n_embd), iters).view(cfg.n_layer,
                                                                                                 cfg.n_head)

    def layer_knobs(self) -> List[AttentionKnobs]:
        """The resolved knobs of each layer (AttentionConfig.for_layer applied), e.g. for the run's parameters."""
        return [b.attn.knobs for b in self.transformer.h]

    def attention_routes(self, device=None) -> List[str]:
        """Per layer, what computes attention on `device` (default: the parameters'), e.g. 'flash/emulator/paper_bf16'.

        Raises ValueError when a layer asks for backend=triton and it cannot run there: call before training.
        """
        device = torch.device(device) if device is not None else self.lm_head.weight.device
        cfg = self.config
        routes = []
        for i, b in enumerate(self.transformer.h):
            backend = resolve_backend(b.attn.knobs, device, n_head=cfg.n_head, seq_len=cfg.block_size,
                                      head_dim=cfg.head_dim, key=f"attention(layer {i}).backend")
            routes.append(route_name(b.attn.knobs, backend))
        return routes

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (the tied embedding counted once); non_embedding drops the position embedding too."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n


def z_loss_term(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """PaLM's z-loss without its coefficient: mean over the scored positions (targets != -1) of logsumexp(logits)^2,
    in FP32. The train loss adds coef * this to the gradient only, so the logged loss compares with other runs."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    valid = (targets != -1).float()
    return (lse.square() * valid).sum() / valid.sum().clamp_min(1.0)


@torch.no_grad()
def top_singular_values(w: torch.Tensor, iters: int = 30) -> torch.Tensor:
    """sigma_max of each matrix of w (N, D, C) FP32, without a host sync (GPT.wq_spectral_norms says how)."""
    g = w @ w.transpose(-2, -1)
    tiny = torch.finfo(torch.float32).tiny
    a = g / _trace(g).clamp_min(tiny)[:, None, None]
    for _ in range(iters):
        a = a @ a
        a = a / _trace(a).clamp_min(tiny)[:, None, None]
    top = _trace(a @ g) / _trace(a).clamp_min(tiny)
    return top.clamp_min(0).sqrt()


def _trace(a: torch.Tensor) -> torch.Tensor:
    return a.diagonal(dim1=-2, dim2=-1).sum(-1)


__all__ = ["GPT", "ModelConfig", "asdict", "z_loss_term", "top_singular_values"]
