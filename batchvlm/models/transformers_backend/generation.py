"""Static batches through transformers' `generate`: the reference path for models without a
native family.

Images arrive one by one; every `engine.max_batch_size` of them (fewer at the end) form a batch,
and each of the job's sequences (a caption, a query, one object of a detect / point task) runs
as one `generate` call over the whole batch: the processor pads the prompts on the left, so
every row's last prompt token sits at the end and the new tokens line up. Rows are independent
(attention mask, per-row positions), which is why a batch gives the labels of batch-1 calls.

Decoding is greedy unless the job samples (engine.temperature > 0). The checkpoint's other
generation settings (stop tokens, repetition penalty, ...) are kept; its sampling settings and
beam count are replaced by the job's. A sampled batch is seeded from the job seed, its first
sample's key and the sequence: sampled labels are reproducible for the same batches, but unlike
the native engine they depend on which images share a batch.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from PIL import Image

from ...job import EngineSpec
from ..base.decoding import RawOutput, sequence_seed
from ..base.contract import SampleT, TaskSequence
from .prompts import Prompt
from .structured import GrammarLogits, end_of_turn, score_choices


def _stop_ids(generation_config) -> set[int]:
    eos = generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


class StaticLabeler:
    def __init__(self, model, processor, seqs: list[TaskSequence], settings: EngineSpec):
        self.model, self.processor, self.settings = model, processor, settings
        self.prompts: list[Prompt] = [s.spec for s in seqs]
        self.batch_size = settings.batch_size_for(model.device.type)  # the device's default where none is given
        processor.tokenizer.padding_side = "left"
        self.config = copy.deepcopy(model.generation_config)
        self.config.num_beams = 1
        self.sampling = settings.temperature > 0
        if self.sampling:
            self.config.do_sample, self.config.temperature, self.config.top_p = True, settings.temperature, settings.top_p
            self.config.top_k = None
        else:
            self.config.do_sample, self.config.temperature, self.config.top_p, self.config.top_k = False, None, None, None
        self.stop = _stop_ids(self.config)
        # forced_eos_token_id (Florence-2) makes generate write that token as the last one allowed,
        # which hides whether the model stopped there itself. generate runs unforced instead (the
        # keyword: a None in the config would be filled from the model's) and the forced end is
        # applied to what it wrote: the last allowed token is dropped (the answer cut) unless it is
        # the model's own stop.
        self.forced_stop = self.config.forced_eos_token_id is not None
        bos = processor.tokenizer.bos_token
        # A template that writes BOS itself must not get a second one from the tokenizer (what
        # apply_chat_template does); other prompts keep the processor's own default.
        self.text_kwargs = [{"add_special_tokens": False} if bos and p.text.startswith(bos) else {} for p in self.prompts]
        self.grammars = self._compile([p.schema for p in self.prompts])

    def _compile(self, schemas: list[dict | None]) -> list[Any]:
        """Each json prompt's grammar, compiled once per job for the model's vocabulary."""
        if not any(schemas):
            return [None] * len(schemas)
        from ..base.grammar import Vocabulary

        tok = self.processor.tokenizer
        vocab = Vocabulary(tok.backend_tokenizer, self.model.get_output_embeddings().weight.shape[0],
                           [end_of_turn(tok)])
        self.vocab = vocab
        return [vocab.compile(s) if s else None for s in schemas]

    def label(self, samples: Iterable[SampleT]) -> Iterator[tuple[SampleT, list[RawOutput]]]:
        batch: list[SampleT] = []
        for sample in samples:
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield from self._batch(batch)
                batch = []
        if batch:
            yield from self._batch(batch)

    def _batch(self, batch: list[SampleT]) -> Iterator[tuple[SampleT, list[RawOutput]]]:
        images = [Image.fromarray(sample.prepared.pixels) for sample in batch]
        per_seq = [self._generate(images, s, batch[0].key) for s in range(len(self.prompts))]
        for j, sample in enumerate(batch):
            yield sample, [out[j] for out in per_seq]

    @torch.inference_mode()
    def _generate(self, images: list[Image.Image], s: int, first_key: str) -> list[RawOutput]:
        prompt = self.prompts[s]
        enc = self.processor(images=[[im] for im in images], text=[prompt.text] * len(images), padding=True,
                             return_tensors="pt", **self.text_kwargs[s])
        enc.pop("labels", None)  # PaliGemma's processor returns training labels too
        enc = enc.to(self.model.device)
        for k, v in enc.items():  # pixel values in the model's dtype; ids and masks stay integers
            if torch.is_floating_point(v):
                enc[k] = v.to(self.model.dtype)
        # each row's prompt tokens as the native engine counts them: its unpadded ids (image tokens
        # included), and an encoder-decoder's decoder start token, read before the first generated one
        prompt_lens = enc["attention_mask"].sum(1).tolist() if "attention_mask" in enc else \
            [enc["input_ids"].shape[1]] * len(images)
        prompt_lens = [int(n) + int(self.model.config.is_encoder_decoder) for n in prompt_lens]
        if prompt.choices:
            return [RawOutput([], [(score,) for score in row], prompt_tokens=sum(int(n) + len(c) for c in prompt.choices))
                    for row, n in zip(score_choices(self.model, enc, prompt.choices), prompt_lens)]
        if self.sampling:
            torch.manual_seed(sequence_seed(self.settings.seed, first_key, s))
        grammar = self.grammars[s]
        masks = GrammarLogits(self.vocab, grammar, len(images), enc["input_ids"].shape[1]) if grammar is not None else None
        extra = {"logits_processor": [masks]} if masks is not None else {}
        out = self.model.generate(**enc, generation_config=self.config, max_new_tokens=prompt.max_new_tokens,
                                  forced_eos_token_id=None, **extra)
        # Decoder-only models return the prompt too; encoder-decoders start with the decoder's start token.
        new = out[:, 1:] if self.model.config.is_encoder_decoder else out[:, enc["input_ids"].shape[1]:]
        kept = prompt.max_new_tokens - 1 if self.forced_stop else prompt.max_new_tokens  # tokens a cut answer keeps
        results = []
        for j, (row, n) in enumerate(zip(new.tolist(), prompt_lens)):
            stop = next((k for k, t in enumerate(row) if t in self.stop), None)
            if stop is None and masks is not None and not self.forced_stop and masks.whole_with(j, row[-1]):
                stop = len(row)  # a json answer whole with the last token allowed: nothing was cut
            out = RawOutput(row[:kept], cut=True) if stop is None else RawOutput(row[:stop], cut=False)
            out.prompt_tokens, out.generated_tokens = int(n), len(row) if stop is None else min(len(row), stop + 1)
            results.append(out)
        return results
