"""A GGUF file run in plain PyTorch: read with the `gguf` package's reader, every tensor dequantised with its
dequantisers, and the forward written from llama.cpp's graphs for the architectures fastft exports.

This is the read-back check's independent model: it never calls transformers. It takes its hyperparameters
from the file's metadata only (head counts, RMSNorm epsilon, RoPE base, RoPE layout and factors, expert
counts), so a wrong value in the file changes its answers.

- ``llama`` (Llama, Mistral, Mixtral): RMSNorm, RoPE on adjacent pairs (llama.cpp's "normal" RoPE),
  optional per-frequency factors (``rope_freqs``), GQA attention, SwiGLU MLP, or top-k experts with
  softmax-then-renormalised weights.
- ``qwen2``: the same with the "neox" RoPE (halves) and q/k/v biases.
- ``qwen3`` / ``qwen3moe``: neox RoPE, per-head RMSNorm of q and k before RoPE, SwiGLU or top-k experts.
- ``gemma3``: embeddings scaled by the root of their width, neox RoPE with the sliding layers' own base and
  the full layers' linear scaling, per-head q/k RMSNorm, queries scaled as llama.cpp scales them (by the
  layer count), sliding-window layers as the file's pattern says, norms after attention and MLP as well as
  before, a tanh-GELU gated MLP, an optional final logit soft-cap.
"""

from __future__ import annotations

import math
import os

import gguf
import torch
import torch.nn.functional as F

ROPE_PAIRS = {"llama"}  # llama.cpp's LLAMA_ROPE_TYPE_NORM; the rest here are NEOX
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3")


class GGUFReadError(ValueError):
    """The file cannot be run by the reference forward; the message names what is missing."""


def read_metadata(path: str | os.PathLike) -> dict[str, object]:
    """Every metadata entry of a GGUF file as plain Python values (arrays as lists)."""

    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


class GGUFModel:
    """A causal LM from a GGUF file: ``logits(ids)`` and greedy ``generate(ids, ...)`` in fp32 on the CPU.

    All tensors are dequantised to fp32 when the file is opened (the check runs on models that fit)."""

    def __init__(self, path: str | os.PathLike):
        reader = gguf.GGUFReader(path)
        self.meta = {name: field.contents() for name, field in reader.fields.items()}
        self.types = {t.name: t.tensor_type.name for t in reader.tensors}
        self.tensors: dict[str, torch.Tensor] = {}
        for t in reader.tensors:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            self.tensors[t.name] = torch.from_numpy(values.astype("float32", copy=False).copy())
        del reader
        arch = self.meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise GGUFReadError(
                f"the reference forward runs {', '.join(ARCHITECTURES)}; this file is {arch!r}"
            )
        self.arch = arch
        key = lambda name, default=None: self.meta.get(f"{arch}.{name}", default)  # noqa: E731
        self.layers = int(key("block_count"))
        self.heads = int(key("attention.head_count"))
        self.kv_heads = int(key("attention.head_count_kv", self.heads))
        self.eps = float(key("attention.layer_norm_rms_epsilon"))
        self.rope_base = float(key("rope.freq_base", 10000.0))
        embedding = int(key("embedding_length"))
        self.head_dim = int(key("attention.key_length", embedding // self.heads))
        self.rope_dim = int(key("rope.dimension_count", self.head_dim))
        self.experts = int(key("expert_count", 0) or 0)
        self.experts_used = int(key("expert_used_count", 0) or 0)
        self.rope_factors = self.tensors.get("rope_freqs.weight")
        self.embedding = embedding
        self.query_scale = 1 / math.sqrt(self.head_dim)
        self.sliding = [False] * self.layers
        self.window = 0
        self.rope_base_swa = self.rope_base
        self.rope_scale = 1.0  # positions are multiplied by it in the full-attention layers
        self.softcap = 0.0
        if arch == "gemma3":
            self._gemma3_settings(key)
        for name in ("token_embd.weight", "output_norm.weight"):
            self._need(name)

    def _gemma3_settings(self, key) -> None:
        """llama.cpp's reading of a gemma3 file (``llama_model_gemma3::load_arch_hparams``)."""
        self.window = int(key("attention.sliding_window", 0) or 0)
        if self.window:
            pattern = key("attention.sliding_window_pattern")
            if isinstance(pattern, list):
                self.sliding = [bool(p) for p in pattern]
            else:  # a period: every n-th layer attends fully, the rest slide
                period = int(pattern or 6)
                self.sliding = [period == 0 or layer % period < period - 1 for layer in range(self.layers)]
            self.rope_base_swa = float(key("rope.freq_base_swa", 10000.0))
        if key("rope.scaling.type") == "linear":
            self.rope_scale = 1.0 / float(key("rope.scaling.factor", 1.0))
        self.softcap = float(key("final_logit_softcapping", 0.0) or 0.0)
        if self.layers == 62:  # llama.cpp's Gemma 3 27B: queries scaled by 1/sqrt(hidden / heads)
            self.query_scale = 1 / math.sqrt(self.embedding // self.heads)

    def _need(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise GGUFReadError(f"the GGUF file has no tensor {name!r}")
        return self.tensors[name]

    def _get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    # -- pieces ---------------------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, block: int) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by position; pairs (2i, 2i+1) for llama, halves for neox. A sliding
        layer uses its own base and no scaling, as llama.cpp's ``get_rope_freq_base`` / ``_scale``."""
        half = self.rope_dim // 2
        base, scale = (self.rope_base_swa, 1.0) if self.sliding[block] else (self.rope_base, self.rope_scale)
        freqs = base ** (-torch.arange(0, half, dtype=torch.float64) * 2 / self.rope_dim)
        if self.rope_factors is not None:
            freqs = freqs / self.rope_factors.double()
        angles = (positions.double() * scale)[:, None] * freqs[None, :]  # [T, half]
        cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
        rotated, rest = x[..., : self.rope_dim], x[..., self.rope_dim :]
        if self.arch in ROPE_PAIRS:
            a, b = rotated[..., 0::2], rotated[..., 1::2]
            out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            a, b = rotated[..., :half], rotated[..., half:]
            out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        return torch.cat((out, rest), dim=-1)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ self._need(name + ".weight").T
        bias = self._get(name + ".bias")
        return y + bias if bias is not None else y

    def _attention(self, x: torch.Tensor, block: int, positions: torch.Tensor) -> torch.Tensor:
        p = f"blk.{block}."
        length = x.shape[0]
        q = self._linear(x, p + "attn_q").view(length, self.heads, self.head_dim)
        k = self._linear(x, p + "attn_k").view(length, self.kv_heads, self.head_dim)
        v = self._linear(x, p + "attn_v").view(length, self.kv_heads, self.head_dim)
        q_norm, k_norm = self._get(p + "attn_q_norm.weight"), self._get(p + "attn_k_norm.weight")
        if q_norm is not None:
            q = self._norm(q, q_norm)
        if k_norm is not None:
            k = self._norm(k, k_norm)
        q, k = self._rope(q, positions, block), self._rope(k, positions, block)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.query_scale
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        if self.sliding[block]:  # a query sees the keys less than `window` positions back
            causal &= ~torch.ones(length, length, dtype=torch.bool).tril(-self.window)
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, -1)
        return self._linear(out, p + "attn_output")

    def _mlp(self, x: torch.Tensor, block: int) -> torch.Tensor:
        p = f"blk.{block}."
        if self._get(p + "ffn_gate_inp.weight") is None:
            gate = self._linear(x, p + "ffn_gate")
            gate = F.gelu(gate, approximate="tanh") if self.arch == "gemma3" else F.silu(gate)
            hidden = gate * self._linear(x, p + "ffn_up")
            return self._linear(hidden, p + "ffn_down")
        logits = x @ self.tensors[p + "ffn_gate_inp.weight"].T  # [T, E]
        weights, chosen = logits.softmax(-1).topk(self.experts_used, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)  # llama.cpp renormalises for both families
        gate, up = self._need(p + "ffn_gate_exps.weight"), self._need(p + "ffn_up_exps.weight")
        down = self._need(p + "ffn_down_exps.weight")
        out = torch.zeros_like(x)
        for slot in range(self.experts_used):
            for expert in chosen[:, slot].unique().tolist():
                rows = (chosen[:, slot] == expert).nonzero(as_tuple=True)[0]
                h = F.silu(x[rows] @ gate[expert].T) * (x[rows] @ up[expert].T)
                out[rows] += weights[rows, slot, None] * (h @ down[expert].T)
        return out

    # -- model ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def logits(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Next-token logits [T, vocab] (fp32) of one sequence of token ids."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        x = self.tensors["token_embd.weight"][ids]
        if self.arch == "gemma3":
            x = x * math.sqrt(self.embedding)
        positions = torch.arange(ids.shape[0])
        for block in range(self.layers):
            p = f"blk.{block}."
            attention = self._attention(self._norm(x, self._need(p + "attn_norm.weight")), block, positions)
            x = x + self._post_norm(attention, p + "post_attention_norm.weight")
            mlp = self._mlp(self._norm(x, self._need(p + "ffn_norm.weight")), block)
            x = x + self._post_norm(mlp, p + "post_ffw_norm.weight")
        x = self._norm(x, self.tensors["output_norm.weight"])
        head = self.tensors.get("output.weight", self.tensors["token_embd.weight"])  # tied: the embedding
        logits = x @ head.T
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _post_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Gemma's norm after a sublayer, before the residual add (absent elsewhere: x unchanged)."""
        weight = self._get(name)
        return x if weight is None else self._norm(x, weight)

    def generate(self, ids: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
        """Greedy continuation of `ids` (the new tokens only), ending after a token in `stop`."""
        ids, new = list(ids), []
        for _ in range(max_new_tokens):
            token = int(self.logits(ids)[-1].argmax())
            new.append(token)
            ids.append(token)
            if token in stop:
                break
        return new
