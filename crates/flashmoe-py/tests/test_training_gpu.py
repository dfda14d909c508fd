"""Training through flashmoe's attention: a small causal language model trained for 50 steps
with `flashmoe.attention` follows the loss curve of the same model with PyTorch's SDPA
(issue 33's loss-curve test).

Both models start from the same weights and see the same batches (a fixed cycle the model
memorises, so the loss falls by several nats and a wrong gradient changes the curve); their
per-step losses may differ by bf16 rounding only. Skipped without torch or a CUDA device.
"""

import math
import random

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

import flashmoe  # noqa: E402

DEV = torch.device("cuda", 0)
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 512, 256, 4, 2, 64, 2
STEPS, BATCHES = 50, 4
# Per-step bound on |loss(flashmoe) - loss(SDPA)| in nats: max(floor, relative * loss).
LOSS_FLOOR, LOSS_RELATIVE = 0.05, 0.02


def init_weights(seed):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def w(*shape, fan_in):
        return torch.randn(*shape, device=DEV, generator=g) / math.sqrt(fan_in)

    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    weights = {"embed": w(VOCAB, HIDDEN, fan_in=1), "head": w(HIDDEN, VOCAB, fan_in=HIDDEN)}
    for i in range(LAYERS):
        weights[f"qkv{i}"] = w(HIDDEN, qkv, fan_in=HIDDEN)
        weights[f"o{i}"] = w(HEADS * HEAD_DIM, HIDDEN, fan_in=HEADS * HEAD_DIM)
        weights[f"up{i}"] = w(HIDDEN, 4 * HIDDEN, fan_in=HIDDEN)
        weights[f"down{i}"] = w(4 * HIDDEN, HIDDEN, fan_in=4 * HIDDEN)
    return {k: v.to(torch.bfloat16) for k, v in weights.items()}


def sdpa(q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=True)
    return o.transpose(1, 2)


def fm_attention(q, k, v):
    return flashmoe.attention(q, k, v, causal=True)


def forward(p, ids, attention):
    b, s = ids.shape
    x = p["embed"][ids]
    for i in range(LAYERS):
        h = F.rms_norm(x, (HIDDEN,))
        qkv = (h @ p[f"qkv{i}"]).view(b, s, HEADS + 2 * KV_HEADS, HEAD_DIM)
        q, k, v = qkv[:, :, :HEADS], qkv[:, :, HEADS:HEADS + KV_HEADS], qkv[:, :, HEADS + KV_HEADS:]
        x = x + attention(q, k, v).reshape(b, s, -1) @ p[f"o{i}"]
        h = F.rms_norm(x, (HIDDEN,))
        x = x + F.gelu(h @ p[f"up{i}"]) @ p[f"down{i}"]
    return F.rms_norm(x, (HIDDEN,)) @ p["head"]


def train(weights, batches, attention):
    params = {k: torch.nn.Parameter(v.clone()) for k, v in weights.items()}
    opt = torch.optim.AdamW(params.values(), lr=2e-3)
    losses = []
    for step in range(STEPS):
        ids = batches[step % BATCHES]
        logits = forward(params, ids, attention)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(x) for x in torch.stack(losses).cpu()]


@pytest.mark.parametrize("seq", [128, 333])
def test_flashmoe_attention_trains_like_sdpa(seq):
    seed = random.SystemRandom().randrange(1 << 31)
    print(f"seed {seed}")
    weights = init_weights(seed)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    batches = [torch.randint(0, VOCAB, (2, seq), device=DEV, generator=g) for _ in range(BATCHES)]
    ref = train(weights, batches, sdpa)
    got = train(weights, batches, fm_attention)
    assert all(math.isfinite(x) for x in ref + got), (ref, got)
    # The curve says something only if the model learns: the reference must fall.
    assert ref[-1] < ref[0] - 1.0, f"SDPA's loss fell only {ref[0]:.3f} -> {ref[-1]:.3f}"
    worst = max(range(STEPS), key=lambda i: abs(got[i] - ref[i]) - max(LOSS_FLOOR, LOSS_RELATIVE * ref[i]))
    dev = abs(got[worst] - ref[worst])
    print(f"loss {ref[0]:.3f} -> {ref[-1]:.3f} (SDPA), {got[-1]:.3f} (flashmoe); "
          f"max |Δ| {max(abs(a - b) for a, b in zip(got, ref)):.4f}")
    assert dev <= max(LOSS_FLOOR, LOSS_RELATIVE * ref[worst]), (
        f"step {worst}: flashmoe loss {got[worst]:.4f} vs SDPA {ref[worst]:.4f}")
