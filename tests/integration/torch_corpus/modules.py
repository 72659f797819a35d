"""Attention written as nn.Modules, in the styles of well-known open-source code (written here, not copied)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """nanoGPT style: a causal mask buffer sliced to T, heads by view + transpose(1, 2), an output projection."""

    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.q_attn = nn.Linear(n_embd, n_embd)
        self.k_attn = nn.Linear(n_embd, n_embd)
        self.v_attn = nn.Linear(n_embd, n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("bias", mask)

    def forward(self, x):
        B, T, C = x.size()
        q = self.q_attn(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = self.k_attn(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.v_attn(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class BertSelfAttention(nn.Module):
    """Hugging Face BERT style: transpose_for_scores (view + permute), dropout (eval), an output dense layer."""

    def __init__(self, hidden_size: int, num_attention_heads: int) -> None:
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = hidden_size
        self.query = nn.Linear(hidden_size, self.all_head_size)
        self.key = nn.Linear(hidden_size, self.all_head_size)
        self.value = nn.Linear(hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(0.1)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(new_context_layer_shape)
        return self.dense(context_layer)


class RelativeBiasAttention(nn.Module):
    """A learned relative-position bias (one n × n table, as T5's buckets end up), added in place to the scores."""

    def __init__(self, d_model: int, d_k: int, seq_len: int) -> None:
        super().__init__()
        self.to_q = nn.Linear(d_model, d_k, bias=False)
        self.to_k = nn.Linear(d_model, d_k, bias=False)
        self.to_v = nn.Linear(d_model, d_k, bias=False)
        self.rel_bias = nn.Parameter(0.1 * torch.randn(seq_len, seq_len))

    def forward(self, x):
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        scores = q @ k.transpose(-2, -1)
        scores = scores / math.sqrt(q.shape[-1])
        scores += self.rel_bias
        attn = scores.softmax(dim=-1)
        return attn @ v


class SoftcapAttention(nn.Module):
    """Gemma 2 style: queries scaled by query_pre_attn_scalar ** -0.5, logits soft-capped by cap·tanh(·/cap)."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int, softcap: float = 50.0) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.softcap = num_heads, head_dim, softcap
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, self.num_heads, self.head_dim)
        query_states = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        attn_weights = torch.matmul(query_states * self.scaling, key_states.transpose(2, 3))
        attn_weights = attn_weights / self.softcap
        attn_weights = torch.tanh(attn_weights)
        attn_weights = attn_weights * self.softcap
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class EinsumAttention(nn.Module):
    """lucidrains style: heads by reshape + permute (what einops.rearrange runs), scores and output by einsum,
    a scale dim_head ** -0.5 kept on the module, a to_out projection."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        inner_dim = heads * dim_head
        self.heads, self.scale = heads, dim_head**-0.5
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_k = nn.Linear(dim, inner_dim, bias=False)
        self.to_v = nn.Linear(dim, inner_dim, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (f(x).reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for f in (self.to_q, self.to_k, self.to_v))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.permute(0, 2, 1, 3).reshape(b, n, -1)
        return self.to_out(out)


class CosineAttention(nn.Module):
    """Swin Transformer V2 style: cosine scores (F.normalize) times a learned logit scale, clamped and exp'd."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv_q = nn.Linear(dim, dim)
        self.qkv_k = nn.Linear(dim, dim)
        self.qkv_v = nn.Linear(dim, dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv_q(x), self.qkv_k(x), self.qkv_v(x)
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        logit_scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        attn = attn * logit_scale
        attn = attn.softmax(dim=-1)
        x = attn @ v
        return self.proj(x)


class DifferentialAttention(nn.Module):
    """Differential Transformer style: (softmax(Q₁K₁ᵀ/√d) − λ softmax(Q₂K₂ᵀ/√d)) V, λ re-parameterised by
    exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init from learned vectors."""

    def __init__(self, d_model: int, d_head: int, lambda_init: float = 0.8) -> None:
        super().__init__()
        self.q1, self.k1 = nn.Linear(d_model, d_head, bias=False), nn.Linear(d_model, d_head, bias=False)
        self.q2, self.k2 = nn.Linear(d_model, d_head, bias=False), nn.Linear(d_model, d_head, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.lambda_init = lambda_init
        self.lambda_q1 = nn.Parameter(0.1 * torch.randn(d_head))
        self.lambda_k1 = nn.Parameter(0.1 * torch.randn(d_head))
        self.lambda_q2 = nn.Parameter(0.1 * torch.randn(d_head))
        self.lambda_k2 = nn.Parameter(0.1 * torch.randn(d_head))

    def forward(self, x):
        scale = self.q1.out_features**-0.5
        a1 = F.softmax(self.q1(x) @ self.k1(x).mT * scale, dim=-1)
        a2 = F.softmax(self.q2(x) @ self.k2(x).mT * scale, dim=-1)
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1))
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1))
        lambda_full = lambda_1 - lambda_2 + self.lambda_init
        attn = a1 - lambda_full * a2
        return attn @ self.v(x)


class TimmAttention(nn.Module):
    """timm's Attention with fused attention: reshape + permute into heads, per-head LayerNorm of q and k
    (qk_norm), F.scaled_dot_product_attention (causal), transpose(1, 2).reshape back, a projection."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.q_norm = nn.LayerNorm(self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q = self.q(x).reshape(B, N, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        k = self.k(x).reshape(B, N, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        v = self.v(x).reshape(B, N, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class TemperatureAlibiAttention(nn.Module):
    """A learned temperature (a 0-d parameter) and a fixed ALiBi-like distance penalty (a buffer) added in place."""

    def __init__(self, d_model: int, seq_len: int) -> None:
        super().__init__()
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_k = nn.Linear(d_model, d_model, bias=False)
        self.temperature = nn.Parameter(torch.tensor(0.7))
        pos = torch.arange(seq_len)
        self.register_buffer("alibi", -0.5 * (pos[None, :] - pos[:, None]).abs().float())

    def forward(self, x):
        q, k = self.w_q(x), self.w_k(x)
        scores = q @ k.mT
        scores *= self.temperature
        scores += self.alibi
        probs = scores.softmax(-1)
        return probs @ x


class PreLNBlock(nn.Module):
    """A pre-LN Transformer block: x + MHA(LN(x)), then + MLP(LN(x)) with a GELU (exact or tanh)."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, approximate: str = "none") -> None:
        super().__init__()
        self.n_heads, self.approximate = n_heads, approximate
        self.ln_1 = nn.LayerNorm(d_model)
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.fc_in = nn.Linear(d_model, d_ff)
        self.fc_out = nn.Linear(d_ff, d_model)

    def attention(self, h):
        b, n, d = h.shape
        heads = [
            proj(h).view(b, n, self.n_heads, d // self.n_heads).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        ]
        q, k, v = heads
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.n_heads)
        ctx = scores.softmax(dim=-1) @ v
        return self.out_proj(ctx.transpose(1, 2).reshape(b, n, d))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        hidden = F.gelu(self.fc_in(self.ln_2(x)), approximate=self.approximate)
        return x + self.fc_out(hidden)


class FusedCausalSelfAttention(nn.Module):
    """nanoGPT's own: one fused projection c_attn split in three along the features, sdpa (causal)."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class TimmFusedAttention(nn.Module):
    """timm's Attention as it is: one qkv projection reshaped to (B, N, 3, H, d), permuted, unbound."""

    def __init__(self, dim: int, num_heads: int, index: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.index = index  # older timm: q, k, v = qkv[0], qkv[1], qkv[2]

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = (qkv[0], qkv[1], qkv[2]) if self.index else qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class WindowAttention(nn.Module):
    """Swin's window attention (W-MSA) as Swin writes it: a fused qkv projection reshaped and permuted into heads,
    q scaled, a learned relative-position table ((2Wh − 1)(2Ww − 1), H) read at the relative_position_index buffer
    (N × N, N = Wh·Ww, made at construction from meshgrid), viewed (N, N, H), permuted heads first and added to the
    scores, softmax, a projection."""

    def __init__(self, dim: int, window_size: tuple[int, int], num_heads: int, qkv_bias: bool = True) -> None:
        super().__init__()
        self.dim, self.window_size, self.num_heads = dim, window_size, num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * window_size[0] - 1) * (2 * window_size[1] - 1), num_heads)
        )
        coords_h = torch.arange(self.window_size[0])
        coords_w = torch.arange(self.window_size[1])
        coords = torch.stack(torch.meshgrid([coords_h, coords_w], indexing="ij"))  # 2, Wh, Ww
        coords_flatten = torch.flatten(coords, 1)  # 2, Wh*Ww
        relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]  # 2, Wh*Ww, Wh*Ww
        relative_coords = relative_coords.permute(1, 2, 0).contiguous()  # Wh*Ww, Wh*Ww, 2
        relative_coords[:, :, 0] += self.window_size[0] - 1  # shift to start from 0
        relative_coords[:, :, 1] += self.window_size[1] - 1
        relative_coords[:, :, 0] *= 2 * self.window_size[1] - 1
        relative_position_index = relative_coords.sum(-1)  # Wh*Ww, Wh*Ww
        self.register_buffer("relative_position_index", relative_position_index)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # make torchscript happy (cannot use tensor as tuple)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        relative_position_bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(
            self.window_size[0] * self.window_size[1], self.window_size[0] * self.window_size[1], -1
        )  # Wh*Ww,Wh*Ww,nH
        relative_position_bias = relative_position_bias.permute(2, 0, 1).contiguous()  # nH, Wh*Ww, Wh*Ww
        attn = attn + relative_position_bias.unsqueeze(0)
        attn = self.softmax(attn)
        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        return self.proj(x)
