"""Hugging Face transformers: the trainer's token log-probs bitwise equal to the rollout's.

    import rl_kernels
    from rl_kernels.integrations.transformers import patch, token_logprobs, rollout

    model = patch(AutoModelForCausalLM.from_pretrained(...))   # Qwen3 / Llama / Qwen2 / Mistral
    out = rollout(model, prompts, max_new_tokens=256)           # prefill + KV-cache decode, batch B
    logp = token_logprobs(model, ids, mask)                      # one forward, any batch / padding

patch(model) switches the model to the attention implementation "rl_kernels" (registered here in
transformers' AttentionInterface, with a mask function in its AttentionMaskInterface so that the
attention receives the 2-D padding mask), makes its forward run inside
rl_kernels.batch_invariant() (every Linear, the RMSNorms' mean, softmax ... on rl_kernels), and by
default replaces the RMSNorm modules' forward by the fused rl_kernels.rms_norm(round_before_weight=
True), which has their arithmetic (weight * normalized.to(dtype)). unpatch(model) undoes it all.

The attention maps transformers' query/key/value [B, H, T, d] onto rl_kernels.attention without
copies (transposed views; GQA without repeating k/v) and returns [B, T, H, d]:
  * a padded batch: per-sequence (q_start, q_len, k_start, k_len) computed on the device from the
    2-D mask, causal masking aligned bottom-right. The real keys of a row must be ONE contiguous
    block: left padding (generation), right padding (training) or none. A row whose real tokens
    have a hole (right-padded prompts then decoded, or padding inside) is refused with ValueError
    (checked once per mask, one host sync per forward);
  * packed sequences: cu_seq_lens_q / cu_seq_lens_k (+ max_length_q / max_length_k) keyword
    arguments, as transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives, or
    batch-1 position_ids that restart at each sequence (detected like flash-attention does);
  * no sliding window, softcap, attention sinks or attention dropout (ValueError / NotImplementedError).
Positions count from each sequence's first real token in rl_kernels.attention; the RoPE positions
come from position_ids, which rollout() and token_logprobs() compute from the mask
(cumsum - 1), so left- and right-padded copies of a sequence see the same positions.

``import rl_kernels`` does not import transformers; importing this module does.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import re
import weakref
from dataclasses import dataclass

import torch
import transformers  # noqa: F401  (this module is the transformers integration)
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from ..batch_invariant import batch_invariant
from ..ops.attention import attention
from ..ops.common import real_number
from ..ops.linear_logp import linear_logp
from ..ops.row_ops import rms_norm

__all__ = ["ATTN_IMPLEMENTATION", "Rollout", "attention_forward", "is_patched", "left_pad",
           "padding_mask", "patch", "position_ids_from_mask", "register", "right_pad", "rollout",
           "token_logprobs", "unpatch"]

ATTN_IMPLEMENTATION = "rl_kernels"


# --------------------------------------------------------------------------------------------
# The attention function and its mask function
# --------------------------------------------------------------------------------------------

def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs):
    """transformers' mask hook for "rl_kernels": the 2-D boolean padding mask [B, kv_length], or
    None when the batch has no padding mask. The causal structure is the attention's own (bottom-
    right aligned), so mask_function is not materialized."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"rl_kernels attention: expected a 2-D padding mask, got "
                         f"{attention_mask.dim()}-D")
    # columns kv_offset ... kv_offset + kv_length - 1, the ones transformers' sdpa and eager masks
    # read when the mask is wider than the keys (a narrower one is refused by the attention)
    return attention_mask[:, kv_offset:kv_offset + kv_length]


class _LastCache:
    """The ranges computed for the last mask (or position_ids) object: every layer of one forward
    gets the same object, so the ranges and the one host sync happen once per forward."""

    def __init__(self):
        self.ref, self.key, self.value = None, None, None

    def get(self, tensor, key):
        if self.ref is not None and self.ref() is tensor and self.key == key:
            return self.value
        return None

    def put(self, tensor, key, value):
        self.ref, self.key, self.value = weakref.ref(tensor), key, value
        return value


_mask_ranges = _LastCache()
_packed_ranges = _LastCache()


def _ranges_from_mask(mask, q_rows, k_rows):
    """(q_start, q_len, k_start, k_len) int32 [B] from a 2-D padding mask [B, k_rows] whose real
    keys form one contiguous block per row; the queries are the last q_rows key positions."""
    key = (q_rows, k_rows, mask.device, mask._version)  # _version: in-place edits invalidate
    cached = _mask_ranges.get(mask, key)
    if cached is not None:
        return cached
    if mask.shape[1] != k_rows:
        raise ValueError(f"rl_kernels attention: the padding mask has {mask.shape[1]} columns, the "
                         f"keys {k_rows} rows")
    real = mask if mask.dtype == torch.bool else mask != 0
    as_int = real.to(torch.int32)
    k_len = as_int.sum(-1, dtype=torch.int32)
    k_start = as_int.argmax(-1).to(torch.int32)  # the first real key (0 for an empty row)
    q_real = as_int[:, k_rows - q_rows:]
    q_len = q_real.sum(-1, dtype=torch.int32)
    q_start = q_real.argmax(-1).to(torch.int32)
    # one contiguous block: the last real key is k_start + k_len - 1 (rows with no real key pass)
    last = (k_rows - 1) - as_int.flip(-1).argmax(-1).to(torch.int32)
    contiguous = (k_len == 0) | (last - k_start + 1 == k_len)
    if not bool(contiguous.all()):
        bad = (~contiguous).nonzero().flatten().tolist()
        raise ValueError(
            f"rl_kernels attention: rows {bad[:8]} of the padding mask have real tokens that are "
            f"not one contiguous block. Use left padding for generation and right padding (or "
            f"packing) for training; a right-padded prompt cannot be decoded with a KV cache.")
    return _mask_ranges.put(mask, key, (q_start, q_len, k_start, k_len))


def _packed_from_position_ids(position_ids, rows):
    """cu_seqlens (int32) and the longest length for a batch-1 row of packed sequences whose
    position_ids restart at each sequence, or None when the row is one sequence."""
    key = (rows, position_ids.device, position_ids._version)
    cached = _packed_ranges.get(position_ids, key)
    if cached is not None:
        return cached or None
    pos = position_ids.reshape(-1)
    if pos.shape[0] != rows:
        return _packed_ranges.put(position_ids, key, ()) or None
    starts = torch.ones(rows, dtype=torch.bool, device=pos.device)
    starts[1:] = pos[1:] != pos[:-1] + 1
    first = starts.nonzero().flatten()
    if first.numel() <= 1:
        return _packed_ranges.put(position_ids, key, ()) or None
    cu = torch.cat([first, first.new_tensor([rows])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return _packed_ranges.put(position_ids, key, (cu, longest))


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention interface for "rl_kernels": query [B, Hq, Tq, d], key / value
    [B, Hkv, Tk, d] (the KV cache included) -> ([B, Tq, Hq, d], None)."""
    if dropout:
        raise NotImplementedError("rl_kernels attention: attention dropout is not supported "
                                  "(it would also break rollout/trainer equality)")
    if sliding_window is not None:
        raise NotImplementedError("rl_kernels attention: sliding-window layers are not supported")
    if softcap:
        raise NotImplementedError("rl_kernels attention: logit softcapping is not supported")
    if s_aux is not None:
        raise NotImplementedError("rl_kernels attention: attention sinks (s_aux) are not supported")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    batch, q_rows, k_rows = q.shape[0], q.shape[1], k.shape[1]

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if batch != 1 or cu_q is None or cu_k is None:
            raise ValueError("rl_kernels attention: cu_seq_lens_q and cu_seq_lens_k go together, "
                             "with packed inputs of batch size 1")
        out = attention(q[0], k[0], v[0], causal=causal, softmax_scale=scaling,
                        cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_k=cu_k.to(torch.int32),
                        max_seqlen_q=kwargs.get("max_length_q"),
                        max_seqlen_k=kwargs.get("max_length_k"))
        return out.unsqueeze(0), None

    if attention_mask is None:
        position_ids = kwargs.get("position_ids")
        if batch == 1 and q_rows == k_rows and q_rows > 1 and isinstance(position_ids, torch.Tensor):
            packed = _packed_from_position_ids(position_ids, q_rows)
            if packed is not None:
                cu, longest = packed
                out = attention(q[0], k[0], v[0], causal=causal, softmax_scale=scaling,
                                cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                max_seqlen_k=longest)
                return out.unsqueeze(0), None
        return attention(q, k, v, causal=causal, softmax_scale=scaling), None

    if attention_mask.dim() != 2:
        raise ValueError("rl_kernels attention: expected the 2-D padding mask (is the model's "
                         "attn_implementation 'rl_kernels'? a custom 4-D mask is not supported)")
    q_start, q_len, k_start, k_len = _ranges_from_mask(attention_mask, q_rows, k_rows)
    out = attention(q, k, v, causal=causal, softmax_scale=scaling, q_start=q_start, q_len=q_len,
                    k_start=k_start, k_len=k_len)
    return out, None


def register() -> None:
    """Register "rl_kernels" in transformers' attention and attention-mask interfaces (idempotent;
    patch() calls it)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)


# --------------------------------------------------------------------------------------------
# patch / unpatch
# --------------------------------------------------------------------------------------------

_RMSNORM_BODY = """
input_dtype = hidden_states.dtype
hidden_states = hidden_states.to(torch.float32)
variance = hidden_states.pow(2).mean(-1, keepdim=True)
hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
return self.weight * hidden_states.to(input_dtype)
"""


def _normalized(source):
    body = source.split(":", 1)[1] if source.lstrip().startswith("def") else source
    lines = [line.strip() for line in body.splitlines()]
    lines = [line for line in lines if line and not line.startswith(("#", '"""', "'''"))]
    return re.sub(r"\s+", "", "".join(lines))


@functools.lru_cache(maxsize=None)
def _is_llama_rmsnorm_class(cls) -> bool:
    """cls.forward is transformers' Llama/Qwen RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(
    dtype), computed in fp32 (Llama, Qwen2/3, Mistral, Mixtral, their MoE variants ...). Olmo2 and
    Gemma normalize differently and keep their forward."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    source = source[source.index("def "):]
    body = source.split("\n", 1)[1] if "\n" in source else ""
    return _normalized(body) == _normalized(_RMSNORM_BODY)


class _PatchedForward:
    """The `forward` patch() sets on a module. An object that holds the module, not a closure over
    its bound forward: copy.deepcopy (which copies functions by reference) and pickle / torch.save
    then rebind it to the copy, which computes with its own weights."""

    def __init__(self, module):
        self.module = module

    def __setstate__(self, state):
        register()  # a patched model unpickled in a fresh process finds "rl_kernels" registered
        self.__dict__.update(state)


class _ModeForward(_PatchedForward):
    """The module's previous forward (its class's, or the one set on the instance before patch())
    run inside batch_invariant()."""

    def __init__(self, module, previous):
        super().__init__(module)
        self.previous = previous

    @property
    def __wrapped__(self):  # inspect.signature (generate(), Trainer) sees the module's signature
        if self.previous is not None:
            return self.previous
        return type(self.module).forward.__get__(self.module)

    def __call__(self, *args, **kwargs):
        with batch_invariant():
            return self.__wrapped__(*args, **kwargs)


class _FusedRMSNormForward(_PatchedForward):
    """A Llama-style RMSNorm module's forward on the fused rl_kernels.rms_norm."""

    def __call__(self, hidden_states):
        module = self.module
        weight = module.weight
        if (hidden_states.dtype != weight.dtype or hidden_states.device != weight.device
                or (hidden_states.is_cuda and hidden_states.dtype == torch.float64)):
            return type(module).forward(module, hidden_states)  # mixed dtypes: transformers' code
        return rms_norm(hidden_states, weight, module.variance_epsilon, round_before_weight=True)


def _body_and_head(model):
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        head = getattr(model, "lm_head", None)
    body = getattr(model, "model", None)
    if body is None and hasattr(model, "get_decoder"):
        body = model.get_decoder()
    if body is None or head is None or not isinstance(head, torch.nn.Linear):
        raise TypeError(f"{type(model).__name__}: expected a causal LM with .model (the decoder) "
                        f"and an nn.Linear lm_head")
    return body, head


def _cache_keyword(body):
    """The decoder's keyword for its KV cache: `cache` in newer transformers 5.x (5.24 deprecates
    `past_key_values`, to be removed in 5.40), `past_key_values` in older ones (5.17)."""
    return "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"


def _set_attn_implementation(model, name):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def is_patched(model) -> bool:
    return getattr(model, "_rl_kernels_patch", None) is not None


def patch(model, *, rms_norm: bool = True):
    """Switch a loaded transformers causal LM (Qwen3, Llama, Qwen2, Mistral ...) to rl_kernels:
    attention implementation "rl_kernels", forward (of the model and of its decoder ``.model``) run
    inside rl_kernels.batch_invariant(), and with rms_norm=True the Llama-style RMSNorm modules on
    the fused rl_kernels.rms_norm. Returns the model (patched in place; patching twice is a no-op;
    copy.deepcopy and pickle / torch.save give a patched copy that runs its own weights).
    The backward pass runs outside forward(): put loss.backward() inside
    rl_kernels.batch_invariant() too for batch-invariant, deterministic gradients."""
    if not isinstance(rms_norm, bool):
        raise TypeError(f"patch: rms_norm must be a bool, got {rms_norm!r}")
    if is_patched(model):
        return model
    register()
    body, _ = _body_and_head(model)
    state = {"attn": model.config._attn_implementation, "forwards": [], "norms": []}
    _set_attn_implementation(model, ATTN_IMPLEMENTATION)
    try:
        for module in dict.fromkeys((model, body)):
            previous = module.__dict__.get("forward")
            module.forward = _ModeForward(module, previous)
            state["forwards"].append((module, previous))
        if rms_norm:
            for module in model.modules():
                if "forward" not in module.__dict__ and hasattr(module, "variance_epsilon") \
                        and isinstance(getattr(module, "weight", None), torch.Tensor) \
                        and _is_llama_rmsnorm_class(type(module)):
                    module.forward = _FusedRMSNormForward(module)
                    state["norms"].append(module)
    except BaseException:
        model._rl_kernels_patch = state
        unpatch(model)
        raise
    model._rl_kernels_patch = state
    return model


def unpatch(model):
    """Undo patch(model): the previous attention implementation, forward and RMSNorm forwards."""
    state = getattr(model, "_rl_kernels_patch", None)
    if state is None:
        return model
    for module in state["norms"]:
        module.__dict__.pop("forward", None)
    for module, previous in reversed(state["forwards"]):
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous
    _set_attn_implementation(model, state["attn"])
    model._rl_kernels_patch = None
    return model


# --------------------------------------------------------------------------------------------
# Log-probs: trainer and rollout
# --------------------------------------------------------------------------------------------

def position_ids_from_mask(attention_mask):
    """RoPE positions counted from each row's first real token (left or right padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def _check_head(model):
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale"):
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            raise NotImplementedError(f"token_logprobs: {name}={value} is not supported")


def token_logprobs(model, input_ids, attention_mask=None, *, temperature: float = 1.0,
                   return_entropy: bool = False, position_ids=None, cu_seqlens=None,
                   ignore_index: int = -100):
    """Per-token log-probs of the next tokens: out[b, i] = log p(input_ids[b, i + 1] | tokens
    <= i), shape [B, T - 1], fp32, differentiable (through rl_kernels.linear_logp on the decoder's
    hidden states and the lm_head: no [tokens, vocab] logits). Positions where either token is
    padding (attention_mask 0), or, packed, where i + 1 starts a new sequence, give 0 (and entropy
    0). With return_entropy, also the entropy of each next-token distribution.

    Padded batch: input_ids [B, T] with attention_mask [B, T] (left or right padding). Packed:
    input_ids [1, total] and cu_seqlens (int [n + 1], from 0 to total). position_ids default to
    positions counted from each sequence's first real token."""
    _check_head(model)
    body, head = _body_and_head(model)
    if not isinstance(input_ids, torch.Tensor) or not _is_integer_dtype(input_ids.dtype):
        raise TypeError(f"token_logprobs: input_ids must be an integer tensor, got "
                        f"{_describe(input_ids)}")
    if input_ids.dim() != 2:
        raise ValueError(f"token_logprobs: input_ids must be [B, T], got {tuple(input_ids.shape)}")
    input_ids = input_ids.long()  # linear_logp takes int64 targets (a no-op for int64 ids)
    kwargs = {}
    valid = None
    if cu_seqlens is not None:
        if input_ids.shape[0] != 1 or attention_mask is not None:
            raise ValueError("token_logprobs: packed input (cu_seqlens) is [1, total] without an "
                             "attention_mask")
        cu = torch.as_tensor(cu_seqlens, device=input_ids.device)
        total = input_ids.shape[1]
        if not _is_integer_dtype(cu.dtype):
            raise TypeError(f"token_logprobs: cu_seqlens must be integers, got "
                            f"{_describe(cu_seqlens)}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"token_logprobs: cu_seqlens must be 1-D [n + 1], got "
                             f"{_describe(cu_seqlens)}")
        cu = cu.to(torch.int32)
        lengths = (cu[1:] - cu[:-1]).long()
        # one host sync for the checks and the longest length
        first, last, shortest, longest = torch.stack(
            [cu[0].long(), cu[-1].long(), lengths.min(), lengths.max()]).tolist()
        if first != 0 or last != total or shortest < 0:
            raise ValueError(f"token_logprobs: cu_seqlens must rise from 0 to input_ids.shape[1] = "
                             f"{total}, got {_describe(cu_seqlens)}")
        if position_ids is None:
            starts = torch.repeat_interleave(cu[:-1].long(), lengths, output_size=total)
            position_ids = (torch.arange(total, device=input_ids.device) - starts)[None]
        kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest,
                  "max_length_k": longest}
        is_start = torch.zeros(total, dtype=torch.bool, device=input_ids.device)
        is_start[cu[:-1].long()] = True
        valid = ~is_start[1:][None]
    elif attention_mask is not None:
        real = attention_mask.bool()
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        valid = real[:, 1:] & real[:, :-1]
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  use_cache=False, **kwargs).last_hidden_state
    target = input_ids[:, 1:]
    if valid is not None:
        target = torch.where(valid, target, torch.full_like(target, ignore_index))
    return linear_logp(hidden[:, :-1], head.weight, target, head.bias, temperature=temperature,
                       ignore_index=ignore_index, return_entropy=return_entropy)


@dataclass
class Rollout:
    """What rollout() produced, per sequence b: the prompt, the generated tokens (up to and
    including an eos token), and each generated token's log-prob and entropy (fp32, computed by
    rl_kernels.linear_logp from the step's last hidden state, as token_logprobs() does)."""
    prompts: list
    completions: list
    logprobs: list
    entropies: list

    def sequences(self):
        return [p + c for p, c in zip(self.prompts, self.completions)]


def left_pad(sequences, pad_token_id, device):
    """[B, T] token ids and attention mask of sequences (lists of token ids or 1-D integer
    tensors), padded on the left."""
    return _pad(_token_rows(sequences, "left_pad", "sequences"),
                _integer(pad_token_id, "left_pad", "pad_token_id"), device, left=True)


def right_pad(sequences, pad_token_id, device):
    """[B, T] token ids and attention mask of sequences (lists of token ids or 1-D integer
    tensors), padded on the right."""
    return _pad(_token_rows(sequences, "right_pad", "sequences"),
                _integer(pad_token_id, "right_pad", "pad_token_id"), device, left=False)


def _pad(rows, pad_token_id, device, left):
    width = max((len(row) for row in rows), default=0)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        if len(row):
            cols = slice(width - len(row), width) if left else slice(0, len(row))
            ids[b, cols] = row
            mask[b, cols] = 1
    return ids.to(device), mask.to(device)


def _is_integer_dtype(dtype):
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _describe(value):
    return f"{type(value).__name__} {value!r:.80}"


def _integer(value, caller, name):
    """value (an int, a NumPy integer, an integer tensor of one element) as an int; floats, bools
    and None are refused rather than truncated (operator.index takes bools: refused first)."""
    if not isinstance(value, bool) and not (
            isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{caller}: {name} must be an integer, got {_describe(value)}")


def _token_rows(sequences, caller, name):
    """Sequences of token ids (lists of ints or 1-D integer tensors, e.g. a tokenizer's input_ids
    rows) as 1-D int64 CPU tensors; float ids are refused rather than truncated."""
    if isinstance(sequences, (torch.Tensor, str, bytes)) or not hasattr(sequences, "__iter__"):
        raise TypeError(f"{caller}: {name} must be a list of token-id lists or 1-D integer "
                        f"tensors, got {_describe(sequences)}")
    rows = []
    for b, seq in enumerate(sequences):
        try:
            row = torch.as_tensor(seq)
        except (TypeError, ValueError, RuntimeError):
            row = None
        if row is None or row.dim() != 1 or (row.numel() and not _is_integer_dtype(row.dtype)):
            raise TypeError(f"{caller}: {name}[{b}] must be a list of int token ids or a 1-D "
                            f"integer tensor, got {_describe(seq)}")
        rows.append(row.to("cpu", torch.long))
    return rows


def _eos_ids(eos_token_id):
    """rollout's eos_token_id as a set of ints: None, an int, a list / tuple of ints or an integer
    tensor (a Qwen3 / Llama-3 generation_config has several), as generate() takes."""
    if eos_token_id is None:
        return set()
    try:
        if isinstance(eos_token_id, torch.Tensor):
            if eos_token_id.dim() > 1 or not _is_integer_dtype(eos_token_id.dtype):
                raise TypeError
            values = eos_token_id.reshape(-1).tolist()
        else:
            values = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
        ids = {_integer(value, "rollout", "eos_token_id") for value in values}
    except TypeError:
        raise TypeError(f"rollout: eos_token_id must be an int, a list / tuple of ints or a 1-D "
                        f"integer tensor, got {_describe(eos_token_id)}") from None
    if not ids:
        raise ValueError("rollout: eos_token_id is empty (pass None for no eos token)")
    return ids


@torch.no_grad()
def rollout(model, prompts, max_new_tokens: int, *, temperature: float = 1.0, greedy: bool = False,
            generator: torch.Generator | None = None,
            eos_token_id: int | list[int] | torch.Tensor | None = None, pad_token_id: int = 0,
            check=None) -> Rollout:
    """Generate like an RL rollout engine: the prompts (lists of token ids or 1-D integer tensors,
    any lengths) left-padded into one batch, one prefill, then token-by-token decode through
    model(...) calls with a transformers DynamicCache. Each step samples (softmax of logits /
    temperature, with `generator`) or takes the argmax (greedy), and records the token's log-prob
    and entropy at that temperature from the step's last hidden state through
    rl_kernels.linear_logp -- the op token_logprobs() uses, so a patched model gives the trainer
    the same bits. A sequence stops after any of eos_token_id (an int, a list / tuple of ints or
    a 1-D integer tensor, as generation_config.eos_token_id may be).

    check: a context-manager factory (e.g. rl_kernels.strict) entered around every model call and
    log-prob computation (not around the sampling, which draws random numbers)."""
    from transformers import DynamicCache

    _check_head(model)
    # a patched model's forward turns the mode on and off per call; holding it on for the whole
    # loop saves that (about a millisecond per step) and changes no bits
    with (batch_invariant() if is_patched(model) else _nullcontext()):
        return _rollout(model, prompts, max_new_tokens, temperature, greedy, generator,
                        eos_token_id, pad_token_id, check or _nullcontext, DynamicCache)


def _rollout(model, prompts, max_new_tokens, temperature, greedy, generator, eos_token_id,
             pad_token_id, context, cache_class):
    rows = _token_rows(prompts, "rollout", "prompts")
    if not rows or any(len(row) == 0 for row in rows):
        raise ValueError("rollout: give at least one prompt, each of at least one token")
    max_new_tokens = _integer(max_new_tokens, "rollout", "max_new_tokens")
    if max_new_tokens < 1:
        raise ValueError(f"rollout: max_new_tokens must be >= 1, got {max_new_tokens}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"rollout: generator must be a torch.Generator or None, got "
                        f"{_describe(generator)}")
    temperature = real_number("rollout", "temperature", temperature)
    if not (math.isfinite(temperature) and temperature > 0):  # (linear_logp's rule, before the prefill)
        raise ValueError(f"rollout: temperature must be finite and > 0, got {temperature}")
    eos_ids = _eos_ids(eos_token_id)
    body, head = _body_and_head(model)
    device = head.weight.device
    ids, mask = _pad(rows, _integer(pad_token_id, "rollout", "pad_token_id"), device, left=True)
    positions = position_ids_from_mask(mask)
    cache_kwargs = {_cache_keyword(body): cache_class(config=model.config)}
    batch = len(rows)
    completions = [[] for _ in range(batch)]
    logps, entropies = [[] for _ in range(batch)], [[] for _ in range(batch)]
    done = [False] * batch
    with context():
        hidden = body(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                      **cache_kwargs).last_hidden_state[:, -1]
    for step in range(max_new_tokens):
        logits = torch.nn.functional.linear(hidden, head.weight, head.bias).float()
        if greedy:
            token = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, -1)
            if generator is not None and generator.device != probs.device:
                probs = probs.to(generator.device)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1).to(device)
        with context():
            logp, entropy = linear_logp(hidden, head.weight, token, head.bias,
                                        temperature=temperature, return_entropy=True)
        token_list, logp_list, entropy_list = token.tolist(), logp.tolist(), entropy.tolist()
        for b in range(batch):
            if not done[b]:
                completions[b].append(token_list[b])
                logps[b].append(logp_list[b])  # fp32 -> Python float -> fp32 is exact
                entropies[b].append(entropy_list[b])
                done[b] = token_list[b] in eos_ids
        if step == max_new_tokens - 1 or all(done):
            break
        mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
        positions = positions[:, -1:] + 1
        with context():
            hidden = body(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                          use_cache=True, **cache_kwargs).last_hidden_state[:, -1]
    as_tensor = functools.partial(torch.tensor, dtype=torch.float32)
    return Rollout([row.tolist() for row in rows], completions, [as_tensor(x) for x in logps],
                   [as_tensor(x) for x in entropies])


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
