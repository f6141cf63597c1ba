"""Two toy families for the engine's state kinds (cache/specs.py), each with a dense
one-sequence-at-a-time reference (no paging, no cache, no batching, no snapshots):

  HybridToy   layers [linear, full, linear]: the linear layers keep a recurrent state per sequence
              (a causal-conv state [C, K-1] and a decayed outer-product state [H, Dk, Dv]),
              forked by copy from the image-prefix snapshot; the full layer is paged K/V.
  EncDecToy   an encoder over (image features, prefix prompt) whose K/V is never stored; its
              output becomes every decoder layer's cross-attention K/V, a prefix per (image,
              prompt); the decoder self-attends over its own tokens only, positions from 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from support.toy_family import DIM, HEAD_DIM, HEADS, KV_HEADS, STOP, ToyImage, ToyModel, prefix_positions, rotate

from batchvlm.cache.spans import ZERO, StateSpans
from batchvlm.cache.specs import CrossKV, PagedKV, Recurrent
from batchvlm.attention import AttentionBatch, PrefixGroup, Reads, attend, plan_groups, prefix_self_attention
from batchvlm.models.base.decoding import MODE_TEXT, SeqSpec
from batchvlm.models.base.contract import PrefixInputs

KERNEL, LIN_HEADS, KEY_DIM, VALUE_DIM = 3, 2, 4, 8
CONV_C = LIN_HEADS * (2 * KEY_DIM + VALUE_DIM)
KINDS = ("linear", "full", "linear")


# The toy's scan over a step's state spans (cache/spans.py): prefix spans from zero into their
# snapshot, prompt spans from a copy of their prefix's snapshot into their row, step tokens in place.
State = dict[str, torch.Tensor]  # part -> one layer's state of some sequences [B, *shape]
Scan = Callable[[torch.Tensor, State], tuple[torch.Tensor, State]]  # ([T, C] tokens, [1, ...] state)


def run_recurrent(x_NC: torch.Tensor, spans: StateSpans, state: dict[str, torch.Tensor], layer: int,
                  scan: Scan, step: Scan) -> torch.Tensor:
    """Run one recurrent layer over a step: `scan` once per span (its tokens in order, from its
    starting state, [1, ...] states), `step` once for all step tokens ([D, ...] states, one token
    each). `state[part]` is [n_states, n_layers, *shape]; writes the end states. -> [N, C_out]."""
    parts: list[tuple[int, torch.Tensor]] = []
    for start, n, read, write in zip(spans.scan_start, spans.scan_len, spans.scan_read, spans.scan_write):
        s0 = {p: (t.new_zeros(1, *t.shape[2:]) if read == ZERO else t[read : read + 1, layer].clone())
              for p, t in state.items()}
        y, s1 = scan(x_NC[start : start + n], s0)
        for p, t in state.items():
            t[write, layer] = s1[p][0]
        parts.append((start, y))
    rows = spans.step_rows
    if rows.shape[0]:
        y, s1 = step(x_NC[spans.first_step :], {p: t[rows, layer] for p, t in state.items()})
        for p, t in state.items():
            t[rows, layer] = s1[p]
        parts.append((spans.first_step, y))
    if not parts:
        return x_NC.new_zeros(0)
    out = parts[0][1].new_empty(x_NC.shape[0], *parts[0][1].shape[1:])
    for start, y in parts:
        out[start : start + y.shape[0]] = y
    return out


def _dense(q, k, v, causal: bool = True):
    k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=causal).transpose(0, 1)


def _greedy(next_token, spec: SeqSpec) -> list[int]:
    tokens: list[int] = []
    while True:
        nxt = next_token(list(spec.prompt) + tokens)
        if nxt == STOP:
            return tokens
        tokens.append(nxt)
        if len(tokens) >= spec.limit:
            return tokens


class HybridToy(ToyModel):
    def __init__(self, seed: int = 0):
        super().__init__(seed)
        g = torch.Generator().manual_seed(seed + 100)
        r = lambda *shape: torch.randn(*shape, generator=g) / shape[0] ** 0.5  # noqa: E731
        self.lin = [{"in": r(DIM, CONV_C) * 2, "conv": torch.randn(CONV_C, KERNEL, generator=g) / 2,
                     "decay": torch.sigmoid(torch.randn(LIN_HEADS, generator=g) + 1),
                     "out": r(LIN_HEADS * VALUE_DIM, DIM)} for _ in range(2)]

    def state_specs(self):
        return [PagedKV("attn", 1, KV_HEADS, HEAD_DIM, self.dtype),
                Recurrent("linear", {"conv": (2, CONV_C, KERNEL - 1), "ssm": (2, LIN_HEADS, KEY_DIM, VALUE_DIM)})]

    def step(self, li: int, x_BC: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """One token per row: [B, C] and [B, ...] states -> [B, C], new states."""
        w = self.lin[li]
        u = x_BC @ w["in"]  # [B, CONV_C]
        window = torch.cat([state["conv"], u[:, :, None]], dim=2)  # [B, CONV_C, K]
        c = F.silu((window * w["conv"]).sum(-1))
        q, k, v = c.split([LIN_HEADS * KEY_DIM, LIN_HEADS * KEY_DIM, LIN_HEADS * VALUE_DIM], dim=-1)
        B = x_BC.shape[0]
        q, k = q.view(B, LIN_HEADS, KEY_DIM), F.normalize(k.view(B, LIN_HEADS, KEY_DIM), dim=-1)
        ssm = w["decay"][None, :, None, None] * state["ssm"] + k[..., None] * v.view(B, LIN_HEADS, 1, VALUE_DIM)
        o = torch.einsum("bhk,bhkv->bhv", q, ssm).reshape(B, -1)
        return o @ w["out"], {"conv": window[:, :, 1:], "ssm": ssm}

    def scan(self, li: int, x_TC: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """A span's tokens in order (the toy's 'chunked' scan is token by token)."""
        ys = []
        for t in range(x_TC.shape[0]):
            y, state = self.step(li, x_TC[t : t + 1], state)
            ys.append(y)
        return torch.cat(ys), state

    def forward(self, embeds_NC, positions, batch: AttentionBatch, cache, prefix=None):
        kv, states = cache.paged["attn"], cache.recurrent["linear"]
        plans = plan_groups(batch, kv)
        return self._hybrid(embeds_NC, positions,
                            lambda i, q, k, v: attend(q, k, v, kv.k[i], kv.v[i], batch, plans),
                            lambda li, x: run_recurrent(x, batch.states, states, li,
                                                        lambda x, s: self.scan(li, x, s),
                                                        lambda x, s: self.step(li, x, s)))

    def _hybrid(self, x_NC, pos_2N, attention, recurrent):
        N = x_NC.shape[0]
        for i, kind in enumerate(KINDS):
            w = self.layers[i % len(self.layers)]
            if kind == "full":
                q = rotate((x_NC @ w["q"]).view(N, HEADS, HEAD_DIM), pos_2N)
                k = rotate((x_NC @ w["k"]).view(N, KV_HEADS, HEAD_DIM), pos_2N)
                v = (x_NC @ w["v"]).view(N, KV_HEADS, HEAD_DIM)
                x_NC = x_NC + attention(0, q, k, v).reshape(N, -1) @ w["o"]
            else:
                x_NC = x_NC + recurrent(i // 2, x_NC)
            x_NC = x_NC + torch.tanh(x_NC @ w["mlp"])
        return x_NC


def hybrid_reference(model: HybridToy, image: ToyImage, spec: SeqSpec) -> list[int]:
    assert spec.mode == MODE_TEXT and spec.temperature == 0
    feats = model.encode([image])[0]
    zero = {"conv": torch.zeros(1, CONV_C, KERNEL - 1), "ssm": torch.zeros(1, LIN_HEADS, KEY_DIM, VALUE_DIM)}

    def next_token(own: list[int]) -> int:
        x = torch.cat([feats, model.wte[torch.tensor(own)]])
        pos = torch.cat([prefix_positions(image.prefix_len), (image.next_pos + torch.arange(len(own))).expand(2, -1)], 1)
        h = model._hybrid(x, pos, lambda i, q, k, v: _dense(q, k, v), lambda li, x: model.scan(li, x, zero)[0])
        return int(model.logits(h[-1]).argmax())

    return _greedy(next_token, spec)


DEC_START = 2  # every decoder prompt starts with it


def _posenc(pos_N: torch.Tensor) -> torch.Tensor:
    return torch.sin(pos_N.float()[:, None] * torch.linspace(0.1, 1.0, DIM)[None]) / 2


class EncDecToy(ToyModel):
    causal_prefix = False

    def __init__(self, seed: int = 0, shared_cache: bool = False):
        super().__init__(seed)
        self.shared_cache = shared_cache  # cross K/V on the self-attention's tensors (CrossKV.shares)
        g = torch.Generator().manual_seed(seed + 200)
        r = lambda *shape: torch.randn(*shape, generator=g) / shape[0] ** 0.5  # noqa: E731
        self.enc = {"q": r(DIM, HEADS * HEAD_DIM) * 2, "k": r(DIM, HEADS * HEAD_DIM) * 2, "v": r(DIM, HEADS * HEAD_DIM),
                    "o": r(HEADS * HEAD_DIM, DIM), "mlp": r(DIM, DIM)}
        self.cross = [{"q": r(DIM, HEADS * HEAD_DIM) * 2, "k": r(DIM, KV_HEADS * HEAD_DIM) * 2,
                       "v": r(DIM, KV_HEADS * HEAD_DIM), "o": r(HEADS * HEAD_DIM, DIM)} for _ in self.layers]
        self.encodes = 0  # images through the vision stage

    def state_specs(self):
        n = len(self.layers)
        return [PagedKV("self", n, KV_HEADS, HEAD_DIM, self.dtype),
                CrossKV("cross", n, KV_HEADS, HEAD_DIM, self.dtype, shares="self" if self.shared_cache else None)]

    def prefix_layout(self, image: ToyImage, prompt: tuple[int, ...]) -> tuple[int, int]:
        return image.prefix_len + len(prompt), 0  # the decoder's positions start at 0

    def encode(self, images):
        self.encodes += len(images)
        return super().encode(images)

    def prefix_inputs(self, features, prompts):
        embeds = [torch.cat([f, self.wte[p]]) for f, p in zip(features, prompts)]
        return PrefixInputs(torch.cat(embeds), torch.cat([torch.arange(e.shape[0]) for e in embeds]))

    def own_positions(self, pos_N):
        return pos_N

    def encoder(self, x_NC: torch.Tensor, pos_N: torch.Tensor, self_attention) -> torch.Tensor:
        N, w = x_NC.shape[0], self.enc
        x_NC = x_NC + _posenc(pos_N)
        q, k, v = ((x_NC @ w[n]).view(N, HEADS, HEAD_DIM) for n in "qkv")
        x_NC = x_NC + self_attention(q, k, v).reshape(N, -1) @ w["o"]
        return x_NC + torch.tanh(x_NC @ w["mlp"])

    def decoder(self, x_NC, pos_N, self_attn, cross_attn, enc_MC):
        """enc_MC: encoder output rows whose cross K/V this call writes (may be empty)."""
        N = x_NC.shape[0]
        x_NC = x_NC + _posenc(pos_N)
        pos_2N = pos_N.expand(2, -1)
        for i, (w, c) in enumerate(zip(self.layers, self.cross)):
            q = rotate((x_NC @ w["q"]).view(N, HEADS, HEAD_DIM), pos_2N)
            k = rotate((x_NC @ w["k"]).view(N, KV_HEADS, HEAD_DIM), pos_2N)
            x_NC = x_NC + self_attn(i, q, k, (x_NC @ w["v"]).view(N, KV_HEADS, HEAD_DIM)).reshape(N, -1) @ w["o"]
            M = enc_MC.shape[0]
            ck, cv = (enc_MC @ c["k"]).view(M, KV_HEADS, HEAD_DIM), (enc_MC @ c["v"]).view(M, KV_HEADS, HEAD_DIM)
            x_NC = x_NC + cross_attn(i, (x_NC @ c["q"]).view(N, HEADS, HEAD_DIM), ck, cv).reshape(N, -1) @ c["o"]
            x_NC = x_NC + torch.tanh(x_NC @ w["mlp"])
        return x_NC

    def forward(self, embeds_NC, positions, batch: AttentionBatch, cache, prefix=None):
        own, cross = cache.paged["self"], cache.paged["cross"]
        P = batch.n_prefix
        enc = embeds_NC[:P]
        if P:
            group = next(g for g in batch.groups if isinstance(g, PrefixGroup))
            enc = self.encoder(embeds_NC[:P], positions[:P],
                               lambda q, k, v: prefix_self_attention(q, k, v, _local(group, P)))
        x = torch.cat([embeds_NC.new_zeros(P, DIM), embeds_NC[P:]])  # the decoder runs on own rows
        pos = torch.cat([positions.new_zeros(P), positions[P:]])
        po, pc = plan_groups(batch, own), plan_groups(batch, cross)
        return self.decoder(x, pos, lambda i, q, k, v: attend(q, k, v, own.k[i], own.v[i], batch, po, Reads.OWN),
                            lambda i, q, k, v: attend(q, k, v, cross.k[i], cross.v[i], batch, pc, Reads.PREFIX),
                            enc)


def _local(group: PrefixGroup, P: int) -> PrefixGroup:
    """The prefix group over the encoder's own [P] rows (padding -> row P)."""
    return PrefixGroup(group.q_rows.clamp(max=P), group.table, group.lens, group.causal)


def encdec_reference(model: EncDecToy, image: ToyImage, spec: SeqSpec) -> list[int]:
    assert spec.mode == MODE_TEXT and spec.temperature == 0
    x = torch.cat([model.encode([image])[0], model.wte[torch.tensor(spec.prefix_prompt, dtype=torch.long)]])
    enc = model.encoder(x, torch.arange(x.shape[0]), lambda q, k, v: _dense(q, k, v, causal=False))

    k_all = [(enc @ c["k"]).view(-1, KV_HEADS, HEAD_DIM) for c in model.cross]
    v_all = [(enc @ c["v"]).view(-1, KV_HEADS, HEAD_DIM) for c in model.cross]

    def cross(i, q, k, v):
        return _dense(q, k_all[i], v_all[i], causal=False)

    def next_token(own: list[int]) -> int:
        h = model.decoder(model.wte[torch.tensor(own)], torch.arange(len(own)), lambda i, q, k, v: _dense(q, k, v),
                          cross, enc[:0])
        return int(model.logits(h[-1]).argmax())

    return _greedy(next_token, spec)


