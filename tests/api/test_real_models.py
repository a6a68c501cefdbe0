"""Real models train under graphgrad exactly like under torch.autograd.

The architectures are transformers' own (GPT-2, Llama, Mistral, BERT with a classification
head, T5, BART, Wav2Vec2 with CTC), built from tiny configs with random weights: nothing is
downloaded (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are set), and each model has 2 layers, a
hidden size of 32 and a vocabulary of 96. Two torch.nn models stand beside them: a tagger with
a bidirectional GRU and an LSTM with projections over packed sequences, and an EmbeddingBag
classifier.

Each model is built once in float64, deep-copied (the copy is adopted) and both copies take 3
AdamW steps side by side on the same batches, with the same dropout masks
(``torch.manual_seed(step)`` before each forward). The losses after each step, the gradients of
the first step and every parameter after each step must equal torch.autograd's to the float64
tolerance ``TOL``. The losses are float64 throughout: where transformers computes a loss in
float32 (its causal-LM loss and Wav2Vec2ForCTC's), the test computes it from the logits.

transformers comes with the ``[models]`` extra (``requirements/models.txt``; ``bash
scripts/test.sh`` installs it): without it those cases skip, saying so.
"""

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import graphgrad as gg
from helpers import TOL, plain

# Models are built from configs with random weights: nothing may be fetched from a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
try:
    import transformers
except ImportError:
    transformers = None

needs_transformers = pytest.mark.skipif(
    transformers is None, reason="transformers is not installed: the real-model tests need the [models] "
    "extra (pip install '.[models]' or pip install -r requirements/models.txt; bash scripts/test.sh "
    "installs it)")

DT = torch.float64
STEPS = 3
VOCAB = 96
LR = 1e-2


def generator(step):
    return torch.Generator().manual_seed(1000 + step)


def lm_batch(step):
    """Two sequences of 9 tokens; the second ends in 3 padding positions (masked, no loss)."""
    ids = torch.randint(0, VOCAB, (2, 9), generator=generator(step))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    return dict(input_ids=ids, attention_mask=mask)


def causal_lm_loss(model, batch):
    """Next-token cross-entropy over the unpadded positions, in float64 (transformers' own
    causal-LM loss casts the logits to float32)."""
    logits = model(**batch).logits
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def model_loss(model, batch):
    """The loss the model computes itself from ``labels`` (float64 for these models)."""
    return model(**batch).loss


def gpt2(attn_implementation):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = attn_implementation
    return transformers.GPT2LMHeadModel(cfg), lm_batch, causal_lm_loss


def llama():
    """Grouped-query attention (4 query heads, 2 key/value heads), RoPE, RMSNorm, SwiGLU."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=16, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(cfg), lm_batch, causal_lm_loss


def llama_checkpointed():
    """Llama with transformers' activation checkpointing on (torch.utils.checkpoint, the
    non-reentrant kind, around each decoder layer). graphgrad records through it: torch's
    saved-tensor hooks that would drop and recompute activations act on torch's graph only, so
    under graphgrad the layers run once and keep what they save; the gradients must match."""
    model, batch, loss = llama()
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing
    return model, batch, loss


def mistral():
    """Llama's blocks with a sliding attention window (4) shorter than the sequences (9)."""
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=16, sliding_window=4, bos_token_id=1,
                                     eos_token_id=2)
    return transformers.MistralForCausalLM(cfg), lm_batch, causal_lm_loss


def bert():
    """Sequence classification (3 labels) through the pooler; padding masked, two segments."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=16,
                                  num_labels=3)

    def batch(step):
        g = generator(step)
        ids = torch.randint(0, VOCAB, (3, 8), generator=g)
        mask = torch.ones_like(ids)
        mask[0, 5:] = 0
        segments = torch.zeros_like(ids)
        segments[:, 4:] = 1
        return dict(input_ids=ids, attention_mask=mask, token_type_ids=segments,
                    labels=torch.randint(0, 3, (3,), generator=g))

    return transformers.BertForSequenceClassification(cfg), batch, model_loss


def seq2seq_batch(step):
    """Source sequences of 7 tokens (the second padded after 5) and targets of 5."""
    g = generator(step)
    ids = torch.randint(3, VOCAB, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=torch.randint(3, VOCAB, (2, 5), generator=g))


def t5():
    """Relative position buckets, RMS-style layer norm, cross-attention; the model's own loss."""
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg), seq2seq_batch, model_loss


def bart():
    """Learned positions, post-norm blocks, tied embeddings; the model's own loss."""
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=16)
    return transformers.BartForConditionalGeneration(cfg), seq2seq_batch, model_loss


def wav2vec2():
    """Raw audio through the convolutional feature encoder (GroupNorm), the weight-normed
    convolutional position embedding and 2 transformer layers (LayerDrop seeded), trained with
    CTC on targets of different lengths. No SpecAugment masking (mask_time_prob=0): it draws
    with numpy."""
    cfg = transformers.Wav2Vec2Config(vocab_size=12, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
                                      conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                                      num_conv_pos_embedding_groups=4, mask_time_prob=0.0, pad_token_id=0)
    model = transformers.Wav2Vec2ForCTC(cfg)

    def batch(step):
        g = generator(step)
        return dict(input_values=torch.randn(2, 400, dtype=DT, generator=g),
                    targets=torch.randint(1, 12, (2, 6), generator=g), target_lengths=torch.tensor([6, 4]))

    def ctc_loss(model, batch):
        """F.ctc_loss on float64 log-probabilities (Wav2Vec2ForCTC's loss takes them in float32)."""
        logits = model(batch["input_values"]).logits
        frames = model._get_feat_extract_output_lengths(torch.tensor(batch["input_values"].shape[-1]))
        log_probs = F.log_softmax(logits, dim=-1).transpose(0, 1)
        return F.ctc_loss(log_probs, batch["targets"], frames.repeat(2), batch["target_lengths"],
                          blank=cfg.pad_token_id, zero_infinity=True)

    return model, batch, ctc_loss


class Tagger(nn.Module):
    """Token tagging over sequences of different lengths: embeddings (padding_idx 0), a 2-layer
    bidirectional GRU over packed sequences with dropout between its layers, an LSTM with
    projections, a linear head."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(30, 12, padding_idx=0)
        self.gru = nn.GRU(12, 10, num_layers=2, bidirectional=True, dropout=0.2, batch_first=True)
        self.lstm = nn.LSTM(20, 12, proj_size=6, batch_first=True)
        self.head = nn.Linear(6, 5)

    def forward(self, tokens, lengths):
        packed = pack_padded_sequence(self.tok(tokens), lengths, batch_first=True, enforce_sorted=False)
        h, _ = self.gru(packed)
        h, _ = pad_packed_sequence(h, batch_first=True, total_length=tokens.shape[1])
        h, _ = self.lstm(h)
        return self.head(h)


def tagger():
    def batch(step):
        g = generator(step)
        lengths = torch.tensor([7, 4, 6])
        tokens = torch.randint(1, 30, (3, 7), generator=g)
        tags = torch.randint(0, 5, (3, 7), generator=g)
        padding = torch.arange(7) >= lengths[:, None]
        return dict(tokens=tokens.masked_fill(padding, 0), lengths=lengths,
                    tags=tags.masked_fill(padding, -100))

    def loss(model, batch):
        logits = model(batch["tokens"], batch["lengths"])
        return F.cross_entropy(logits.flatten(0, 1), batch["tags"].flatten(), ignore_index=-100)

    return Tagger(), batch, loss


class BagClassifier(nn.Module):
    """Bag-of-words classification: a weighted sum bag over flat word ids with offsets, a mean
    bag over padded tag ids (padding_idx 0) and a max bag, concatenated into a linear head."""

    def __init__(self):
        super().__init__()
        self.words = nn.EmbeddingBag(VOCAB, 16, mode="sum")
        self.tags = nn.EmbeddingBag(20, 8, mode="mean", padding_idx=0)
        self.peak = nn.EmbeddingBag(VOCAB, 8, mode="max")
        self.head = nn.Linear(32, 4)

    def forward(self, words, offsets, weights, tags):
        return self.head(torch.cat([self.words(words, offsets, per_sample_weights=weights),
                                    self.tags(tags), self.peak(words, offsets)], dim=1))


def bag_classifier():
    def batch(step):
        g = generator(step)
        words = torch.randint(0, VOCAB, (14,), generator=g)
        tags = torch.randint(0, 20, (4, 5), generator=g)
        tags[1, 3:] = 0  # padding
        return dict(words=words, offsets=torch.tensor([0, 3, 7, 8]),
                    weights=torch.rand(14, dtype=DT, generator=g), tags=tags,
                    labels=torch.randint(0, 4, (4,), generator=g))

    def loss(model, batch):
        logits = model(batch["words"], batch["offsets"], batch["weights"], batch["tags"])
        return F.cross_entropy(logits, batch["labels"])

    return BagClassifier(), batch, loss


# name: (builder, parameters that get no gradient by design)
MODELS = {
    "gpt2": (lambda: gpt2("sdpa"), set()),
    "gpt2_eager_attention": (lambda: gpt2("eager"), set()),
    "llama": (llama, set()),
    "llama_activation_checkpointing": (llama_checkpointed, set()),
    "mistral_sliding_window": (mistral, set()),
    "bert_classifier": (bert, set()),
    "t5": (t5, set()),
    "bart": (bart, set()),
    "wav2vec2_ctc": (wav2vec2, set()),  # masked_spec_embed exists only with SpecAugment masking
    "gru_lstm_tagger": (tagger, set()),
    "embedding_bag_classifier": (bag_classifier, set()),
}
TORCH_NN_ONLY = {"gru_lstm_tagger", "embedding_bag_classifier"}


def close(ours, ref, what):
    torch.testing.assert_close(plain(ours), ref.detach(), **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name in TORCH_NN_ONLY else needs_transformers) for name in MODELS])
def test_real_model_trains_like_torch(name):
    build, no_grad_expected = MODELS[name]
    torch.manual_seed(0)
    ref, batches, loss_of = build()
    ref = ref.to(DT).train()
    ours = gg.nn.adopt(copy.deepcopy(ref))
    names = [n for n, _ in ref.named_parameters()]
    assert names == [n for n, _ in ours.named_parameters()]
    assert all(isinstance(p, gg.nn.Parameter) for p in ours.parameters())
    assert not any(isinstance(p, gg.Tensor) for p in ref.parameters())
    initial = [p.detach().clone() for p in ref.parameters()]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (ours, ref)]
    for step in range(STEPS):
        batch = batches(step)
        losses = []
        for model, opt in zip((ours, ref), optimizers):
            opt.zero_grad()
            torch.manual_seed(step)  # the same dropout masks (and LayerDrop draws) on both sides
            loss = loss_of(model, batch)
            loss.backward()
            losses.append(loss)
        loss_ours, loss_ref = losses
        # graphgrad recorded the step (its graph, its backward), torch.autograd the other
        assert isinstance(loss_ours, gg.Tensor) and isinstance(loss_ours.grad_fn, gg.Node), name
        assert not isinstance(loss_ref, gg.Tensor)
        assert loss_ours.dtype == loss_ref.dtype == DT
        close(loss_ours, loss_ref, f"{name} step {step} loss")
        if step == 0:
            no_grad_ours = {n for n, p in zip(names, ours.parameters()) if p.grad is None}
            no_grad_ref = {n for n, p in zip(names, ref.parameters()) if p.grad is None}
            assert no_grad_ref == no_grad_expected
            assert no_grad_ours == no_grad_ref
            for n, po, pr in zip(names, ours.parameters(), ref.parameters()):
                if pr.grad is not None:
                    assert type(po.grad) is torch.Tensor
                    close(po.grad, pr.grad, f"{name} step 0 gradient of {n}")
        for opt in optimizers:
            opt.step()
        for n, po, pr in zip(names, ours.parameters(), ref.parameters()):
            close(po, pr, f"{name} {n} after step {step}")
    trained = [n for n, p, p0 in zip(names, ref.parameters(), initial) if not torch.equal(p.detach(), p0)]
    assert set(trained) == set(names) - no_grad_expected  # every parameter with a gradient moved
