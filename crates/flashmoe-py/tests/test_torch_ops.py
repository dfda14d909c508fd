"""The torch layer without a GPU: op schemas, fake kernels (meta tensors, fake tracing) and the
arguments the public functions hand to the ops. Skipped without torch; needs no CUDA device."""

import pytest

torch = pytest.importorskip("torch")

import flashmoe  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

NEW_ARGS = {"window_left": -1, "window_right": -1, "softcap": 0.0}


@pytest.mark.parametrize("op", ["attention", "attention_varlen"])
def test_schemas_take_window_and_softcap_with_defaults(op):
    schema = getattr(torch.ops.flashmoe, op).default._schema
    args = {a.name: a for a in schema.arguments}
    for name, default in NEW_ARGS.items():
        assert name in args, f"{op} has no {name}: {schema}"
        assert args[name].default_value == default, f"{op}.{name}: {schema}"
    assert str(args["window_left"].type) == "int" and str(args["softcap"].type) == "float"
    # the new arguments come last: positional calls of the old schema still bind
    assert [a.name for a in schema.arguments][-3:] == list(NEW_ARGS)


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("extra", [(), (64, 0, 30.0), (-1, 16, 0.0)])
def test_attention_fake_kernel_shapes(extra):
    q, k, v = meta(2, 77, 8, 128), meta(2, 300, 2, 128), meta(2, 300, 2, 128)
    o, lse = torch.ops.flashmoe.attention.default(q, k, v, True, None, *extra)
    assert o.shape == (2, 77, 8, 128) and o.dtype == torch.bfloat16
    assert lse.shape == (2, 8, 77) and lse.dtype == torch.float32


@pytest.mark.parametrize("extra", [(), (50, 20, 30.0)])
def test_attention_varlen_fake_kernel_shapes(extra):
    q, k, v = meta(300, 8, 64, dtype=torch.float16), meta(400, 2, 64, dtype=torch.float16), meta(
        400, 2, 64, dtype=torch.float16)
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    o, lse = torch.ops.flashmoe.attention_varlen.default(q, k, v, cu, cu, 200, 300, False, 0.1, *extra)
    assert o.shape == (300, 8, 64) and o.dtype == torch.float16
    assert lse.shape == (8, 300) and lse.dtype == torch.float32


def traced_args(fn, *tensors):
    """The arguments of the one flashmoe op call in fn's fake-traced graph."""
    gm = make_fx(fn, tracing_mode="fake")(*tensors)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "flashmoe" in str(n.target)]
    assert len(calls) == 1, gm.graph
    node = calls[0]
    schema = node.target._schema
    bound = {a.name: a.default_value for a in schema.arguments}
    bound.update({a.name: x for a, x in zip(schema.arguments, node.args)})
    bound.update(node.kwargs)
    return bound


def test_attention_passes_window_and_softcap_to_the_op():
    q, k, v = torch.randn(1, 20, 4, 64), torch.randn(1, 30, 2, 64), torch.randn(1, 30, 2, 64)
    a = traced_args(lambda q, k, v: flashmoe.attention(q, k, v, window_size=(8, 3), softcap=30), q, k, v)
    assert (a["causal"], a["window_left"], a["window_right"], a["softcap"]) == (False, 8, 3, 30.0)
    # causal sets the right side to 0 (FlashAttention's rule), so both spellings share a plan
    a = traced_args(lambda q, k, v: flashmoe.attention(q, k, v, causal=True, window_size=(8, 3)), q, k, v)
    assert (a["causal"], a["window_left"], a["window_right"], a["softcap"]) == (True, 8, 0, 0.0)
    a = traced_args(lambda q, k, v: flashmoe.attention(q, k, v, causal=True), q, k, v)
    assert (a["window_left"], a["window_right"], a["softcap"]) == (-1, -1, 0.0)
    # a side past int32 is unbounded anyway: clamped, not an overflow
    a = traced_args(lambda q, k, v: flashmoe.attention(q, k, v, window_size=[2**40, -1]), q, k, v)
    assert (a["window_left"], a["window_right"]) == (2**31 - 1, -1)


def test_attention_varlen_passes_window_and_softcap_to_the_op():
    q, k = torch.randn(20, 4, 64), torch.randn(30, 2, 64)
    cu_q = torch.tensor([0, 5, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32)

    def fn(q, k, v, cq, ck):
        return flashmoe.attention_varlen(q, k, v, cq, ck, 15, 20, window_size=(16, 4), softcap=20.0)

    a = traced_args(fn, q, k, k.clone(), cu_q, cu_k)
    assert (a["causal"], a["window_left"], a["window_right"], a["softcap"]) == (False, 16, 4, 20.0)


@pytest.mark.parametrize("window_size", [5, (1, 2, 3), (1.5, 0), "ab", None])
def test_window_size_must_be_a_pair_of_ints(window_size):
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="window_size must be a \\(left, right\\) pair of ints"):
        flashmoe.attention(q, q, q, window_size=window_size)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="window_size must be a \\(left, right\\) pair of ints"):
        flashmoe.attention_varlen(q[0], q[0], q[0], cu, cu, 8, 8, window_size=window_size)


# --------------------------------------------------------------------------- no silent detach
# The ops without a backward (all but dense and varlen attention): with grad mode on, an input that requires
# grad must raise rather than give outputs without a grad_fn (everything upstream would stop
# training unnoticed). The check runs before the device check, so CPU tensors show it without a GPU.

NO_BACKWARD = "has no backward pass yet, but {} requires grad"


def attention_calls():
    q, k = torch.randn(1, 8, 4, 64, dtype=torch.bfloat16), torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    cache = torch.randn(2, 16, 2, 64, dtype=torch.bfloat16)
    bt, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([8], dtype=torch.int32)
    return {
        "attention": (lambda q, k, v: flashmoe.attention(q, k, v, causal=True), (q, k, k.clone())),
        "attention_varlen": (lambda q, k, v: flashmoe.attention_varlen(q, k, v, cu, cu, 8, 8), (q[0], k[0], k[0])),
        "attention_with_kvcache": (
            lambda q, kc, vc: flashmoe.attention_with_kvcache(q, kc, vc, block_table=bt, cache_seqlens=lens),
            (q[:, :1], cache, cache.clone())),
    }


@pytest.mark.parametrize("fn", ["attention_with_kvcache"])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_attention_refuses_inputs_that_require_grad(fn, which):
    call, tensors = attention_calls()[fn]
    tensors = [t.clone().requires_grad_(i == which) for i, t in enumerate(tensors)]
    name = {"attention_with_kvcache": ("q", "k_cache", "v_cache")}.get(fn, ("q", "k", "v"))[which]
    with pytest.raises(RuntimeError, match=NO_BACKWARD.format(name)):
        call(*tensors)
    # inference (grad mode off) is unaffected: the call gets as far as the device check
    with torch.no_grad(), pytest.raises(ValueError, match="flashmoe takes CUDA tensors"):
        call(*tensors)


def test_kvcache_refuses_appended_rows_that_require_grad():
    q, cache = torch.randn(1, 1, 4, 64, dtype=torch.bfloat16), torch.randn(2, 16, 2, 64, dtype=torch.bfloat16)
    new = torch.randn(1, 1, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    bt, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([8], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=NO_BACKWARD.format("k")):
        flashmoe.attention_with_kvcache(q, cache, cache, block_table=bt, cache_seqlens=lens, k=new, v=new.detach())


def moe_args(h=64, i=32, e=4):
    return (torch.randn(16, h, dtype=torch.bfloat16), torch.randn(h, e, dtype=torch.bfloat16),
            torch.randn(e, h, 2 * i, dtype=torch.bfloat16), torch.randn(e, i, h, dtype=torch.bfloat16))


@pytest.mark.parametrize("which", ["x", "router_w", "w13", "w2", "shared_w2"])
def test_moe_with_grad_takes_the_training_op(which):
    # flashmoe.moe is differentiable (flashmoe::moe_train, _moe_autograd.py): a CPU tensor that
    # requires grad meets the device check, with grad mode on or off
    x, rw, w13, w2 = moe_args()
    args = {"x": x, "router_w": rw, "w13": w13, "w2": w2}
    shared = [torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)]
    if which == "shared_w2":
        shared[1] = torch.nn.Parameter(shared[1])
    else:
        args[which] = torch.nn.Parameter(args[which]) if which != "x" else x.requires_grad_()
    with pytest.raises(ValueError, match="flashmoe takes CUDA tensors"):
        flashmoe.moe(*args.values(), top_k=2, shared=tuple(shared))
    with torch.no_grad(), pytest.raises(ValueError, match="flashmoe takes CUDA tensors"):
        flashmoe.moe(*args.values(), top_k=2, shared=tuple(shared))


@pytest.mark.parametrize("shared, recompute", [(False, False), (True, False), (False, True)])
def test_moe_is_differentiable_on_meta(shared, recompute):
    # the fake kernels of moe_train and moe_backward: autograd wiring, shapes and dtypes, with the
    # gate/up kept from the forward (the default) or recomputed
    x, rw, w13, w2 = (t.to("meta").requires_grad_() for t in moe_args())
    sh = (meta(64, 64).requires_grad_(), meta(32, 64).requires_grad_()) if shared else None
    r = flashmoe.moe(x, rw, w13, w2, top_k=2, shared=sh, recompute_gate_up=recompute)
    assert r.out.grad_fn is not None and r.aux_loss.grad_fn is not None
    leaves = (x, rw, w13, w2) + (sh if shared else ())
    grads = torch.autograd.grad((r.out, r.aux_loss, r.z_loss), leaves,
                                (torch.ones_like(r.out), torch.ones_like(r.aux_loss), torch.ones_like(r.z_loss)))
    for g, t in zip(grads, leaves):
        assert g.shape == t.shape and g.dtype == t.dtype
    # only w2 requires grad: the others get none
    r = flashmoe.moe(x.detach(), rw.detach(), w13.detach(), w2, top_k=2)
    (dw2,) = torch.autograd.grad(r.out, (w2,), torch.ones_like(r.out))
    assert dw2.shape == w2.shape


def test_moe_recompute_gate_up_is_for_training_calls():
    x, rw, w13, w2 = (t.to("meta") for t in moe_args())
    with pytest.raises(ValueError, match="recompute_gate_up=True is for calls that train"):
        flashmoe.moe(x, rw, w13, w2, top_k=2, recompute_gate_up=True)


def test_moe_backward_traces_into_the_backward_op():
    def step(x, rw, w13, w2):
        r = flashmoe.moe(x, rw, w13, w2, top_k=2, scoring="sigmoid")
        return torch.autograd.grad((r.out, r.z_loss), (x, rw, w13, w2),
                                   (torch.ones_like(r.out), torch.ones_like(r.z_loss)))

    gm = make_fx(lambda *a: step(*(t.requires_grad_() for t in a)), tracing_mode="fake")(*moe_args())
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert any("flashmoe.moe_train.default" in t for t in targets), targets
    assert any("flashmoe.moe_backward.default" in t for t in targets), targets


def test_op_path_refuses_inputs_that_require_grad():
    # torch.ops.flashmoe.* directly (as torch.compile calls them): the ops' Autograd kernels
    q = meta(1, 8, 4, 64).requires_grad_()
    k = meta(1, 8, 2, 64)
    cu = torch.empty(2, dtype=torch.int32, device="meta")
    o, _ = torch.ops.flashmoe.attention_varlen.default(q[0], k[0], k[0], cu, cu, 8, 8, True, None)
    assert o.grad_fn is not None  # differentiable (the fake kernel runs)
    o, lse = torch.ops.flashmoe.attention.default(q.detach(), k, k, True, None)  # the fake kernel runs
    assert o.shape == (1, 8, 4, 64) and o.grad_fn is None
    x, rw, w13, w2 = (t.to("meta") for t in moe_args())
    with pytest.raises(RuntimeError, match=NO_BACKWARD.format("w13")):
        torch.ops.flashmoe.moe.default(x, rw, w13.requires_grad_(), w2, None, None, 2, "softmax", True)


def test_compile_with_grad_reaches_the_training_op():
    # under torch.compile a call that needs grad traces flashmoe::moe_train (one graph): a CPU
    # tensor meets its device check
    x, rw, w13, w2 = moe_args()
    fn = torch.compile(lambda x: flashmoe.moe(x, rw, w13, w2, top_k=2), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="flashmoe takes CUDA tensors"):
        fn(x.requires_grad_())


# --------------------------------------------------------------------------- autograd (dense attention)
# flashmoe.attention is differentiable (register_autograd on flashmoe::attention, backward through
# flashmoe::attention_backward). On meta tensors the fake kernels run, so the autograd wiring,
# shapes and dtypes are checked without a GPU.


def test_attention_backward_fake_kernel_shapes():
    q, k = meta(2, 77, 8, 128), meta(2, 300, 2, 128)
    lse = meta(2, 8, 77, dtype=torch.float32)
    dq, dk, dv = torch.ops.flashmoe.attention_backward.default(q, q, k, k, q, lse, True, None, 16, 0, 30.0)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    assert dq.dtype == dk.dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window_size": (8, 0), "softcap": 5.0}])
def test_attention_is_differentiable(kwargs):
    q = meta(2, 33, 8, 64).requires_grad_()
    k, v = meta(2, 40, 2, 64).requires_grad_(), meta(2, 40, 2, 64).requires_grad_()
    o = flashmoe.attention(q, k, v, **kwargs)
    assert o.requires_grad and o.grad_fn is not None
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    # only k requires grad: the other inputs get none
    o, lse = flashmoe.attention(q.detach(), k, v.detach(), return_lse=True, **kwargs)
    (dk,) = torch.autograd.grad(o, (k,), torch.ones_like(o))
    assert dk.shape == k.shape


def test_attention_backward_traces_into_the_backward_op():
    def step(q, k, v):
        o = flashmoe.attention(q, k, v, causal=True)
        return torch.autograd.grad(o, (q, k, v), torch.ones_like(o))

    q, k = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16), torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    gm = make_fx(lambda q, k, v: step(q.requires_grad_(), k.requires_grad_(), v.requires_grad_()),
                 tracing_mode="fake")(q, k, k.clone())
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert any("flashmoe.attention.default" in t for t in targets), targets
    assert any("flashmoe.attention_backward.default" in t for t in targets), targets


@pytest.mark.parametrize("deterministic, flag, want", [
    (None, False, False), (None, True, True), (True, False, True), (False, True, False)])
def test_attention_deterministic_reaches_the_backward_op(deterministic, flag, want):
    # None follows torch.are_deterministic_algorithms_enabled() at the forward call; the choice
    # is the backward op's last argument
    def step(q, k, v):
        o = flashmoe.attention(q, k, v, causal=True, deterministic=deterministic)
        return torch.autograd.grad(o, (q, k, v), torch.ones_like(o))

    q, k = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16), torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(flag)
    try:
        gm = make_fx(lambda q, k, v: step(q.requires_grad_(), k.requires_grad_(), v.requires_grad_()),
                     tracing_mode="fake")(q, k, k.clone())
    finally:
        torch.use_deterministic_algorithms(before)
    bwd = [n for n in gm.graph.nodes if "flashmoe.attention_backward.default" in str(n.target)]
    assert len(bwd) == 1
    # the dispatcher may drop a trailing default (False): then the kwargs fallback reads False
    got = bwd[0].args[11] if len(bwd[0].args) > 11 else bwd[0].kwargs.get("deterministic", False)
    assert got is want, (bwd[0].args, bwd[0].kwargs)


def test_attention_cpu_tensors_with_grad_meet_the_device_check():
    q = torch.randn(1, 8, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="flashmoe takes CUDA tensors"):
        flashmoe.attention(q, q, q)


def test_attention_head_dim_without_backward_raises():
    q = meta(1, 8, 4, 256).requires_grad_()
    with pytest.raises(RuntimeError, match=r"no backward pass for head_dim 256 \(.*\), but q requires grad"):
        flashmoe.attention(q, q.detach(), q.detach())
    # inference is unaffected: the eager call gets as far as the device check
    with torch.no_grad(), pytest.raises(ValueError, match="flashmoe takes CUDA tensors"):
        flashmoe.attention(q, q, q)


# --------------------------------------------------------------------------- autograd (varlen attention)
# flashmoe.attention_varlen is differentiable (register_autograd on flashmoe::attention_varlen,
# backward through flashmoe::attention_varlen_backward); checked on meta tensors as above.


def test_attention_varlen_backward_fake_kernel_shapes():
    q, k = meta(300, 8, 128), meta(400, 2, 128)
    lse = meta(8, 300, dtype=torch.float32)
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    dq, dk, dv = torch.ops.flashmoe.attention_varlen_backward.default(q, q, k, k, q, lse, cu, cu, 200, 300, True,
                                                                      None, 16, 0, 30.0)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    assert dq.dtype == dk.dtype == torch.bfloat16


def test_attention_varlen_backward_schema():
    schema = torch.ops.flashmoe.attention_varlen_backward.default._schema
    names = [a.name for a in schema.arguments]
    assert names[:8] == ["dout", "q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k"], names
    assert names[-3:] == list(NEW_ARGS)


@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window_size": (8, 0), "softcap": 5.0}])
def test_attention_varlen_is_differentiable(kwargs):
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    q = meta(33, 8, 64).requires_grad_()
    k, v = meta(40, 2, 64).requires_grad_(), meta(40, 2, 64).requires_grad_()
    o = flashmoe.attention_varlen(q, k, v, cu, cu, 20, 25, **kwargs)
    assert o.requires_grad and o.grad_fn is not None
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    o, lse = flashmoe.attention_varlen(q.detach(), k, v.detach(), cu, cu, 20, 25, return_lse=True, **kwargs)
    (dk,) = torch.autograd.grad(o, (k,), torch.ones_like(o))
    assert dk.shape == k.shape


def test_attention_varlen_backward_traces_into_the_backward_op():
    # The offsets are traced inputs too: a real tensor captured by the closure would meet the
    # fake tensors of the trace inside the op.
    def step(q, k, v, cu):
        o = flashmoe.attention_varlen(q, k, v, cu, cu, 10, 10, causal=True)
        return torch.autograd.grad(o, (q, k, v), torch.ones_like(o))

    cu = torch.tensor([0, 10, 16], dtype=torch.int32)
    q, k = torch.randn(16, 4, 64, dtype=torch.bfloat16), torch.randn(16, 2, 64, dtype=torch.bfloat16)
    gm = make_fx(lambda q, k, v, cu: step(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu),
                 tracing_mode="fake")(q, k, k.clone(), cu)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert any("flashmoe.attention_varlen.default" in t for t in targets), targets
    assert any("flashmoe.attention_varlen_backward.default" in t for t in targets), targets


def test_attention_varlen_head_dim_without_backward_raises():
    cu = torch.empty(2, dtype=torch.int32, device="meta")
    q = meta(8, 4, 256).requires_grad_()
    with pytest.raises(RuntimeError, match=r"no backward pass for head_dim 256 \(.*\), but q requires grad"):
        flashmoe.attention_varlen(q, q.detach(), q.detach(), cu, cu, 8, 8)
    with torch.no_grad(), pytest.raises(ValueError, match="flashmoe takes CUDA tensors"):
        flashmoe.attention_varlen(q, q, q, cu, cu, 8, 8)


# --------------------------------------------------------------------------- ALiBi


def test_alibi_schemas():
    args = [a.name for a in torch.ops.flashmoe.attention_alibi.default._schema.arguments]
    assert args[:5] == ["q", "k", "v", "alibi_slopes", "causal"]
    kv = {a.name: a for a in torch.ops.flashmoe.attention_kvcache.default._schema.arguments}
    # the new argument comes last with a None default: positional calls of the old schema still bind
    assert list(kv)[-1] == "alibi_slopes" and kv["alibi_slopes"].default_value is None


def test_attention_alibi_fake_kernel_shapes():
    q, k = meta(2, 77, 8, 96), meta(2, 300, 2, 96)
    slopes = meta(8, dtype=torch.float32)
    o, lse = torch.ops.flashmoe.attention_alibi.default(q, k, k, slopes, True, None, 64, 0, 30.0)
    assert o.shape == (2, 77, 8, 96) and lse.shape == (2, 8, 77) and lse.dtype == torch.float32


def test_attention_passes_alibi_slopes_to_the_alibi_op():
    q, k = torch.randn(2, 5, 8, 64, dtype=torch.bfloat16), torch.randn(2, 9, 2, 64, dtype=torch.bfloat16)
    slopes = torch.rand(2, 8)
    bound = traced_args(
        lambda q, k, s: flashmoe.attention(q, k, k, causal=True, window_size=(4, -1), alibi_slopes=s), q, k, slopes)
    assert bound["causal"] is True and (bound["window_left"], bound["window_right"]) == (4, 0)
    assert bound["alibi_slopes"].op == "placeholder"  # the slopes themselves, no copy


@pytest.mark.parametrize("which", [0, 1, 2, 3])
def test_alibi_refuses_inputs_that_require_grad(which):
    q, k = torch.randn(1, 8, 4, 64, dtype=torch.bfloat16), torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    tensors = [t.clone().requires_grad_(i == which) for i, t in enumerate((q, k, k, torch.rand(4)))]
    name = ("q", "k", "v", "alibi_slopes")[which]
    with pytest.raises(RuntimeError, match=f"alibi_slopes.*no backward pass yet, but {name} requires grad"):
        flashmoe.attention(*tensors[:3], alibi_slopes=tensors[3])
    with torch.no_grad(), pytest.raises(ValueError, match="flashmoe takes CUDA tensors"):
        flashmoe.attention(*tensors[:3], alibi_slopes=tensors[3])
