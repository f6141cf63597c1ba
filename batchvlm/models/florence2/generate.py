"""Florence-2 in static batches on batchvlm's own model code: the labeler the run loop drives.

A batch is up to max_batch_size // (sequences per image) images. Each stage runs once for what
it depends on: the vision tower once per image (shared by all its tasks), the encoder once per
(image, distinct prompt), the cross-attention K/V once per encoder output; then every sequence
of every image decodes together. Encoder-decoder sequences all start at decoder position 0, so
the rows stay aligned step by step without padding: one self-attention cache [rows, heads, steps,
head_dim] per layer, written at the step's column.

Decoding is greedy unless the job samples (models/decoding.py, seeded per sequence from the job
seed, the image key and the sequence). The checkpoint's generation settings that change greedy
tokens are applied as transformers' generate applies them: a forced first token
(forced_bos_token_id), the end token forced at the last allowed position (forced_eos_token_id;
such an answer counts as cut) and no_repeat_ngram_size. The host reads one flag per step (all
rows done?) and the tokens once per batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ...job import EngineSpec
from ..decoding import RawOutput, RowState, sample_tokens, sequence_seed
from ..family import ModelInfo, TaskSequence, WorkItem
from .config import GenerationSettings
from .model import Florence2Model


class Florence2Static:
    """The loaded model; the run loop asks it for a labeler (models/family.py StaticModel)."""

    def __init__(self, model: Florence2Model, info: ModelInfo, generation: GenerationSettings):
        self.model, self.info, self.generation = model, info, generation

    def labeler(self, seqs: list[TaskSequence], engine: EngineSpec) -> Florence2Labeler:
        return Florence2Labeler(self.model, self.generation, seqs, engine)


def no_repeat_mask(hist_RL: torch.Tensor, n: int, vocab: int) -> torch.Tensor | None:
    """bool [R, V]: tokens that would repeat an n-gram of the row's tokens so far (None: none yet)."""
    L = hist_RL.shape[1]
    if L < n:
        return None
    win_RWn = hist_RL.unfold(1, n, 1)  # every n-gram so far
    hit_RW = (win_RWn[:, :, : n - 1] == hist_RL[:, None, L - n + 1 :]).all(-1)  # starts like the last n - 1 tokens
    counts = torch.zeros(hist_RL.shape[0], vocab, dtype=torch.long, device=hist_RL.device)
    return counts.scatter_add_(1, win_RWn[:, :, n - 1], hit_RW.long()) > 0


class Florence2Labeler:
    def __init__(self, model: Florence2Model, generation: GenerationSettings, seqs: list[TaskSequence],
                 settings: EngineSpec):
        self.model, self.gen, self.seqs, self.settings = model, generation, seqs, settings
        self.dev = model.device
        distinct = list(dict.fromkeys(s.spec.prefix_prompt for s in seqs))
        self.prompt_of = torch.tensor([distinct.index(s.spec.prefix_prompt) for s in seqs], device=self.dev)
        width = max(len(p) for p in distinct)
        self.prompts_PL = torch.tensor([list(p) + [generation.pad] * (width - len(p)) for p in distinct], device=self.dev)
        self.valid_PL = torch.tensor([[True] * len(p) + [False] * (width - len(p)) for p in distinct], device=self.dev)
        self.limits = torch.tensor([s.spec.limit for s in seqs], device=self.dev)
        self.images_per_batch = max(1, settings.batch_size_for(self.dev.type) // len(seqs))
        self.sampling = settings.temperature > 0
        self.stats = {"images_encoded": 0, "prompts_encoded": 0, "sequences": 0, "decode_steps": 0}

    def label(self, items: Iterable[WorkItem]) -> Iterator[tuple[Any, list[RawOutput]]]:
        batch: list[WorkItem] = []
        for item in items:
            batch.append(item)
            if len(batch) == self.images_per_batch:
                yield from self._batch(batch)
                batch = []
        if batch:
            yield from self._batch(batch)

    @torch.inference_mode()
    def _batch(self, items: list[WorkItem]) -> Iterator[tuple[Any, list[RawOutput]]]:
        m, B, S, P = self.model, len(items), len(self.seqs), self.prompts_PL.shape[0]
        pixels = torch.stack([it.image.pixels for it in items])
        image_BIC = m.image_tokens(m.pixel_values(pixels))
        enc_valid = torch.cat([self.valid_PL.new_ones(P, image_BIC.shape[1]), self.valid_PL], dim=1)  # [P, T]
        enc = m.encode(image_BIC.repeat_interleave(P, 0), self.prompts_PL.repeat(B, 1), self.valid_PL.repeat(B, 1))
        # decoder row r = b * S + s reads encoder row b * P + (prompt of s)
        src_R = (torch.arange(B, device=self.dev)[:, None] * P + self.prompt_of[None, :]).flatten()
        cross = [(k[src_R].transpose(1, 2), v[src_R].transpose(1, 2)) for k, v in m.text.decoder.cross_kv(enc)]
        mask_R11T = enc_valid.repeat(B, 1)[src_R][:, None, None, :]
        self.stats["images_encoded"] += B
        self.stats["prompts_encoded"] += B * P
        self.stats["sequences"] += B * S
        seeds = [sequence_seed(self.settings.seed, it.key, s) for it in items for s in range(S)]
        tokens_RL, length_R, cut_R = self._decode(cross, mask_R11T, self.limits.repeat(B), seeds)
        tokens, lengths, cuts = tokens_RL.tolist(), length_R.tolist(), cut_R.tolist()
        for b, item in enumerate(items):
            rows = range(b * S, (b + 1) * S)
            yield item.ticket, [RawOutput(tokens[r][: lengths[r]], cut=cuts[r]) for r in rows]

    def _decode(self, cross: list[tuple[torch.Tensor, torch.Tensor]], mask_R11T: torch.Tensor, limit_R: torch.Tensor,
                seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> generated tokens [R, L] (the first `length` of each row), length [R], cut [R]."""
        m, g, dev = self.model, self.gen, self.dev
        R, L = limit_R.shape[0], int(self.limits.max())
        H, D = cross[0][0].shape[1], cross[0][0].shape[3]
        cache = [(cross[0][0].new_empty(R, H, L, D), cross[0][0].new_empty(R, H, L, D)) for _ in cross]
        hist_RL = torch.full((R, L + 1), g.decoder_start, dtype=torch.long, device=dev)  # start token, then output
        length_R = torch.zeros(R, dtype=torch.long, device=dev)
        done_R = torch.zeros(R, dtype=torch.bool, device=dev)
        cut_R = torch.zeros(R, dtype=torch.bool, device=dev)
        state = RowState(*(torch.zeros(R, dtype=torch.long, device=dev) for _ in range(4)),
                         torch.zeros(R, dtype=torch.bool, device=dev),
                         torch.full((R,), self.settings.temperature, device=dev),
                         torch.full((R,), self.settings.top_p, device=dev), torch.tensor(seeds, device=dev))
        for t in range(L):
            def self_attend(layer: int, q, k, v, t=t):
                ck, cv = cache[layer]
                ck[:, :, t], cv[:, :, t] = k[:, 0], v[:, 0]
                return F.scaled_dot_product_attention(q.transpose(1, 2), ck[:, :, : t + 1], cv[:, :, : t + 1]).transpose(1, 2)

            def cross_attend(layer: int, q):
                k, v = cross[layer]
                return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask_R11T).transpose(1, 2)

            tok_R1 = hist_RL[:, t : t + 1]
            pos = torch.full_like(tok_R1, t)
            logits_RV = m.text.logits(m.text.decoder(m.text.embed(tok_R1), pos, self_attend, cross_attend)[:, 0])
            if g.no_repeat_ngram and (ban := no_repeat_mask(hist_RL[:, : t + 1], g.no_repeat_ngram,
                                                            logits_RV.shape[1])) is not None:
                logits_RV = logits_RV.masked_fill(ban, float("-inf"))
            state.count.fill_(t)
            chosen = sample_tokens(logits_RV, state, self.sampling)
            if t == 0 and g.forced_bos is not None:
                chosen = torch.full_like(chosen, g.forced_bos)
            last = t == limit_R - 1
            if g.forced_eos is not None:
                cut_R |= ~done_R & last & (chosen != g.eos)
                chosen = torch.where(last, g.forced_eos, chosen)
            stop = chosen == g.eos
            emit = ~done_R & ~stop
            hist_RL[:, t + 1] = chosen
            length_R += emit.long()
            if g.forced_eos is None:
                cut_R |= emit & last
            done_R |= stop | last
            self.stats["decode_steps"] += 1
            if bool(done_R.all()):
                break
        return hist_RL[:, 1:], length_R, cut_R
