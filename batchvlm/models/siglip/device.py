"""SigLIP's device side (base/contract.py ImageModel): a batch of images -> one vision forward ->
each sequence's output per image, no decode (engine/images.py drives it).

  embed       the pooled image feature, L2-normalized (a float32 numpy row on the host)
  classify    the image-text logits of every choice's text (`scale * cos + bias`, the model's own
              logit scale and bias): base/columns.py turns them into the softmax over the choices;
              the choices' text embeddings are computed once per job (`start`)
  similarity  the logit of the image and its own text (a kept input value), through a sigmoid

A batch's results are copied to pinned host memory right after its forward is queued, under an
event: collecting batch t waits for batch t only, while batch t+1 runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..base.contract import ModelInfo, SampleLike, TaskSequence
from ..base.decoding import RawOutput
from ..base.pinned import PinnedUpload
from .model import SiglipModel
from .preprocess import PreparedImage
from .text import TextPrep

TEXT_BATCH = 256  # choice texts embedded at once


@dataclass(frozen=True)
class ImageTask:
    """What one task's sequence computes (TaskSequence.spec of this family)."""

    kind: str  # embed | classify | similarity
    texts: tuple[str, ...] = ()  # classify: each choice in its template
    text_column: str | None = None  # similarity: the kept input value holding each image's text


def resized_positions(table_SSC: torch.Tensor, shapes_B2: torch.Tensor, length: int) -> torch.Tensor:
    """The position table resized to each (rows, cols) grid and laid out row-major in `length`
    slots (padding slots get the first position): transformers' Siglip2VisionEmbeddings.
    resize_positional_embeddings (bilinear, antialiased, as weights), in float32. -> [B, L, C]."""
    grid = table_SSC.shape[0]
    sizes = shapes_B2.float()[:, None]
    pos = torch.arange(length, device=shapes_B2.device, dtype=torch.float32)[None, :, None]
    rows = torch.div(pos, sizes[..., 1:], rounding_mode="floor")
    index = torch.cat([rows, pos - rows * sizes[..., 1:]], dim=-1)
    index = index * (pos < sizes.prod(-1, keepdim=True))
    scale = grid / sizes
    support = scale.clamp(min=1)
    center = (index + 0.5) * scale - 0.5
    source = torch.arange(grid, device=shapes_B2.device, dtype=torch.float32)
    weights = (1 - (source - center[..., None]).abs_().div_(support[..., None])).clamp_(min=0)
    weights = weights / weights.sum(-1, keepdim=True)
    weights = (weights[..., 0, :, None] * weights[..., 1, None, :]).flatten(-2)
    flat = table_SSC.reshape(-1, table_SSC.shape[-1])
    return (weights @ flat.float()).to(table_SSC.dtype)


class SiglipImageModel:
    def __init__(self, model: SiglipModel, info: ModelInfo, lut: np.ndarray, text: TextPrep | None,
                 bucket_step: int, max_patches: int):
        self.model, self.info = model, info
        self.device, self.dtype = model.device, model.dtype
        self.text = text
        self.bucket_step, self.max_patches = bucket_step, max_patches
        self.naflex = model.config.naflex
        patch_dim = 3 * model.config.patch ** 2
        # pixel value of (patch slot, level): the lookup table of each slot's channel, flattened
        self._lut = torch.from_numpy(lut).to(self.device).reshape(-1)
        self._chan = (torch.arange(patch_dim, device=self.device) % 3) * 256
        self._upload = PinnedUpload(self.device)
        self.tasks: list[ImageTask] = []
        self._choices: list[torch.Tensor | None] = []

    # ------------------------------------------------------------------ the job

    @torch.inference_mode()
    def start(self, seqs: list[TaskSequence]) -> None:
        self.tasks = [s.spec for s in seqs]
        self._choices = [self._text_embeds(list(t.texts)) if t.kind == "classify" else None for t in self.tasks]

    def bucket(self, image: PreparedImage) -> int:
        if not self.naflex:
            return image.prefix_len
        return min(self.max_patches, -(-image.prefix_len // self.bucket_step) * self.bucket_step)

    # ------------------------------------------------------------------ one batch

    @torch.inference_mode()
    def run(self, samples: list[SampleLike], length: int) -> Any:
        images: list[PreparedImage] = [s.prepared for s in samples]
        emb_BD = self.image_embeds(images, length)
        outs: list[torch.Tensor] = []
        scale, bias = self.model.logit_scale.float().exp(), self.model.logit_bias.float()
        for t, choices in zip(self.tasks, self._choices):
            if t.kind == "embed":
                outs.append(emb_BD)
            elif t.kind == "classify":
                outs.append(emb_BD @ choices.T * scale + bias)
            else:
                texts = [(s.meta or {}).get(t.text_column) for s in samples]
                text_BD = self._text_embeds([x if isinstance(x, str) else "" for x in texts])
                logit_B = (emb_BD * text_BD).sum(-1) * scale + bias
                valid = torch.tensor([isinstance(x, str) for x in texts], device=self.device)
                outs.append(torch.where(valid, torch.sigmoid(logit_B), torch.nan))
        host = [o.to("cpu", non_blocking=True) for o in outs]
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return host, event

    def collect(self, handle: Any) -> list[list[RawOutput]]:
        host, event = handle
        if event is not None:
            event.synchronize()
        # An embedding stays a numpy row (Arrow converts it ten times faster than Python floats).
        per_seq = [o.numpy() if t.kind == "embed" else o.tolist() for t, o in zip(self.tasks, host)]
        n = len(per_seq[0]) if per_seq else 0
        out = []
        for b in range(n):
            raws = []
            for t, values in zip(self.tasks, per_seq):
                v = values[b]
                if t.kind == "similarity":
                    raws.append(RawOutput([], [] if v != v else [(v,)]))  # NaN: the image had no text
                elif t.kind == "embed":
                    raws.append(RawOutput([], [v]))
                else:
                    raws.append(RawOutput([], [(x,) for x in v]))
            out.append(raws)
        return out

    # ------------------------------------------------------------------ towers

    def image_embeds(self, images: list[PreparedImage], length: int) -> torch.Tensor:
        """Images padded to `length` patches -> L2-normalized embeddings [B, D], float32."""
        pixels = self.pixel_values(images, length).to(self.dtype)
        emb = self.model.vision_model.embeddings
        if self.naflex:
            table = emb.position_embedding.weight.view(emb.side, emb.side, -1)
            shapes = torch.tensor([im.grid for im in images], device=self.device)
            positions = resized_positions(table, shapes, length)
            n_B = torch.tensor([im.prefix_len for im in images], device=self.device)
            mask = None if all(im.prefix_len == length for im in images) else \
                (torch.arange(length, device=self.device) < n_B[:, None])[:, None, None, :]
        else:
            positions, mask = emb.position_embedding.weight[None], None
        feats = self.model.vision_model(pixels, positions, mask).float()
        return F.normalize(feats, dim=-1)

    def pixel_values(self, images: list[PreparedImage], length: int) -> torch.Tensor:
        """Images padded to `length` patches -> their pixel values [B, L, P] float32 on the device:
        the processor's, bit for bit (padding patches: level 0's values, masked out)."""
        B, P = len(images), images[0].patches.shape[1]
        padded = torch.zeros(B, length, P, dtype=torch.uint8)
        for i, im in enumerate(images):
            padded[i, : im.prefix_len] = im.patches
        return self._lut[self._upload([padded]).long() + self._chan]

    def _text_embeds(self, texts: list[str]) -> torch.Tensor:
        """Texts -> L2-normalized text embeddings [N, D], float32."""
        assert self.text is not None, "a task with text on a checkpoint without a tokenizer (host.py refuses it)"
        out = []
        for i in range(0, len(texts), TEXT_BATCH):
            ids, mask = self.text(texts[i: i + TEXT_BATCH])
            attn = None if bool(mask.all()) else mask.bool().to(self.device)[:, None, None, :]
            ids = ids.to(self.device)
            out.append(self.model.text_model(ids, attn).float())
        return F.normalize(torch.cat(out), dim=-1)
