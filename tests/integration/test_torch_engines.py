"""Generated torch modules where torch runs: torch.compile (CPU, inductor), torch.func, and
DistributedDataParallel on two local processes (gloo), each against the eager single-process numbers."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")

from gloo_step import run_step  # noqa: E402
from symattn.generated import mha_torch, transformer_block_torch  # noqa: E402

E, H, L, N = 16, 4, 6, 4
PRE_LN_GELU = {"dropout": 0.0, "activation": "gelu", "norm_first": True}  # the generated module's configuration


def _modules(dtype=torch.float64):
    """symattn's own-layout module and the drop-in, with random biases, seeded."""
    torch.manual_seed(0)
    own = mha_torch.MultiHeadAttention(E, num_heads=H, bias=True, dtype=dtype)
    dropin = mha_torch.MultiheadAttention(E, H, batch_first=True, dtype=dtype)
    with torch.no_grad():
        for p in [*own.parameters(), *dropin.parameters()]:
            p.copy_(torch.randn_like(p) / 4)
    return own, dropin


def _gradients(module, x, compiled=None):
    """The output and the gradients (x first, then the parameters) of ⟨G, out⟩ through module (or compiled)."""
    x = x.detach().requires_grad_()
    out = (module if compiled is None else compiled)(x, x, x)
    out = out[0] if isinstance(out, tuple) else out
    torch.manual_seed(1)
    grads = torch.autograd.grad((out * torch.randn_like(out)).sum(), [x, *module.parameters()])
    return out.detach(), grads


def _no_cxx():
    return not any(shutil.which(name) for name in ("g++", "c++", "clang++"))


@pytest.mark.slow
@pytest.mark.skipif(_no_cxx(), reason="torch.compile's CPU backend (inductor) compiles C++: no C++ compiler on PATH")
def test_torch_compile_inductor_cpu_matches_eager():
    # the autograd Function is traced by dynamo (forward and the closed-form backward) and compiled by inductor
    x = torch.randn(N, L, E, dtype=torch.float64)
    for module in _modules():
        compiled = torch.compile(module, backend="inductor", fullgraph=False)
        out, grads = _gradients(module, x)
        out_c, grads_c = _gradients(module, x, compiled)
        assert (out - out_c).abs().max() < 1e-12
        for a, b in zip(grads, grads_c, strict=True):
            assert (a - b).abs().max() < 1e-11


def _cases() -> dict:
    """name → (a function of float64 tensors, the tensors): every generated torch entry point with masks, heads,
    biases, memeff and the drop-ins; self-attention passes one tensor as query, key and value."""
    from symattn.generated import attention_torch, attention_torch_memeff, mha_torch_memeff

    torch.manual_seed(2)
    q, k, v = (torch.randn(2, L, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    x = torch.randn(N, L, E, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(L, L, dtype=torch.float64, requires_grad=True)
    padding = torch.zeros(2, L, dtype=torch.bool)
    padding[1, -2:] = True
    own, dropin = _modules()
    gqa = mha_torch.MultiHeadAttention(E, num_heads=H, num_kv_heads=2, bias=True, dtype=torch.float64)
    layer = transformer_block_torch.TransformerEncoderLayer(E, H, 8, **PRE_LN_GELU, dtype=torch.float64)
    # torch's default configuration, post-LN ReLU: a closed form rendered in memory, traced as the generated one
    post_ln = transformer_block_torch.TransformerEncoderLayer(E, H, 8, dropout=0.0, dtype=torch.float64)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    # 300 query rows: three blocks of rows (128, 128, 44), each reading its causal key range, traced too
    long = tuple(torch.randn(2, 300, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    long_padding = torch.zeros(2, 300, dtype=torch.bool)
    long_padding[0, :5] = True
    return {
        "attention causal, blocks of rows": (
            lambda a, b, c: attention_torch.forward(a, b, c, causal=True, key_padding_mask=long_padding),
            long,
        ),
        "attention": (attention_torch.forward, (q, k, v)),
        "attention causal": (lambda a, b, c: attention_torch.forward(a, b, c, causal=True), (q, k, v)),
        "attention float mask": (lambda a, b, c, m: attention_torch.forward(a, b, c, attn_mask=m), (q, k, v, bias)),
        "attention key padding": (
            lambda a, b, c: attention_torch.forward(a, b, c, key_padding_mask=padding),
            (q, k, v),
        ),
        "attention memeff causal": (lambda a, b, c: attention_torch_memeff.forward(a, b, c, causal=True), (q, k, v)),
        "mha Q = K = V": (lambda t: own(t, t, t, causal=True), (x,)),
        "mha grouped heads": (lambda t: gqa(t, t, t), (x,)),
        "mha memeff": (
            lambda t: mha_torch_memeff.forward(t, t, t, own.W_Q, own.W_K, own.W_V, own.W_O, num_heads=H, causal=True),
            (x,),
        ),
        "drop-in MultiheadAttention": (lambda t: dropin(t, t, t, attn_mask=causal)[0], (x,)),
        "drop-in TransformerEncoderLayer": (layer, (x,)),
        "drop-in TransformerEncoderLayer post-LN ReLU": (post_ln, (x,)),
    }


CASES = _cases()


def _leaves(args, function) -> list:
    parameters = list(function.parameters()) if isinstance(function, torch.nn.Module) else []
    owner = getattr(function, "__closure__", None) or ()
    for cell in owner:  # a lambda over a module: its parameters too
        if isinstance(cell.cell_contents, torch.nn.Module):
            parameters += list(cell.cell_contents.parameters())
    return [a for a in args if a.requires_grad] + parameters


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_compile_fullgraph_traces_the_closed_form(name):
    # fullgraph=True: one graph or an error (no silent eager fallback for the Function); no branch on the data
    # (a fully masked row), no type.__index__, one tensor as Q, K and V; outputs and gradients as eager
    function, args = CASES[name]
    leaves = _leaves(args, function)
    torch._dynamo.reset()
    compiled = torch.compile(function, backend="aot_eager", fullgraph=True)
    for run in (function, compiled):
        out = run(*args)
        weighted = out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        grads = torch.autograd.grad(weighted.sum(), leaves, allow_unused=True)  # (mha memeff: no biases)
        if run is function:
            want = out.detach(), grads
    assert (out - want[0]).abs().max() < 1e-12
    for a, b in zip(grads, want[1], strict=True):
        assert (a is None and b is None) or (a - b).abs().max() < 1e-11


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_export_traces_masks_and_heads(name):
    function, args = CASES[name]

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = function if isinstance(function, torch.nn.Module) else None

        def forward(self, *xs):
            return function(*xs)

    exported = torch.export.export(Wrapped(), tuple(a.detach() for a in args))
    got = exported.module()(*(a.detach() for a in args))
    assert (got - function(*args).detach()).abs().max() < 1e-12


def test_torch_func_reaches_the_modules_and_drop_ins():
    # setup_context-style Functions: torch.func's grad and vmap through the nn.Modules, the drop-ins and the
    # encoder layer equal the eager numbers (tests/integration/test_torch_func.py checks every transform)
    own, dropin = _modules()
    x = torch.randn(N, L, E, dtype=torch.float64)

    def loss(w_q):
        return mha_torch.forward(x, x, x, w_q, own.W_K, own.W_V, own.W_O, num_heads=H).sum()

    w_q = own.W_Q.detach().requires_grad_()
    (eager,) = torch.autograd.grad(loss(w_q), w_q)
    assert (torch.func.grad(loss)(own.W_Q.detach()) - eager).abs().max() < 1e-12
    with torch.no_grad():
        assert (torch.func.vmap(lambda xs: own(xs, xs, xs))(x) - own(x, x, x)).abs().max() < 1e-12
        mapped = torch.func.vmap(lambda xs: dropin(xs, xs, xs, need_weights=False)[0])(x)
        assert (mapped - dropin(x, x, x, need_weights=False)[0]).abs().max() < 1e-12
    for options in (PRE_LN_GELU, {"dropout": 0.0, "activation": torch.nn.SiLU()}):  # post-LN SiLU: rendered
        layer = transformer_block_torch.TransformerEncoderLayer(E, H, 8, **options, dtype=torch.float64)
        xg = x.clone().requires_grad_()
        (eager,) = torch.autograd.grad(layer(xg).sum(), xg)
        assert (torch.func.grad(lambda xs, layer=layer: layer(xs).sum())(x) - eager).abs().max() < 1e-12


def test_leading_batch_dimensions_stand_in_for_vmap():
    # what vmap over a batch would give, the generated forward gives with a leading batch axis
    own, _ = _modules()
    x = torch.randn(3, N, L, E, dtype=torch.float64)
    stacked = torch.stack([own(x[i], x[i], x[i]) for i in range(3)])
    assert (own(x, x, x) - stacked).abs().max() < 1e-13


# DDP's step of the script gloo_step.py runs (its models, data, loss, exit and single-process reference)
DDP_STEP = """
from torch.nn.parallel import DistributedDataParallel


def step(rank, kind, init, out):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    KEEP_ALIVE.append(dist.group.WORLD)
    try:
        torch.set_num_threads(1)
        ddp = DistributedDataParallel(model(kind))
        KEEP_ALIVE.append(ddp)
        x, target = data()
        shard = slice(rank * N // WORLD, (rank + 1) * N // WORLD)
        loss(ddp, x[shard], target[shard]).backward()  # DDP averages the gradients over the ranks
        torch.save({name: p.grad for name, p in ddp.module.named_parameters()}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()

"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["own", "dropin"])
def test_distributed_data_parallel_gloo_matches_single_process(tmp_path, kind):
    out = run_step(tmp_path, "ddp_step", DDP_STEP, kind, timeout=300)
    single = torch.load(f"{out}.single")
    for rank in (0, 1):
        grads = torch.load(f"{out}.{rank}")
        assert grads.keys() == single.keys()
        for name, g in grads.items():  # every rank holds the all-reduced (averaged) gradient
            assert (g - single[name]).abs().max() < 1e-13 * max(1.0, single[name].abs().max().item()), name
