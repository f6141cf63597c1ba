"""A deliberately different model family, for testing the engine's family boundary: image
prefixes of any length (3 to 300 tokens), attended causally, 2-D rotary positions that are not
slot indices (the text after an image resumes at a compressed offset, as in Qwen's M-RoPE), GQA,
and plain text output. `reference` computes the same model densely, one sequence at a time,
with no paging, no cache and no batching: what the engine must reproduce."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchvlm.cache.specs import PagedKV
from batchvlm.attention import AttentionBatch, attend, plan_groups
from batchvlm.models.base.decoding import MODE_TEXT, RowState, SeqSpec, decide_text, emit_text
from batchvlm.models.base.contract import ModelInfo, PrefixInputs

DIM, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB, PIXELS = 32, 4, 2, 8, 2, 40, 6
STOP = 1  # the stop token


@dataclass
class ToyImage:
    pixels: torch.Tensor  # [L, PIXELS] float32: one row per prefix token

    @property
    def prefix_len(self) -> int:
        return self.pixels.shape[0]

    @property
    def next_pos(self) -> int:
        return self.prefix_len // 3 + 2  # not the slot count: positions are compressed

    @property
    def cost(self) -> int:
        return 1

    @property
    def seen(self) -> None:
        return None  # the toy family writes no coordinates


def prefix_positions(L: int) -> torch.Tensor:
    """[2, L]: a 4-wide grid (row, column), after one leading token at (0, 0)."""
    j = torch.arange(L)
    return torch.stack([(j + 3) // 4, torch.where(j == 0, 0, (j - 1) % 4 + 1)])


def rotate(x_NHD: torch.Tensor, pos_2N: torch.Tensor) -> torch.Tensor:
    """2-D rotary: the first half of each head rotates by axis 0, the second by axis 1."""
    half = HEAD_DIM // 2
    inv = 1.0 / (100.0 ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
    out = []
    for axis, part in enumerate(x_NHD.split(half, dim=-1)):
        ang = pos_2N[axis].float()[:, None] * inv[None]  # [N, half/2]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        a, b = part[..., : half // 2], part[..., half // 2 :]
        out.append(torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1))
    return torch.cat(out, dim=-1)


class ToyModel:
    causal_prefix = True

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        r = lambda *shape: torch.randn(*shape, generator=g) / shape[0] ** 0.5  # noqa: E731
        self.vision = r(PIXELS, DIM)
        self.wte = torch.randn(VOCAB, DIM, generator=g)
        self.layers = [{"q": r(DIM, HEADS * HEAD_DIM) * 2, "k": r(DIM, KV_HEADS * HEAD_DIM) * 2,
                        "v": r(DIM, KV_HEADS * HEAD_DIM), "o": r(HEADS * HEAD_DIM, DIM), "mlp": r(DIM, DIM)}
                       for _ in range(LAYERS)]
        self.head = r(DIM, VOCAB) * 3
        self.bias = torch.zeros(VOCAB)
        self.bias[STOP] = 2.5  # so that some sequences stop by themselves
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.info = ModelInfo("toy", None, "", "none", "float32", "cpu", "toy", "native")
        self.stop_ids = torch.tensor([STOP])

    # --- the engine's interface (models/base/contract.py EngineModel)
    def state_specs(self) -> list[PagedKV]:
        return [PagedKV("attn", LAYERS, KV_HEADS, HEAD_DIM, self.dtype)]

    def prefix_layout(self, image: ToyImage, prompt: tuple[int, ...]) -> tuple[int, int]:
        return image.prefix_len, image.next_pos

    def encode(self, images: list[ToyImage]) -> list[torch.Tensor]:
        return [torch.tanh(im.pixels @ self.vision) for im in images]

    def largest_vision_batch(self) -> list[ToyImage]:
        return [ToyImage(torch.zeros(300, PIXELS))]

    def prefix_inputs(self, features: list[torch.Tensor], prompts) -> PrefixInputs:
        return PrefixInputs(torch.cat(features), torch.cat([prefix_positions(f.shape[0]) for f in features], dim=1))

    def own_positions(self, pos_N: torch.Tensor) -> torch.Tensor:
        return pos_N.expand(2, -1)

    def embed_tokens(self, ids_N: torch.Tensor) -> torch.Tensor:
        return self.wte[ids_N]

    def embed_inputs(self, kind_N, token_N, value_N2) -> torch.Tensor:
        return self.wte[token_N]

    def forward(self, embeds_NC, positions, batch: AttentionBatch, cache, prefix=None) -> torch.Tensor:
        kv = cache.paged["attn"]
        plans = plan_groups(batch, kv)
        return self._layers(embeds_NC, positions,
                            lambda i, q, k, v: attend(q, k, v, kv.k[i], kv.v[i], batch, plans))

    emit = staticmethod(emit_text)

    def decide(self, hidden_BC, state: RowState, sampling: bool, heads):
        return decide_text(self.logits(hidden_BC), state, self.stop_ids, sampling)

    def logits(self, hidden_BC: torch.Tensor) -> torch.Tensor:
        return hidden_BC @ self.head + self.bias

    # --- shared by the engine path and the dense reference
    def _layers(self, x_NC, pos_2N, attention) -> torch.Tensor:
        N = x_NC.shape[0]
        for i, w in enumerate(self.layers):
            q = rotate((x_NC @ w["q"]).view(N, HEADS, HEAD_DIM), pos_2N)
            k = rotate((x_NC @ w["k"]).view(N, KV_HEADS, HEAD_DIM), pos_2N)
            v = (x_NC @ w["v"]).view(N, KV_HEADS, HEAD_DIM)
            x_NC = x_NC + attention(i, q, k, v).reshape(N, -1) @ w["o"]
            x_NC = x_NC + torch.tanh(x_NC @ w["mlp"])
        return x_NC


def reference(model: ToyModel, image: ToyImage, spec: SeqSpec) -> list[int]:
    """Greedy tokens of one sequence, recomputing the whole causal sequence densely each step."""
    assert spec.mode == MODE_TEXT and spec.temperature == 0
    L = image.prefix_len
    prefix = model.encode([image])[0]
    tokens: list[int] = []

    def dense(i, q, k, v):
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True).transpose(0, 1)

    while True:
        own = list(spec.prompt) + tokens
        x = torch.cat([prefix, model.wte[torch.tensor(own)]])
        own_pos = image.next_pos + torch.arange(len(own))
        pos = torch.cat([prefix_positions(L), own_pos.expand(2, -1)], dim=1)
        nxt = int(model.logits(model._layers(x, pos, dense)[-1]).argmax())
        if nxt == STOP:
            return tokens
        tokens.append(nxt)
        if len(tokens) >= spec.limit:
            return tokens
