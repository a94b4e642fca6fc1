"""The acceptance test of issue 15 on the CPU: a transformers model (Qwen3, Llama architecture, random
weights from a tiny config) generates like an RL rollout engine (left-padded prefill + KV-cache
decode at batch B), then a trainer recomputes the generated tokens' log-probs in one forward at
other batch sizes, orders and paddings (right padding, packing). Under patch(model) (rl_kernels
attention + batch_invariant() + fused RMSNorm) every log-prob and entropy is bitwise equal, and
strict() finds nothing; without it the same comparison differs, so the test can fail."""

import copy
import io
import math
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rl_kernels  # noqa: E402
from rl_kernels.integrations.transformers import (is_patched, left_pad, patch, right_pad,  # noqa: E402
                                                  rollout, token_logprobs, unpatch)

transformers.logging.set_verbosity_error()
# rollout() passes the KV cache under the keyword the installed transformers takes (`cache` where
# `past_key_values` is deprecated, to be removed within the pinned range, in 5.40)
pytestmark = pytest.mark.filterwarnings("error:.*past_key_values.*:FutureWarning")

VOCAB = 512
PROMPT_LENGTHS = [37, 5, 120, 64, 90, 11]  # batch B = 6, left-padded to 120
NEW_TOKENS = 24


@pytest.fixture(autouse=True)
def _one_thread():
    """These models run thousands of tiny ops: on a busy 2-core machine OpenMP barriers (torch's and
    rl_kernels') then cost more than the arithmetic (47 s instead of 6 s for this file, measured
    under load). Bits do not depend on the thread count (tests/test_invariance.py)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    rl_kernels.set_num_threads(1)
    yield
    torch.set_num_threads(saved)  # rl_kernels' count: conftest restores it


def tiny_model(arch, dtype, seed=0):
    """Dimensions are multiples of 64 (head_dim 64, hidden 128, intermediate 256): see the CPU
    pointwise caveat in docs/operators/batch_invariant.md."""
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=1024)
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.to(dtype).eval()


def prompts(seed=1, lengths=PROMPT_LENGTHS):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def trainer_logprobs(model, result, order, batches, packed=False, check=None):
    """Recompute the rollout's generated-token log-probs (and entropies) with token_logprobs over
    prompt + completion, in `order`, in batches of the given sizes; right-padded or packed."""
    seqs = result.sequences()
    logps, ents = [None] * len(seqs), [None] * len(seqs)
    start = 0
    for size in batches:
        chunk = order[start:start + size]
        start += size
        with torch.no_grad(), (check() if check else _null()):
            if packed:
                flat, cu = [], [0]
                for i in chunk:
                    flat += seqs[i]
                    cu.append(len(flat))
                lp, ent = token_logprobs(model, torch.tensor([flat]), cu_seqlens=torch.tensor(cu),
                                         return_entropy=True)
                rows = [(0, cu[j]) for j in range(len(chunk))]
            else:
                ids, mask = right_pad([seqs[i] for i in chunk], 0, "cpu")
                lp, ent = token_logprobs(model, ids, mask, return_entropy=True)
                rows = [(j, 0) for j in range(len(chunk))]
        for (row, offset), i in zip(rows, chunk):
            p, c = len(result.prompts[i]), len(result.completions[i])
            logps[i] = lp[row, offset + p - 1:offset + p - 1 + c]
            ents[i] = ent[row, offset + p - 1:offset + p - 1 + c]
    assert start == len(order)
    return logps, ents


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def count_differences(result, logps, ents):
    n_logp = sum(int((a != b).sum()) for a, b in zip(result.logprobs, logps))
    n_ent = sum(int((a != b).sum()) for a, b in zip(result.entropies, ents))
    return n_logp, n_ent


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rollout_logprobs_bitwise_equal_trainer(arch, dtype):
    model = tiny_model(arch, dtype)
    total = len(PROMPT_LENGTHS) * NEW_TOKENS

    # with rl_kernels: rollout at B = 6 under strict(), trainer at B' = 2 + 4 (right padding) and
    # 3 + 3 (packed) in another order, under strict()
    patch(model)
    result = rollout(model, prompts(), NEW_TOKENS, generator=torch.Generator().manual_seed(2),
                     check=rl_kernels.strict)
    assert sum(len(c) for c in result.completions) == total
    for packed, order, batches in ((False, [3, 0, 5, 1, 4, 2], [2, 4]),
                                   (True, [5, 2, 0, 4, 1, 3], [3, 3])):
        logps, ents = trainer_logprobs(model, result, order, batches, packed=packed,
                                       check=rl_kernels.strict)
        for i in range(len(PROMPT_LENGTHS)):
            assert torch.equal(logps[i], result.logprobs[i]), (packed, i)
            assert torch.equal(ents[i], result.entropies[i]), (packed, i)
    unpatch(model)

    # without rl_kernels (transformers' sdpa attention, torch's kernels), the same tokens: the
    # rollout's and the trainer's numbers differ
    native = rollout(model, [s[:len(p)] for s, p in zip(result.sequences(), result.prompts)],
                     NEW_TOKENS, generator=torch.Generator().manual_seed(2))
    logps, ents = trainer_logprobs(model, native, [3, 0, 5, 1, 4, 2], [2, 4])
    n_logp, n_ent = count_differences(native, logps, ents)
    assert n_logp > 0, "torch's own kernels were rollout/trainer invariant here: the test could not fail"
    assert n_logp <= total


def test_strict_names_what_breaks_the_native_model():
    model = tiny_model("qwen3", torch.float32)
    ids, mask = right_pad(prompts(lengths=[9, 4]), 0, "cpu")
    with pytest.raises(rl_kernels.strict.Error) as info, torch.no_grad(), rl_kernels.strict():
        token_logprobs(model, ids, mask)
    message = str(info.value)
    assert "aten." in message and "modeling_qwen3.py" in message and "test_transformers_rollout.py" in message
    with pytest.warns(rl_kernels.strict.Warning), torch.no_grad(), \
            rl_kernels.strict("warn") as check:
        token_logprobs(model, ids, mask)
    ops = {v.op for v in check.violations}
    assert "aten.mm.default" in ops and "aten.mean.dim" in ops
    assert any("scaled_dot_product" in op for op in ops)


def test_padding_batch_and_packing_do_not_change_a_sequence():
    model = patch(tiny_model("qwen3", torch.bfloat16))
    seqs = prompts(seed=5, lengths=[50, 7, 33])
    with torch.no_grad():
        alone = [token_logprobs(model, torch.tensor([s]))[0] for s in seqs]
        ids, mask = right_pad(seqs, 0, "cpu")
        right = token_logprobs(model, ids, mask)
        ids, mask = left_pad(seqs, 0, "cpu")
        left = token_logprobs(model, ids, mask)
        flat = torch.tensor([seqs[0] + seqs[1] + seqs[2]])
        cu = torch.tensor([0, 50, 57, 90])
        packed = token_logprobs(model, flat, cu_seqlens=cu)
        # packing announced only through position_ids that restart (as flash-attention detects)
        positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        hidden = model.model(input_ids=flat, position_ids=positions).last_hidden_state
    width = ids.shape[1]
    for b, s in enumerate(seqs):
        n = len(s) - 1
        assert torch.equal(right[b, :n], alone[b])
        assert torch.equal(left[b, width - len(s):], alone[b])
        assert torch.equal(packed[0, int(cu[b]):int(cu[b]) + n], alone[b])
        assert (right[b, n:] == 0).all() and (left[b, :width - len(s)] == 0).all()
    assert (packed[0, cu[1:-1] - 1] == 0).all()  # the last token of a sequence predicts nothing
    with torch.no_grad():
        h1 = model.model(input_ids=torch.tensor([seqs[1]])).last_hidden_state[0]
    assert torch.equal(hidden[0, 50:57], h1)


def test_token_logprobs_autograd_and_deterministic_backward():
    model = patch(tiny_model("qwen3", torch.float32))
    ids, mask = right_pad(prompts(seed=3, lengths=[20, 12]), 0, "cpu")
    grads = []
    for _ in range(2):
        model.zero_grad()
        with rl_kernels.batch_invariant():
            logp, ent = token_logprobs(model, ids, mask, return_entropy=True)
            (-(logp.sum()) - 0.01 * ent.sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert logp.shape == (2, 19) and logp.dtype == torch.float32
    assert (logp[1, 11:] == 0).all() and (logp[0] < 0).all()
    assert all(g.abs().sum() > 0 for g in grads[0][:3])
    assert all(torch.equal(a, b) for a, b in zip(*grads))  # bitwise the same twice


def test_patch_and_unpatch_restore_the_model():
    model = tiny_model("qwen3", torch.float32)
    reference = tiny_model("qwen3", torch.float32)
    ids, mask = right_pad(prompts(seed=4, lengths=[16, 9]), 0, "cpu")
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    assert patch(model) is model and is_patched(model)
    assert patch(model) is model  # twice: a no-op
    assert model.config._attn_implementation == "rl_kernels"
    assert "forward" in model.__dict__ and "forward" in model.model.__dict__
    assert "forward" in model.model.norm.__dict__ and "forward" in model.model.layers[0].self_attn.q_norm.__dict__
    with torch.no_grad():
        during = model(input_ids=ids, attention_mask=mask).logits
    assert not rl_kernels.is_batch_invariant()  # on only inside forward
    assert torch.allclose(during[mask.bool()], before[mask.bool()], atol=1e-4)
    unpatch(model)
    assert not is_patched(model) and model.config._attn_implementation == "sdpa"
    assert "forward" not in model.__dict__ and "forward" not in model.model.norm.__dict__
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
        ref = reference(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(after, before) and torch.equal(after, ref)


def test_unfused_rms_norm_is_invariant_too():
    """patch(rms_norm=False) keeps transformers' RMSNorm code: its mean runs on rl_kernels through
    the mode, so the rollout still matches (other bits than the fused norm)."""
    model = patch(tiny_model("qwen3", torch.bfloat16), rms_norm=False)
    assert "forward" not in model.model.norm.__dict__
    result = rollout(model, prompts(lengths=[30, 8, 17]), 8, greedy=True)
    logps, ents = trainer_logprobs(model, result, [2, 1, 0], [1, 2])
    assert count_differences(result, logps, ents) == (0, 0)


def test_rollout_eos_and_greedy():
    model = patch(tiny_model("qwen3", torch.float32))
    first = rollout(model, prompts(lengths=[10, 20]), 6, greedy=True)
    eos = first.completions[0][2]
    result = rollout(model, prompts(lengths=[10, 20]), 6, greedy=True, eos_token_id=eos)
    for b in range(2):
        full = first.completions[b]
        stop = full.index(eos) + 1 if eos in full else len(full)  # eos itself is kept
        assert result.completions[b] == full[:stop]
        assert torch.equal(result.logprobs[b], first.logprobs[b][:stop])


def test_padding_mask_with_a_hole_is_refused():
    model = patch(tiny_model("qwen3", torch.float32))
    ids = torch.randint(1, VOCAB, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 3] = 0
    with pytest.raises(ValueError, match="contiguous"), torch.no_grad():
        token_logprobs(model, ids, mask)


def test_deepcopy_and_pickle_of_a_patched_model_run_their_own_weights():
    """A frozen reference model is often copy.deepcopy(policy): the patched forwards must follow
    the copy (a closure over the original's bound forward would keep running its weights)."""
    model = patch(tiny_model("qwen3", torch.float32))
    ids = torch.tensor([[5, 6, 7, 8]])
    clone = copy.deepcopy(model)
    with torch.no_grad():
        expected = model(ids).logits
        for p in clone.parameters():
            p.zero_()
        assert (clone(ids).logits == 0).all()
        assert torch.equal(model(ids).logits, expected)
    unpatch(clone)
    assert "forward" not in clone.model.norm.__dict__ and is_patched(model)
    assert model.config._attn_implementation == "rl_kernels"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert is_patched(loaded) and torch.equal(loaded(ids).logits, expected)


def test_a_padding_mask_wider_than_the_ids_is_read_as_transformers_reads_it():
    """transformers' sdpa / eager masks use the first columns of a mask wider than the keys."""
    model = tiny_model("qwen3", torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    wide = torch.cat([mask, torch.zeros(2, 1, dtype=mask.dtype)], 1)
    real = mask.bool()
    with torch.no_grad():
        native = model(ids, attention_mask=wide).logits[real]
        assert torch.equal(native, model(ids, attention_mask=mask).logits[real])
        patch(model)
        patched = model(ids, attention_mask=wide).logits[real]
        assert torch.equal(patched, model(ids, attention_mask=mask).logits[real])
    assert torch.allclose(patched, native, atol=1e-4)


def test_rollout_stops_at_any_of_several_eos_tokens():
    """generation_config.eos_token_id is a list for Qwen3 / Llama-3."""
    model = patch(tiny_model("qwen3", torch.float32))
    batch = prompts(lengths=[10, 20])
    first = rollout(model, batch, 6, greedy=True).completions
    eos = [first[0][2], first[1][1]]
    expected = []
    for full in first:
        stops = [i for i, token in enumerate(full) if token in eos]
        expected.append(full[:stops[0] + 1] if stops else full)
    assert expected != first
    for eos_token_id in (eos, tuple(eos), torch.tensor(eos)):
        result = rollout(model, batch, 6, greedy=True, eos_token_id=eos_token_id)
        assert result.completions == expected, eos_token_id
    for bad in (float(eos[0]), [eos[0], 1.5], torch.tensor([[eos[0]]]), "</s>", True):
        with pytest.raises(TypeError, match="eos_token_id"):
            rollout(model, batch, 6, greedy=True, eos_token_id=bad)


def test_token_ids_must_be_integers_and_tensor_rows_are_taken():
    model = patch(tiny_model("qwen3", torch.float32))
    with pytest.raises(TypeError, match="prompts"):
        rollout(model, [[1.7, 2.2, 3.9]], 2, greedy=True)
    with pytest.raises(TypeError, match="sequences"):
        right_pad([[1.5, 2.5], [3]], 0, "cpu")
    with pytest.raises(TypeError, match="pad_token_id"):
        right_pad([[1, 2], [3]], 0.5, "cpu")
    with pytest.raises(TypeError, match="pad_token_id"):
        rollout(model, [[1, 2]], 2, greedy=True, pad_token_id=None)
    # a tokenizer's input_ids rows: 1-D integer tensors
    batch = prompts(lengths=[7, 3])
    rows = [torch.tensor(batch[0]), torch.tensor(batch[1], dtype=torch.int32)]
    from_rows = rollout(model, rows, 3, greedy=True)
    from_lists = rollout(model, batch, 3, greedy=True)
    assert from_rows.prompts == batch and from_rows.completions == from_lists.completions
    assert all(torch.equal(a, b) for a, b in zip(from_rows.logprobs, from_lists.logprobs))
    for pad in (left_pad, right_pad):
        assert all(torch.equal(a, b) for a, b in zip(pad(rows, 0, "cpu"), pad(batch, 0, "cpu")))


def test_arguments_of_the_wrong_type_are_named():
    model = patch(tiny_model("qwen3", torch.float32))
    batch = [[5, 6, 7], [8, 9]]
    for bad in (None, 2.0, True):
        with pytest.raises(TypeError, match="max_new_tokens"):
            rollout(model, batch, bad, greedy=True)
    with pytest.raises(TypeError, match="generator"):
        rollout(model, batch, 2, generator=5)
    for bad in (0.0, -1.0, math.inf):  # sampling at temperature 0 divided the logits by 0
        with pytest.raises(ValueError, match="temperature"):
            rollout(model, batch, 2, temperature=bad)
    with pytest.raises(TypeError, match="rms_norm"):
        patch(tiny_model("qwen3", torch.float32), rms_norm="no")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, ids.int()), token_logprobs(model, ids))
        with pytest.raises(TypeError, match="input_ids"):
            token_logprobs(model, ids.float())
        for cu in ([0, 3, 5], [0, 5, 3, 7]):
            with pytest.raises(ValueError, match="cu_seqlens"):
                token_logprobs(model, ids, cu_seqlens=torch.tensor(cu))


def test_import_rl_kernels_does_not_import_transformers():
    code = "import sys, rl_kernels; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
