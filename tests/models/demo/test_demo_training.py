"""The demo model's training code: its forward agrees with inference, and a few steps learn."""

import torch

from batchvlm.attention import AttentionBatch, PrefixGroup, SharedPrefix, TaskGroup, slot_of
from batchvlm.shapes.examples import make_batch
from batchvlm.shapes.objective import dense_forward
from batchvlm.shapes.train import Trainer, TrainSettings


def test_training_forward_equals_inference_forward(tmp_path):
    tr = Trainer(tmp_path, TrainSettings(batch_size=2, seed=1), torch.device("cpu"))
    m = tr.model.eval()
    batch = make_batch(3, tr.s, tr.pre, tr.encode, tr.config.prefix_len)
    with torch.no_grad():
        hidden, _ = dense_forward(m, batch)
        # Replay segment 2 of example 0 through the paged inference path.
        P, bs = m.config.prefix_len, 16
        nb = -(-P // bs)
        sel = batch.seg[0] == 2
        n = int(sel.sum())
        cache = m.new_kv_cache(1 + nb + 8, bs)
        prefix_t, own_t = torch.arange(1, 1 + nb)[None], torch.arange(1 + nb, 1 + nb + 8)[None]
        j, lens = torch.arange(P), torch.tensor([P])
        prefix = m.prefix_embeds(m.vision(batch.crops[:1], [(1, 1)]))[0]
        m.forward_tokens(prefix, j, AttentionBatch(slot_of(prefix_t[0], j, bs), [
            PrefixGroup(j[None], prefix_t, lens, causal=False)], bs), cache)
        pos = batch.pos[0][sel]
        own = pos - P
        emb = m.input_embeds(batch.kind[0][sel], batch.token[0][sel], batch.value[0][sel])
        q = torch.arange(n)
        out = m.forward_tokens(emb, pos, AttentionBatch(slot_of(own_t[0], own, bs), [
            TaskGroup(q[None], own[None], own_t, torch.tensor([n]), SharedPrefix(prefix_t, lens, q[None], q[None]))],
            bs), cache)
    torch.testing.assert_close(out, hidden[0][sel], atol=1e-4, rtol=1e-4)


def test_a_few_steps_reduce_the_loss_and_resume_exactly(tmp_path):
    torch.manual_seed(0)
    s = TrainSettings(batch_size=8, steps=40, lr=2e-3, warmup=5, ckpt_every=20, eval_every=10**9)
    tr = Trainer(tmp_path, s, torch.device("cpu"))
    first = [tr.train_step()["total"] for _ in range(5)]
    tr.run(until=40, log=lambda _: None)
    last = tr.history[-1]["total"]
    assert last < 0.8 * sum(first) / len(first)
    assert (tmp_path / "checkpoint.pt").exists()

    # A fresh trainer resumes from the checkpoint at step 40 and continues identically.
    tr2 = Trainer(tmp_path, s, torch.device("cpu"))
    assert tr2.step == 40
    for a, b in zip(tr.model.state_dict().values(), tr2.model.state_dict().values()):
        assert torch.equal(a, b)
